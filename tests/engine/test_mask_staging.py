"""The batch's grammar bitmask as the sampler gets it: on the engine's device, equal to what each matcher allows
at that step (all ones for a free row), and intact while the next step fills its own. With overlap scheduling
step N+1's masks are filled before step N's sampling has run on the device, so a fill must never land in the
memory an earlier step's mask still lives in (on a GPU: pinned host slots copied by a side stream)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import xgrammar as xgr
from helpers import DEVICE

from minisgl.constrained import Grammars
from minisgl.core import Constraint
from minisgl.tokenizer import TokenizerSource

# Grammars that never force the end within the test's steps: every row always has a token besides EOS.
CONSTRAINTS = [Constraint("regex", r"[a-z]+@x\.com"), Constraint("json_schema", '{"type": "string"}'),
               Constraint("ebnf", 'root ::= ("yes" | "no") [a-z]*')]
FREE = 99  # a request without a grammar


def expected(grammars: Grammars, rids: list[int], vocab: int) -> torch.Tensor:
    """Each row's mask filled on its own into a fresh buffer; all ones for a free request."""
    mask = xgr.allocate_token_bitmask(len(rids), vocab)
    for i, rid in enumerate(rids):
        if rid in grammars.matchers:
            grammars.matchers[rid].fill_next_token_bitmask(mask, i)
    return mask


def last_allowed(mask: torch.Tensor, vocab: int, eos: list[int]) -> int:
    """The highest token the row allows, EOS aside."""
    token = torch.arange(vocab)
    allowed = torch.nonzero((mask[token // 32].long() >> (token % 32)) & 1)[:, 0].tolist()
    return [t for t in allowed if t not in eos][-1]


def test_each_steps_mask_is_its_matchers_and_survives_the_next_fill(tiny_models):
    path = tiny_models["qwen3"]
    config = json.loads(Path(path, "config.json").read_text())
    vocab, eos = config["vocab_size"], config["eos_token_id"]
    eos = [eos] if isinstance(eos, int) else eos
    grammars = Grammars(TokenizerSource(path), vocab, eos, DEVICE)
    for rid, constraint in enumerate(CONSTRAINTS):
        grammars.start(rid, constraint)
        grammars.activate(rid)
    # Batches that grow (the buffers are reallocated) and shrink, and mix in a free request.
    batches = [[0], [0, FREE, 1], [2, 1, 0], [1, FREE], [0, 1, 2, FREE], [2]]
    held: list[tuple[torch.Tensor, torch.Tensor]] = []
    for rids in batches:
        want = expected(grammars, rids, vocab)
        mask = grammars.bitmask(rids)
        assert mask.device.type == torch.device(DEVICE).type and mask.dtype == torch.int32
        held.append((mask, want))
        for got, ref in held[-2:]:  # this step's mask, and the previous one, which the sampler may not have read yet
            assert torch.equal(got.cpu(), ref)
        for i, rid in enumerate(rids):
            if rid != FREE:
                assert not grammars.accept(rid, last_allowed(want[i], vocab, eos))
    assert FREE not in grammars.matchers and torch.equal(held[1][1][1], torch.full_like(held[1][1][1], -1))


def test_a_batch_without_constrained_requests_has_no_mask(tiny_models):
    path = tiny_models["qwen3"]
    vocab = json.loads(Path(path, "config.json").read_text())["vocab_size"]
    grammars = Grammars(TokenizerSource(path), vocab, [vocab - 1], DEVICE)
    grammars.start(0, CONSTRAINTS[0])
    grammars.activate(0)
    assert grammars.bitmask([FREE, FREE + 1]) is None
    grammars.release(0)
    assert grammars.bitmask([0]) is None
