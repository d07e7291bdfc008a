"""The CUDA C++ kernels of `csrc/`, built by nvcc into one shared library and called through ctypes.

ctypes, not a torch C++ extension: the library is plain CUDA (static cudart) with a C ABI of raw device
pointers and a stream, so the CUDA version of the nvcc that builds it need not match torch's. Launches go to
`torch.cuda.current_stream()`, so they are captured by CUDA graphs like any kernel.

    python -m minisgl.tools.build_csrc     # nvcc -> csrc/build/libminisgl_csrc.so (MINISGL_CSRC_LIB names
                                           # another library to load instead)

The library serves only where it can (loaded, its ABI version matching, a Hopper GPU): `unavailable()` says
why not, and callers keep their Triton path. Today it holds the FP8 decode GEMV in two variants (VARIANTS):
"mma" (`csrc/fp8_gemv_mma.cu`: x quantized to e4m3 as the Triton GEMV does, tensor cores, 1-8 rows) and
"widen" (`csrc/fp8_gemv_widen.cu`: x kept in float32, weights widened on the CUDA cores, 1-2 rows). The FP8
layers try it first (`try_fp8_gemv`) for the (M, N, K) in NATIVE_FP8_GEMV; MINISGL_NATIVE_GEMV overrides the
table: =1 every shape either variant serves (widen up to its 2 rows, then mma), =mma or =widen only that
variant, =0 never.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import torch

from minisgl.kernels import use_pdl
from minisgl.quantization import Fp8Config

CSRC = Path(__file__).resolve().parents[2] / "csrc"
LIBRARY = "libminisgl_csrc.so"
LIBRARY_ENV = "MINISGL_CSRC_LIB"
ABI_VERSION = 2  # csrc's ABI_VERSION: a library built from other sources is refused
SOURCES = ("fp8_gemv.cu", "fp8_gemv_mma.cu", "fp8_gemv_widen.cu")  # (and the header they share, fp8_gemv.cuh)
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
              "-cudart", "static")
GROUP = 128  # K columns per scale group; the block-scaled layout's blocks are GROUP x GROUP
SMS = 132  # an H100's SMs: the default CTA heights keep two CTAs per SM where the rows allow


@dataclass(frozen=True)
class Variant:
    """One of csrc's FP8 GEMV kernels: its C ABI code, the most x rows it takes, its CTA heights (small, big)."""

    code: int
    max_m: int
    rows: tuple[int, int]


VARIANTS = {"mma": Variant(0, 8, (16, 32)), "widen": Variant(1, 2, (8, 16))}

# (M, N, K) -> (variant, rows per CTA): the qwen3-8b FP8 projections (TP 1) and batch sizes where `python
# benchmarks/fp8.py --rows 1 2 8 --replays 3` measured a native variant faster than the Triton GEMV in the same
# run (down with SiLU-and-mul inside, as the model runs it), on an NVIDIA H200, branch csrc f0b252a (there all
# kernel tests passed; the engine tests were held to the wrong oracle, now transformers). widen only: at 1 row
# it is the clear win (W2 qwen3-8b 3.21 ms/token against the Triton GEMV's 3.93), at 2 rows only for o and
# down (with all four projections in widen the step was no faster than Triton's: 3,049 against 3,020 us).
# qwen3-8b's mma rows (qkv and gate_up at 2 and 8 rows, o at 8) are left out, the step preferred over the rows: its
# step sums at 2 and 8 rows (3,256-3,535 us) were above the Triton column's (3,020-3,049, though that column
# timed down without SiLU-and-mul inside) and W2 at 1 row ran 4.21 ms against 3.93; until a step with mma
# measures faster, it stays behind MINISGL_NATIVE_GEMV=mma there. qwen3-30b-a3b's attention projections (its MLPs
# are experts), from `python benchmarks/fp8.py --models qwen3-30b-a3b --sweep --rows 1 2 8` on an H200 (2026-11-26):
# each row is that run's fastest variant; both projections' step at 1 row, 48 layers: 437 us against the Triton
# GEMV's 655 (widen alone 449, mma alone 621-629).
NATIVE_FP8_GEMV: dict[tuple[int, int, int], tuple[str, int]] = {
    # NVIDIA H200 qwen3-8b TP1 qkv M=1: 8.4 us against the Triton GEMV's 12.7
    (1, 6144, 4096): ("widen", 8),
    # NVIDIA H200 qwen3-8b TP1 o M=1: 5.4 us against the Triton GEMV's 10.5
    (1, 4096, 4096): ("widen", 16),
    # NVIDIA H200 qwen3-8b TP1 o M=2: 7.5 us against the Triton GEMV's 11.0
    (2, 4096, 4096): ("widen", 16),
    # NVIDIA H200 qwen3-8b TP1 gate_up M=1: 27.8 us against the Triton GEMV's 36.5
    (1, 24576, 4096): ("widen", 16),
    # NVIDIA H200 qwen3-8b TP1 down M=1: 14.5 us against the Triton GEMV's 28.7
    (1, 4096, 12288): ("widen", 16),
    # NVIDIA H200 qwen3-8b TP1 down M=2: 24.8 us against the Triton GEMV's 29.3
    (2, 4096, 12288): ("widen", 16),
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv M=1: 5.6 us against the Triton GEMV's 6.6
    (1, 5120, 2048): ("mma", 32),
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv M=2: 5.7 us against the Triton GEMV's 6.8
    (2, 5120, 2048): ("mma", 32),
    # NVIDIA H200 qwen3-30b-a3b TP1 qkv M=8: 5.8 us against the Triton GEMV's 7.0
    (8, 5120, 2048): ("mma", 32),
    # NVIDIA H200 qwen3-30b-a3b TP1 o M=1: 3.5 us against the Triton GEMV's 7.1
    (1, 2048, 4096): ("widen", 8),
    # NVIDIA H200 qwen3-30b-a3b TP1 o M=2: 3.9 us against the Triton GEMV's 7.2
    (2, 2048, 4096): ("widen", 16),
    # NVIDIA H200 qwen3-30b-a3b TP1 o M=8: 6.5 us against the Triton GEMV's 7.1
    (8, 2048, 4096): ("mma", 16),
}


def find_nvcc() -> str | None:
    """nvcc on PATH, else CUDA's default install's."""
    return shutil.which("nvcc") or next((str(p) for p in [Path("/usr/local/cuda/bin/nvcc")] if p.exists()), None)


def build(out_dir: Path = CSRC / "build", extra_flags: tuple[str, ...] = ()) -> Path:
    """Compile csrc/ into out_dir/LIBRARY with nvcc; its path. Raises RuntimeError with nvcc's output."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise RuntimeError("nvcc not found on PATH or in /usr/local/cuda/bin")
    out_dir.mkdir(parents=True, exist_ok=True)
    library = out_dir / LIBRARY
    done = subprocess.run([nvcc, *NVCC_FLAGS, *extra_flags, "-o", str(library), *(str(CSRC / s) for s in SOURCES)],
                          capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"nvcc failed ({done.returncode}):\n{done.stdout}{done.stderr}")
    return library


def library_path() -> Path:
    return Path(os.environ.get(LIBRARY_ENV) or CSRC / "build" / LIBRARY)


@cache
def _load() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) or (None, why it cannot be used); tried once per process."""
    path = library_path()
    if not path.exists():
        return None, f"no csrc library at {path} (build it: python -m minisgl.tools.build_csrc)"
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as exc:
        return None, f"cannot load {path}: {exc}"
    if lib.minisgl_fp8_gemv_abi_version() != ABI_VERSION:
        return None, f"{path} has ABI version {lib.minisgl_fp8_gemv_abi_version()}, expected {ABI_VERSION}: rebuild it"
    fn = lib.minisgl_fp8_gemv
    fn.restype = ctypes.c_int
    fn.argtypes = [ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p, ctypes.c_longlong, ctypes.c_void_p,
                   ctypes.c_longlong, ctypes.c_longlong, ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p,
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                   ctypes.c_int, ctypes.c_void_p]
    return lib, None


@cache
def unavailable(device: torch.device) -> str | None:
    """Why the library cannot run on `device`, or None when it can: loaded and a Hopper (sm_90) GPU."""
    if device.type != "cuda":
        return f"csrc kernels need a CUDA device, not {device.type}"
    major, minor = torch.cuda.get_device_capability(device)
    if (major, minor) != (9, 0):
        return f"csrc is built for sm_90a only; this GPU is sm_{major}{minor}"
    return _load()[1]


def fp8_gemv_rejects(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
                     bias: torch.Tensor | None = None, silu_mul: bool = False, variant: str = "mma") -> str | None:
    """Why `fp8_gemv` does not serve these operands in `variant`, or None when it does (not counting
    `unavailable`)."""
    m, k = x.shape[0], w.shape[1]
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return "x must be a 2-D bfloat16 tensor, unit stride along K, 16-byte aligned rows"
    if not 1 <= m <= VARIANTS[variant].max_m:
        return f"x has {m} rows; the native GEMV ({variant}) takes 1..{VARIANTS[variant].max_m}"
    if x.shape[1] != (2 if silu_mul else 1) * k:
        return f"x has {x.shape[1]} columns; w's K is {k}" + (" (silu_mul: x is [M, 2K])" if silu_mul else "")
    if w.dtype != torch.float8_e4m3fn or w.stride(1) != 1 or w.stride(0) % 16 or w.data_ptr() % 16:
        return "w must be float8_e4m3fn [N, K], unit stride along K, 16-byte aligned rows"
    if k % GROUP or config.group != GROUP or config.block not in (None, (GROUP, GROUP)):
        return f"K must be a multiple of {GROUP}, and scales per channel or in {GROUP} x {GROUP} blocks"
    if scale.dtype != torch.float32 or scale.dim() != 2 or scale.shape != config.scale_shape(*w.shape):
        return f"scale must be float32 {list(config.scale_shape(*w.shape))}"
    if bias is not None and (bias.dtype != torch.bfloat16 or bias.shape != (w.shape[0],) or bias.stride(0) != 1):
        return "bias must be a contiguous bfloat16 [N]"
    if not (x.device == w.device == scale.device and (bias is None or bias.device == x.device)):
        return "operands on different devices"
    return None


def default_variant(m: int) -> str:
    """The variant for m rows where NATIVE_FP8_GEMV has no row (MINISGL_NATIVE_GEMV=1, direct calls): widen while
    it serves (mma's 8-column tile would be mostly padding; widen was the faster at 1 row on the H200), then
    mma."""
    return "widen" if m <= VARIANTS["widen"].max_m else "mma"


def rows_per_cta(variant: str, n: int) -> int:
    """Output rows per CTA where NATIVE_FP8_GEMV has no row: the variant's bigger height halves the re-reads of
    x (and of its SiLU), the smaller doubles the CTAs of small layers; the bigger wherever that still makes two
    CTAs per SM. A guess: the H200's widen rows at 1 row preferred 16 for N = 4096 and 8 for N = 6144."""
    small, big = VARIANTS[variant].rows
    return big if n >= big * 2 * SMS else small


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
             bias: torch.Tensor | None = None, silu_mul: bool = False, variant: str | None = None,
             rows: int | None = None, pdl: bool = False) -> torch.Tensor:
    """`fp8_linear_torch(silu_and_mul(x) if silu_mul else x, w, scale, config, bias)` in csrc's GEMV, on the
    current stream (widen, which keeps x in float32, is the more accurate); `variant` (default_variant) and
    `rows` (rows_per_cta) override the defaults, `pdl` launches it as a programmatic dependent. Raises
    ValueError where `fp8_gemv_rejects` or `unavailable` gives a reason, RuntimeError on a launch error."""
    variant = variant or default_variant(x.shape[0])
    reason = fp8_gemv_rejects(x, w, scale, config, bias, silu_mul, variant) or unavailable(x.device)
    if reason:
        raise ValueError(f"native fp8_gemv: {reason}")
    rows = rows or rows_per_cta(variant, w.shape[0])
    if rows not in VARIANTS[variant].rows:
        raise ValueError(f"native fp8_gemv: {variant} runs CTAs of {VARIANTS[variant].rows} rows, not {rows}")
    return _launch(x, w, scale, config, bias, silu_mul, variant, rows, pdl)


def chosen(m: int, n: int, k: int) -> tuple[str, int] | None:
    """(variant, rows per CTA) that the FP8 layers' decode dispatch runs for x [m, k] @ w [n, k]^T, or None
    (the Triton GEMV): MINISGL_NATIVE_GEMV when set (see the module docstring), else NATIVE_FP8_GEMV."""
    forced = os.environ.get("MINISGL_NATIVE_GEMV")
    if forced is None:
        return NATIVE_FP8_GEMV.get((m, n, k))
    variant = default_variant(m) if forced == "1" else forced if forced in VARIANTS else None
    if variant is None or m > VARIANTS[variant].max_m:
        return None
    return variant, rows_per_cta(variant, n)


def try_fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
                 bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor | None:
    """The FP8 layers' decode dispatch: `fp8_gemv` in the variant `chosen` for this shape where it serves, with
    programmatic dependent launch as the Triton GEMV has it; else None."""
    choice = chosen(x.shape[0], *w.shape)
    if choice is None or fp8_gemv_rejects(x, w, scale, config, bias, silu_mul, choice[0]) or unavailable(x.device):
        return None
    return _launch(x, w, scale, config, bias, silu_mul, *choice, use_pdl(x.device))


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config, bias: torch.Tensor | None,
            silu_mul: bool, variant: str, rows: int, pdl: bool) -> torch.Tensor:
    m, (n, k) = x.shape[0], w.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block = config.block is not None
    err = _load()[0].minisgl_fp8_gemv(
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), scale.data_ptr(), scale.stride(0),
        scale.stride(1) if block else 0, int(block), bias.data_ptr() if bias is not None else None, out.data_ptr(),
        m, n, k, int(silu_mul), VARIANTS[variant].code, rows, int(pdl),
        x.device.index if x.device.index is not None else torch.cuda.current_device(),
        torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"native fp8_gemv ({variant}): launch failed with cudaError {err}")
    return out
