"""The tokenizer, loaded one way by every process that needs it: the offline `LLM`, and the server's api
process, detokenizer and scheduler (its grammar compiler, constrained/grammar.py)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class TokenizerSource:
    """Where the tokenizer is and how it loads (--tokenizer, --trust-remote-code); picklable: the server hands
    this one value to each child process, so none of them can load another tokenizer than the api's."""

    path: str  # a local directory or a Hugging Face Hub id
    trust_remote_code: bool = False  # run the tokenizer's own Python code (its tokenizer_config.json's auto_map)

    def load(self):
        """The Hugging Face tokenizer, or None when `path` is a local directory without one (token ids only)."""
        local = Path(self.path).expanduser()
        if local.is_dir() and not any((local / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(self.path, trust_remote_code=self.trust_remote_code)
