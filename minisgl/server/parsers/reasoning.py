"""Reasoning split from the answer: Qwen3 and DeepSeek-R1 think in `<think>...</think>` before answering.

The output is reasoning from an opening `<think>` (or from its first token when the prompt already opened
one, as thinking-only chat templates do) up to `</think>`; the rest is the answer, its leading newlines
dropped. An output that does not begin with `<think>` is all answer; one that never closes its block is
all reasoning (it was cut short). Fed text deltas, the parser holds back only what may still be a tag.
"""

from __future__ import annotations

from dataclasses import dataclass

from minisgl.server.parsers.markers import scan

REASONING_PARSERS = {"qwen3": ("<think>", "</think>"), "deepseek-r1": ("<think>", "</think>")}


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""


class ReasoningParser:
    def __init__(self, name: str, prompt_text: str):
        self.open, self.close = REASONING_PARSERS[name]
        self.state = "reasoning" if prompt_text.rstrip().endswith(self.open) else "start"
        self.buffer = ""

    def feed(self, text: str) -> Split:
        self.buffer += text
        out = Split()
        while True:
            if self.state == "start":
                head = self.buffer.lstrip()
                if head.startswith(self.open):
                    self.buffer, self.state = head[len(self.open):], "reasoning"
                elif self.open.startswith(head):  # empty, or the tag still coming
                    return out
                else:
                    self.state = "content"
            elif self.state == "reasoning":
                before, self.buffer, closed = scan(self.buffer, self.close)
                out.reasoning += before
                if not closed:
                    return out
                self.state = "answer"
            elif self.state == "answer":  # right after </think>: newlines before the answer are dropped
                self.buffer = self.buffer.lstrip("\n")
                if not self.buffer:
                    return out
                self.state = "content"
            else:
                out.content += self.buffer
                self.buffer = ""
                return out

    def finish(self) -> Split:
        rest, self.buffer = self.buffer, ""
        if self.state == "reasoning":
            return Split(reasoning=rest)
        return Split(content=rest.lstrip("\n") if self.state == "answer" else rest)
