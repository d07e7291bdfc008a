"""Which FP8 GEMM serves which batch (minisgl.kernels.fp8_cublas): the M threshold per shape and its override,
the shapes, dtypes, layouts and platforms cuBLAS's block-scaled recipe takes, the fallback on a device where it
cannot run, and the padded activation quantization it is fed (in Triton's interpreter). The numbers of the
cuBLAS path itself are checked on a Hopper GPU: tests/gpu/test_fp8_scaled_mm.py."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernels import fp8_cublas
from minisgl.kernels.fp8 import quantize_activation
from minisgl.kernels.fp8_cublas import chosen, platform_rejects, rejects, try_fp8_scaled_mm, unavailable
from minisgl.layers.fp8 import fp8_linear_torch, quantize_weight
from minisgl.layers.linear import fp8_linear
from minisgl.quantization import Fp8Config

BLOCK128 = Fp8Config(block=(128, 128))
QWEN3_8B = [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)]  # qkv, o, gate_up, down at TP 1


def operands(m=32, n=256, k=512, config=BLOCK128, dtype=torch.bfloat16, bias=False):
    gen = torch.Generator().manual_seed(m + n + k)
    x = torch.randn(m, k, generator=gen).to(dtype)
    w, scale = quantize_weight(torch.randn(n, k, generator=gen) / k**0.5, config)
    return x, w, scale, torch.randn(n, generator=gen).to(dtype) if bias else None


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(fp8_cublas.ENV, raising=False)


@pytest.mark.parametrize("shape", QWEN3_8B, ids=str)
def test_qwen3_8b_projections_switch_to_cublas_at_their_measured_row(shape):
    min_m = fp8_cublas.CUBLAS_FP8_MIN_M[shape]
    assert min_m is not None and 16 < min_m <= 1024  # the H200 figures: cuBLAS by 1,024 rows, Triton at 16
    assert not chosen(min_m - 1, *shape)
    assert chosen(min_m, *shape) and chosen(8192, *shape)


def test_shapes_without_a_row_take_the_default_and_a_none_row_never(monkeypatch):
    unknown = (1024, 2048)
    assert unknown not in fp8_cublas.CUBLAS_FP8_MIN_M
    assert not chosen(fp8_cublas.DEFAULT_MIN_M - 1, *unknown) and chosen(fp8_cublas.DEFAULT_MIN_M, *unknown)
    monkeypatch.setitem(fp8_cublas.CUBLAS_FP8_MIN_M, unknown, None)
    assert not chosen(8192, *unknown)


def test_the_environment_forces_either_path(monkeypatch):
    monkeypatch.setenv(fp8_cublas.ENV, "0")
    assert not chosen(8192, 6144, 4096)
    monkeypatch.setenv(fp8_cublas.ENV, "1")
    assert chosen(17, 6144, 4096) and chosen(17, 1024, 2048)


@pytest.mark.parametrize("capability, cuda, has_recipe, reason", [
    ((9, 0), "12.9", True, None),
    ((9, 0), "13.0", True, None),
    ((8, 9), "13.0", True, "sm_89"),  # Ada has FP8 but not this recipe in torch
    ((10, 0), "13.0", True, "sm_100"),  # Blackwell: torch takes other scale layouts there
    ((9, 0), "12.8", True, "12.8"),
    ((9, 0), None, True, "None"),
    ((9, 0), "13.0", False, "BlockWise128x128"),
])
def test_platforms(capability, cuda, has_recipe, reason):
    got = platform_rejects(capability, cuda, has_recipe)
    assert got is None if reason is None else reason in got


def test_qwen3_8b_shapes_in_bf16_and_fp16_with_bias_are_served():
    for n, k in QWEN3_8B:
        w = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        scale = torch.empty(BLOCK128.scale_shape(n, k))
        for dtype in (torch.bfloat16, torch.float16):
            assert rejects(torch.empty(300, k, dtype=dtype), w, scale, BLOCK128, torch.empty(n, dtype=dtype)) is None


def test_the_down_projection_is_served_from_gate_and_up():
    """With silu_mul the down projection takes [gate | up] [M, 2K] (the activation formed while quantizing)."""
    n, k = QWEN3_8B[3]
    w, scale = torch.empty(n, k, dtype=torch.float8_e4m3fn), torch.empty(BLOCK128.scale_shape(n, k))
    assert rejects(torch.empty(300, 2 * k, dtype=torch.bfloat16), w, scale, BLOCK128, silu_mul=True) is None
    assert f"[M, {2 * k}]" in rejects(torch.empty(300, k, dtype=torch.bfloat16), w, scale, BLOCK128, silu_mul=True)
    assert f"[M, {k}]" in rejects(torch.empty(300, 2 * k, dtype=torch.bfloat16), w, scale, BLOCK128)


@pytest.mark.parametrize("case, reason", [
    ("float32 x", "bfloat16 or float16"),
    ("per-channel weights", "per channel"),
    ("64 x 64 blocks", "128 x 128"),
    ("K of 3 blocks", "K of 512"),
    ("N not a multiple of 16", "N must be"),
    ("bias of another dtype", "bias"),
    ("scales not contiguous", "scale"),
    ("w with a column stride", "unit stride"),
])
def test_operands_cublas_does_not_take_are_named(case, reason):
    n, k, config, dtype, bias = 256, 512, BLOCK128, torch.bfloat16, None
    if case == "float32 x":
        dtype = torch.float32
    elif case == "per-channel weights":
        config = Fp8Config()
    elif case == "64 x 64 blocks":
        config = Fp8Config(block=(64, 64))
    elif case == "K of 3 blocks":
        k = 384
    elif case == "N not a multiple of 16":
        n = 200
    x, w, scale, _ = operands(n=n, k=k, config=config, dtype=dtype)
    if case == "bias of another dtype":
        bias = torch.zeros(n, dtype=torch.float32)
    elif case == "scales not contiguous":
        scale = scale.t().contiguous().t()
    elif case == "w with a column stride":
        w = torch.cat([w, w], dim=1)[:, ::2]
    assert reason in rejects(x, w, scale, config, bias)


def test_a_cpu_keeps_the_torch_reference_even_when_cublas_is_forced(monkeypatch):
    """Where cuBLAS cannot run, the layers' dispatch falls back (here to the reference) instead of failing."""
    monkeypatch.setenv(fp8_cublas.ENV, "1")
    x, w, scale, b = operands(m=300, dtype=torch.bfloat16, bias=True)
    assert "CUDA" in unavailable(x.device, x.dtype)
    assert try_fp8_scaled_mm(x, w, scale, BLOCK128, b) is None
    assert torch.equal(fp8_linear(x, w, scale, BLOCK128, b), fp8_linear_torch(x, w, scale, BLOCK128, b))


@pytest.mark.parametrize("m, rows", [(5, 16), (16, 16), (17, 32), (40, 48)])
def test_padded_quantization_adds_zero_rows_and_keeps_the_real_ones(m, rows):
    """cuBLAS is fed x padded to 16 rows: the real rows' values and scales are the unpadded call's, the padding's
    values are zeros with finite scales, and the scales stay group-major over the padded row count."""
    x = torch.randn(m, 300, generator=torch.Generator().manual_seed(m))
    q, s = quantize_activation(x, 128)
    qp, sp = quantize_activation(x, 128, rows=rows)
    assert qp.shape == (rows, 300) and sp.shape == (3, rows)
    assert torch.equal(qp[:m], q) and torch.equal(sp[:, :m], s)
    assert not qp[m:].any() and torch.isfinite(sp[:, m:]).all()
