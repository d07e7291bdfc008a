"""What tests share besides fixtures: the test device, prompts, an engine on that device and the
transformers oracle. (Fixtures live in conftest.py; real servers in server_fixtures.py.)"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from contextlib import contextmanager

# The same suite runs on a GPU with MINISGL_TEST_DEVICE=cuda (CI runs it on the CPU). On the CPU, Triton
# kernels run in Triton's interpreter; it must be chosen before any kernel module is imported.
DEVICE = os.environ.get("MINISGL_TEST_DEVICE", "cpu")
if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch

from minisgl import LLM

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


@contextmanager
def triton_compiles() -> Iterator[list[str]]:
    """The names of the Triton kernels compiled inside the block, in order (GPU only: the interpreter compiles
    nothing). The process's compile hook is put back after."""
    from triton import knobs

    compiled: list[str] = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: compiled.append(fn.name)
    try:
        yield compiled
    finally:
        knobs.runtime.jit_post_compile_hook = before


def splits(text: str) -> list[list[str]]:
    """A model's output as a stream may deliver it: whole, in single characters, and cut in two at every
    position (for the output parsers)."""
    return [[text], list(text)] + [[text[:i], text[i:]] for i in range(1, len(text))]


def random_prompts(lengths: list[int], vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def make_llm(path: str, **kwargs) -> LLM:
    """An engine on the test device, fp32 unless told, with a small KV pool: on a GPU the default
    pool takes most of the memory, and tests keep several engines alive at once. CUDA graphs up to
    batch 32 keep the capture short."""
    kwargs = {"device": DEVICE, "dtype": "float32", "num_pages": 4096, "cuda_graph_max_bs": 32, **kwargs}
    return LLM(path, **kwargs)


_HF_CACHE: dict[str, torch.nn.Module] = {}


def hf_model(path: str, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM

    key = f"{path}:{dtype}"
    if key not in _HF_CACHE:
        _HF_CACHE[key] = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(DEVICE).eval()
    return _HF_CACHE[key]


def hf_logprobs(path: str, prompt: list[int], output: list[int], dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """log_softmax of transformers' logits at the positions that predicted each output token."""
    with torch.no_grad():
        logits = hf_model(path, dtype)(torch.tensor([prompt + output], device=DEVICE)).logits[0].float()
    return torch.log_softmax(logits[len(prompt) - 1: len(prompt) + len(output) - 1], -1).cpu()


def hf_greedy(path: str, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    """transformers' own greedy generate, one prompt at a time (no padding), EOS ignored. The attention mask is
    given: inferred, it would hide prompt tokens equal to the pad id (a BOS that doubles as padding)."""
    model = hf_model(path)
    outs = []
    with torch.no_grad():
        for prompt in prompts:
            prompt_ids = torch.tensor([prompt], device=DEVICE)
            ids = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=max_new_tokens,
                                 min_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
            outs.append(ids[0, len(prompt):].tolist())
    return outs
