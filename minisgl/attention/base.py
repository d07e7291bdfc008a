"""What every attention backend receives and must provide."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Protocol

import torch

from minisgl.kvcache.pool import KVPool


@dataclass
class ForwardInput:
    """One batch as device tensors, built once per step by the engine.

    Request i owns `extend_lens[i]` consecutive tokens of input_ids, at positions
    kv_lens[i] .. kv_lens[i] + extend_lens[i] - 1; its K/V go to `out_slots`.
    """

    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    out_slots: torch.Tensor  # [T] KV slot of each new token
    rows: torch.Tensor  # [B] page-table rows
    kv_lens: torch.Tensor  # [B] tokens already cached before this step
    extend_lens: torch.Tensor  # [B] new tokens this step
    seq_lens: torch.Tensor  # [B] kv_lens + extend_lens
    last_index: torch.Tensor  # [B] index in T of each request's last token (its logits are sampled)
    max_extend: int  # host-side max of extend_lens
    max_seq_len: int  # host-side upper bound of seq_lens (exact in eager steps; the engine's limit in CUDA graphs)
    is_decode: bool = False  # every request feeds exactly one token (T == B): the CUDA-graph case
    # Host-side: the leading requests that feed one token each (a mixed step's decodes come first) and the
    # tokens they have cached, so a backend can give them its decode kernel without reading the device.
    decode_rows: int = 0
    decode_kv_tokens: int = 0


@dataclass
class StepAttention:
    """A step's attention as the model sees it: each layer's rope writes the new tokens' k/v into `pool` at
    `slots` (on a GPU in the rope kernel itself, a launch fewer per layer than a separate store), then
    `attend(layer, q)` attends over the pool. The engine binds `attend` to a backend and the step's metadata; the
    whole-step CUDA graphs (engine/whole_graph.py) to static metadata, with static slots."""

    pool: KVPool
    slots: torch.Tensor  # [T] pool slot of each new token
    attend: Callable[[int, torch.Tensor], torch.Tensor]  # (layer, q [T, heads, D]) -> [T, heads * D]


class AttentionBackend(Protocol):
    """`prepare` runs once per step, `attend` once per layer, after the model stored that layer's new K/V in the
    pool (see StepAttention). A backend with `supports_cuda_graph` must keep `prepare` of a decode batch
    capturable: device ops only, no host reads of device tensors, and max_seq_len used only as an upper bound."""

    supports_cuda_graph: bool

    def prepare(self, batch: ForwardInput) -> Any:
        """Build per-batch metadata once; every layer's attend reuses it."""

    def attend(self, layer: int, q: torch.Tensor, meta: Any, out: torch.Tensor | None = None) -> torch.Tensor:
        """Attend causally over each request's whole context, whose new K/V are stored already.
        q: [T, heads, D] -> [T, heads * D], written into `out` when given."""
