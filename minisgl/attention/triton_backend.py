"""Paged attention with the Triton kernels of minisgl.kernels.attention (the GPU fast path).

Decode batches (one new token per request) run split-K flash-decoding; everything else (prefill,
extend after a cached prefix, mixed batches) runs the tiled extend kernel. The decode `prepare` only
gathers references to the step's tensors, so it is safe inside a CUDA graph; the number of splits
depends on the batch size alone, never on sequence lengths. An fp8 pool (`--kv-cache-dtype fp8`) runs the
same kernels: K/V are loaded as fp8 and upcast to the model's dtype in registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend, ForwardInput
from minisgl.kernels.attention import KernelConfig, decode_attention, extend_attention, num_decode_splits
from minisgl.kernels.kv_store import store_kv
from minisgl.kvcache.pool import KVPool

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
FP8_MIN_CAPABILITY = (8, 9)  # Triton's float8e4nv: Ada and Hopper on


@dataclass
class DecodeMeta:
    out_slots: torch.Tensor  # [B]
    rows: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    num_splits: int
    scratch: tuple[torch.Tensor, torch.Tensor] | None = None  # split partials, made by the first layer

    def split_scratch(self, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Partial outputs [B, heads, splits, D] and their log-sum-exp, shared by every layer of the step."""
        if self.num_splits == 1:
            return None, None
        if self.scratch is None:
            batch, heads, dim = q.shape
            self.scratch = (torch.empty(batch, heads, self.num_splits, dim, dtype=torch.float32, device=q.device),
                            torch.empty(batch, heads, self.num_splits, dtype=torch.float32, device=q.device))
        return self.scratch


@dataclass
class ExtendMeta:
    out_slots: torch.Tensor  # [T]
    rows: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    q_starts: torch.Tensor  # [B] index in T of each request's first new token
    max_extend: int


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, page_table: torch.Tensor, config: KernelConfig | None = None):
        if pool.k.dtype not in SUPPORTED_DTYPES:
            raise ValueError(f"triton attention supports KV dtypes {SUPPORTED_DTYPES}, not {pool.k.dtype}")
        if pool.k.stride() != pool.v.stride() or pool.k.stride(-1) != 1:
            raise ValueError("triton attention needs K and V pools of the same contiguous layout")
        device = pool.k.device
        if pool.k.dtype == torch.float8_e4m3fn and device.type == "cuda" and \
                torch.cuda.get_device_capability(device) < FP8_MIN_CAPABILITY:
            raise ValueError("an fp8 KV cache with triton attention needs a GPU of compute capability 8.9 or newer "
                             "(Ada, Hopper); use --attn torch or --kv-cache-dtype auto")
        self.pool, self.page_table = pool, page_table
        self.config = (config or KernelConfig()).fitted(pool.dtype, pool.k.shape[-1], pool.k.dtype)
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def prepare(self, batch: ForwardInput) -> DecodeMeta | ExtendMeta:
        if batch.is_decode or batch.max_extend == 1:
            splits = num_decode_splits(batch.rows.numel(), self.pool.k.shape[2], self.num_sms, self.config)
            return DecodeMeta(batch.out_slots, batch.rows, batch.seq_lens, splits)
        q_starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        return ExtendMeta(batch.out_slots, batch.rows, batch.kv_lens, batch.extend_lens, q_starts, batch.max_extend)

    def store(self, layer: int, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
        store_kv(self.pool.k[layer], self.pool.v[layer], slots, k, v)

    def attend(self, layer: int, q: torch.Tensor, meta: DecodeMeta | ExtendMeta,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out.view(q.shape)
        k_cache, v_cache, page_size = self.pool.k[layer], self.pool.v[layer], self.pool.page_size
        if isinstance(meta, DecodeMeta):
            part_out, part_lse = meta.split_scratch(q)
            decode_attention(q, k_cache, v_cache, self.page_table, meta.rows, meta.seq_lens, out, part_out, part_lse,
                             page_size, meta.num_splits, self.config)
        else:
            extend_attention(q, k_cache, v_cache, self.page_table, meta.rows, meta.kv_lens, meta.extend_lens,
                             meta.q_starts, meta.max_extend, out, page_size, self.config)
        return out.view(q.shape[0], -1)
