"""Incremental detokenization: turn each step's new token ids into text that is safe to stream."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

REPLACEMENT_CHAR = "\ufffd"  # what decode shows for an incomplete UTF-8 sequence


def token_text(tokenizer, token_id: int) -> str:
    """One token's text, as a logprob entry shows it; without a tokenizer, its id (vLLM's `token_id:N`)."""
    return tokenizer.decode([token_id]) if tokenizer is not None else f"token_id:{token_id}"


@dataclass
class TextDelta:
    """Text that may be shown now; `stopped`: a stop string was found, the text ends right before it."""

    text: str
    stopped: bool


class IncrementalDetokenizer:
    """Streams one request's output text, holding back what later tokens could still change.

    Only a short window of recent ids is decoded per step, so the cost does not grow with the output:
    the new text is decode(ids[prefix:]) minus decode(ids[prefix:read]), where `read` ends the ids already
    turned into text and `prefix` is the boundary before it (context for decoders that drop a leading space).
    Byte-level tokens can split a character; text ending in U+FFFD waits for the tokens that complete it.
    A stop string ends the text at the first occurrence to complete (ties: the one starting first), and a
    suffix that could still grow into a stop string is held back until it no longer can.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.skip_special_tokens = skip_special_tokens
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (SGLang's `matched_stop`)
        self._ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0
        self._held = ""  # decoded text not emitted yet because it may be the start of a stop string
        self._emitted: list[str] = []

    @property
    def text(self) -> str:
        """Everything emitted so far (all deltas plus the flush)."""
        return "".join(self._emitted)

    def add(self, token_ids: Sequence[int]) -> TextDelta:
        """Feed the request's next generated token ids (any number, possibly none)."""
        if self.stopped:  # tokens already in flight when the stop string was found are dropped
            return TextDelta("", True)
        self._ids.extend(token_ids)
        return self._emit(self._decode_new(final=False), final=False)

    def flush(self) -> str:
        """The request ended: emit the held-back text, an incomplete character as decode shows it."""
        if self.stopped:
            return ""
        return self._emit(self._decode_new(final=True), final=True).text

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def _decode_new(self, final: bool) -> str:
        """Text of the ids after read_offset; empty while it ends in an incomplete character, unless final."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        window_text = self._decode(self._ids[self._prefix_offset:])
        if len(window_text) <= len(prefix_text) or (window_text.endswith(REPLACEMENT_CHAR) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return window_text[len(prefix_text):]

    def _emit(self, new_text: str, final: bool) -> TextDelta:
        """Cut at a completed stop string, else emit all but a suffix that may begin one."""
        text = self._held + new_text  # a stop string cannot start before the held text, else it would be held
        found = [(i + len(s), i, s) for s in self.stop if (i := text.find(s)) >= 0]
        if found:
            self.stopped = True
            _, cut, self.matched = min(found)
        else:
            cut = len(text) if final else len(text) - self._stop_prefix_len(text)
        out, self._held = text[:cut], ("" if self.stopped else text[cut:])
        self._emitted.append(out)
        return TextDelta(out, self.stopped)

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of some stop string."""
        longest = max((len(s) for s in self.stop), default=1)
        for n in range(min(len(text), longest - 1), 0, -1):
            if any(s.startswith(text[-n:]) for s in self.stop):
                return n
        return 0
