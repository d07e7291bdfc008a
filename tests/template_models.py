"""Tiny checkpoints with a chat template of a real model family: a Qwen3-like one that shows tools to the
model, renders earlier tool calls and tool results, and opens or closes a `<think>` block."""

from __future__ import annotations

import shutil
from pathlib import Path

QWEN3_LIKE = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> \
XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for call in message.tool_calls or [] %}
<tool_call>
{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and not enable_thinking %}<think>

</think>

{% elif force_thinking is defined and force_thinking %}<think>
{% endif %}{% endif %}"""


def with_chat_template(model: str, out: Path, template: str = QWEN3_LIKE) -> str:
    """A copy of the checkpoint at `out` whose tokenizer uses `template`."""
    shutil.copytree(model, out)
    (out / "chat_template.jinja").write_text(template)
    return str(out)
