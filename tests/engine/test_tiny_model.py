"""The tiny checkpoint must load with plain transformers and carry each architecture's distinctive feature."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoModelForCausalLM, AutoTokenizer

from minisgl.tools.tiny_model import make_tiny_model

ARCHS = ["llama", "qwen2", "qwen3", "qwen3_moe"]


def tensor_names(path: Path) -> set[str]:
    names: set[str] = set()
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names |= set(f.keys())
    return names


def q_proj(path: Path) -> torch.Tensor:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.layers.0.self_attn.q_proj.weight")


def safetensors_bytes(path: Path) -> dict[str, bytes]:
    return {f.name: f.read_bytes() for f in sorted(path.glob("*.safetensors"))}


@pytest.fixture(scope="module", params=ARCHS)
def model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    return request.param, make_tiny_model(tmp_path_factory.mktemp(request.param), request.param)


def test_tokenizer(model_dir: tuple[str, Path]) -> None:
    tok = AutoTokenizer.from_pretrained(model_dir[1])
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi!"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi!<|im_end|>\n"
                    "<|im_start|>assistant\n")
    sample = "Grüße, 世界! naïve café 🙂\n\tdef f(x): return x**2"
    assert tok.decode(tok.encode(sample)) == sample
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert len(tok.encode("<|im_start|>")) == 1


def test_generate(model_dir: tuple[str, Path]) -> None:
    arch, path = model_dir
    tok = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=20, do_sample=False, min_new_tokens=20)
    assert out.shape == (1, ids.shape[1] + 20)
    assert model.config.vocab_size % 64 == 0 and model.config.vocab_size >= len(tok)
    gen = json.loads((path / "generation_config.json").read_text())
    assert gen["eos_token_id"] == [tok.convert_tokens_to_ids("<|im_end|>"), tok.pad_token_id]


def test_arch_features(model_dir: tuple[str, Path]) -> None:
    arch, path = model_dir
    config = json.loads((path / "config.json").read_text())
    names = tensor_names(path)
    assert "model.layers.0.self_attn.q_proj.weight" in names
    assert ("model.layers.0.self_attn.q_proj.bias" in names) == (arch == "qwen2")
    assert ("lm_head.weight" in names) == (arch != "qwen3")
    assert config["tie_word_embeddings"] == (arch == "qwen3")
    if arch == "llama":
        rope = config.get("rope_scaling") or config["rope_parameters"]
        assert rope["rope_type"] == "llama3" and rope["factor"] == 8.0
        assert rope["original_max_position_embeddings"] == 256
    if arch == "qwen3_moe":
        assert config["mlp_only_layers"] == [0] and config["num_experts"] == 8
        assert "model.layers.0.mlp.gate_proj.weight" in names
        assert "model.layers.1.mlp.gate.weight" in names
        assert {f"model.layers.2.mlp.experts.{e}.down_proj.weight" for e in range(8)} <= names


def test_sharded_and_deterministic(tmp_path: Path) -> None:
    sharded = make_tiny_model(tmp_path / "a", "qwen3", seed=0, max_shard_size="200KB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert set(safetensors_bytes(sharded)) == set(index["weight_map"].values())

    first = make_tiny_model(tmp_path / "b", "qwen3", seed=0)
    again = make_tiny_model(tmp_path / "c", "qwen3", seed=0)
    other = make_tiny_model(tmp_path / "d", "qwen3", seed=1)
    assert safetensors_bytes(first) == safetensors_bytes(again)
    assert (first / "tokenizer.json").read_bytes() == (again / "tokenizer.json").read_bytes()
    assert not torch.equal(q_proj(first), q_proj(other))


def test_overrides_and_unknown_arch(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path, "llama", num_hidden_layers=3)
    assert json.loads((path / "config.json").read_text())["num_hidden_layers"] == 3
    with pytest.raises(ValueError, match="qwen3_moe"):
        make_tiny_model(tmp_path, "gpt2")
