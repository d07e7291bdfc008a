"""The split-K GEMV kernel against F.linear (its torch reference), and the linear layers' routing to it.

On the CPU the kernel runs in Triton's interpreter (tests/helpers.py sets TRITON_INTERPRET=1) at small shapes, in
float32 and float16 (the interpreter has no bfloat16 arithmetic); with MINISGL_TEST_DEVICE=cuda it runs
compiled in bfloat16 at the decode shapes of its config table (qwen3-0.6b and qwen3-8b, TP 1 and 2).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE

from minisgl.distributed import TPGroup
from minisgl.kernels.gemv import CONFIGS, GEMV_MAX_M, GemvConfig, arrival_counters, gemv, use_gemv
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.embedding import ParallelLMHead
from minisgl.layers.linear import ColumnParallelLinear, RowParallelLinear

ON_GPU = DEVICE == "cuda"
LOW_PRECISION = torch.bfloat16 if ON_GPU else torch.float16
# One rounding of a float32 sum against the reference's, in the output dtype (the inputs are scaled so
# that outputs are about 1).
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
             torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
# Tiles smaller than the defaults, so that the small shapes below have N and K tails and several slices:
# K = 300 over 4 slices of 96 columns (rounded to 32-column tiles: 3 full slices and one of 12 columns).
SMALL_SPLIT = GemvConfig(block_n=16, block_k=32, split_k=4)
SMALL_WHOLE = GemvConfig(block_n=16, block_k=32, split_k=1)
DECODE_SHAPES = sorted(CONFIGS) if ON_GPU else [(96, 1024)]


def operands(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, seed: int = 0):
    gen = torch.Generator(device=DEVICE).manual_seed(seed)
    x = torch.randn(m, k, generator=gen, device=DEVICE)
    w = torch.randn(n, k, generator=gen, device=DEVICE) / k**0.5
    b = torch.randn(n, generator=gen, device=DEVICE) if bias else None
    return [t.to(dtype) if t is not None else None for t in (x, w, b)]


def reference(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """F.linear in float32, rounded once to the inputs' dtype (what a float32-accumulating kernel gives)."""
    return F.linear(x.float(), w.float(), b.float() if b is not None else None).to(x.dtype)


def check(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, config: GemvConfig | None) -> None:
    x, w, b = operands(m, n, k, dtype, bias, seed=m * n + k)
    out = gemv(x, w, b, config)
    assert out.shape == (m, n) and out.dtype == dtype
    torch.testing.assert_close(out.cpu(), reference(x, w, b).cpu(), **TOLERANCE[dtype])


@pytest.mark.parametrize("config", [SMALL_SPLIT, SMALL_WHOLE, None], ids=["split4", "whole", "default"])
@pytest.mark.parametrize("bias", [False, True], ids=["", "bias"])
@pytest.mark.parametrize("m", [1, 3, 5, 8])
def test_gemv_matches_linear_float32(m, bias, config):
    """N = 50 (three full 16-row tiles and a tail of 2), K = 300 (not a multiple of any tile)."""
    check(m, 50, 300, torch.float32, bias, config)


@pytest.mark.parametrize("m,n,k", [(2, 37, 100), (7, 64, 512), (16, 20, 48)])
def test_gemv_matches_linear_low_precision(m, n, k):
    check(m, n, k, LOW_PRECISION, True, SMALL_SPLIT)


@pytest.mark.parametrize("n,k", DECODE_SHAPES)
@pytest.mark.parametrize("m", [1, 2, 5, 8])
def test_gemv_at_decode_shapes(m, n, k):
    """On a GPU every shape of the config table with its row; on the CPU one shape that default_config
    splits in four."""
    check(m, n, k, LOW_PRECISION, True, None)


def test_gemv_reads_strided_rows_and_repeats_exactly():
    """x as a slice of wider rows (the layout of a merged projection's output) gives the contiguous copy's
    result; a second call gives the same bits, and each split-K launch leaves its counters at zero (the
    next launch's last-arrival test depends on it)."""
    x, w, b = operands(4, 50, 300, torch.float32, True)
    wide = torch.randn(4, 400, device=DEVICE)
    wide[:, 60:360] = x
    first = gemv(wide[:, 60:360], w, b, SMALL_SPLIT)
    torch.testing.assert_close(first.cpu(), reference(x, w, b).cpu(), **TOLERANCE[torch.float32])
    assert torch.equal(gemv(x, w, b, SMALL_SPLIT), first)
    assert not arrival_counters(x.device).any()


@pytest.mark.parametrize("config", [SMALL_SPLIT, SMALL_WHOLE], ids=["split4", "whole"])
@pytest.mark.parametrize("m", [1, 5])
def test_gemv_with_silu_mul_matches_activation_then_linear(m, config):
    """x as a merged [gate | up] projection [M, 2K]: the GEMV forms silu(gate) * up per step, rounded as
    the activation's own kernel rounds it."""
    gate_up, w, b = operands(m, 50, 600, torch.float32, True, seed=m)
    out = gemv(gate_up, w[:, :300].contiguous(), b, config, silu_mul=True)
    expected = reference(silu_and_mul_torch(gate_up), w[:, :300], b)
    torch.testing.assert_close(out.cpu(), expected.cpu(), **TOLERANCE[torch.float32])


def test_row_parallel_layer_with_silu_mul_equals_the_activation_then_the_layer():
    """The MLP's down projection takes [gate | up]: the same result as silu_and_mul then the layer, on the
    layer's own path for this device (the GEMV at a tuned shape on a GPU, F.linear on the CPU)."""
    (n, k), tp = next(iter(CONFIGS)), TPGroup(0, 1)
    gate_up, w, _ = operands(1, n, 2 * k, LOW_PRECISION if ON_GPU else torch.float32, False)
    row = RowParallelLinear(k, n, False, tp).to(device=DEVICE, dtype=gate_up.dtype)
    row.weight.data.copy_(w[:, :k])
    torch.testing.assert_close(row(gate_up, silu_mul=True), row(silu_and_mul_torch(gate_up)),
                               **TOLERANCE[gate_up.dtype])


def test_use_gemv_takes_decode_batches_of_tuned_shapes():
    n, k = next(iter(CONFIGS))
    assert [use_gemv(m, n, k) for m in (0, 1, GEMV_MAX_M, GEMV_MAX_M + 1)] == [False, True, True, False]
    assert not use_gemv(1, 50, 300)  # no config row: cuBLAS


def test_layers_on_the_cpu_stay_on_torch():
    """A decode-sized batch at a tuned shape still runs F.linear on CPU tensors (the CPU engine is unchanged),
    whatever the test device."""
    (n, k), tp = next(iter(CONFIGS)), TPGroup(0, 1)
    x, w, b = (t.cpu() for t in operands(1, n, k, torch.float32, True))
    column, row, head = ColumnParallelLinear(k, [n], True, tp), RowParallelLinear(k, n, False, tp), ParallelLMHead(
        n, k, tp)
    for layer in (column, row, head):
        layer.weight.data.copy_(w)
    column.bias.data.copy_(b)
    assert torch.equal(column(x), F.linear(x, w, b))
    assert torch.equal(row(x), F.linear(x, w))
    assert torch.equal(head.compute_logits(x), F.linear(x, w))
