"""The fused MoE kernel against the torch reference (`experts_torch`) and its align step against a plain
Python layout. On the CPU the kernels run in Triton's interpreter at small shapes in float32; with
MINISGL_TEST_DEVICE=cuda the same tests run compiled, at bigger shapes, in bfloat16."""

from __future__ import annotations

import pytest
import torch
from helpers import DEVICE

from minisgl.kernels.fused_moe import MoEConfig, align, fused_experts, route_fused
from minisgl.layers.moe import experts_torch, route

ON_GPU = DEVICE == "cuda"
DTYPE = torch.bfloat16 if ON_GPU else torch.float32
TOL = 2e-2 if ON_GPU else 1e-5
# Hidden size and expert intermediate size: neither a multiple of the small tiles below, so the masked-K
# and wrapped-N paths of the GEMM run too.
HIDDEN, INTER = (576, 200) if ON_GPU else (48, 24)
SMALL_TILES = MoEConfig(block_m=16, block_n=16, block_k=32, group_m=2, num_warps=4, num_stages=2)
WIDE_TILES = MoEConfig(block_m=64, block_n=32, block_k=16, group_m=1, num_warps=4, num_stages=2)


def make_experts(num_experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13 = torch.randn(num_experts, 2 * INTER, HIDDEN, generator=gen) / HIDDEN**0.5
    w2 = torch.randn(num_experts, HIDDEN, INTER, generator=gen) / INTER**0.5
    return w13.to(DEVICE, DTYPE), w2.to(DEVICE, DTYPE)


def make_tokens(num_tokens: int, num_experts: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(num_tokens, HIDDEN, generator=gen)
    logits = torch.randn(num_tokens, num_experts, generator=gen)
    return x.to(DEVICE, DTYPE), logits.to(DEVICE)


def check_fused(x, logits, w13, w2, top_k: int, renormalize: bool, config: MoEConfig | None = None) -> None:
    weights, ids = route(logits, top_k, renormalize)
    out = fused_experts(x, w13, w2, weights, ids, config)
    assert out.shape == x.shape and out.dtype == x.dtype
    torch.testing.assert_close(out, experts_torch(x, w13, w2, weights, ids), rtol=TOL, atol=TOL)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize", [
    (1, 4, 1, False), (1, 8, 4, True), (3, 8, 2, True), (17, 4, 2, False), (17, 8, 4, True), (64, 8, 2, False),
    (80, 4, 4, True),
])
def test_fused_matches_reference(num_tokens, num_experts, top_k, renormalize):
    """The config of the table or the default heuristic, on random routing."""
    w13, w2 = make_experts(num_experts)
    check_fused(*make_tokens(num_tokens, num_experts), w13, w2, top_k, renormalize)


@pytest.mark.parametrize("num_tokens, num_experts, top_k, renormalize", [
    (5, 8, 2, True), (9, 60, 4, False), (33, 128, 8, True), (0, 16, 2, True)])
def test_fused_route_matches_reference(num_tokens, num_experts, top_k, renormalize):
    """The one-launch router picks the reference's experts in its order (highest first), with its weights.
    float32 logits: bf16 ones tie often, and which of two tied experts comes first is not specified."""
    logits = make_tokens(num_tokens, num_experts)[1]
    weights, ids = route_fused(logits, top_k, renormalize)
    want_weights, want_ids = route(logits, top_k, renormalize)
    assert torch.equal(ids.long(), want_ids)
    assert torch.allclose(weights, want_weights, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("config", [SMALL_TILES, WIDE_TILES], ids=["block_m16", "block_m64"])
@pytest.mark.parametrize("num_tokens", [3, 70])
def test_fused_block_sizes(config, num_tokens):
    """block_m smaller and larger than the token count; tiles smaller than H and I (several K steps,
    several column blocks, a partial last one of each)."""
    w13, w2 = make_experts(8)
    check_fused(*make_tokens(num_tokens, 8, seed=num_tokens), w13, w2, 2, True, config)


def test_fused_expert_without_tokens():
    """Experts 2 and 5 are never chosen: they get no block, the others still line up."""
    x, logits = make_tokens(33, 8)
    logits[:, [2, 5]] = -1e4
    w13, w2 = make_experts(8)
    check_fused(x, logits, w13, w2, 2, False, SMALL_TILES)


@pytest.mark.parametrize("top_k", [1, 2])
def test_fused_all_tokens_on_one_expert(top_k):
    """Every token picks expert 3 (and expert 0 second): one long run of many blocks per expert."""
    x, logits = make_tokens(50, 4)
    logits[:, 3], logits[:, 0] = 10.0, 9.0
    w13, w2 = make_experts(4)
    check_fused(x, logits, w13, w2, top_k, False, SMALL_TILES)


def reference_layout(ids: torch.Tensor, num_experts: int, block_m: int) -> tuple[list[int], list[int]]:
    """Expert by expert: the indices of its pairs in order, then sentinels up to a multiple of block_m."""
    flat = ids.reshape(-1).tolist()
    rows, blocks = [], []
    for expert in range(num_experts):
        run = [pair for pair, e in enumerate(flat) if e == expert]
        padded = -(-len(run) // block_m) * block_m
        rows += run + [len(flat)] * (padded - len(run))
        blocks += [expert] * (padded // block_m)
    return rows, blocks


def random_ids(num_tokens: int, num_experts: int, top_k: int) -> torch.Tensor:
    """[T, top_k] distinct experts per token, as a router picks them."""
    gen = torch.Generator().manual_seed(num_tokens)
    return torch.stack([torch.randperm(num_experts, generator=gen)[:top_k] for _ in range(num_tokens)]
                       ).reshape(num_tokens, top_k)


def check_align(ids: torch.Tensor, num_experts: int, block_m: int, **kwargs) -> None:
    """align's layout is the reference's: every pair once, in its expert's run in pair order, runs padded
    to block_m with the sentinel, each block naming its expert, num_padded the rows in use."""
    sorted_ids, block_expert, num_padded = align(ids.to(DEVICE), num_experts, block_m, **kwargs)
    rows, blocks = reference_layout(ids, num_experts, block_m)
    assert num_padded.item() == len(rows) <= sorted_ids.numel()
    assert sorted_ids[:len(rows)].tolist() == rows
    assert block_expert[:len(blocks)].tolist() == blocks


@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "counted"])
@pytest.mark.parametrize("num_tokens, num_experts, top_k, block_m, pairs_per_program", [
    (1, 4, 1, 16, 2048), (1, 128, 8, 16, 2048), (3, 8, 2, 16, 2048), (17, 8, 4, 32, 2048),
    (64, 6, 2, 16, 2048), (300, 60, 4, 64, 2048),
    (64, 8, 4, 16, 40), (100, 5, 1, 16, 33), (257, 128, 8, 16, 128),  # split over several programs
    (250, 8, 8, 16, 8),  # 2,000 pairs at 8 a program: the counted path caps its programs at 128 (16 each)
])
def test_align_layout(num_tokens, num_experts, top_k, block_m, pairs_per_program, one_launch):
    """Both ways of counting, on random routing (E not a power of two: 60, 6, 5)."""
    check_align(random_ids(num_tokens, num_experts, top_k), num_experts, block_m,
                pairs_per_program=pairs_per_program, one_launch=one_launch)


@pytest.mark.parametrize("num_tokens", [8, 9, 16, 17, 200, 511, 512, 513])
def test_align_decode_sizes(num_tokens):
    """qwen3-30b-a3b's routing shape (128 experts, top-8) at the default split, around its edges: one program
    (64 pairs = 8 tokens), several, and either side of ONE_LAUNCH_MAX_TOKENS (512)."""
    check_align(random_ids(num_tokens, 128, 8), 128, 16)


@pytest.mark.parametrize("one_launch", [True, False], ids=["one_launch", "counted"])
def test_align_skewed_routing(one_launch):
    """All pairs but a few on one expert (a run of many blocks, its rows placed by every program), most
    experts without a pair (no block), and an expert whose run is an exact multiple of block_m (no padding)."""
    ids = torch.full((300, 2), 3)
    ids[:, 1] = 7
    ids[::10, 0] = 0  # 30 pairs on expert 0
    ids[:32, 1] = 9  # exactly 2 blocks of 16
    check_align(ids, 12, 16, pairs_per_program=64, one_launch=one_launch)


def test_align_no_pairs():
    """An empty batch: no rows in use (num_padded is written, not left as whatever the buffer held)."""
    _, _, num_padded = align(torch.empty(0, 8, dtype=torch.int32, device=DEVICE), 128, 16)
    assert num_padded.item() == 0
