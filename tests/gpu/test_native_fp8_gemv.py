"""csrc's CUDA FP8 decode GEMV (minisgl.kernels.native) against the torch reference, `fp8_linear_torch` (x
quantized per row and 128-column group as the kernel does, both operands dequantized, one float32 matmul):
qwen3-8b's projections and ragged shapes, both scale layouts, 1-8 rows, both CTA heights, eager and
replayed from a CUDA graph with programmatic dependent launch, and inside the engine. The library is built here
with nvcc; Hopper only (it is built for sm_90a; the CPU side is tests/kernels/test_native_build.py)."""

from __future__ import annotations

import pytest
import torch
from helpers import make_llm
from kernels.test_fp8_kernels import BLOCK128, GPU_SHAPES, TOL
from test_fast_path import PARAMS, PROMPTS, assert_same_greedy

from minisgl.kernels import native
from minisgl.kernels.gemv import gemv
from minisgl.kernels.norm import add_rms_norm
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.fp8 import fp8_linear_torch, quantize_weight
from minisgl.layers.linear import fp8_linear
from minisgl.layers.norm import RMSNorm
from minisgl.quantization import Fp8Config
from minisgl.tools.tiny_model import make_tiny_model

LAYOUTS = {"block128": BLOCK128, "per_channel": Fp8Config()}
# (N, K, silu_mul, bias): qwen3-8b's qkv, o, gate_up and down (SiLU-and-mul inside) at TP 1; N not a multiple
# of a CTA's rows with a partial last scale block and 17 groups over 8 warps; 3 groups (warps with none)
SHAPES = [(n, k, k == 12288, False) for n, k in GPU_SHAPES] + [(1000, 2176, False, True), (200, 384, True, True)]


@pytest.fixture(scope="module", autouse=True)
def library(tmp_path_factory):
    """csrc built by this machine's nvcc, loaded in place of any other build."""
    path = native.build(tmp_path_factory.mktemp("csrc"))
    patch = pytest.MonkeyPatch()
    patch.setenv(native.LIBRARY_ENV, str(path))
    native._load.cache_clear(), native.unavailable.cache_clear()
    cuda = torch.device("cuda", torch.cuda.current_device())
    assert torch.cuda.get_device_capability(cuda) == (9, 0), "the native GEMV is built for Hopper (sm_90a)"
    assert native.unavailable(cuda) is None
    yield path
    patch.undo()
    native._load.cache_clear(), native.unavailable.cache_clear()


def operands(m: int, n: int, k: int, silu_mul: bool, bias: bool, config: Fp8Config, seed: int):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(m, 2 * k if silu_mul else k, generator=gen, device="cuda").bfloat16()
    w, scale = quantize_weight(torch.randn(n, k, generator=gen, device="cuda") / k**0.5, config)
    b = torch.randn(n, generator=gen, device="cuda").bfloat16() if bias else None
    return x, w, scale, b


def reference(x, w, scale, config, b, silu_mul):
    return fp8_linear_torch(silu_and_mul_torch(x) if silu_mul else x, w, scale, config, b)


@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("m", [1, 2, 4, 8])
def test_native_fp8_gemv_matches_the_reference(m, shape, layout, rows):
    n, k, silu_mul, bias = shape
    config = LAYOUTS[layout]
    x, w, scale, b = operands(m, n, k, silu_mul, bias, config, seed=m + n + k)
    out = native.fp8_gemv(x, w, scale, config, b, silu_mul, rows=rows)
    assert out.shape == (m, n) and out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), reference(x, w, scale, config, b, silu_mul).float(), **TOL)
    assert torch.equal(out, native.fp8_gemv(x, w, scale, config, b, silu_mul, rows=rows))  # fixed-order sums


def test_x_rows_with_a_stride():
    """x a slice of a wider tensor (the o projection reads qkv's first columns): its row stride, not K."""
    x, w, scale, _ = operands(4, 4096, 4096, False, False, BLOCK128, seed=1)
    wide = torch.cat([x, torch.randn_like(x)], dim=1)
    torch.testing.assert_close(native.fp8_gemv(wide[:, :4096], w, scale, BLOCK128).float(),
                               reference(x, w, scale, BLOCK128, None, False).float(), **TOL)


def test_fp8_layers_take_the_native_gemv_when_chosen(monkeypatch):
    """MINISGL_NATIVE_GEMV=1 sends the FP8 layers' decode batches here (bit-equal to a direct call); =0 sends
    them to the Triton GEMV."""
    x, w, scale, _ = operands(2, 6144, 4096, False, False, BLOCK128, seed=2)
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "1")
    assert torch.equal(fp8_linear(x, w, scale, BLOCK128), native.fp8_gemv(x, w, scale, BLOCK128))
    monkeypatch.setenv("MINISGL_NATIVE_GEMV", "0")
    assert torch.equal(fp8_linear(x, w, scale, BLOCK128), gemv(x, w, scale=scale, fp8=BLOCK128))


@pytest.mark.parametrize("m", [1, 8])
def test_decode_mlp_replayed_from_a_cuda_graph_with_programmatic_dependent_launch(m):
    """add+RMSNorm (Triton) -> gate_up -> down (SiLU-and-mul inside), qwen3-8b's MLP in FP8, both GEMVs
    native and launched as programmatic dependents, captured once and replayed on fresh inputs: a GEMV that
    read x before its wait would give the previous replay's (or a half-written) result."""
    cuda = torch.device("cuda", torch.cuda.current_device())
    gen = torch.Generator(device=cuda).manual_seed(0)
    w13, s13 = quantize_weight(torch.randn(24576, 4096, generator=gen, device=cuda) / 64, BLOCK128)
    w2, s2 = quantize_weight(torch.randn(4096, 12288, generator=gen, device=cuda) / 110, BLOCK128)
    norm = RMSNorm(4096, 1e-6).to(cuda, torch.bfloat16)
    x, residual = (torch.empty(m, 4096, device=cuda, dtype=torch.bfloat16) for _ in range(2))

    def mlp() -> torch.Tensor:
        h, _ = add_rms_norm(x, residual, norm.weight, norm.eps)
        gate_up = native.fp8_gemv(h, w13, s13, BLOCK128, pdl=True)
        return native.fp8_gemv(gate_up, w2, s2, BLOCK128, silu_mul=True, pdl=True)

    x.normal_(generator=gen), residual.normal_(generator=gen)
    mlp()  # compiles the norm outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = mlp()
    for _ in range(3):
        x.normal_(generator=gen), residual.normal_(generator=gen)
        graph.replay()
        h, _ = norm.forward_torch(x, residual)
        expected = fp8_linear_torch(silu_and_mul_torch(fp8_linear_torch(h, w13, s13, BLOCK128)), w2, s2, BLOCK128)
        torch.testing.assert_close(out.float(), expected.float(), **TOL)


def test_engine_decodes_as_with_the_triton_gemv(tmp_path, monkeypatch):
    """A tiny qwen3 FP8 checkpoint (128 x 128 blocks) whose every projection the native GEMV serves, in
    bfloat16 with decode CUDA graphs: greedy tokens and log-probabilities with MINISGL_NATIVE_GEMV=1 as with
    =0 (the Triton GEMV, the same arithmetic)."""
    path = str(make_tiny_model(tmp_path / "fp8", "qwen3", fp8_block=128, hidden_size=256, intermediate_size=384,
                               head_dim=64, num_attention_heads=4, num_key_value_heads=2))
    outs = {}
    for flag in ("0", "1"):
        monkeypatch.setenv("MINISGL_NATIVE_GEMV", flag)
        engine = make_llm(path, dtype="bfloat16")
        projections = [(name, layer) for name, layer in engine.engine.model.named_modules()
                       if getattr(layer, "quant", None) is not None and hasattr(layer, "weight_scale_inv")]
        assert len(projections) == 8  # qkv, o, gate_up, down x 2 layers
        for name, layer in projections:  # decode rows of each: all served natively under =1
            silu_mul = name.endswith("down_proj")
            x = torch.zeros(1, layer.weight.shape[1] * (2 if silu_mul else 1), dtype=torch.bfloat16, device="cuda")
            assert native.fp8_gemv_rejects(x, layer.weight, layer.weight_scale_inv, layer.quant, silu_mul=silu_mul) \
                is None, name
        outs[flag] = engine.generate(PROMPTS, PARAMS)
        engine.shutdown()
    assert_same_greedy(outs["1"], outs["0"])
