"""Shared memory of the fused MoE's expert GEMM as Triton compiles it for an H100/H200 (sm_90), on a machine
without a GPU: the kernel is compiled, not launched, through `expert_gemm`'s own launch (so with the
arguments' real specialization), and Triton's figure is printed beside `fused_moe.shared_memory`'s.

    python benchmarks/moe_smem.py    # every config of the tables and the heuristic: bf16 and float32 x with
                                     # plain weights; e4m3 weights with e4m3 x, or with bf16 and float32 x
                                     # quantized in the tiles (in_tile); about 5 s of compiling per line

The figures in tests/kernels/test_moe_smem.py come from this script (Triton 3.9).
"""

from __future__ import annotations

from dataclasses import replace

import torch
from triton.backends.compiler import GPUTarget
from triton.runtime import driver

import minisgl.kernels.fused_moe as fused_moe
from minisgl.kernels.fused_moe import MoEConfig, default_config, expert_gemm, shared_memory
from minisgl.quantization import Fp8Config

EXPERTS, HIDDEN, INTER, TOKENS = 8, 256, 256, 64


class Sm90:
    """Triton's driver as far as compiling needs it: an H100/H200 target, device 0, stream 0."""

    def get_current_target(self) -> GPUTarget:
        return GPUTarget("cuda", 90, 32)

    def get_current_device(self) -> int:
        return 0

    def get_current_stream(self, device: int | None = None) -> int:
        return 0


class CompileOnly:
    """Stands in for the kernel: `[grid](...)` compiles it for the active target and keeps its figure."""

    def __init__(self, kernel) -> None:
        self.kernel, self.shared = kernel, 0

    def __getitem__(self, grid):
        def compile_only(*args, **kwargs) -> None:
            self.shared = self.kernel.warmup(*args, grid=grid, **kwargs).metadata.shared
        return compile_only


def compiled_shared_memory(config: MoEConfig, x_dtype: torch.dtype, fp8: Fp8Config | None, gated: bool) -> int:
    """Triton's shared memory for one expert GEMM (gate/up when gated, else down) with these tiles."""
    w_dtype = torch.float8_e4m3fn if fp8 else x_dtype
    quantized = fp8 is not None and not config.in_tile  # x as fused_experts passes it
    x = torch.zeros(TOKENS, HIDDEN, dtype=w_dtype if quantized else x_dtype)
    w = torch.zeros(EXPERTS, (2 if gated else 1) * INTER, HIDDEN, dtype=w_dtype)
    out = torch.zeros(TOKENS, INTER, dtype=x_dtype)
    blocks = fused_moe.max_blocks(TOKENS, EXPERTS, config.block_m)
    aligned = (torch.zeros(blocks * config.block_m, dtype=torch.int32), torch.zeros(blocks, dtype=torch.int32),
               torch.zeros(1, dtype=torch.int32))
    scale = torch.zeros(EXPERTS, *fp8.scale_shape(*w.shape[1:])) if fp8 else None
    x_scale = torch.zeros(HIDDEN // fp8.group, TOKENS) if quantized else None
    expert_gemm(x, w, out, aligned, 1, config, None if gated else torch.zeros(TOKENS), scale=scale, fp8=fp8,
                a_scale=x_scale)
    return fused_moe._expert_gemm_kernel.shared


def main() -> None:
    driver.set_active(Sm90())
    fused_moe.EMULATE = False  # compile the tensor-core path, not the interpreter's emulation
    fused_moe._expert_gemm_kernel = CompileOnly(fused_moe._expert_gemm_kernel)
    configs = [config for rows in fused_moe.CONFIGS.values() for _, config in rows]
    configs += [replace(config, in_tile=False) for rows in fused_moe.FP8_CONFIGS.values() for _, config in rows]
    configs += [default_config(tokens, 8, 128) for tokens in (1, 128, 1024, 16384)]
    print("block_m block_n block_k warps stages  x             weights  gated (model)    down (model)")
    for config in dict.fromkeys(replace(config, group_m=8) for config in configs):  # group_m: no bearing
        # FP8 x quantized by its own launch is e4m3 whatever its dtype; in_tile it is bf16 or float32
        for x_dtype, fp8, in_tile in ((torch.bfloat16, None, False), (torch.float32, None, False),
                                      (torch.bfloat16, Fp8Config(), False), (torch.bfloat16, Fp8Config(), True),
                                      (torch.float32, Fp8Config(), True)):
            tiles = replace(config, block_k=fp8.group, in_tile=in_tile) if fp8 else config
            w_size = 1 if fp8 else x_dtype.itemsize
            figures = [(compiled_shared_memory(tiles, x_dtype, fp8, gated),
                        shared_memory(tiles, x_dtype.itemsize, w_size, gated)) for gated in (True, False)]
            x_name = "e4m3" if fp8 and not in_tile else str(x_dtype)[6:] + (" tile" if in_tile else "")
            print(f"{tiles.block_m:7} {tiles.block_n:7} {tiles.block_k:7} {tiles.num_warps:5} "
                  f"{tiles.num_stages:6}  {x_name:13} {'e4m3' if fp8 else 'plain':8} "
                  + "  ".join(f"{got:6} ({model:6})" for got, model in figures), flush=True)

if __name__ == "__main__":
    main()
