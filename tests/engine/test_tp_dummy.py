"""Dummy weights are one model at any tensor-parallel size: each rank's shard is the slice of the tensor
a TP=1 engine draws, so benchmarks on dummy weights can check TP=2 against TP=1. And a TP engine whose
rank dies fails at once instead of waiting for it for ever."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ARCHS, DEVICE, hf_greedy, make_llm, random_prompts
from safetensors import safe_open
from safetensors.torch import save_file

from minisgl import SamplingParams
from minisgl.models.config import ModelConfig
from minisgl.models.loader import checkpoint_layout, dummy_tensor

TOKENS = 12
GREEDY = SamplingParams(temperature=0, max_tokens=TOKENS, ignore_eos=True, logprobs=3)
# dense: one KV head, replicated on both ranks, and a vocabulary whose last shard is padded.
CONFIGS = {"dense": ("qwen3", {"num_key_value_heads": 1, "vocab_size": 509}), "moe": ("qwen3_moe", {})}


def config_dir(tmp_path: Path, tiny_model: str, **overrides) -> Path:
    """A model directory holding only config.json, as benchmarks use for dummy weights."""
    path = tmp_path / "config-only"
    path.mkdir()
    raw = json.loads((Path(tiny_model) / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, **overrides}))
    return path


@pytest.mark.parametrize("arch", ARCHS)
def test_layout_is_a_real_checkpoints(tiny_models, arch):
    with safe_open(str(Path(tiny_models[arch]) / "model.safetensors"), "pt") as f:
        real = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert checkpoint_layout(ModelConfig.from_dir(tiny_models[arch])) == real


@pytest.mark.parametrize("kind", CONFIGS)
def test_tp2_dummy_equals_tp1_and_transformers(tmp_path, tiny_models, kind):
    arch, overrides = CONFIGS[kind]
    path = config_dir(tmp_path, tiny_models[arch], **overrides)
    vocab = ModelConfig.from_dir(path).vocab_size
    prompts = random_prompts([5, 23, 40], vocab, seed=7)
    with make_llm(str(path), dummy_weights=True, tp_size=2, max_prefill_tokens=32) as llm:
        tp2 = llm.generate(prompts, GREEDY)
    tp1 = make_llm(str(path), dummy_weights=True).generate(prompts, GREEDY)
    assert [o.token_ids for o in tp2] == [o.token_ids for o in tp1]
    for a, b in zip(tp1, tp2):
        for x, y in zip(a.logprobs, b.logprobs):
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert [lp for _, lp in y.top] == pytest.approx([lp for _, lp in x.top], abs=1e-4)
    # The dummy model is a real one: written out as a checkpoint, transformers generates the same tokens.
    gen = torch.Generator(DEVICE)  # the engine draws on its device: so must we, to get the same numbers
    tensors = {name: dummy_tensor(name, shape, gen, torch.float32).cpu()
               for name, shape in checkpoint_layout(ModelConfig.from_dir(path)).items()}
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    assert hf_greedy(str(path), prompts, TOKENS) == [o.token_ids for o in tp1]


def test_dummy_tensor_depends_on_name_and_seed_alone():
    gen = torch.Generator(DEVICE)
    first = dummy_tensor("model.layers.3.mlp.down_proj.weight", (8, 4), gen, torch.float32)
    dummy_tensor("model.layers.0.mlp.up_proj.weight", (4, 8), gen, torch.float32)  # draws in between change nothing
    again = dummy_tensor("model.layers.3.mlp.down_proj.weight", (8, 4), gen, torch.float32)
    other_seed = dummy_tensor("model.layers.3.mlp.down_proj.weight", (8, 4), gen, torch.float32, seed=1)
    assert torch.equal(first, again) and not torch.equal(first, other_seed)
    assert first.std().item() == pytest.approx(0.02, rel=0.5)


def test_tp2_dead_follower_fails_the_call_then_the_engine_stays_stopped(tmp_path, tiny_models):
    path = config_dir(tmp_path, tiny_models["qwen3"])
    prompt = random_prompts([9], 400)[0]
    llm = make_llm(str(path), dummy_weights=True, tp_size=2)
    assert len(llm.generate(prompt, GREEDY)[0].token_ids) == TOKENS
    follower = llm._followers.procs[0]
    os.kill(follower.pid, signal.SIGKILL)  # as the OOM killer would
    with pytest.raises(RuntimeError, match=rf"tp-rank-1 \(pid {follower.pid}\) exited with code -9"):
        llm.generate(prompt, GREEDY)
    with pytest.raises(RuntimeError, match="this engine has stopped: tp-rank-1"):
        llm.generate(prompt, GREEDY)
    llm.shutdown()


def test_tp2_follower_dying_before_it_joins_fails_rank_0(tmp_path, tiny_models):
    """A script without the `if __name__ == "__main__"` guard: each spawned rank re-runs it and dies while
    starting up, so rank 0 would wait at the rendezvous for ever."""
    path = config_dir(tmp_path, tiny_models["qwen3"])
    script = tmp_path / "unguarded.py"
    script.write_text(f"from minisgl import LLM\nLLM({str(path)!r}, device='cpu', dtype='float32', tp_size=2, "
                      "num_pages=64, dummy_weights=True)\n")
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert proc.returncode == 1
    assert "RuntimeError: tp-rank-1" in proc.stderr and "exited with code 1" in proc.stderr
