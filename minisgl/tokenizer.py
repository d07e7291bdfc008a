"""The model directory's tokenizer, for both fronts: the offline `LLM` and the server's api process."""

from __future__ import annotations

from pathlib import Path


def load_tokenizer(path: Path):
    """The Hugging Face tokenizer beside the weights, or None when the directory has none (token ids only)."""
    if not any((path / name).exists() for name in ("tokenizer.json", "tokenizer_config.json")):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)
