"""The grammar-bitmask kernel against `apply_bitmask`'s torch code (its reference and CPU path). On the CPU the
kernel runs in Triton's interpreter (tests/helpers.py sets TRITON_INTERPRET=1); that it compiles once for every
batch size is tests/gpu/test_bitmask_compiles_once.py's."""

from __future__ import annotations

import os

import pytest
import torch

from minisgl.constrained import apply_bitmask
from minisgl.kernels.bitmask import apply_bitmask_triton

DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")
LOW_PRECISION = torch.float16 if DEVICE == "cpu" else torch.bfloat16  # the interpreter has no bfloat16


def random_case(rows: int, vocab: int, dtype: torch.dtype, seed: int, pad: int = 0, extra_words: int = 0):
    """Logits [rows, vocab] as a view with `pad` more columns per row (a row stride past vocab), and a bitmask
    with `extra_words` more words than vocab needs; row 1 allows everything, row 2 a single token."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, vocab + pad, generator=gen).to(dtype)[:, :vocab]
    words = (vocab + 31) // 32 + extra_words
    bitmask = torch.randint(-2**31, 2**31 - 1, (rows, words), generator=gen, dtype=torch.int32)
    if rows > 2:
        bitmask[1] = -1
        bitmask[2] = 0
        bit = (vocab - 1) % 32
        bitmask[2, (vocab - 1) // 32] = 1 << bit if bit < 31 else -2**31  # bit 31 is the sign bit
    return logits, bitmask


@pytest.mark.parametrize("rows, vocab, pad, extra_words", [(3, 77, 0, 0), (5, 4096 + 32, 7, 2), (4, 9000, 0, 0)])
@pytest.mark.parametrize("dtype", [torch.float32, LOW_PRECISION])
def test_the_kernel_masks_exactly_what_the_torch_code_masks(rows, vocab, pad, extra_words, dtype):
    logits, bitmask = random_case(rows, vocab, dtype, seed=vocab, pad=pad, extra_words=extra_words)
    expected = logits.clone()
    apply_bitmask(expected, bitmask)  # on the CPU: the torch code
    got = logits.to(DEVICE)
    apply_bitmask_triton(got, bitmask.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    assert torch.equal(expected[1], logits[1]) and torch.isfinite(expected[2]).sum() == 1
    assert torch.isfinite(expected[2, -1])


def test_an_empty_batch_is_left_alone():
    logits = torch.zeros(0, 40, device=DEVICE)
    apply_bitmask_triton(logits, torch.zeros(0, 2, dtype=torch.int32, device=DEVICE))
    assert logits.shape == (0, 40)
