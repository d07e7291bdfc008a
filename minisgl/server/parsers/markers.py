"""Finding a marker (a tag such as `<tool_call>`) in streamed text without showing half of it early."""

from __future__ import annotations


def scan(text: str, marker: str) -> tuple[str, str, bool]:
    """(before, rest, found): with the marker in `text`, what precedes it and what follows it; without,
    what can be shown now and the suffix held back because the marker may still begin there."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], text[at + len(marker):], True
    cut = len(text) - held_back(text, marker)
    return text[:cut], text[cut:], False


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that `marker` starts with (it may be the marker, cut)."""
    for n in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0
