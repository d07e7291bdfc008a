"""The fast path (Triton over an fp8 pool, CUDA graphs, overlap) in bf16 (GPU only: see conftest.py).

In fp32 it equals transformers over fp8-rounded K/V (tests/engine/test_fp8_kv.py, run with MINISGL_TEST_DEVICE=cuda).
In bf16 both engines round differently from that truth: bf16 noise tips some values across an e4m3 rounding
boundary (a whole fp8 step, ~6%), and these tiny random models amplify it (on the CPU the torch reference in
bf16 strays 0.2 to 3 from the truth). Two bf16 implementations are two draws of that noise, so the fast path
must stray no further than twice as far as the torch reference, plus FP8_TOLERANCE: loose, but a broken kernel
strays by 10 or more.
"""

from __future__ import annotations

import pytest
import torch
from engine.test_fp8_kv import FP8_TOLERANCE, oracle_distance
from helpers import ARCHS, make_llm
from test_fast_path import PARAMS, PROMPTS


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_fast_path_in_bf16_strays_from_the_truth_as_the_torch_reference_does(tiny_models, arch):
    path = tiny_models[arch]
    fast = make_llm(path, dtype="bfloat16", kv_cache_dtype="fp8")
    assert fast.engine.graphs is not None and fast.scheduler.overlap
    assert fast.engine.pool.k.dtype == torch.float8_e4m3fn
    reference = make_llm(path, dtype="bfloat16", kv_cache_dtype="fp8", attention_backend="torch", cuda_graph_max_bs=0,
                         overlap_schedule=False)
    got, want = fast.generate(PROMPTS, PARAMS), reference.generate(PROMPTS, PARAMS)
    assert all(len(o.token_ids) == PARAMS.max_tokens for o in got)
    fast_error, reference_error = oracle_distance(path, PROMPTS, got), oracle_distance(path, PROMPTS, want)
    assert fast_error <= 2 * reference_error + FP8_TOLERANCE, (fast_error, reference_error)
