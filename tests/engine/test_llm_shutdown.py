"""LLM.shutdown() (and leaving a `with LLM(...)` block) frees the engine's tensors, so that a second LLM works in
the same process (a notebook, a benchmark comparing two settings). A GPU engine sizes its KV pool from the
device's free memory, so anything that outlives shutdown shrinks or fails the next one; tests/gpu/
test_two_engines_in_one_process.py checks that on a GPU, this checks that the tensors themselves go."""

from __future__ import annotations

import weakref

import pytest
import torch
from helpers import DEVICE

from minisgl import LLM, SamplingParams

PROMPTS = [[5, 6, 7], [11, 12, 13, 14, 15]]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def build(path: str) -> LLM:
    return LLM(path, device=DEVICE, dtype="float32", num_pages=512, cuda_graph_max_bs=4)


def engine_tensors(llm: LLM) -> list[weakref.ref]:
    """Weak references to every tensor the engine holds: weights, KV pool, tables, sampler state, and the
    decode graphs' outputs where there are graphs."""
    engine = llm.engine
    tensors = [*engine.model.parameters(), *engine.model.buffers()]
    for part in (engine, engine.pool, engine.sampler, engine.graphs):
        tensors += [value for value in vars(part).values() if isinstance(value, torch.Tensor)] if part else []
    if engine.graphs is not None:
        tensors += engine.graphs.outputs.values()
    assert {id(engine.pool.k), id(engine.pool.v)} <= {id(tensor) for tensor in tensors}
    return [weakref.ref(tensor) for tensor in tensors]


def test_shutdown_frees_the_engine_and_a_second_llm_generates(tiny_models):
    first = build(tiny_models["qwen3"])
    expected = [out.token_ids for out in first.generate(PROMPTS, GREEDY)]
    tensors = engine_tensors(first)
    first.shutdown()
    assert [ref for ref in tensors if ref() is not None] == []  # without the test collecting garbage itself
    with pytest.raises(RuntimeError, match="stopped: it was shut down"):
        first.generate(PROMPTS, GREEDY)
    with pytest.raises(RuntimeError, match="stopped"):
        first.stats()
    first.shutdown()  # a second call is a no-op

    second = build(tiny_models["qwen3"])
    assert [out.token_ids for out in second.generate(PROMPTS, GREEDY)] == expected
    second.shutdown()


def test_leaving_a_with_block_frees_the_engine(tiny_models):
    with build(tiny_models["llama"]) as llm:
        expected = [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]
        tensors = engine_tensors(llm)
    assert [ref for ref in tensors if ref() is not None] == []
    with build(tiny_models["llama"]) as again:
        assert [out.token_ids for out in again.generate(PROMPTS, GREEDY)] == expected
