"""The few-token MoE (`minisgl.kernels.moe_gemv`) against the torch reference (`experts_torch`), and
SparseMoE's choice of it. On the CPU the kernels run in Triton's interpreter at small shapes, in float32
and float16 (the interpreter has no bfloat16 arithmetic); with MINISGL_TEST_DEVICE=cuda compiled, in
bfloat16 and float32. Full-size shapes are in tests/gpu/test_moe_gemv_full_size.py."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE

from kernels.test_fp8_kernels import BLOCK128, SMALL, check_experts
from minisgl.kernels.fused_moe import fused_experts
from minisgl.kernels.moe_gemv import SMALL_MOE_MAX_TOKENS, MoeGemvConfig, moe_gemv
from minisgl.layers.moe import experts_torch, pick_experts, route

ON_GPU = DEVICE == "cuda"
DTYPES = [torch.bfloat16, torch.float32] if ON_GPU else [torch.float32, torch.float16]
# One rounding of float32 sums against the reference's several (it rounds each expert's output, its weighted
# product and the running sum to x's dtype); outputs are about 1.
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=1e-2, atol=1e-2),
       torch.bfloat16: dict(rtol=5e-2, atol=5e-2)}
EXPERTS = 8
# Neither H nor I a multiple of the tiles: the masked K tail and the columns past N run too.
HIDDEN, INTER = 200, 72
TILES = MoeGemvConfig(up_block_n=16, down_block_n=32, block_k=64)
# The down GEMV's slots in two groups, reduced by the last to arrive (top_k 3 falls back to one group).
SPLIT_TILES = MoeGemvConfig(up_block_n=16, down_block_n=32, down_split=2, block_k=64)


def make_experts(dtype: torch.dtype, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(EXPERTS, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(EXPERTS, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def check(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, config: MoeGemvConfig | None) -> None:
    w13, w2 = make_experts(x.dtype)
    out = moe_gemv(x, w13, w2, weights, ids, config)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, experts_torch(x, w13, w2, weights, ids), **TOL[x.dtype])


@pytest.mark.parametrize("config", [TILES, SPLIT_TILES, None], ids=["small_tiles", "split_slots", "default_tiles"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens, top_k", [(1, 2), (2, 4), (3, 3), (5, 2)])
def test_moe_gemv_matches_reference(tokens, top_k, dtype, config):
    """Random routing (int32 ids, as the fused router gives them), odd token counts and top_k."""
    gen = torch.Generator().manual_seed(tokens)
    x = torch.randn(tokens, HIDDEN, generator=gen).to(DEVICE, dtype)
    weights, ids = route(torch.randn(tokens, EXPERTS, generator=gen).to(DEVICE), top_k, True)
    check(x, weights, ids.to(torch.int32), config)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_gemv_tokens_share_experts(dtype):
    """Five tokens on overlapping expert sets (expert 3 in every token, in different slots), int64 ids as
    torch's router gives them, unnormalised weights: each pair reads its own expert and its own token."""
    ids = torch.tensor([[3, 0, 1], [1, 3, 0], [0, 1, 3], [3, 7, 0], [7, 0, 3]], device=DEVICE)
    weights = torch.tensor([[0.5, 0.3, 0.1], [0.6, 0.2, 0.1], [0.4, 0.4, 0.2], [0.9, 0.05, 0.05],
                            [0.3, 0.3, 0.3]], device=DEVICE)
    x = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(0)).to(DEVICE, dtype)
    check(x, weights, ids, TILES)


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("tokens, top_k, split", [(1, 4, 1), (1, 4, 4), (3, 2, 2), (5, 3, 1)])
def test_moe_gemv_fp8_block128(tokens, top_k, split):
    """e4m3 experts in 128 x 128 blocks (Qwen3-30B-A3B-FP8's layout) at H 256, I 128: x and the activation
    quantized per token and 128-column group, as `fp8_linear_torch` does; the down GEMV's slots in `split`
    groups."""
    check_experts(tokens, EXPERTS, top_k, 256, 128, BLOCK128, MoeGemvConfig(down_split=split), kernel=moe_gemv)


@pytest.mark.skipif(ON_GPU, reason="small shapes: the interpreter's")
@pytest.mark.parametrize("scales", list(SMALL))
def test_moe_gemv_fp8_small_blocks(scales):
    """16 x 32 blocks (a 32-row gate/up tile spans two block rows: a weight scale per row) and per-channel
    scales (applied after the K loop), at I 48: the down GEMV's last group is 16 columns of 32."""
    check_experts(3, EXPERTS, 2, 64, 48, SMALL[scales], None, kernel=moe_gemv)


def test_sparse_moe_picks_the_gemv_for_few_tokens():
    """On a GPU, up to SMALL_MOE_MAX_TOKENS tokens take the GEMVs, more the fused MoE; elsewhere the torch
    reference runs whatever the count."""
    assert pick_experts(1, True) is moe_gemv
    assert pick_experts(SMALL_MOE_MAX_TOKENS, True) is moe_gemv
    assert pick_experts(SMALL_MOE_MAX_TOKENS + 1, True) is fused_experts
    assert pick_experts(0, True) is fused_experts
    assert pick_experts(1, False) is experts_torch
