"""The fused MoE's tiles fit the GPU's shared memory whatever the activation dtype (issue 22: FP8 experts of a
float32 model asked an H200 for 245,760 bytes of its 232,448 and failed to launch).

MEASURED holds Triton 3.9's own figures for the expert GEMM compiled for sm_90 (H100/H200), read back
without a GPU by `python benchmarks/moe_smem.py`: (block_m, block_n, block_k, num_warps, num_stages, bytes of
an x element, bytes of a weight element, in_tile) -> (gate/up GEMM, down GEMM). `shared_memory` must
never be below them, and is exact where the tiles go to wgmma (block_m >= 64).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from minisgl.kernels.fused_moe import (
    CONFIGS,
    FP8_CONFIGS,
    SMEM_LIMIT,
    MoEConfig,
    default_config,
    fit_shared_memory,
    launch_config,
    pick_config,
    shared_memory,
    shared_memory_limit,
)
from minisgl.quantization import Fp8Config

H200_LIMIT = 232448  # also the H100's opt-in limit
MEASURED = {
    # e4m3 weights, x quantized in registers
    (128, 128, 128, 8, 3, 4, 1, True): (245760, 196608),  # the failure: default tiles, float32 x
    (128, 128, 128, 8, 3, 2, 1, True): (180224, 131072),
    (64, 128, 128, 8, 4, 4, 1, True): (237568, 172032),  # qwen3-30b-a3b's row of 1,024 tokens, float32 x
    (64, 128, 128, 8, 4, 2, 1, True): (188416, 122880),
    (64, 64, 128, 4, 3, 4, 1, True): (122880, 98304),
    (32, 64, 128, 4, 3, 4, 1, True): (73728, 57344),
    (16, 64, 128, 4, 3, 4, 1, True): (53248, 36864),
    (16, 32, 128, 4, 4, 2, 1, True): (40960, 28672),
    # e4m3 weights and x quantized by its own launch (x's dtype has no bearing)
    (128, 128, 128, 8, 3, 4, 1, False): (147456, 98304),  # the tiles, which now fit in float32
    (64, 128, 128, 8, 4, 2, 1, False): (163840, 98304),  # qwen3-30b-a3b's row of 1,024 tokens
    (64, 64, 128, 4, 3, 2, 1, False): (73728, 49152),
    (32, 64, 128, 4, 3, 2, 1, False): (40960, 24576),
    (16, 64, 128, 4, 3, 2, 1, False): (36864, 20480),
    (16, 32, 128, 4, 4, 2, 1, False): (30720, 18432),
    # plain weights of x's dtype
    (128, 128, 64, 8, 3, 2, 2, False): (147456, 98304),
    (64, 128, 64, 8, 4, 2, 2, False): (163840, 98304),
    (16, 128, 128, 4, 3, 2, 2, False): (139264, 73728),
    (64, 128, 64, 8, 4, 4, 4, False): (245760, 147456),  # qwen3-30b-a3b's row of 1,024 tokens in float32
    (16, 128, 128, 4, 3, 4, 4, False): (278528, 147456),  # and its row of 64 tokens
    (32, 64, 128, 4, 3, 4, 4, False): (163840, 98304),
}
X_DTYPES = [torch.bfloat16, torch.float16, torch.float32]
FP8_SCALES = [Fp8Config(), Fp8Config(block=(128, 128))]


def tiles(block_m, block_n, block_k, num_warps, num_stages, in_tile=False) -> MoEConfig:
    return MoEConfig(block_m, block_n, block_k, group_m=8, num_warps=num_warps, num_stages=num_stages,
                     in_tile=in_tile)


@pytest.mark.parametrize("key", list(MEASURED), ids=str)
def test_shared_memory_bounds_what_triton_allocates(key):
    *shape, x_size, w_size, in_tile = key
    model = [shared_memory(tiles(*shape, in_tile), x_size, w_size, gated) for gated in (True, False)]
    measured = list(MEASURED[key])
    assert all(m >= got for m, got in zip(model, measured)), (model, measured)
    if shape[0] >= 64:
        assert model == measured


def test_the_failing_config_is_reproduced_and_shrunk():
    """The tiny qwen3_moe of test_fp8_weights.py (8 experts, top 2, hidden 64) at a prefill-sized batch, in
    float32 with per-channel FP8 experts: the heuristic's 128 x 128 tiles (BLOCK_K the 128-column group).
    Quantizing x in the tiles it does not fit; x quantized by its own launch (the default) it does."""
    x = torch.empty(8192, 64, dtype=torch.float32, device="meta")
    w13 = torch.empty(8, 64, 64, dtype=torch.float8_e4m3fn, device="meta")
    picked = replace(pick_config(8192, 2, w13), block_k=128)
    assert launch_config(picked, x, w13, Fp8Config()) == picked
    assert shared_memory(picked, 4, 1) == 147456
    in_tile = replace(picked, in_tile=True)
    assert shared_memory(in_tile, 4, 1) == 245760 > H200_LIMIT
    launched = launch_config(in_tile, x, w13, Fp8Config())
    assert launched == replace(in_tile, num_stages=2)  # one stage fewer, the same tiles
    assert shared_memory(launched, 4, 1) <= H200_LIMIT


def chooser_configs() -> list[tuple[int, int, int, int, int]]:
    """(tokens, top_k, experts, I_local, hidden) for every row of the tables and the heuristic's regimes."""
    shapes = [(tokens, 8, *shape) for table in (CONFIGS, FP8_CONFIGS) for shape, rows in table.items()
              for tokens, _ in rows]
    shapes += [(tokens * 4, 8, 128, 768, 2048) for tokens, _ in CONFIGS[(128, 768, 2048)]]  # past the last row
    shapes += [(tokens, top_k, experts, 32, 64) for tokens in (1, 8, 64, 256, 1024, 8192)
               for top_k, experts in ((2, 8), (8, 64), (8, 128))]
    return shapes


@pytest.mark.parametrize("x_dtype", X_DTYPES, ids=str)
@pytest.mark.parametrize("weights", ["e4m3", "bf16", "x"])
def test_every_launched_config_fits_and_two_byte_activations_are_unchanged(x_dtype, weights):
    """Whatever the table or the heuristic picks, launched with float32, float16 or bfloat16 x and e4m3
    (block or per-channel scales), bfloat16 or x-typed weights, fits the H100/H200's shared memory; with
    2-byte x it is the picked config itself (FP8: with BLOCK_K the scale group)."""
    w_dtype = {"e4m3": torch.float8_e4m3fn, "bf16": torch.bfloat16, "x": x_dtype}[weights]
    for fp8 in FP8_SCALES if weights == "e4m3" else [None]:
        for tokens, top_k, experts, inter, hidden in chooser_configs():
            x = torch.empty(tokens, hidden, dtype=x_dtype, device="meta")
            w13 = torch.empty(experts, 2 * inter, hidden, dtype=w_dtype, device="meta")
            picked = pick_config(tokens, top_k, w13)
            picked = replace(picked, block_k=fp8.group) if fp8 else picked
            launched = launch_config(pick_config(tokens, top_k, w13), x, w13, fp8)
            assert shared_memory(launched, x_dtype.itemsize, w_dtype.itemsize) <= H200_LIMIT, (launched, tokens)
            if x_dtype.itemsize == 2 and w_dtype.itemsize <= 2:
                assert launched == picked


def test_fit_shrinks_stages_then_block_k_then_block_n():
    big = MoEConfig(block_m=64, block_n=128, block_k=128, group_m=8, num_warps=8, num_stages=4)
    need = {stages: shared_memory(replace(big, num_stages=stages), 4, 4) for stages in (2, 3)}
    assert fit_shared_memory(big, 4, 4, need[3]) == replace(big, num_stages=3)
    assert fit_shared_memory(big, 4, 4, need[2]) == replace(big, num_stages=2)
    assert fit_shared_memory(big, 4, 4, need[2] - 1) == replace(big, num_stages=2, block_k=64)
    # e4m3: BLOCK_K is the scale group, so the columns go instead
    fp8_need = shared_memory(replace(big, num_stages=2), 4, 1)
    assert fit_shared_memory(big, 4, 1, fp8_need - 1) == replace(big, num_stages=2, block_n=64)
    with pytest.raises(ValueError, match="no tiles .* fit 1024 bytes"):
        fit_shared_memory(default_config(8192, 8, 8), 4, 1, 1024)


def test_the_limit_off_cuda_is_the_h100s():
    assert shared_memory_limit(torch.device("cpu")) == SMEM_LIMIT == H200_LIMIT
