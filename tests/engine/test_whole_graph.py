"""The whole-step CUDA graphs' bucket choice and flags, on the CPU (capture and replay:
tests/gpu/test_whole_graph.py; their attention metadata: tests/kernels/test_triton_attention.py)."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import DEVICE, make_llm
from kernels.test_triton_attention import LAYER, Case

from minisgl.attention import make_backend
from minisgl.attention.torch_backend import TorchBackend
from minisgl.attention.triton_backend import TritonBackend
from minisgl.engine.config import EngineArgs
from minisgl.engine.whole_graph import bucket_for, timing_ids, token_buckets
from minisgl.layers.moe import SparseMoE, route
from minisgl.server.args import parse_args


def test_buckets_double_up_to_256_then_step_by_64_up_to_2048_then_by_256():
    assert token_buckets(2048) == [16, 32, 64, 128, *range(256, 2049, 64)]
    assert token_buckets(3000) == token_buckets(2048) + [2304, 2560, 2816, 3000]
    assert token_buckets(9000) == token_buckets(2048) + list(range(2304, 8193, 256)) + [8448, 8704, 8960, 9000]
    assert token_buckets(600) == [16, 32, 64, 128, 256, 320, 384, 448, 512, 576, 600]
    assert token_buckets(100) == [16, 32, 64, 100]
    assert token_buckets(8) == [8]
    assert token_buckets(0) == []


def test_the_timing_runs_tokens_spread_over_the_experts_as_a_served_steps_do(tiny_models):
    """The step cost model times each bucket on `timing_ids`; all-equal ids would route every token of a MoE model
    to the same top-k experts, and time a fraction of the expert weights a served step reads."""
    with make_llm(tiny_models["qwen3_moe"]) as llm:
        model, vocab = llm.engine.model.model, llm.engine.config.vocab_size
        layer = next(layer for layer in model.layers if isinstance(layer.mlp, SparseMoE))
        moe, experts = layer.mlp, layer.mlp.w13.shape[0]

        def experts_used(ids: torch.Tensor) -> int:
            with torch.no_grad():
                hidden = layer.post_attention_layernorm(model.embed_tokens(ids.to(llm.engine.device)))
                return route(moe.gate(hidden), moe.top_k, moe.renormalize)[1].unique().numel()

        ids = timing_ids(256, vocab)
        assert ids.min() >= 0 and ids.max() < vocab and torch.equal(ids, timing_ids(256, vocab))  # every rank alike
        assert experts_used(torch.zeros(256, dtype=torch.int64)) == moe.top_k
        assert experts_used(ids) == experts > moe.top_k


@pytest.mark.parametrize("cap", [100, 1000, 2048, 9000])
def test_every_step_up_to_the_cap_gets_the_smallest_bucket_that_holds_it(cap):
    buckets = token_buckets(cap)
    for tokens in range(1, cap + 1):
        bucket = bucket_for(buckets, tokens)
        assert bucket >= tokens
        smaller = [b for b in buckets if b < bucket]
        assert not smaller or smaller[-1] < tokens  # no smaller bucket would have held it
        assert bucket - tokens < (256 if tokens <= 2048 else 512)  # padding wastes at most 255 (511) rows
    assert bucket_for(buckets, cap + 1) is None  # above the cap: eager


def test_flags_set_the_cap_or_turn_the_graphs_off(tiny_models):
    base = ["--model", tiny_models["qwen3"], "--device", "cpu"]
    assert parse_args(base).engine.piecewise_graph_max_tokens == 8192
    assert parse_args(base + ["--piecewise-cuda-graph-max-tokens", "512"]).engine.piecewise_graph_max_tokens == 512
    assert parse_args(base + ["--disable-piecewise-cuda-graph"]).engine.piecewise_graph_max_tokens == 0
    with pytest.raises(ValueError, match="piecewise_graph_max_tokens"):
        EngineArgs(tiny_models["qwen3"], piecewise_graph_max_tokens=-1)


@pytest.mark.parametrize("backend_name", ["torch", "triton"])
def test_store_with_padding_rows_then_attend_into_a_buffer_equals_forward(backend_name):
    """What a padded step does per layer: the rope stores the bucket's K/V (padding rows at the scratch slot, with
    stale values), then attention of the real rows writes into the static output. Same output and the same
    pool as the plain forward; the scratch slot is the only other slot touched."""
    case = Case([5, 0, 17], [3, 9, 1], heads=4, kv_heads=2, head_dim=16, page_size=4)
    want, want_pool = case.run(TorchBackend if backend_name == "torch" else TritonBackend)
    pool = copy.copy(case.pool)
    pool.k, pool.v = case.pool.k.clone(), case.pool.v.clone()
    backend = make_backend(backend_name, pool, case.page_table)
    pad, scratch = 5, pool.scratch_page * pool.page_size
    slots = torch.cat([case.batch.out_slots, torch.full((pad,), scratch, device=DEVICE)])
    stale = [torch.cat([t, torch.randn(pad, *t.shape[1:], dtype=t.dtype, device=DEVICE)]) for t in (case.k, case.v)]
    pool.store(LAYER, slots, *stale)  # as the piece's rope does
    out = torch.full((case.q.shape[0] + pad, want.shape[1]), float("nan"), dtype=want.dtype, device=DEVICE)
    returned = backend.attend(LAYER, case.q, backend.prepare(case.batch), out[: case.q.shape[0]])
    assert returned.data_ptr() == out.data_ptr()
    torch.testing.assert_close(out[: case.q.shape[0]], want, atol=2e-5, rtol=0)
    assert out[case.q.shape[0]:].isnan().all()  # padding rows of the output are not written
    keep = torch.ones(pool.k.shape[1], dtype=torch.bool, device=DEVICE)
    keep[scratch] = False
    assert torch.equal(pool.k[:, keep], want_pool.k[:, keep]) and torch.equal(pool.v[:, keep], want_pool.v[:, keep])
