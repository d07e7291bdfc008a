"""CUDA graphs for decode steps: one graph per batch-size bucket, replayed with the batch padded up.

A decode step is a few hundred small kernels; replaying them as one graph removes the CPU's launch
cost, which dominates at small batches. A graph bakes in the addresses it read and wrote, so every
input lives in static buffers (`rows`, `kv_lens`) that a step copies into before replaying; the
captured function derives everything else (token ids, positions, KV slots, attention metadata) on
the device. Padding entries use the engine's padding row, whose pages are the pool's scratch page.
"""

from __future__ import annotations

import gc
import logging
import time
from contextlib import contextmanager
from typing import Callable, Iterator

import torch

logger = logging.getLogger(__name__)

DecodeFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (rows [B], kv_lens [B]) -> logits [B, V]


def bucket_sizes(max_bs: int) -> list[int]:
    """1, 2, 4, 8, then every 16 up to max_bs (and max_bs itself): padding wastes at most 15 rows."""
    sizes = {bs for bs in (1, 2, 4, 8) if bs <= max_bs} | set(range(16, max_bs + 1, 16)) | {max_bs}
    return sorted(sizes)


@contextmanager
def gc_paused() -> Iterator[None]:
    """The garbage collector may run during a capture and free an earlier engine's graphs or pinned buffers,
    which CUDA forbids while a stream captures (the capture fails): collect first, then not until done."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


class DecodeGraphs:
    def __init__(self, decode: DecodeFn, max_bs: int, pad_row: int, device: torch.device):
        self.max_bs, self.pad_row = max_bs, pad_row
        self.buckets = bucket_sizes(max_bs)
        self.inputs = torch.zeros(2, max_bs, dtype=torch.int64, device=device)  # rows, kv_lens
        self.inputs[0] = pad_row
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        start, free_before = time.perf_counter(), torch.cuda.mem_get_info(device)[0]
        pool = None
        with gc_paused(), torch.inference_mode():
            for bs in reversed(self.buckets):  # largest first: smaller graphs reuse its memory
                rows, kv_lens = self.inputs[0, :bs], self.inputs[1, :bs]
                decode(rows, kv_lens)  # warm-up outside the capture: kernels compile, workspaces appear
                torch.cuda.synchronize(device)
                graph = torch.cuda.CUDAGraph()
                # thread_local: another thread's CUDA calls (NCCL's watchdog polling earlier collectives'
                # events, with tensor parallelism) must not invalidate this thread's capture.
                with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                    self.outputs[bs] = decode(rows, kv_lens)
                pool = graph.pool()
                self.graphs[bs] = graph
        torch.cuda.synchronize(device)
        self.capture_seconds = time.perf_counter() - start
        self.memory_bytes = free_before - torch.cuda.mem_get_info(device)[0]
        logger.info("captured %d decode CUDA graphs (batch 1..%d) in %.1f s, %.0f MiB", len(self.buckets), max_bs,
                    self.capture_seconds, self.memory_bytes / 2**20)

    def release(self) -> None:
        """Destroy the graphs now, whoever still refers to this object: under tensor parallelism NCCL's
        communicator cannot be destroyed while a graph that captured one of its collectives lives."""
        for graph in self.graphs.values():
            graph.reset()
        self.graphs.clear()
        self.outputs.clear()

    def replay(self, rows: list[int], kv_lens: list[int]) -> torch.Tensor:
        """Logits [len(rows), V] of one decode step; the view is overwritten by the next replay."""
        bs = len(rows)
        padded = next(b for b in self.buckets if b >= bs)
        pad = padded - bs
        host = torch.tensor([rows + [self.pad_row] * pad, kv_lens + [0] * pad], dtype=torch.int64)
        self.inputs[:, :padded].copy_(host, non_blocking=True)
        self.graphs[padded].replay()
        return self.outputs[padded][:bs]
