"""Checkpoint loading: sharded files, dtypes, dummy weights, and errors that name the problem."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from helpers import hf_greedy, hf_logprobs, make_llm, random_prompts
from safetensors.torch import load_file, save_file

from minisgl import SamplingParams
from minisgl.models.loader import ModelLoadError
from minisgl.tools.tiny_model import make_tiny_model

VOCAB = 400
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


def edit_checkpoint(src: str, dst, edit) -> str:
    """Copy a single-file checkpoint and rewrite its tensors with edit(dict) -> dict."""
    shutil.copytree(src, dst)
    tensors = edit(load_file(dst / "model.safetensors"))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return str(dst)


def test_sharded_checkpoint_equals_single_file(tmp_path, tiny_models):
    sharded = make_tiny_model(tmp_path / "sharded", arch="qwen3_moe", seed=0, max_shard_size="100KB")
    assert (sharded / "model.safetensors.index.json").exists() and len(list(sharded.glob("*.safetensors"))) > 2
    prompts = random_prompts([7, 33], VOCAB)
    out = make_llm(str(sharded)).generate(prompts, GREEDY)
    assert [o.token_ids for o in out] == hf_greedy(tiny_models["qwen3_moe"], prompts, 16)


def test_missing_tensor_is_named(tmp_path, tiny_models):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = edit_checkpoint(tiny_models["llama"], tmp_path / "m", lambda t: {k: v for k, v in t.items() if k != name})
    with pytest.raises(ModelLoadError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight"):
        make_llm(path)


def test_misshaped_tensor_is_named(tmp_path, tiny_models):
    name = "model.layers.0.mlp.down_proj.weight"
    path = edit_checkpoint(tiny_models["qwen2"], tmp_path / "m", lambda t: {**t, name: t[name][:, :-1].contiguous()})
    with pytest.raises(ModelLoadError, match=rf"{name}.*\(shape \(64, 127\)\) does not fit"):
        make_llm(path)


def test_unexpected_tensor_is_named(tmp_path, tiny_models):
    path = edit_checkpoint(tiny_models["qwen2"], tmp_path / "m", lambda t: {**t, "model.extra.weight": torch.ones(2)})
    with pytest.raises(ModelLoadError, match=r"model\.extra\.weight"):
        make_llm(path)


def test_unsupported_architecture_is_named(tmp_path, tiny_models):
    shutil.copytree(tiny_models["qwen3"], tmp_path / "m")
    config = json.loads((tmp_path / "m" / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (tmp_path / "m" / "config.json").write_text(json.dumps(config))
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel.*Qwen3ForCausalLM"):
        make_llm(str(tmp_path / "m"))


def test_hub_id_offline_gives_a_clear_error(tmp_path):
    code = "from minisgl import LLM; LLM('no-such-org/no-such-model', device='cpu')"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "'no-such-org/no-such-model' is not a local directory and could not be fetched" in proc.stderr


def test_dummy_weights_need_only_a_config(tmp_path, tiny_models):
    (tmp_path / "cfg").mkdir()
    shutil.copy(os.path.join(tiny_models["qwen3_moe"], "config.json"), tmp_path / "cfg")
    llm = make_llm(str(tmp_path / "cfg"), dummy_weights=True)
    assert llm.tokenizer is None
    out = llm.generate(random_prompts([12], VOCAB)[0], GREEDY)[0]
    assert out.text is None and len(out.token_ids) == 16 and all(0 <= t < 512 for t in out.token_ids)
    with pytest.raises(ValueError, match="no tokenizer"):
        llm.generate("text needs a tokenizer")


def test_bfloat16_logits_close_to_transformers(tiny_models):
    """In bf16 exact equality is not expected: compare logprobs with a tolerance, and greedy tokens
    over a short horizon."""
    path = tiny_models["llama"]
    prompts = random_prompts([5, 40], VOCAB, seed=5)
    llm = make_llm(path, dtype="bfloat16")
    assert llm.engine.pool.k.dtype == torch.bfloat16
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, logprobs=5))
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_greedy(path, [prompt], 4)[0]
        ref = hf_logprobs(path, prompt, out.token_ids, torch.bfloat16)
        for step, lp in enumerate(out.logprobs):
            assert lp.logprob == pytest.approx(ref[step, lp.token_id].item(), abs=0.1)


def test_bad_engine_arguments_name_the_field(tiny_models):
    for kwargs, field in [({"cache_type": "lru"}, "cache_type"), ({"page_size": 0}, "page_size"),
                          ({"dtype": "int8"}, "dtype"), ({"attention_backend": "nope"}, "attention_backend")]:
        with pytest.raises(ValueError, match=field):
            make_llm(tiny_models["qwen3"], **kwargs)
