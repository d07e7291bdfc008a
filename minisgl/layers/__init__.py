"""Tensor-parallel building blocks shared by every model."""

from minisgl.layers.activation import silu_and_mul
from minisgl.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from minisgl.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding

__all__ = ["ColumnParallelLinear", "ParallelLMHead", "QKVParallelLinear", "RMSNorm", "RotaryEmbedding",
           "RowParallelLinear", "VocabParallelEmbedding", "silu_and_mul"]
