"""Reference attention in plain torch (CPU and GPU): the oracle for the fast backends.

The batch is padded to [B, max_extend] queries over [B, max_seq_len] keys gathered from the pool,
with one boolean mask for causality and length; a single SDPA call then covers prefill, extend
and decode alike. The gathered pages are upcast to q's dtype (dequantized, for an fp8 pool) before it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from minisgl.attention.base import AttentionBackend, ForwardInput
from minisgl.kvcache.pool import KVPool


@dataclass
class TorchMeta:
    kv_slots: torch.Tensor  # [B, L] slot of every context position (scratch slot past the end)
    mask: torch.Tensor  # [B, 1, Q, L] True where query j of request b may see key p
    batch_index: torch.Tensor  # [T] request of each token
    query_index: torch.Tensor  # [T] position of each token inside its request's padded query block
    num_reqs: int
    max_extend: int


class TorchBackend(AttentionBackend):
    supports_cuda_graph = False  # shapes depend on max_seq_len

    def __init__(self, pool: KVPool, page_table: torch.Tensor):
        self.pool, self.page_table = pool, page_table

    def prepare(self, batch: ForwardInput) -> TorchMeta:
        device, ps = batch.positions.device, self.pool.page_size
        b, q, length = batch.rows.numel(), batch.max_extend, batch.max_seq_len
        pos = torch.arange(length, device=device)
        pages = self.page_table[batch.rows][:, pos // ps].long()  # [B, L]
        valid = pos[None, :] < batch.seq_lens[:, None]
        kv_slots = torch.where(valid, pages * ps + pos % ps, self.pool.scratch_page * ps)
        batch_index = torch.repeat_interleave(torch.arange(b, device=device), batch.extend_lens,
                                              output_size=batch.input_ids.numel())
        starts = torch.cumsum(batch.extend_lens, 0) - batch.extend_lens
        query_index = torch.arange(batch.input_ids.numel(), device=device) - starts[batch_index]
        query_pos = batch.kv_lens[:, None] + torch.arange(q, device=device)[None, :]  # [B, Q]
        mask = (pos[None, None, :] <= query_pos[:, :, None]) & valid[:, None, :]
        mask[:, :, 0] = True  # padded query rows see one key instead of none (no NaN; discarded anyway)
        return TorchMeta(kv_slots, mask.unsqueeze(1), batch_index, query_index, b, q)

    def attend(self, layer: int, q: torch.Tensor, meta: TorchMeta, out: torch.Tensor | None = None) -> torch.Tensor:
        heads, dim = q.shape[1], q.shape[2]
        q_pad = q.new_zeros(meta.num_reqs, meta.max_extend, heads, dim)
        q_pad[meta.batch_index, meta.query_index] = q
        keys, values = self.pool.load(layer, meta.kv_slots, q.dtype)  # [B, L, kv_heads, D]
        result = F.scaled_dot_product_attention(q_pad.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2),
                                             attn_mask=meta.mask, enable_gqa=True)
        result = result.transpose(1, 2)[meta.batch_index, meta.query_index].reshape(q.shape[0], heads * dim)
        return result if out is None else out.copy_(result)
