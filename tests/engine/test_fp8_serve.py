"""`python -m minisgl` serves FP8 weights: an FP8 checkpoint as it is, and a float one under `--quantization fp8`.
A real server process and the real `openai` client; its greedy tokens are the offline engine's on the same
weights."""

from __future__ import annotations

import pytest
from helpers import DEVICE
from server_fixtures import serving

from minisgl import LLM, SamplingParams
from minisgl.tools.tiny_model import make_tiny_model

PROMPT = [11, 42, 7, 99, 250, 31]
TOKENS = 8


def serve_greedy(model: str, *flags: str) -> list[int]:
    """The output token ids of one greedy completion from a fresh server on `model` (which must exit 0)."""
    with serving(model, *flags, name="fp8") as server:
        out = server.openai_client().completions.create(model="fp8", prompt=PROMPT, max_tokens=TOKENS, temperature=0,
                                                        extra_body={"ignore_eos": True, "return_token_ids": True})
    assert out.choices[0].finish_reason == "length" and out.usage.completion_tokens == TOKENS
    return out.choices[0].model_extra["token_ids"]


def offline_greedy(model: str, **kwargs) -> list[int]:
    with LLM(model, device=DEVICE, dtype="float32", num_pages=1024, cuda_graph_max_bs=8, **kwargs) as llm:
        out = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True))
    return out[0].token_ids


@pytest.mark.parametrize("source", ["fp8_checkpoint", "quantization_flag"])
def test_server_serves_fp8_weights(tmp_path, source):
    if source == "fp8_checkpoint":
        model, flags, kwargs = str(make_tiny_model(tmp_path / "m", arch="qwen3_moe", fp8_block=32)), (), {}
    else:
        model = str(make_tiny_model(tmp_path / "m", arch="qwen3_moe"))
        flags, kwargs = ("--quantization", "fp8"), {"quantization": "fp8"}
    served = serve_greedy(model, *flags)
    assert served == offline_greedy(model, **kwargs)
    if kwargs:  # on this prompt FP8 and float greedy differ: the server did quantize
        assert served != offline_greedy(model)
