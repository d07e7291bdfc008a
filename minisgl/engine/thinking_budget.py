"""Sampling's step 6, vLLM's thinking_token_budget: a row whose thinking block holds its budget of tokens gets the
block's end marker, one token per step, in place of the token drawn.

Each row with a budget keeps its state on the device (tokens in the block, or -1 outside one; how much of each
marker its last tokens match), advanced by every token it takes, so forcing needs no host round trip and works
ahead of the host under overlap scheduling. `thinking_step` is the same rule for one row in plain Python: it
rebuilds a row's state from the tokens it has when the row is (re-)admitted.
"""

from __future__ import annotations

import torch

from minisgl.core import MAX_MARKER_TOKENS, ThinkingBudget
from minisgl.engine.host_copy import upload


def _last_index(ids: list[int], marker: tuple[int, ...]) -> int:
    """Where `marker` last starts in `ids` (-1: nowhere)."""
    n = len(marker)
    return next((i for i in range(len(ids) - n, -1, -1) if tuple(ids[i:i + n]) == marker), -1)


def thinking_state(think: ThinkingBudget, prompt_ids: list[int], output_ids: list[int]) -> tuple[int, int, int]:
    """A row's thinking state after its prompt and output, as step 6 leaves it: (tokens in the open block, -1
    outside one; the length of the start marker's prefix the last tokens match; the end marker's). A prompt
    whose last start marker comes after its last end marker opens the block (at most `budget` full)."""
    last_start = _last_index(prompt_ids, think.start)
    count = -1
    if last_start > _last_index(prompt_ids, think.end):
        count = min(len(prompt_ids) - last_start - len(think.start), think.budget)
    state = (count, 0, 0)
    for token in output_ids:
        state = thinking_step(think, *state, token)
    return state


def thinking_step(think: ThinkingBudget, count: int, start_match: int, end_match: int, token: int
                  ) -> tuple[int, int, int]:
    """Step 6 for one token taken (the forced one, when forcing), in plain Python: what the device does per row."""
    def advance(match: int, marker: tuple[int, ...]) -> int:
        return match + 1 if token == marker[match] else int(token == marker[0])

    if count < 0:
        start_match = advance(start_match, think.start)
        return (0, 0, 0) if start_match == len(think.start) else (-1, start_match, 0)
    forced_at = count - think.budget
    if forced_at >= 0:
        return (-1, 0, 0) if forced_at + 1 == len(think.end) else (count + 1, 0, 0)
    end_match = advance(end_match, think.end)
    return (-1, 0, 0) if end_match == len(think.end) else (count + 1, 0, end_match)


class ThinkingBudgets:
    """Every sampler row's thinking budget and state, on the device; the sampler loads rows and calls `force_end`."""

    def __init__(self, max_rows: int, device: torch.device):
        self.max_rows, self.device = max_rows, device
        # Allocated the first time a request has a budget: [max_rows, 4] budget (-1: none), tokens in the block
        # (-1: outside), start / end marker prefix matched; [max_rows, 2, MAX_MARKER_TOKENS] the markers, padded
        # with -1 (no token); [max_rows, 2] their lengths.
        self.state: torch.Tensor | None = None
        self.markers: torch.Tensor | None = None
        self.marker_lens: torch.Tensor | None = None
        self.rows: set[int] = set()  # rows with a budget: without any, sampling skips step 6

    def prepare_row(self, row: int, think: ThinkingBudget | None, prompt_ids: list[int],
                    output_ids: list[int]) -> None:
        """Load the row's thinking budget and its state after the tokens it has; a row without one is inert."""
        if think is None:
            if self.state is not None:
                self.state[row, 0].fill_(-1)  # t[i] = number would wait for the device (host_copy.py)
            self.rows.discard(row)
            return
        if self.state is None:
            self.state = torch.zeros(self.max_rows, 4, dtype=torch.int64, device=self.device)
            self.state[:, 0] = -1  # no budget
            self.markers = torch.full((self.max_rows, 2, MAX_MARKER_TOKENS), -1, dtype=torch.int64,
                                      device=self.device)
            self.marker_lens = torch.ones(self.max_rows, 2, dtype=torch.int64, device=self.device)
        markers = torch.full((2, MAX_MARKER_TOKENS), -1, dtype=torch.int64)
        markers[0, :len(think.start)], markers[1, :len(think.end)] = torch.tensor(think.start), torch.tensor(think.end)
        self.markers[row] = upload(markers, torch.int64, self.device)
        self.marker_lens[row] = upload([len(think.start), len(think.end)], torch.int64, self.device)
        self.state[row] = upload([think.budget, *thinking_state(think, prompt_ids, output_ids)], torch.int64,
                                 self.device)
        self.rows.add(row)

    def release_row(self, row: int) -> None:
        self.rows.discard(row)

    def force_end(self, tokens: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Step 6 for every row at once (`thinking_step`'s rule; rows without a budget keep their token)."""
        budget, count, start_match, end_match = self.state[rows].unbind(1)
        start, end = self.markers[rows].unbind(1)
        start_len, end_len = self.marker_lens[rows].unbind(1)
        active = budget >= 0
        inside = active & (count >= 0)
        forced_at = count - budget
        forcing = inside & (forced_at >= 0)
        tokens = torch.where(forcing, end.gather(1, forced_at.clamp(0, MAX_MARKER_TOKENS - 1)[:, None])[:, 0], tokens)

        def advance(match: torch.Tensor, marker: torch.Tensor) -> torch.Tensor:
            return torch.where(tokens == marker.gather(1, match[:, None])[:, 0], match + 1,
                               (tokens == marker[:, 0]).long())

        start_match, end_match = advance(start_match, start), advance(end_match, end)
        closed = inside & torch.where(forcing, forced_at + 1 == end_len, end_match == end_len)
        opened = active & ~inside & (start_match == start_len)
        count = torch.where(closed, -1, torch.where(inside, count + 1, torch.where(opened, 0, count)))
        start_match = torch.where(active & ~inside & ~opened, start_match, 0)
        end_match = torch.where(inside & ~forcing & ~closed, end_match, 0)
        self.state[rows] = torch.stack([budget, count, start_match, end_match], 1)
        return tokens
