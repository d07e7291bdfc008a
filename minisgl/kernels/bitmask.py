"""Grammar bitmasks applied to a batch of logits in place: -inf for every token a row's mask leaves out.

xgrammar ships a Triton kernel for this, but it takes the batch size as a specialized integer argument, so
Triton compiles a new variant the first time a batch of one, of a multiple of 16, and of any other size
arrives: under load that is in the middle of serving (each compile costs far more than a whole step). Here
the batch size is the launch grid's, and the per-model integers are not specialized either: one compile, at
the first constrained request. The torch reference is `minisgl.constrained.grammar.apply_bitmask`'s CPU path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens per program: 128 mask words


@triton.jit(do_not_specialize=["vocab", "logits_stride", "mask_stride"])
def _apply_bitmask_kernel(logits_ptr, mask_ptr, vocab, logits_stride, mask_stride, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    tokens = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = tokens < vocab
    words = tl.load(mask_ptr + row * mask_stride + tokens // 32, mask=inside, other=-1)
    banned = ((words >> (tokens % 32)) & 1) == 0
    tl.store(logits_ptr + row * logits_stride + tokens, float("-inf"), mask=inside & banned)


def apply_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """logits [B, V] (any float dtype, unit stride along V), in place; bitmask [B, >= ceil(V/32)] int32 on the
    same device, unit stride: bit j of word i allows token 32 * i + j."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and bitmask.stride(1) == 1 and bitmask.shape[1] * 32 >= vocab
    if rows:
        _apply_bitmask_kernel[(rows, triton.cdiv(vocab, BLOCK))](logits, bitmask, vocab, logits.stride(0),
                                                                 bitmask.stride(0), BLOCK=BLOCK, num_warps=4)
