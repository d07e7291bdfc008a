"""The FP8 kernels at qwen3-8b's and qwen3-30b-a3b's shapes, compiled, in bfloat16 with 128 x 128 blocks,
against their torch reference (the interpreter's small shapes are tests/kernels/test_fp8_kernels.py)."""

from __future__ import annotations

import pytest
from kernels.test_fp8_kernels import BLOCK128, GPU_SHAPES, check_experts, check_gemv, check_linear

from minisgl.kernels.fp8 import Fp8GemmConfig, fp8_gemm
from minisgl.kernels.gemv import BLOCK_M
from minisgl.quantization import Fp8Config


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 16, 64, 512])
def test_fp8_linear_full_size(shape, m):
    """The GEMV up to its 16 rows (one row: both its CUDA-core and its tensor-core path); the GEMM from 16
    rows, with the tuned tiles (64 or 128 columns: one weight scale per group) and 256-column ones (a weight
    scale per column)."""
    for scales in (BLOCK128, Fp8Config()):
        for block_m in ([1, BLOCK_M] if m == 1 else [BLOCK_M] if m <= BLOCK_M else []):
            check_gemv(None, m, *shape, scales, block_m=block_m)
        if m >= 16:
            wide = Fp8GemmConfig(block_m=64, block_n=256, num_warps=8)
            for kernel in (fp8_gemm, lambda x, w, s, c, b: fp8_gemm(x, w, s, c, b, wide)):
                check_linear(kernel, m, *shape, scales)


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_fp8_fused_experts_full_size(tokens):
    """qwen3-30b-a3b's experts at TP 1: 128 experts, top 8, hidden 2048, intermediate 768."""
    check_experts(tokens, 128, 8, 2048, 768, BLOCK128, None)
