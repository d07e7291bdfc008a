"""Tiny checkpoints with a chat template of a real model family: a Qwen3-like one that shows tools to the
model, renders earlier tool calls and tool results, and opens or closes a `<think>` block."""

from __future__ import annotations

import shutil
from pathlib import Path

from minisgl.tools.tiny_model import QWEN3_CHAT_TEMPLATE as QWEN3_LIKE


def with_chat_template(model: str, out: Path, template: str = QWEN3_LIKE) -> str:
    """A copy of the checkpoint at `out` whose tokenizer uses `template`."""
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(template)
    return str(out)
