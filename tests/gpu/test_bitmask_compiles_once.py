"""The grammar-bitmask kernel compiles once for every batch size: xgrammar's kernel compiled a variant per class
of batch size (1, multiples of 16, the rest) in the middle of serving. GPU only: the interpreter compiles nothing."""

from __future__ import annotations

import torch
from helpers import DEVICE, triton_compiles
from kernels.test_bitmask_kernel import random_case

from minisgl.kernels.bitmask import apply_bitmask_triton


def test_one_compile_serves_every_batch_size():
    with triton_compiles() as compiled:
        for rows in (1, 16, 17, 256, 3):
            logits, bitmask = random_case(rows, 151936, torch.bfloat16, seed=rows)
            apply_bitmask_triton(logits.to(DEVICE), bitmask.to(DEVICE))
    assert len(compiled) <= 1  # none when an earlier test of this process compiled it already
