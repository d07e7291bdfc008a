"""Our own tests of the generic-API behaviour that vLLM's and SGLang's OpenAI-server suites check."""
