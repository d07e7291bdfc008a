"""Paged attention with the Triton kernels of minisgl.kernels.attention (the GPU fast path).

Decode batches (one new token per request) run split-K flash-decoding; everything else (prefill,
extend after a cached prefix) runs the tiled extend kernel, and so does a mixed batch (decodes first, then
prefill chunks) unless its decodes read enough K/V to pay for their own launches (see MixedMeta). The
decode `prepare` only gathers references to the step's tensors, so it is safe inside a CUDA graph; the
number of splits depends on the batch size alone, never on sequence lengths. An fp8 pool
(`--kv-cache-dtype fp8`) runs the same kernels: K/V are loaded as fp8 and upcast to the model's dtype in
registers.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.attention.base import AttentionBackend, ForwardInput
from minisgl.kernels.attention import (
    KernelConfig,
    decode_attention,
    extend_attention,
    extend_tokens_per_tile,
    num_decode_splits,
)
from minisgl.kvcache.pool import KVPool

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float8_e4m3fn)
FP8_MIN_CAPABILITY = (8, 9)  # Triton's float8e4nv: Ada and Hopper on


@dataclass
class DecodeMeta:
    rows: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    num_splits: int
    scratch: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # split partials, made by the first layer

    def split_scratch(self, q: torch.Tensor, kv_heads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | \
            tuple[None, None, None]:
        """Partial outputs [B, heads, splits, D], their log-sum-exp, and the arrival counters [B, kv_heads] (zeros,
        and zeros again after each layer), shared by every layer of the step."""
        if self.num_splits == 1:
            return None, None, None
        if self.scratch is None:
            batch, (heads, dim) = self.rows.numel(), q.shape[1:]
            self.scratch = (torch.empty(batch, heads, self.num_splits, dim, dtype=torch.float32, device=q.device),
                            torch.empty(batch, heads, self.num_splits, dtype=torch.float32, device=q.device),
                            torch.zeros(batch, kv_heads, dtype=torch.int32, device=q.device))
        return self.scratch


@dataclass
class ExtendMeta:
    """Prompt chunks (or any rows) through the extend kernel's tile list (kernels/attention.py `_extend_kernel`).
    q_starts are absolute rows of the step's q (a mixed step's chunks come after its decode rows). tile_ends and
    tiles are set by `tile` at the first layer in an eager step, or written by the whole-step CUDA graphs
    (engine/whole_graph.py), whose `tiles` is the bucket's bound and whose padding entries own no tile."""

    rows: torch.Tensor  # [B]
    kv_lens: torch.Tensor  # [B]
    extend_lens: torch.Tensor  # [B]
    q_starts: torch.Tensor  # [B] index in T of each request's first new token
    tokens: int  # host-side: an upper bound of sum(extend_lens)
    tile_ends: torch.Tensor | None = None  # [B] running total of each request's tiles
    tiles: int = 0  # the grid's programs per KV head: at least the tiles' total

    def tile(self, tokens_per_tile: int) -> None:
        """The tile list of an eager step, from the device lengths (no host read): every request wastes at
        most one partial tile, so cdiv(tokens, tokens_per_tile) + B programs cover them all."""
        if self.tile_ends is None:
            self.tile_ends = torch.cumsum(torch.div(self.extend_lens + tokens_per_tile - 1, tokens_per_tile,
                                                    rounding_mode="floor"), 0)
            self.tiles = -(-self.tokens // tokens_per_tile) + self.rows.numel()


# A mixed step's decode rows get the decode kernel when their K/V of one layer is at least this many bytes (a qwen3
# layer: 8 KV heads x 128 dims x K and V in bf16 = 4 KiB a token). Why: in the extend kernel a decode row is one live
# program per KV head that walks its whole context alone (no split-KV), with a tile of 64 query rows (128 when this was
# measured) of which `group` are real. On an H200 (qwen3-8b, 224 decodes of ~1,000 cached tokens beside 1,358 prompt
# tokens) that took ~20 ms of a 61 ms step, ~2.5x their read at copy bandwidth (33 GB at ~4.3 TB/s: ~8 ms), which the
# decode kernel roughly reaches: the split saves more than the decode rows' read time. It costs one more launch a layer
# (the decode kernel; when it splits the keys, its last split reduces them), which a host-bound enqueue would feel, so
# tiny reads stay in one launch. But mixed steps under load are device-bound (qwen3-0.6b at 64 streams on an H200: ~11
# ms on the device for ~5 ms of enqueue), and there the split already pays at 64 rows of ~800 tokens (~200 MiB: 135
# against 214 us a layer, benchmarks/attention.py --mode mixed); splitting every mixed step took that level's ITL p99
# from 10.6 to 9.9 ms (docs/benchmarks.md, 2026-11-26 session 2). 32 MiB is ~8,000 cached tokens of a qwen3 layer: a few
# streams' worth.
MIXED_SPLIT_KV_BYTES = 32 << 20


@dataclass
class MixedMeta:
    """A mixed batch split in two: its leading one-token rows through the decode kernel (q and out rows 0..D-1),
    the rest (prefill chunks, at absolute q_starts) through the extend kernel; each writes its own rows of the output.
    Why: the extend kernel gives a decode row one program per KV head over its whole context, a tile mostly
    of padding; the decode kernel reads the same keys at about copy bandwidth (MIXED_SPLIT_KV_BYTES: when)."""

    decode: DecodeMeta
    extend: ExtendMeta


class TritonBackend(AttentionBackend):
    supports_cuda_graph = True

    def __init__(self, pool: KVPool, page_table: torch.Tensor, config: KernelConfig | None = None,
                 mixed_split_kv_bytes: int = MIXED_SPLIT_KV_BYTES):
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
        self.mixed_split_kv_bytes = mixed_split_kv_bytes
        self.num_sms = torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 1

    def prepare(self, batch: ForwardInput) -> DecodeMeta | ExtendMeta | MixedMeta:
        if batch.is_decode or batch.max_extend == 1:
            return self._decode_meta(batch.rows, batch.seq_lens)
        decodes = batch.decode_rows if self._worth_splitting(batch) else 0  # rows (and tokens) [0, decodes)
        extend_lens = batch.extend_lens[decodes:]
        extend = ExtendMeta(batch.rows[decodes:], batch.kv_lens[decodes:], extend_lens,
                            torch.cumsum(extend_lens, 0) - extend_lens + decodes, batch.input_ids.shape[0] - decodes)
        if not decodes:
            return extend
        decode = self._decode_meta(batch.rows[:decodes], batch.seq_lens[:decodes])
        return MixedMeta(decode, extend)

    def _decode_meta(self, rows: torch.Tensor, seq_lens: torch.Tensor) -> DecodeMeta:
        splits = num_decode_splits(rows.numel(), self.pool.k.shape[2], self.num_sms, self.config)
        return DecodeMeta(rows, seq_lens, splits)

    def _worth_splitting(self, batch: ForwardInput) -> bool:
        """Whether the leading decode rows' K/V of one layer (cached tokens, plus each row's new one) reaches
        mixed_split_kv_bytes (MIXED_SPLIT_KV_BYTES; tests set 0 to split every mixed batch)."""
        k = self.pool.k
        token_bytes = 2 * k.shape[2] * k.shape[3] * k.element_size()
        kv_bytes = (batch.decode_kv_tokens + batch.decode_rows) * token_bytes
        return batch.decode_rows > 0 and kv_bytes >= self.mixed_split_kv_bytes

    def attend(self, layer: int, q: torch.Tensor, meta: DecodeMeta | ExtendMeta | MixedMeta,
               out: torch.Tensor | None = None) -> torch.Tensor:
        if q.stride(-1) != 1:
            q = q.contiguous()
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device) if out is None else out.view(q.shape)
        if isinstance(meta, MixedMeta):
            self._attend(layer, q, meta.decode, out)
            self._attend(layer, q, meta.extend, out)
        else:
            self._attend(layer, q, meta, out)
        return out.view(q.shape[0], -1)

    def _attend(self, layer: int, q: torch.Tensor, meta: DecodeMeta | ExtendMeta, out: torch.Tensor) -> None:
        """One kernel over its own rows of q and out: a decode meta's rows 0..B-1, an extend meta's q_starts."""
        k_cache, v_cache, page_size = self.pool.k[layer], self.pool.v[layer], self.pool.page_size
        if isinstance(meta, DecodeMeta):
            part_out, part_lse, counter = meta.split_scratch(q, k_cache.shape[1])
            decode_attention(q, k_cache, v_cache, self.page_table, meta.rows, meta.seq_lens, out, part_out, part_lse,
                             counter, page_size, meta.num_splits, self.config)
        else:
            meta.tile(extend_tokens_per_tile(q.shape[1], k_cache.shape[1], self.config))
            extend_attention(q, k_cache, v_cache, self.page_table, meta.rows, meta.kv_lens, meta.extend_lens,
                             meta.q_starts, meta.tile_ends, meta.tiles, out, page_size, self.config)


class StaticStepMeta:
    """The attention metadata of the whole-step CUDA graphs (engine/whole_graph.py) in one static device buffer,
    so that a graph captured at a token bucket replays any step that fits the bucket's caps: at most `decode_cap`
    leading decode rows (the decode kernel's grid: decode_cap rows, splits fixed at capture) and at most
    `chunk_cap` other requests (the extend kernel's tile list: a grid of cdiv(bucket, tokens per tile) +
    chunk_cap programs, the most tiles chunk_cap requests of `bucket` tokens can need). Padding entries make
    their programs exit at once: a decode row of seq_len 0, a request of no tile (extend_len 0). So the metadata
    all of padding leaves attention out of a replay, which the step cost model times (engine/step_cost.py).
    One buffer serves every bucket: a bucket's metadata are views of its first entries."""

    DECODE_ROWS, SEQ_LENS, ROWS, KV_LENS, EXTEND_LENS, Q_STARTS, TILE_ENDS = range(7)

    def __init__(self, backend: TritonBackend, heads: int, max_decodes: int, max_chunks: int, pad_row: int):
        self.backend, self.pad_row = backend, pad_row
        self.kv_heads = backend.pool.k.shape[2]
        self.tokens_per_tile = extend_tokens_per_tile(heads, self.kv_heads, backend.config)
        self.width = max(max_decodes, max_chunks, 1)
        self.values = torch.zeros(7, self.width, dtype=torch.int64, device=backend.pool.k.device)
        self.values.copy_(self.host_values([], [], [], 0))

    def meta(self, tokens: int, decode_cap: int, chunk_cap: int) -> MixedMeta:
        """The metadata a graph of `tokens` tokens captures: views of the buffer, grids fixed by the caps."""
        v = self.values
        splits = num_decode_splits(decode_cap, self.kv_heads, self.backend.num_sms, self.backend.config)
        decode = DecodeMeta(v[self.DECODE_ROWS, :decode_cap], v[self.SEQ_LENS, :decode_cap], splits)
        extend = ExtendMeta(*(v[i, :chunk_cap] for i in (self.ROWS, self.KV_LENS, self.EXTEND_LENS, self.Q_STARTS)),
                            tokens, v[self.TILE_ENDS, :chunk_cap], -(-tokens // self.tokens_per_tile) + chunk_cap)
        return MixedMeta(decode, extend)

    def host_values(self, rows: list[int], kv_lens: list[int], extend_lens: list[int], decodes: int) -> torch.Tensor:
        """The buffer's contents for a step (rows, kv_lens, extend_lens per request; the first `decodes` are its
        decode rows), padded to the buffer's width, as one host tensor to copy in."""
        pad, width = self.pad_row, self.width
        n = len(rows) - decodes
        ext = extend_lens[decodes:]
        q_starts, tile_ends, start, tiles = [], [], decodes, 0
        for length in ext:
            q_starts.append(start)
            start += length
            tiles += -(-length // self.tokens_per_tile)
            tile_ends.append(tiles)
        decode_pad, chunk_pad = width - decodes, width - n
        return torch.tensor([
            rows[:decodes] + [pad] * decode_pad, [k + 1 for k in kv_lens[:decodes]] + [0] * decode_pad,
            rows[decodes:] + [pad] * chunk_pad, kv_lens[decodes:] + [0] * chunk_pad, ext + [0] * chunk_pad,
            q_starts + [start] * chunk_pad, tile_ends + [tiles] * chunk_pad], dtype=torch.int64)

    def write(self, rows: list[int], kv_lens: list[int], extend_lens: list[int], decodes: int) -> None:
        """Enqueue the step's metadata into the buffer (one host->device copy; the host does not wait)."""
        self.values.copy_(self.host_values(rows, kv_lens, extend_lens, decodes), non_blocking=True)
