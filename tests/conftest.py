"""Shared fixtures: tiny random checkpoints of every architecture and the transformers oracle."""

from __future__ import annotations

import random

import pytest
import torch

from minisgl.tools.tiny_model import make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """One tiny fp32 checkpoint per architecture, written by the project's own tiny-model tool."""
    root = tmp_path_factory.mktemp("tiny")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=0)) for arch in ARCHS}


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_model(path: str) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    if path not in _HF_CACHE:
        _HF_CACHE[path] = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return _HF_CACHE[path]


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding), EOS ignored."""
    model = hf_model(path)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            ids = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, min_new_tokens=max_new_tokens,
                                 do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
    return outs
