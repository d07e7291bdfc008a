"""Tiny checkpoints with a chat template of a real model family: a Qwen3-like one that shows tools to the
model, renders earlier tool calls and tool results, and opens or closes a `<think>` block; and a tokenizer that
begins every text with its BOS, as Llama 3's does."""

from __future__ import annotations

import shutil
from pathlib import Path

from tokenizers import processors
from transformers import AutoTokenizer

from minisgl.tools.tiny_model import QWEN3_CHAT_TEMPLATE as QWEN3_LIKE


def with_chat_template(model: str, out: Path, template: str = QWEN3_LIKE) -> str:
    """A copy of the checkpoint at `out` whose tokenizer uses `template`."""
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(template)
    return str(out)


def with_bos_token(model: str, out: Path, template_writes_it: bool = False) -> str:
    """A copy of the checkpoint at `out` whose tokenizer puts its BOS before every text it encodes with special
    tokens (Llama 3's post-processor); `template_writes_it`: the chat template also begins with it (Llama 3's)."""
    shutil.copytree(model, out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    bos = tokenizer.bos_token
    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A {bos} $B", special_tokens=[(bos, tokenizer.bos_token_id)])
    if template_writes_it:
        tokenizer.chat_template = "{{ bos_token }}" + tokenizer.chat_template
    tokenizer.save_pretrained(out)
    return str(out)
