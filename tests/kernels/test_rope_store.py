"""The rope kernel that also stores K/V (`qk_norm_rope_store`) against its torch reference:
`RotaryEmbedding.forward_torch` for q and k, then `KVPool.store` for the pool.

Checked: the new q; the pool at the step's slots (k within rounding of the reference, v byte for byte), for
pools of the model's dtype and fp8, pages of 1 and more slots, and CUDA-graph padding rows whose slots are
on the scratch page; every other slot byte for byte unchanged. On the CPU in Triton's interpreter (float32 and
float16: it has no bfloat16 arithmetic); on a GPU (MINISGL_TEST_DEVICE=cuda) in bfloat16 too.
"""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import DEVICE

from kernels.test_fused_ops import (
    LOW_PRECISION,
    TOKENS_DTYPES,
    TOKENS_DTYPES_IDS,
    assert_close,
    make_norm,
    randn,
)
from kernels.test_triton_attention import as_bytes
from minisgl.kernels.rotary import qk_norm_rope_store
from minisgl.kvcache.pool import KVPool
from minisgl.layers.rotary import RotaryEmbedding

FP8 = torch.float8_e4m3fn
LAYER = 1  # of 2: the kernel must write the layer's own slice of the pool
MAX_POSITIONS = 4096
# (head_dim, q heads, kv heads): MHA, and GQA at 2:1 and 4:1 with a q head count that is no power of two.
HEAD_SHAPES = [(16, 4, 4), (64, 12, 3), (128, 16, 8)]


def fp8_rounding_cases() -> torch.Tensor:
    """Every finite e4m3 value, each midpoint between neighbours (a tie: rounds to the even one), values
    around the subnormals, past +-448 (saturate) and the infinities, in rows of 16."""
    finite = torch.arange(256, dtype=torch.uint8).view(FP8).float()
    finite = finite[finite.isfinite()].sort().values
    ties = (finite[1:] + finite[:-1]) / 2
    gen = torch.Generator().manual_seed(15)
    spread = torch.randn(1000, generator=gen) * torch.exp2(torch.randint(-14, 12, (1000,), generator=gen).float())
    edges = torch.tensor([449.0, 463.9, 464.0, 500.0, 1e6, float("inf"), 2.0**-10, 2.0**-9 * 1.5, 1e-30, -0.0])
    values = torch.cat([finite, ties, spread, edges, -edges])
    return values[: values.numel() // 16 * 16].view(-1, 1, 16)


class RopeStoreCase:
    """Tokens of a fused qkv output (q, k, v are its strided views) at random, unsorted, repeated positions,
    going to distinct random slots of a pool full of stale values; `padded` more tokens go to the scratch page,
    as a CUDA graph's padding rows do."""

    def __init__(self, tokens: int, head_dim: int, heads: int, kv_heads: int, dtype: torch.dtype,
                 cache_dtype: torch.dtype | None = None, page_size: int = 16, padded: int = 0,
                 qk_norm: bool = False, seed: int = 0):
        torch.manual_seed(seed)
        self.rope = RotaryEmbedding(head_dim, MAX_POSITIONS, theta=1e6, scaling=None).to(DEVICE)
        total = tokens + padded
        qkv = randn(total, (heads + 2 * kv_heads) * head_dim, dtype=dtype, scale=2.0)
        q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
        self.qkv = qkv
        self.q, self.k, self.v = (x.view(total, -1, head_dim) for x in (q, k, v))
        self.positions = torch.randint(0, MAX_POSITIONS, (total,), device=DEVICE)
        num_pages = -(-2 * tokens // page_size) + 1
        self.pool = KVPool(2, num_pages, page_size, kv_heads, head_dim, dtype, torch.device(DEVICE), cache_dtype)
        for cache in (self.pool.k, self.pool.v):
            cache.copy_(torch.randn(cache.shape) * 3)
        scratch = self.pool.scratch_page * page_size
        real = torch.randperm(scratch)[:tokens]
        self.slots = torch.cat([real, scratch + torch.randint(0, page_size, (padded,))]).to(DEVICE)
        self.tokens = tokens
        self.norms = (make_norm(head_dim, dtype), make_norm(head_dim, dtype)) if qk_norm else (None, None)

    def fresh_pool(self) -> KVPool:
        pool = copy.copy(self.pool)
        pool.k, pool.v = self.pool.k.clone(), self.pool.v.clone()
        return pool

    def run_kernel(self, pool: KVPool) -> torch.Tensor:
        weights = [n.weight for n in self.norms] if self.norms[0] is not None else [None, None]
        eps = self.norms[0].eps if self.norms[0] is not None else 1e-6
        return qk_norm_rope_store(self.q, self.k, self.v, self.positions, self.rope.cos, self.rope.sin,
                                  pool.k[LAYER], pool.v[LAYER], self.slots, *weights, eps=eps)

    def run_reference(self, pool: KVPool) -> torch.Tensor:
        q, k = self.rope.forward_torch(self.positions, self.q, self.k, *self.norms)
        pool.store(LAYER, self.slots, k, self.v)
        return q

    def check(self) -> None:
        """The kernel on a copy of the pool against the reference on another: q, the pool, the inputs unchanged."""
        qkv_before = self.qkv.clone()
        ours = self.fresh_pool()
        q_out = self.run_kernel(ours)
        assert torch.equal(self.qkv, qkv_before)
        self.verify(q_out, ours)

    def verify(self, q_out: torch.Tensor, ours: KVPool) -> None:
        """q_out and `ours` (a copy of this case's pool that the kernel wrote into) against the reference."""
        ref = self.fresh_pool()
        q_ref = self.run_reference(ref)
        assert_close(q_out, q_ref)  # padding rows too: their q is computed like any other
        real = self.slots[: self.tokens]
        k_got, _ = ours.load(LAYER, real, torch.float32)
        k_want, _ = ref.load(LAYER, real, torch.float32)
        if ours.k.dtype == FP8:
            # k is rounded once more (to fp8) after the rounding to the model's dtype, where both may differ: by
            # an ulp of k, or near zero (the rotation cancels) by the reference's roundings of its products, an ulp
            # of inputs ~1 (2**-8 in bf16; two fp8 subnormal steps, seen on an H100). So one fp8 step (12.5%) plus
            # 2**-6 absolute, and equal almost everywhere.
            torch.testing.assert_close(k_got, k_want, rtol=0.125, atol=2.0**-6)
            assert (k_got == k_want).float().mean() > 0.95
        else:
            assert_close(k_got.to(self.q.dtype), k_want.to(self.q.dtype))
        assert torch.equal(as_bytes(ours.v[LAYER][real]), as_bytes(ref.v[LAYER][real]))
        untouched = torch.ones(ours.k.shape[1], dtype=torch.bool, device=DEVICE)
        untouched[real] = False
        untouched[self.pool.scratch_page * self.pool.page_size:] = False  # padding rows write there
        for got, before in ((ours.k, self.pool.k), (ours.v, self.pool.v)):
            assert torch.equal(as_bytes(got[:, untouched]), as_bytes(before[:, untouched]))
            assert torch.equal(as_bytes(got[1 - LAYER]), as_bytes(before[1 - LAYER]))


@pytest.mark.parametrize("qk_norm", [False, True], ids=["rope", "norm+rope"])
@pytest.mark.parametrize("head_dim,heads,kv_heads", HEAD_SHAPES)
@pytest.mark.parametrize("tokens,dtype", TOKENS_DTYPES, ids=TOKENS_DTYPES_IDS)
def test_rope_store_matches_torch(tokens: int, head_dim: int, heads: int, kv_heads: int, qk_norm: bool,
                                  dtype: torch.dtype) -> None:
    RopeStoreCase(tokens, head_dim, heads, kv_heads, dtype, qk_norm=qk_norm, seed=tokens * head_dim + heads).check()


@pytest.mark.parametrize("cache", ["model", "fp8"])
@pytest.mark.parametrize("page_size,padded", [(1, 0), (1, 3), (4, 5)])
@pytest.mark.parametrize("dtype", [torch.float32, LOW_PRECISION], ids=str)
def test_rope_store_pools_pages_and_padding(cache: str, page_size: int, padded: int, dtype: torch.dtype) -> None:
    """Qwen3-like heads (GQA 2:1 with q/k norm) into either pool, with and without padding rows."""
    RopeStoreCase(9, 64, 4, 2, dtype, FP8 if cache == "fp8" else None, page_size, padded, qk_norm=True,
                  seed=page_size + padded).check()


def test_rope_store_llama3_table() -> None:
    """Llama-3 scaling only changes the table; the kernel reads whatever table it is given, with positions
    of any stride."""
    torch.manual_seed(0)
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 256}
    rope = RotaryEmbedding(64, max_positions=2048, theta=5e5, scaling=scaling).to(DEVICE)
    q, k, v = (randn(9, h, 64, dtype=torch.float32) for h in (4, 2, 2))
    positions = torch.tensor([2047, 0, 300, 255, 256, 1000, 5, 5, 1500], device=DEVICE).repeat_interleave(2)[::2]
    assert positions.stride(0) == 2
    slots = torch.arange(9, device=DEVICE)
    ours, ref = (KVPool(1, 9, 1, 2, 64, torch.float32, torch.device(DEVICE)) for _ in range(2))
    q_out = qk_norm_rope_store(q, k, v, positions, rope.cos, rope.sin, ours.k[0], ours.v[0], slots)
    q_ref, k_ref = rope.forward_torch(positions, q, k)
    ref.store(0, slots, k_ref, v)
    assert_close(q_out, q_ref)
    assert_close(ours.k[0, :9], ref.k[0, :9])
    assert torch.equal(ours.v, ref.v)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_fp8_pool_gets_the_torch_cast(dtype: torch.dtype) -> None:
    """Into an fp8 pool both k and v are x.to(float8_e4m3fn) byte for byte from fp32, bf16 and fp16 (at
    position 0 the rotation is the identity), except that anything past +-448 saturates to +-448 (torch's CUDA
    cast overflows to NaN instead); so does KVPool.store, the reference."""
    x = fp8_rounding_cases().to(DEVICE, dtype)
    # k's infinities would meet sin = 0 in the rotation (inf * 0 = NaN): big finite values saturate as well.
    k, v = x.nan_to_num(posinf=6e4, neginf=-6e4), x
    tokens = x.shape[0]
    slots, positions = torch.randperm(tokens).to(DEVICE), torch.zeros(tokens, dtype=torch.int64, device=DEVICE)
    rope = RotaryEmbedding(16, 1, 1e4, None).to(DEVICE)
    kernel, ref = (KVPool(1, tokens, 1, 1, 16, dtype, torch.device(DEVICE), FP8) for _ in range(2))
    qk_norm_rope_store(k, k, v, positions, rope.cos, rope.sin, kernel.k[0], kernel.v[0], slots)
    ref.store(0, slots, k, v)
    for pool in (kernel, ref):
        for cache, values in ((pool.k, k), (pool.v, v)):
            assert torch.equal(as_bytes(cache[0][slots]), as_bytes(values.float().clamp(-448, 448).to(FP8)))
        big = x.float().abs() >= 448
        k_read, v_read = pool.load(0, slots, torch.float32)
        assert big.sum() >= 10 and k_read.abs()[big].unique().tolist() == v_read.abs()[big].unique().tolist() == [448]


def test_empty_batch() -> None:
    """Zero tokens (an idle rank, an empty chunk) launch nothing and return an empty q."""
    rope = RotaryEmbedding(16, 32, 1e4, None).to(DEVICE)
    pool = KVPool(1, 4, 1, 2, 16, torch.float32, torch.device(DEVICE))
    empty = lambda heads: torch.empty(0, heads, 16, device=DEVICE)  # noqa: E731
    q = qk_norm_rope_store(empty(4), empty(2), empty(2), torch.empty(0, dtype=torch.int64, device=DEVICE), rope.cos,
                           rope.sin, pool.k[0], pool.v[0], torch.empty(0, dtype=torch.int64, device=DEVICE))
    assert q.shape == (0, 4, 16) and not pool.k.any()
