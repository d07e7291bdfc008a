"""The wire schemas: what each API's requests and answers look like (pydantic models, one file per API)."""
