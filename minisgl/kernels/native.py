"""The CUDA C++ kernels of `csrc/`, built by nvcc into one shared library and called through ctypes.

ctypes, not a torch C++ extension: the library is plain CUDA (static cudart) with a C ABI of raw device
pointers and a stream, so the CUDA version of the nvcc that builds it need not match torch's. Launches go to
`torch.cuda.current_stream()`, so they are captured by CUDA graphs like any kernel.

    python -m minisgl.tools.build_csrc     # nvcc -> csrc/build/libminisgl_csrc.so (MINISGL_CSRC_LIB names
                                           # another library to load instead)

The library serves only where it can (loaded, its ABI version matching, a Hopper GPU): `unavailable()` says
why not, and callers keep their Triton path. Today it holds the FP8 decode GEMV (`csrc/fp8_gemv.cu`), which
the FP8 layers try first (`try_fp8_gemv`) for the shapes in NATIVE_FP8_GEMV, or for every shape it serves
with MINISGL_NATIVE_GEMV=1 (=0: never).
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from functools import cache
from pathlib import Path

import torch

from minisgl.kernels import use_pdl
from minisgl.quantization import Fp8Config

CSRC = Path(__file__).resolve().parents[2] / "csrc"
LIBRARY = "libminisgl_csrc.so"
LIBRARY_ENV = "MINISGL_CSRC_LIB"
ABI_VERSION = 1  # csrc's ABI_VERSION: a library built from other sources is refused
SOURCES = ("fp8_gemv.cu",)
NVCC_FLAGS = ("-O3", "-std=c++17", "-gencode=arch=compute_90a,code=sm_90a", "-shared", "-Xcompiler", "-fPIC",
              "-cudart", "static")
GEMV_MAX_M = 8  # x rows per GEMV: the width of the tensor-core tile it fills with x
GROUP = 128  # K columns per scale group; the block-scaled layout's blocks are GROUP x GROUP

# (N, K) -> rows per CTA, for the FP8 projections that `python benchmarks/fp8.py --rows 1 8` measured faster
# in the native GEMV than in the Triton one. Empty until a GPU has measured it (the kernel has not yet run).
NATIVE_FP8_GEMV: dict[tuple[int, int], int] = {}


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
                   ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int,
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
                     bias: torch.Tensor | None = None, silu_mul: bool = False) -> str | None:
    """Why `fp8_gemv` does not serve these operands, or None when it does (not counting `unavailable`)."""
    m, k = x.shape[0], w.shape[1]
    if x.dim() != 2 or x.dtype != torch.bfloat16 or x.stride(1) != 1 or x.stride(0) % 8 or x.data_ptr() % 16:
        return "x must be a 2-D bfloat16 tensor, unit stride along K, 16-byte aligned rows"
    if not 1 <= m <= GEMV_MAX_M:
        return f"x has {m} rows; the native GEMV takes 1..{GEMV_MAX_M}"
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


def rows_per_cta(n: int) -> int:
    """Output rows per CTA (16 or 32): 32 halves the re-reads of x, 16 doubles the CTAs of small layers.
    Unmeasured: 32 wherever that still makes two CTAs per SM of an H100 (132)."""
    return 32 if n >= 32 * 2 * 132 else 16


def fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
             bias: torch.Tensor | None = None, silu_mul: bool = False, rows: int | None = None,
             pdl: bool = False) -> torch.Tensor:
    """`fp8_linear_torch(silu_and_mul(x) if silu_mul else x, w, scale, config, bias)` in csrc's GEMV, on the
    current stream; `rows` overrides rows_per_cta, `pdl` launches it as a programmatic dependent. Raises
    ValueError where `fp8_gemv_rejects` or `unavailable` gives a reason, RuntimeError on a launch error."""
    reason = fp8_gemv_rejects(x, w, scale, config, bias, silu_mul) or unavailable(x.device)
    if reason:
        raise ValueError(f"native fp8_gemv: {reason}")
    return _launch(x, w, scale, config, bias, silu_mul, rows or rows_per_cta(w.shape[0]), pdl)


def try_fp8_gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config,
                 bias: torch.Tensor | None = None, silu_mul: bool = False) -> torch.Tensor | None:
    """The FP8 layers' decode dispatch: `fp8_gemv` where it is chosen (MINISGL_NATIVE_GEMV, else a row in
    NATIVE_FP8_GEMV) and serves, with programmatic dependent launch as the Triton GEMV has it; else None."""
    forced = os.environ.get("MINISGL_NATIVE_GEMV")
    rows = NATIVE_FP8_GEMV.get(tuple(w.shape)) if forced is None else rows_per_cta(w.shape[0]) if forced == "1" \
        else None
    if rows is None or fp8_gemv_rejects(x, w, scale, config, bias, silu_mul) or unavailable(x.device):
        return None
    return _launch(x, w, scale, config, bias, silu_mul, rows, use_pdl(x.device))


def _launch(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, config: Fp8Config, bias: torch.Tensor | None,
            silu_mul: bool, rows: int, pdl: bool) -> torch.Tensor:
    m, (n, k) = x.shape[0], w.shape
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    block = config.block is not None
    err = _load()[0].minisgl_fp8_gemv(
        x.data_ptr(), x.stride(0), w.data_ptr(), w.stride(0), scale.data_ptr(), scale.stride(0),
        scale.stride(1) if block else 0, int(block), bias.data_ptr() if bias is not None else None, out.data_ptr(),
        m, n, k, int(silu_mul), rows, int(pdl), x.device.index if x.device.index is not None else
        torch.cuda.current_device(), torch.cuda.current_stream(x.device).cuda_stream)
    if err:
        raise RuntimeError(f"native fp8_gemv: launch failed with cudaError {err}")
    return out

