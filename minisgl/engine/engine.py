"""The engine: weights, KV pool, page table, attention backend and sampler on one device.

It knows nothing of queues or requests' life cycles: the scheduler hands it a Batch, it runs one
forward pass and samples a token for every request whose input reached its end.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.distributed as dist

from minisgl.attention import ForwardInput, make_backend
from minisgl.core import Batch
from minisgl.distributed import TPGroup
from minisgl.engine.config import EngineArgs
from minisgl.engine.sampler import SampleOutput, Sampler
from minisgl.kvcache.pool import KVPool
from minisgl.models import load_model, resolve_model_path

logger = logging.getLogger(__name__)

CPU_KV_BUDGET = 256 << 20  # bytes of KV pool on a CPU when num_pages is not given


def resolve_device(name: str, rank: int) -> torch.device:
    """'auto' prefers CUDA; TP rank r of a CUDA run uses GPU r."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank)
    return torch.device(name)


@dataclass
class StepOutput:
    """Sampled tokens, in batch order, for the requests whose input reached its end."""

    sampled: list[int]  # indices into batch.reqs
    samples: SampleOutput


class Engine:
    def __init__(self, args: EngineArgs, tp: TPGroup, device: torch.device):
        self.args, self.tp, self.device = args, tp, device
        self.model_path = resolve_model_path(args.model)
        self.model = load_model(self.model_path, tp, device, args.dtype, dummy=args.dummy_weights)
        config = self.config = self.model.config
        self.max_seq_len = min(args.max_seq_len or config.max_position_embeddings, config.max_position_embeddings)
        attn = self.model.model.layers[0].self_attn
        self.page_size = args.page_size
        self.num_pages = args.num_pages or self._pages_from_memory(attn.kv_heads, config.head_dim)
        self.pool = KVPool(config.num_layers, self.num_pages, args.page_size, attn.kv_heads, config.head_dim,
                           config.dtype, device)
        pages_per_seq = -(-self.max_seq_len // args.page_size)
        self.page_table = torch.zeros(args.max_running_requests, pages_per_seq, dtype=torch.int32, device=device)
        self.backend = make_backend(args.attention_backend, self.pool, self.page_table)
        self.sampler = Sampler(args.max_running_requests, config.vocab_size, device)

    def _pages_from_memory(self, kv_heads: int, head_dim: int) -> int:
        """Fill what `memory_ratio` of the device leaves after the weights; the same on every rank."""
        per_token = KVPool.bytes_per_token(self.config.num_layers, kv_heads, head_dim, self.config.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.args.memory_ratio)
        else:
            budget = CPU_KV_BUDGET
        pages = int(budget // (per_token * self.args.page_size))
        if self.tp.size > 1:
            box = torch.tensor([pages])
            dist.all_reduce(box, op=dist.ReduceOp.MIN, group=self.tp.cpu_group)
            pages = int(box.item())
        if pages < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                               f"raise memory_ratio or set num_pages")
        return pages

    def make_input(self, batch: Batch) -> ForwardInput:
        reqs, lens = batch.reqs, batch.extend_lens
        ids: list[int] = []
        for req, n in zip(reqs, lens):
            ids += req.tokens(req.kv_len, req.kv_len + n)
        kv = [r.kv_len for r in reqs]
        input_ids = torch.tensor(ids, dtype=torch.int64).to(self.device)
        kv_lens, extend_lens, rows = torch.tensor([kv, lens, [r.row for r in reqs]]).to(self.device)
        owner = torch.repeat_interleave(torch.arange(len(reqs), device=self.device), extend_lens)
        ends = torch.cumsum(extend_lens, 0)
        positions = kv_lens[owner] + torch.arange(len(ids), device=self.device) - (ends - extend_lens)[owner]
        pages = self.page_table[rows[owner], positions // self.page_size].long()
        return ForwardInput(
            input_ids=input_ids, positions=positions, out_slots=pages * self.page_size + positions % self.page_size,
            rows=rows, kv_lens=kv_lens, extend_lens=extend_lens, seq_lens=kv_lens + extend_lens,
            last_index=ends - 1, max_extend=max(lens), max_seq_len=max(k + n for k, n in zip(kv, lens)))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> torch.Tensor:
        """Logits [B, vocab] at each request's last new token."""
        inputs = self.make_input(batch)
        meta = self.backend.prepare(inputs)
        hidden = self.model(inputs.input_ids, inputs.positions,
                            lambda layer, q, k, v: self.backend.forward(layer, q, k, v, meta))
        return self.model.compute_logits(hidden[inputs.last_index])

    @torch.inference_mode()
    def step(self, batch: Batch) -> StepOutput | None:
        """Forward the batch and sample for requests that reach the end of their known tokens."""
        logits = self.forward(batch)
        sampled = [i for i, (r, n) in enumerate(zip(batch.reqs, batch.extend_lens)) if r.kv_len + n == r.seq_len]
        if not sampled:
            return None
        reqs = [batch.reqs[i] for i in sampled]
        top_n = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        rows = torch.tensor([r.row for r in reqs], dtype=torch.int64).to(self.device)
        index = torch.tensor(sampled, dtype=torch.int64).to(self.device)
        return StepOutput(sampled, self.sampler.sample(logits[index], rows, top_n))
