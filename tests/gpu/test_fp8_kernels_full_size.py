"""The FP8 kernels at qwen3-8b's and qwen3-30b-a3b's shapes, compiled, in bfloat16 with 128 x 128 blocks,
against their torch reference (the interpreter's small shapes are tests/kernels/test_fp8_kernels.py)."""

from __future__ import annotations

import pytest
from kernels.test_fp8_kernels import BLOCK128, GPU_SHAPES, check_experts, check_linear, gemv_fp8

from minisgl.kernels.fp8 import fp8_gemm
from minisgl.layers.fp8 import Fp8Config


@pytest.mark.parametrize("shape", GPU_SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 8, 64, 512])
def test_fp8_linear_full_size(shape, m):
    if m <= 8:
        check_linear(gemv_fp8(None), m, *shape, BLOCK128)
        check_linear(gemv_fp8(None), m, *shape, Fp8Config())
    else:
        check_linear(fp8_gemm, m, *shape, BLOCK128)
        check_linear(fp8_gemm, m, *shape, Fp8Config())


@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_fp8_fused_experts_full_size(tokens):
    """qwen3-30b-a3b's experts at TP 1: 128 experts, top 8, hidden 2048, intermediate 768."""
    check_experts(tokens, 128, 8, 2048, 768, BLOCK128, None)
