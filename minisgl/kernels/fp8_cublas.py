"""Block-scaled FP8 GEMMs of prefill-sized batches through cuBLASLt (torch's `F.scaled_mm`), on Hopper.

Why: our Triton FP8 GEMM (`minisgl.kernels.fp8.fp8_gemm`) is no faster than cuBLAS in bf16, so FP8 weights won
nothing where a step is bound by its GEMMs (prefill, large batches). On an H200 (torch 2.11.0+cu130) cuBLASLt's
block-scaled FP8 GEMM alone took 0.6-0.7x the time of bf16 F.linear at qwen3-8b's projections from about 1,024
rows up, where the Triton GEMM (quantization included) took about bf16's (figures above CUBLAS_FP8_MIN_M).

What it computes is `fp8_linear_torch` for 128 x 128 weight blocks: x is quantized per token and 128-column group
by the same Triton kernel as the GEMM's (`quantize_activation`, whose group-major scales are, transposed, the
layout cuBLAS takes; the down projection's silu(gate) * up is formed there, from [gate | up], as it quantizes),
then cuBLASLt multiplies e4m3 x (one scale per row and group: BlockWise1x128) by e4m3 W^T
(one per 128 x 128 block: BlockWise128x128) and applies both scales to each 128-column partial sum in float32.

Where it serves, from torch's own checks of this recipe (aten/src/ATen/native/cuda/ScaledBlas.cpp and
test/test_scaled_matmul_cuda.py in pytorch/pytorch), `rejects` and `unavailable`:
- a Hopper GPU (sm_90: torch refuses the recipe on other GPUs), torch with `F.scaled_mm` and
  `ScalingType.BlockWise128x128`, built with CUDA 12.9 or newer (the cuBLASLt that has the recipe);
- weights in 128 x 128 blocks (per-channel weights stay on Triton: cuBLAS's per-channel recipe takes one
  activation scale per token, coarser than ours), unit stride along K, 16-byte aligned rows;
- x in bfloat16 or float16, the output's dtype (float32 activations stay on Triton); a bias of the same dtype,
  added after the GEMM (one more launch, for the few models with biased projections): cuBLAS's bias epilogue
  with this recipe is not in torch's tests, so it is not relied on;
- N a multiple of 16 and K of 512: cuBLAS reads the weight scales K-major with their count along K padded to a
  multiple of 4, which our [N / 128, K / 128] scales are as they stand only when K / 128 is (qwen3-8b's and
  qwen3-30b-a3b's projections are, at TP 1 to 8); other K stay on Triton rather than pad the scales per call.

x's rows are padded to a multiple of ROW_ALIGN with zeros (the output is the first M rows, a contiguous view):
torch requires the activation scales' stride to be exactly the row count, and how cuBLASLt wants them aligned
is not written down; 16 rows put each group's column of scales on a 64-byte boundary, for at most 15 rows of
extra work. Everything stays on the current stream with no host synchronisation, so it is captured by CUDA
graphs (the engine's whole-step and decode graphs) like the Triton kernels.

Detection: `unavailable(device, dtype)` checks the above, then makes one probe call per device and dtype (16
x 512 ones by 128 x 512 ones: every output must be 512) the first time it is asked outside a CUDA graph
capture; an error or a wrong result keeps that dtype on Triton (float16 is not in torch's tests of this
recipe; the probe is what decides it). The engine runs each of its graph shapes eagerly before capturing it,
so the probe never lands in a graph; asked first during a capture, it answers "not probed yet" (Triton)
without remembering the answer.

Dispatch (`chosen`): MINISGL_FP8_CUBLAS=0 never, =1 every batch the Triton GEMM would take (above the GEMV's
16 rows); unset, from CUBLAS_FP8_MIN_M, measured by `python benchmarks/fp8.py --cublas`.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from minisgl.kernels.fp8 import quantize_activation
from minisgl.quantization import Fp8Config

BLOCK = 128  # the only weight block (and activation group) cuBLAS's recipe takes
ROW_ALIGN = 16
DTYPES = (torch.bfloat16, torch.float16)
MIN_CUDA = (12, 9)
ENV = "MINISGL_FP8_CUBLAS"

# (N, K) -> the smallest batch (rows of x) that cuBLAS serves, smaller ones taking the Triton GEMM (None: never).
# `python benchmarks/fp8.py --cublas --write` rewrites the rows from CUDA-graph timings of both paths
# (quantization included in each): the smallest timed M from which cuBLAS was the faster at every timed M.
# These rows: that run on an H200 (torch 2.11.0+cu130, 2026-11-26); summed over qwen3-8b's four projections
# and 36 layers, cuBLAS took 0.92x the Triton GEMM's time at 64 rows, 0.73x at 256, 0.63x from 1,024 (0.65x
# bf16's); at 32 rows, 0.98x. qwen3-30b-a3b's qkv and o (its MLPs are experts): cuBLAS from 32 rows too, 0.65x
# and 0.57x the Triton GEMM's time at 128 rows (though bf16 is faster still for these small weights up to ~1,024
# rows). Each row's comment: us per call of cuBLAS / Triton / bf16 at M rows.
CUBLAS_FP8_MIN_M: dict[tuple[int, int], int | None] = {
    # H200 qwen3-8b qkv, us at M 128: 17/20/17, 256: 17/22/22, 1024: 48/70/68, 4096: 184/280/260
    (6144, 4096): 32,
    # H200 qwen3-8b o, us at M 128: 17/20/14, 256: 17/20/16, 1024: 32/49/45, 4096: 134/208/178
    (4096, 4096): 32,
    # H200 qwen3-8b gate_up, us at M 128: 36/47/54, 256: 48/71/73, 1024: 189/301/263, 4096: 730/1185/1088
    (24576, 4096): 128,
    # H200 qwen3-8b down, us at M 128: 43/57/35, 256: 43/57/44, 1024: 107/137/127, 4096: 400/638/635
    (4096, 12288): 32,
    # H200 qwen3-30b-a3b qkv, us at M 128: 11/17/8, 256: 11/17/12, 1024: 28/43/30, 4096: 84/138/115
    (5120, 2048): 32,
    # H200 qwen3-30b-a3b o, us at M 128: 17/30/10, 256: 17/30/10, 1024: 19/32/23, 4096: 71/109/87
    (2048, 4096): 32,
}
DEFAULT_MIN_M = 256  # shapes without a row (other models, other TP sizes)


def chosen(m: int, n: int, k: int) -> bool:
    """Whether the FP8 layers send x [m, k] @ w [n, k]^T to cuBLAS where it serves (see the module docstring)."""
    forced = os.environ.get(ENV)
    if forced in ("0", "1"):
        return forced == "1"
    min_m = CUBLAS_FP8_MIN_M.get((n, k), DEFAULT_MIN_M)
    return min_m is not None and m >= min_m


def platform_rejects(capability: tuple[int, int], cuda_version: str | None, has_recipe: bool) -> str | None:
    """Why a GPU of `capability`, under a torch built with CUDA `cuda_version` (None: without CUDA) that has
    (or lacks) the block-scaled recipe's API, cannot run it; None when it can."""
    if not has_recipe:
        return "this torch has no F.scaled_mm with ScalingType.BlockWise128x128"
    if cuda_version is None or tuple(int(part) for part in cuda_version.split(".")[:2]) < MIN_CUDA:
        return f"torch is built with CUDA {cuda_version}; block-scaled FP8 needs cuBLASLt 12.9 or newer"
    if capability != (9, 0):
        return f"torch runs block-scaled FP8 in cuBLASLt on sm_90 only; this GPU is sm_{capability[0]}{capability[1]}"
    return None


def rejects(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
            bias: torch.Tensor | None = None, silu_mul: bool = False) -> str | None:
    """Why cuBLAS does not serve these operands (not counting `unavailable`), or None when it does; with
    `silu_mul`, x is the MLP's [gate | up] [M, 2K]."""
    (n, k), dtype = w.shape, x.dtype
    width = 2 * k if silu_mul else k
    if x.dim() != 2 or x.shape[1] != width:
        return f"x must be [M, {width}]"
    if dtype not in DTYPES:
        return f"x is {dtype}; cuBLAS's block-scaled GEMM here takes bfloat16 or float16"
    if config.block != (BLOCK, BLOCK):
        return f"weights must be in {BLOCK} x {BLOCK} blocks, not {config.block or 'per channel'}"
    if n % 16 or k % (4 * BLOCK):
        return f"N must be a multiple of 16 and K of {4 * BLOCK} (got N {n}, K {k})"
    if w.dtype != torch.float8_e4m3fn or w.stride(1) != 1 or w.stride(0) % 16 or w.data_ptr() % 16:
        return "w must be float8_e4m3fn [N, K], unit stride along K, 16-byte aligned rows"
    if scale.dtype != torch.float32 or scale.shape != config.scale_shape(n, k) or not scale.is_contiguous():
        return f"scale must be a contiguous float32 {list(config.scale_shape(n, k))}"
    if bias is not None and (bias.dtype != dtype or bias.shape != (n,) or bias.stride(0) != 1):
        return f"bias must be a contiguous {dtype} [N]"
    if not (x.device == w.device == scale.device and (bias is None or bias.device == x.device)):
        return "operands on different devices"
    return None


_probed: dict[tuple[torch.device, torch.dtype], str | None] = {}


def unavailable(device: torch.device, dtype: torch.dtype) -> str | None:
    """Why cuBLAS's block-scaled FP8 GEMM cannot run on `device` with `dtype` activations, or None when it can
    (checked, then probed once: see the module docstring)."""
    if device.type != "cuda":
        return f"cuBLAS needs a CUDA device, not {device.type}"
    key = (device, dtype)
    if key not in _probed:
        reason = platform_rejects(torch.cuda.get_device_capability(device), torch.version.cuda,
                                  hasattr(F, "scaled_mm") and hasattr(getattr(F, "ScalingType", None),
                                                                      "BlockWise128x128"))
        if reason is None and torch.cuda.is_current_stream_capturing():
            return "not probed yet (first asked during a CUDA graph capture)"
        _probed[key] = reason or _probe(device, dtype)
    return _probed[key]


def _probe(device: torch.device, dtype: torch.dtype) -> str | None:
    """One small call whose every output is known (512): None if it gives that, else why not."""
    x = torch.ones(ROW_ALIGN, 4 * BLOCK, dtype=dtype, device=device)
    w = torch.ones(BLOCK, 4 * BLOCK, device=device).to(torch.float8_e4m3fn)
    scale = torch.ones(1, 4, dtype=torch.float32, device=device)
    try:
        out = _launch(x, w, scale, None)
    except (RuntimeError, ValueError, NotImplementedError, TypeError) as exc:
        return f"F.scaled_mm failed on {torch.cuda.get_device_name(device)} in {dtype}: {exc}"
    if not torch.equal(out, torch.full_like(out, 4 * BLOCK)):
        return f"F.scaled_mm gave wrong results in {dtype} (expected all {4 * BLOCK})"
    return None


def fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
                  bias: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_linear_torch(x, w, scale, config, bias)` through cuBLASLt, on the current stream. Raises ValueError
    where `rejects` or `unavailable` gives a reason."""
    reason = rejects(x, w, scale, config, bias) or unavailable(x.device, x.dtype)
    if reason:
        raise ValueError(f"fp8_scaled_mm: {reason}")
    return _launch(x, w, scale, bias)


def try_fp8_scaled_mm(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
                      bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor | None:
    """The FP8 layers' dispatch: cuBLAS where `chosen` for this shape and it serves; else None (the Triton GEMM).
    With `silu_mul`, x is the MLP's [gate | up] [M, 2K] and silu_and_mul(x) is multiplied (formed while
    quantizing it)."""
    if not chosen(x.shape[0], *w.shape):
        return None
    if rejects(x, w, scale, config, bias, silu_mul) or unavailable(x.device, x.dtype):
        return None
    return _launch(x, w, scale, bias, silu_mul)


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None,
            silu_mul: bool = False) -> torch.Tensor:
    m = x.shape[0]
    xq, sx = quantize_activation(x, BLOCK, rows=-(-m // ROW_ALIGN) * ROW_ALIGN, silu_mul=silu_mul)
    out = F.scaled_mm(xq, w.t(), sx.t(), F.ScalingType.BlockWise1x128, scale.t(), F.ScalingType.BlockWise128x128,
                      output_dtype=x.dtype)[:m]
    return out if bias is None else out.add_(bias)
