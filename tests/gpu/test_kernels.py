"""Kernels at full size in bf16 and replayed from CUDA graphs (GPU only: see conftest.py)."""

from __future__ import annotations

import copy
import random

import pytest
import torch
from kernels.test_fused_moe import TOL, make_experts, make_tokens
from kernels.test_rope_store import RopeStoreCase
from kernels.test_triton_attention import (
    DECODE_KV,
    LAYER,
    RAGGED_EXT,
    RAGGED_KV,
    SENTINEL,
    SPLIT_ALWAYS,
    SPLIT_NEVER,
    Case,
    mixed_meta_kind,
)

from minisgl.attention.torch_backend import TorchBackend
from minisgl.attention.triton_backend import ExtendMeta, MixedMeta, StaticStepMeta, TritonBackend
from minisgl.kernels.attention import KernelConfig
from minisgl.kernels.fused_moe import fused_experts
from minisgl.layers.moe import experts_torch, route

CACHE_DTYPES = {"bf16": None, "fp8": torch.float8_e4m3fn}  # the pool: the model's dtype, or --kv-cache-dtype fp8


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_attention_bf16_matches_torch(heads, kv_heads, page_size, cache):
    kw = dict(cache_dtype=CACHE_DTYPES[cache])
    Case(RAGGED_KV, RAGGED_EXT, heads, kv_heads, 128, page_size, torch.bfloat16, seed=5, **kw).check()
    Case(DECODE_KV, [1] * len(DECODE_KV), heads, kv_heads, 128, page_size, torch.bfloat16, padded=3, seed=6,
         **kw).check()


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(16, 8), (32, 8)])
def test_mixed_attention_bf16_matches_torch(heads, kv_heads, page_size, cache):
    """A mixed step at serving size: 64 decodes of 1-3,000 cached tokens, then a fresh 700-token chunk and a
    300-token chunk after 1,500 cached. Its decode rows through the decode kernel (the backend's own splits, and
    4 splits: the scratch for the decode rows alone) and all rows through the extend kernel give the torch
    reference."""
    rng = random.Random(9)
    kv_lens, extend_lens = [rng.randrange(1, 3000) for _ in range(64)] + [0, 1500], [1] * 64 + [700, 300]
    case = Case(kv_lens, extend_lens, heads, kv_heads, 128, page_size, torch.bfloat16, seed=24,
                cache_dtype=CACHE_DTYPES[cache])
    assert mixed_meta_kind(case, **SPLIT_ALWAYS) == (MixedMeta, 64)
    assert mixed_meta_kind(case, **SPLIT_NEVER) == (ExtendMeta, 0)
    for config in (None, KernelConfig(decode_splits=4)):
        case.check(config, **SPLIT_ALWAYS)
    case.check(**SPLIT_NEVER)


def test_any_decode_batch_size_reuses_the_compiled_decode_kernels():
    """A mixed step's decode rows come in any number, and the split count follows it: after one batch with a
    single split and one with several, decode batches of every size 1-48 (split counts 1-32 on any GPU) give the
    torch reference without compiling another variant of the decode kernel (which also reduces the splits now; a
    variant per count stalled the first mixed step that met it for the compile, ~0.5 s, on an H200)."""
    from minisgl.kernels import attention

    def compiled() -> int:
        device = torch.cuda.current_device()
        return len(attention._decode_split_kernel.device_caches[device][0])

    def check(batch: int) -> None:
        # One row of 2,000 tokens in each: the page table's width (a stride Triton specializes) stays the engine's
        # one fixed width, as it is in serving.
        kv_lens = [100 + 37 * i for i in range(batch - 1)] + [2000]
        Case(kv_lens, [1] * batch, 16, 8, 128, 1, torch.bfloat16, seed=batch).check()

    check(1)
    check(48)
    before = compiled()
    for batch in range(1, 49):
        check(batch)
    assert compiled() == before


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_attention_decode_replays_in_cuda_graph(cache):
    """Capture prepare + forward once, then replay with other lengths and pages in the same buffers
    (the same lengths in another order, so that the pool and page table keep their shapes)."""
    kw = dict(cache_dtype=CACHE_DTYPES[cache])
    first = Case([10, 300, 2000], [1, 1, 1], 8, 2, 128, 16, torch.bfloat16, seed=7, **kw)
    second = Case([2000, 10, 300], [1, 1, 1], 8, 2, 128, 16, torch.bfloat16, seed=8, **kw)
    backend = TritonBackend(first.pool, first.page_table)
    static = first.batch
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    def layer() -> torch.Tensor:  # the new K/V into the pool (the model's rope does it), then attention
        first.pool.store(LAYER, static.out_slots, first.k, first.v)
        return backend.attend(LAYER, first.q, backend.prepare(static))

    with torch.cuda.stream(stream):  # warm-up compiles the kernels outside the capture
        layer()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer()
    for case in (first, second):
        first.pool.k.copy_(case.pool.k)
        first.pool.v.copy_(case.pool.v)
        first.page_table.copy_(case.page_table)
        for name in ("out_slots", "rows", "kv_lens", "extend_lens", "seq_lens"):
            getattr(static, name).copy_(getattr(case.batch, name))
        for dst, src in ((first.q, case.q), (first.k, case.k), (first.v, case.v)):
            dst.copy_(src)
        graph.replay()
        expected, _ = case.run(TorchBackend)
        torch.testing.assert_close(out.float(), expected.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_static_step_attention_replays_any_step_of_its_bucket(cache):
    """One layer's attention over StaticStepMeta (a whole-step graph's), captured once at a bucket of 1,024 tokens
    with all-padding metadata, then replayed for three mixed steps of other pools, page tables, decode counts and
    chunk splits (the same page counts, so the buffers keep their shapes): each gives the torch reference on its
    real rows and leaves the padding rows of the output alone."""
    specs = [([900, 17, 2047, 0, 1500], [1, 1, 1, 700, 300], 3), ([17, 2047, 900, 1500, 0], [1, 1, 1, 300, 700], 3),
             ([2047, 900, 0, 0, 1500], [1, 1, 18, 700, 300], 2)]
    cases = [Case(kv, ext, 16, 8, 128, 16, torch.bfloat16, seed=40 + i, cache_dtype=CACHE_DTYPES[cache])
             for i, (kv, ext, _) in enumerate(specs)]
    first, bucket = cases[0], 1024
    pool = copy.copy(first.pool)
    pool.k, pool.v = first.pool.k.clone(), first.pool.v.clone()
    page_table = first.page_table.clone()
    backend = TritonBackend(pool, page_table)
    static = StaticStepMeta(backend, 16, max_decodes=8, max_chunks=6, pad_row=page_table.shape[0] - 1)
    meta = static.meta(bucket, 8, 6)
    q = torch.zeros(bucket, 16, 128, dtype=torch.bfloat16, device="cuda")
    out = torch.zeros(bucket, 16 * 128, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernels (and makes the split scratch) outside the capture
        backend.attend(LAYER, q, meta, out)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.attend(LAYER, q, meta, out)
    for case, (kv, ext, decodes) in zip(cases, specs):
        expected, ref_pool = case.run(TorchBackend)
        pool.k.copy_(ref_pool.k)
        pool.v.copy_(ref_pool.v)
        page_table.copy_(case.page_table)
        static.write(case.batch.rows.tolist(), kv, ext, decodes)
        n = case.q.shape[0]
        q[:n].copy_(case.q)
        out.fill_(SENTINEL)
        graph.replay()
        torch.testing.assert_close(out[:n].float(), expected.float(), atol=2e-2, rtol=2e-2)
        assert (out[n:] == SENTINEL).all()


@pytest.mark.parametrize("cache", list(CACHE_DTYPES))
def test_rope_store_full_size_replays_in_cuda_graph(cache):
    """qwen3-8b's attention heads (32 q, 8 KV, head_dim 128, q/k norm) in bf16, a decode batch of 61 plus 3
    padding rows on the scratch page: the rope kernel that stores K/V against its torch reference, eagerly,
    then captured once and replayed with another batch's q/k/v, positions, slots, norms and pool."""
    kw = dict(cache_dtype=CACHE_DTYPES[cache], page_size=16, padded=3, qk_norm=True)
    first, second = (RopeStoreCase(61, 128, 32, 8, torch.bfloat16, seed=seed, **kw) for seed in (1, 2))
    first.check()
    pool = first.fresh_pool()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up compiles the kernel outside the capture
        first.run_kernel(pool)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        q = first.run_kernel(pool)
    for case in (second, first):
        for dst, src in ((first.qkv, case.qkv), (first.positions, case.positions), (first.slots, case.slots),
                         (pool.k, case.pool.k), (pool.v, case.pool.v)):
            dst.copy_(src)
        for dst, src in zip(first.norms, case.norms):
            dst.weight.data.copy_(src.weight)
        graph.replay()
        case.verify(q, pool)


def test_fused_moe_replays_in_cuda_graph():
    """Captured once, replayed on new routing: nothing host-side (a sync, a data-dependent size) is baked in."""
    num_tokens, num_experts, top_k = 8, 16, 4
    w13, w2 = make_experts(num_experts)
    x, logits = make_tokens(num_tokens, num_experts)
    weights, ids = route(logits, top_k, True)
    fused_experts(x, w13, w2, weights, ids)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fused_experts(x, w13, w2, weights, ids)
    for seed in (2, 3):
        new_x, new_logits = make_tokens(num_tokens, num_experts, seed)
        new_weights, new_ids = route(new_logits, top_k, True)
        for static, new in ((x, new_x), (weights, new_weights), (ids, new_ids)):
            static.copy_(new)
        graph.replay()
        torch.testing.assert_close(out, experts_torch(x, w13, w2, weights, ids), rtol=TOL, atol=TOL)
