"""Vocabulary-parallel token embedding and LM head: each rank holds a contiguous slice of the vocab."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from minisgl.distributed import TPGroup
from minisgl.layers.linear import check_shape, linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, tp: TPGroup):
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        self.local_vocab = -(-vocab_size // tp.size)  # the last rank's slice may be padded
        self.start = tp.rank * self.local_vocab
        self.weight = nn.Parameter(torch.empty(self.local_vocab, hidden), requires_grad=False)
        self.weight.weight_loader = self.load_weight

    def load_weight(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        rows = max(0, min(self.local_vocab, loaded.shape[0] - self.start))
        if loaded.shape[0] != self.vocab_size:
            raise ValueError(f"shape mismatch: checkpoint has {loaded.shape[0]} vocabulary rows, "
                             f"config.json says vocab_size={self.vocab_size}")
        param.data[rows:].zero_()
        check_shape(param, loaded.narrow(0, self.start, rows), param.data.narrow(0, 0, rows))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.local_vocab)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.tp.all_reduce(out.masked_fill(outside.unsqueeze(-1), 0))


class ParallelLMHead(VocabParallelEmbedding):
    """Logits over the full vocabulary; shares its weight with the embedding when tied."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.tp.all_gather(linear(hidden, self.weight))
        return logits[..., : self.vocab_size]
