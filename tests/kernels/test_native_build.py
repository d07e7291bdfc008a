"""csrc/ builds with nvcc for sm_90a into a library that exports its C ABI, and without a GPU (or without
the library) the loader says why and the FP8 layers keep their other path. The kernel's numbers are checked
on a GPU: tests/gpu/test_native_fp8_gemv.py.

nvcc must be present (CI machines and the development machine have CUDA 13.0 in /usr/local/cuda): this test
fails, never skips, without it. One compile, about 10 s of nvcc on an idle core."""

from __future__ import annotations

import ctypes
import subprocess

import pytest
import torch

from minisgl.kernels import native
from minisgl.layers.fp8 import fp8_linear_torch, quantize_weight
from minisgl.layers.linear import fp8_linear
from minisgl.quantization import Fp8Config

BLOCK128 = Fp8Config(block=(128, 128))
EXPORTS = {"minisgl_fp8_gemv", "minisgl_fp8_gemv_abi_version"}


@pytest.fixture(scope="module")
def library(tmp_path_factory) -> str:
    assert native.find_nvcc(), "nvcc is needed to build csrc/ (PATH or /usr/local/cuda/bin)"
    return str(native.build(tmp_path_factory.mktemp("csrc")))


@pytest.fixture
def use_library(monkeypatch, library):
    """The freshly built library as the one the loader finds (its caches cleared around the test)."""
    monkeypatch.setenv(native.LIBRARY_ENV, library)
    native._load.cache_clear(), native.unavailable.cache_clear()
    yield library
    native._load.cache_clear(), native.unavailable.cache_clear()


def test_library_exports_the_c_abi(library):
    symbols = subprocess.run(["nm", "-D", "--defined-only", library], capture_output=True, text=True, check=True)
    exported = {line.split()[-1] for line in symbols.stdout.splitlines()}
    assert EXPORTS <= exported, f"missing exports: {EXPORTS - exported}"
    assert ctypes.CDLL(library).minisgl_fp8_gemv_abi_version() == native.ABI_VERSION


def test_built_library_loads_and_refuses_a_cpu_device(use_library):
    lib, reason = native._load()
    assert lib is not None and reason is None
    assert native.unavailable(torch.device("cpu")) == "csrc kernels need a CUDA device, not cpu"


def test_missing_library_gives_the_path_and_how_to_build(monkeypatch, tmp_path):
    monkeypatch.setenv(native.LIBRARY_ENV, str(tmp_path / "absent.so"))
    native._load.cache_clear()
    try:
        lib, reason = native._load()
    finally:
        native._load.cache_clear()
    assert lib is None and str(tmp_path / "absent.so") in reason and "minisgl.tools.build_csrc" in reason


def test_fp8_layers_fall_back_on_the_cpu_with_the_native_gemv_forced(monkeypatch, use_library):
    """MINISGL_NATIVE_GEMV=1 asks for the native GEMV on every shape it serves: on the CPU the dispatch
    declines (no GPU) and the layer's result is its torch reference's; a direct call raises the reason."""
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "1")
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w, scale = quantize_weight(torch.randn(384, 256) / 16, BLOCK128)
    assert native.chosen(2, 384, 256) == ("widen", 8)  # what it would run on a GPU: 2 rows, widened weights
    assert native.fp8_gemv_rejects(x, w, scale, BLOCK128, variant="widen") is None
    assert native.try_fp8_gemv(x, w, scale, BLOCK128) is None
    torch.testing.assert_close(fp8_linear(x, w, scale, BLOCK128), fp8_linear_torch(x, w, scale, BLOCK128))
    for variant in native.VARIANTS:
        with pytest.raises(ValueError, match="need a CUDA device"):
            native.fp8_gemv(x, w, scale, BLOCK128, variant=variant)


def test_dispatch_follows_the_table_and_the_environment(monkeypatch):
    """NATIVE_FP8_GEMV picks per (M, N, K) (a shape it lacks: the Triton GEMV); MINISGL_NATIVE_GEMV=1 takes
    widen up to its 2 rows and mma up to 8, =mma / =widen only that variant where it serves, =0 nothing."""
    monkeypatch.delenv("MINISGL_NATIVE_GEMV", raising=False)
    assert native.chosen(1, 4096, 4096) == ("widen", 16) and native.chosen(8, 4096, 4096) is None
    monkeypatch.setitem(native.NATIVE_FP8_GEMV, (8, 4096, 4096), ("mma", 16))
    assert native.chosen(8, 4096, 4096) == ("mma", 16)
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "1")
    assert [native.chosen(m, 4096, 4096) for m in (1, 2, 3, 8, 9)] == \
        [("widen", 8), ("widen", 8), ("mma", 16), ("mma", 16), None]
    assert native.chosen(1, 24576, 4096) == ("widen", 16) and native.chosen(8, 24576, 4096) == ("mma", 32)
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "widen")
    assert native.chosen(2, 4096, 4096) == ("widen", 8) and native.chosen(3, 4096, 4096) is None
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "mma")
    assert native.chosen(1, 4096, 4096) == ("mma", 16)
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "0")
    assert native.chosen(1, 4096, 4096) is None


def test_the_measured_table_names_only_what_its_variants_serve():
    """Every NATIVE_FP8_GEMV row is a variant that takes its M rows, at one of its CTA heights, for a K in whole
    128-column groups: a row pasted wrong would send that shape to the Triton GEMV unnoticed (try_fp8_gemv
    falls back on a rejection) or fail at launch."""
    assert native.NATIVE_FP8_GEMV
    for (m, n, k), (variant, rows) in native.NATIVE_FP8_GEMV.items():
        assert variant in native.VARIANTS and 1 <= m <= native.VARIANTS[variant].max_m, (m, n, k)
        assert rows in native.VARIANTS[variant].rows and k % native.GROUP == 0 and n > 0, (m, n, k)


def test_operands_it_does_not_serve_are_named():
    x = torch.randn(2, 256, dtype=torch.bfloat16)
    w, scale = quantize_weight(torch.randn(384, 256) / 16, BLOCK128)
    wc, channel = quantize_weight(torch.randn(384, 256) / 16, Fp8Config())
    assert native.fp8_gemv_rejects(x, wc, channel, Fp8Config()) is None
    assert native.fp8_gemv_rejects(x, w, scale, BLOCK128, silu_mul=True) == \
        "x has 256 columns; w's K is 256 (silu_mul: x is [M, 2K])"
    assert native.fp8_gemv_rejects(torch.randn(2, 512, dtype=torch.bfloat16), w, scale, BLOCK128,
                                   silu_mul=True) is None
    assert "1..8" in native.fp8_gemv_rejects(torch.randn(9, 256, dtype=torch.bfloat16), w, scale, BLOCK128)
    assert "(widen) takes 1..2" in native.fp8_gemv_rejects(torch.randn(3, 256, dtype=torch.bfloat16), w, scale,
                                                           BLOCK128, variant="widen")
    assert "bfloat16" in native.fp8_gemv_rejects(x.float(), w, scale, BLOCK128)
    assert "float8_e4m3fn" in native.fp8_gemv_rejects(x, w.to(torch.bfloat16), scale, BLOCK128)
    w_ragged, s_ragged = quantize_weight(torch.randn(384, 320) / 16, BLOCK128)
    assert "multiple of 128" in native.fp8_gemv_rejects(torch.randn(2, 320, dtype=torch.bfloat16), w_ragged,
                                                        s_ragged, BLOCK128)
    small = Fp8Config(block=(16, 128))
    w16, s16 = quantize_weight(torch.randn(384, 256) / 16, small)
    assert "128 x 128 blocks" in native.fp8_gemv_rejects(x, w16, s16, small)
    assert "bias" in native.fp8_gemv_rejects(x, w, scale, BLOCK128, bias=torch.zeros(384))
