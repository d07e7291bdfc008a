"""The host builds and enqueues every step without waiting for the device (GPU only: see conftest.py).

Under overlap scheduling the host builds step N+1 while the device runs step N; one blocking copy while it
builds (torch's `device_table[row] = host_tensor` is one) holds the host until step N ends, and the launch
that follows leaves the device idle (engine/host_copy.py). torch's sync debug mode turns every such wait
into an error: building the batches (admissions with every sampling feature, chunked prompts beside
decodes, retraction), enqueuing the forward passes and enqueuing sampling run under it here. Reading a
step's tokens is the one intended wait, and is left out.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import pytest
import torch
from helpers import make_llm, random_prompts

from minisgl import SamplingParams
from minisgl.core import Batch, ThinkingBudget
from minisgl.engine.engine import Engine
from minisgl.scheduler.scheduler import Scheduler


@contextlib.contextmanager
def no_device_wait():
    torch.cuda.set_sync_debug_mode("error")
    try:
        yield
    finally:
        torch.cuda.set_sync_debug_mode("default")


def strict(method: Callable, seen: list | None = None) -> Callable:
    def wrapped(*args, **kwargs):
        with no_device_wait():
            out = method(*args, **kwargs)
        if seen is not None and out is not None:
            seen.append(out)
        return out
    return wrapped


def params(k: int) -> SamplingParams:
    """Every sampling feature that loads a sampler row at admission, one request each, and plain ones."""
    common = dict(max_tokens=24, ignore_eos=True, seed=k)
    return [
        SamplingParams(temperature=0, **common),
        SamplingParams(temperature=0.8, top_p=0.9, top_k=20, min_p=0.05, **common),
        SamplingParams(temperature=0.7, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.2,
                       **common),
        SamplingParams(temperature=0.7, logit_bias={5: 3.0, 9: -2.0}, **common),
        SamplingParams(temperature=0.7, min_tokens=10, stop_token_ids=[7], **common),
        SamplingParams(temperature=0.7, thinking_budget=ThinkingBudget(4, (11,), (12, 13)), **common),
        SamplingParams(temperature=0.7, logprobs=3, **common),
    ][k % 7]


@pytest.mark.parametrize("whole", [True, False], ids=["whole-step", "eager"])
def test_steps_are_built_and_launched_without_waiting_for_the_device(tiny_models, monkeypatch, whole):
    """28 requests of 7 kinds arrive while others decode, prompts longer than the 64-token step budget come in
    chunks beside decodes, and a pool of 1,200 pages makes the scheduler retract: every batch is built and
    enqueued under sync debug mode "error", and every request gets all its tokens."""
    llm = make_llm(tiny_models["qwen3"], max_prefill_tokens=64, num_pages=1200, cuda_graph_max_bs=8)
    vocab = llm.engine.config.vocab_size
    lengths = [150, 20, 90, 5, 130, 40, 70] * 4
    llm.generate(random_prompts(lengths, vocab, seed=1), [params(k) for k in range(len(lengths))])  # warm
    if not whole:
        llm.engine.whole = None  # every step with prefill tokens runs eagerly
    built: list[Batch] = []
    monkeypatch.setattr(Scheduler, "_next_batch", strict(Scheduler._next_batch, built))
    monkeypatch.setattr(Engine, "forward", strict(Engine.forward))
    monkeypatch.setattr(Engine, "sample", strict(Engine.sample))
    retracted = llm.scheduler.num_retracted
    outputs = llm.generate(random_prompts(lengths, vocab, seed=2), [params(k) for k in range(len(lengths))])

    assert [len(o.token_ids) for o in outputs] == [24] * len(lengths)
    mixed = [b for b in built if 1 in b.extend_lens and any(n > 1 for n in b.extend_lens)]
    assert mixed, "no step put prefill chunks beside decodes"
    assert any(b.is_decode and len(b.reqs) > 8 for b in built), "no decode above the graphs' batch sizes (eager)"
    assert llm.scheduler.num_retracted > retracted, "the pool was large enough: nothing was retracted"
    llm.shutdown()
