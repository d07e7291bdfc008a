"""FP8 weights end to end: a tiny checkpoint in the Hugging Face FP8 layout against transformers and against
minisgl's own run of the same weights dequantized; `--quantization fp8` of a float checkpoint; dummy FP8
weights laid out from config.json; and the errors of checkpoints that do not fit.

Tolerance: transformers on a CPU loads an FP8 checkpoint dequantized (its FP8 kernels need a GPU) and
multiplies in float32, while minisgl also rounds activations to e4m3 per token and group of 32 (the
checkpoints' dynamic scheme; one rounding is up to 1/16 relative). These random tiny models have very
peaked distributions (prompt log-probabilities of -5 to -20), so that moves them by a mean of 0.26-0.43
and at most 18% of their magnitude (measured); MEAN_TOL and REL_TOL allow 0.5 and 25%. A wrong scale or
slice moves them by far more, and without the activation rounding minisgl equals transformers to 1e-3
(asserted below).
"""

from __future__ import annotations

import json
import math
import random
import shutil

import pytest
import torch
from helpers import DEVICE
from safetensors.torch import load_file, save_file

import minisgl.layers.fp8 as fp8
from minisgl import LLM, SamplingParams
from minisgl.distributed import TPGroup
from minisgl.layers.fp8 import FP8_DTYPE, dequantize_weight
from minisgl.models.loader import ModelLoadError, load_model
from minisgl.quantization import Fp8Config
from minisgl.tools.tiny_model import make_tiny_model

BLOCK = 32
MEAN_TOL, REL_TOL = 0.5, 0.25
PROMPT_LOGPROBS = SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0)


def llm(path: str, **kwargs) -> LLM:
    return LLM(path, **{"device": DEVICE, "dtype": "float32", "num_pages": 1024, "cuda_graph_max_bs": 8, **kwargs})


def prompts(lengths=(9, 40), vocab=400, seed=0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def minisgl_logprobs(engine: LLM, prompt_list: list[list[int]]) -> list[torch.Tensor]:
    """log p(prompt[i] | prompt[:i]) for i >= 1, per prompt."""
    outs = engine.generate(prompt_list, PROMPT_LOGPROBS)
    return [torch.tensor([lp.logprob for lp in o.prompt_logprobs]) for o in outs]


def hf_logprobs(path: str, prompt_list: list[list[int]]) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM, FineGrainedFP8Config

    # Dequantized on every machine (on a GPU transformers would otherwise run its own FP8 kernels).
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=FineGrainedFP8Config(dequantize=True)).eval()
    result = []
    with torch.no_grad():
        for prompt in prompt_list:
            logits = model(torch.tensor([prompt])).logits[0, :-1].float()
            result.append(torch.log_softmax(logits, -1).gather(1, torch.tensor(prompt[1:])[:, None])[:, 0])
    return result


def max_gap(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def assert_close_logprobs(ours: list[torch.Tensor], ref: list[torch.Tensor]) -> None:
    """Within FP8 noise: the mean gap under MEAN_TOL, each gap under REL_TOL of the reference's magnitude."""
    gap, ref_all = torch.cat(ours) - torch.cat(ref), torch.cat(ref)
    assert gap.abs().mean() < MEAN_TOL
    assert (gap.abs() / ref_all.abs().clamp(min=1)).max() < REL_TOL


@pytest.fixture(scope="module")
def fp8_models(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fp8")
    return {arch: str(make_tiny_model(root / arch, arch=arch, seed=0, fp8_block=BLOCK))
            for arch in ("qwen3", "qwen3_moe")}


def dequantized_copy(src: str, dst) -> str:
    """The FP8 checkpoint with every weight dequantized to float32 and no quantization_config."""
    shutil.copytree(src, dst)
    config = Fp8Config(block=(BLOCK, BLOCK))
    tensors = load_file(dst / "model.safetensors")
    for name in [n for n in tensors if n.endswith("_scale_inv")]:
        weight = name.removesuffix("_scale_inv")
        tensors[weight] = dequantize_weight(tensors[weight], tensors.pop(name), config)
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((dst / "config.json").read_text())
    del raw["quantization_config"]
    (dst / "config.json").write_text(json.dumps(raw))
    return str(dst)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_checkpoint_matches_transformers(fp8_models, arch):
    path = fp8_models[arch]
    engine = llm(path)
    params = dict(engine.engine.model.named_parameters())
    assert params["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8_DTYPE
    assert params["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (128 // BLOCK, 64 // BLOCK)
    assert params["model.embed_tokens.weight"].dtype == torch.float32  # embeddings, norms, LM head: unquantized
    ours, theirs = minisgl_logprobs(engine, prompts()), hf_logprobs(path, prompts())
    assert_close_logprobs(ours, theirs)


def test_fp8_without_activation_rounding_equals_transformers(fp8_models, monkeypatch):
    """The weights (layout, scales, merged and sharded slices) are exactly transformers' dequantized ones."""
    path = fp8_models["qwen3_moe"]
    monkeypatch.setattr(fp8, "quantize_activation", lambda x, group: (
        x.float(), torch.ones(x.shape[0], math.ceil(x.shape[1] / group), device=x.device)))
    if DEVICE != "cpu":
        pytest.skip("the GPU kernels round activations in-kernel")
    ours, theirs = minisgl_logprobs(llm(path), prompts()), hf_logprobs(path, prompts())
    assert max_gap(ours, theirs) < 1e-3


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_moe"])
def test_fp8_checkpoint_matches_its_dequantized_copy(fp8_models, tmp_path, arch):
    ours = minisgl_logprobs(llm(fp8_models[arch]), prompts())
    dequantized = minisgl_logprobs(llm(dequantized_copy(fp8_models[arch], tmp_path / "dq")), prompts())
    assert_close_logprobs(ours, dequantized)
    assert max_gap(ours, dequantized) > 0  # the FP8 path did run (activations are rounded)


def test_quantization_flag_quantizes_a_float_checkpoint(tmp_path):
    path = str(make_tiny_model(tmp_path / "f32", arch="qwen3_moe", seed=0))
    engine = llm(path, quantization="fp8")
    params = dict(engine.engine.model.named_parameters())
    assert params["model.layers.1.mlp.w13"].dtype == FP8_DTYPE
    assert params["model.layers.1.mlp.w13_scale_inv"].shape == (8, 64, 1)  # per channel
    assert params["model.layers.0.mlp.down_proj.weight_scale_inv"].shape == (64, 1)
    quantized = minisgl_logprobs(engine, prompts())
    assert_close_logprobs(quantized, minisgl_logprobs(llm(path), prompts()))


def test_dummy_fp8_weights_are_the_dummy_model_quantized(tmp_path):
    """--dummy-weight with a quantization_config: the checkpoint's layout, with the scales that quantize
    the same random weights a float dummy model has."""
    path = make_tiny_model(tmp_path / "m", arch="qwen3", seed=0, fp8_block=BLOCK)
    tp = TPGroup(0, 1)
    quantized = load_model(path, tp, torch.device("cpu"), "float32", dummy=True)
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    plain = load_model(path, tp, torch.device("cpu"), "float32", dummy=True)
    layer, ref = quantized.model.layers[1].mlp.down_proj, plain.model.layers[1].mlp.down_proj.weight
    assert layer.weight.dtype == FP8_DTYPE and layer.weight_scale_inv.shape == (64 // BLOCK, 128 // BLOCK)
    torch.testing.assert_close(dequantize_weight(layer.weight, layer.weight_scale_inv, layer.quant), ref,
                               rtol=0.07, atol=1e-4)  # one e4m3 rounding: at most 1/16 relative


def test_unsupported_quantization_is_named(fp8_models, tmp_path):
    path = tmp_path / "awq"
    shutil.copytree(fp8_models["qwen3"], path)
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "quantization_config": {"quant_method": "awq"}}))
    with pytest.raises(ValueError, match="quantization method 'awq' is not supported"):
        llm(str(path))


def test_fp8_tensor_for_a_float_parameter_is_named(fp8_models, tmp_path):
    """An FP8 checkpoint whose config lost its quantization_config must not load its e4m3 values unscaled."""
    path = tmp_path / "noconfig"
    shutil.copytree(fp8_models["qwen3"], path)
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ModelLoadError, match=r"weight.*float8_e4m3fn.*quantization_config"):
        llm(str(path))


@pytest.mark.parametrize("quantization", ["checkpoint", "per_channel"])
def test_fp8_tp2_equals_tp1(tmp_path, quantization):
    """Block scales sliced with their weights (16-row blocks: TP 2 splits the 32 KV rows into one block each),
    and per-channel scales taken from the whole tensor before it is sliced. (Per-channel activation groups
    are 128 columns: the row-parallel layers' halves must hold whole groups, as real models' do.)"""
    if quantization == "checkpoint":
        path, kwargs = str(make_tiny_model(tmp_path / "m", arch="qwen3_moe", seed=0, fp8_block=16)), {}
    else:
        wide = dict(hidden_size=256, num_attention_heads=16, intermediate_size=256, moe_intermediate_size=256)
        path = str(make_tiny_model(tmp_path / "m", arch="qwen3_moe", seed=0, **wide))
        kwargs = {"quantization": "fp8"}
    with llm(path, tp_size=2, **kwargs) as engine:
        tp2 = minisgl_logprobs(engine, prompts())
    tp1 = minisgl_logprobs(llm(path, **kwargs), prompts())
    assert max_gap(tp1, tp2) < 1e-4


def test_tp2_slice_inside_a_weight_block_is_refused(fp8_models):
    """32-row blocks and 2 ranks: each rank's 16 KV rows would begin inside a block."""
    with pytest.raises(ValueError, match="not aligned to the FP8 weight blocks of 32"):
        llm(fp8_models["qwen3"], tp_size=2)


def test_modules_to_not_convert_stay_in_the_model_dtype(fp8_models, tmp_path):
    """A checkpoint whose first MLP was left unquantized (listed in modules_to_not_convert) loads it as float
    and gives the same log-probabilities as the all-FP8 checkpoint dequantized there."""
    path = tmp_path / "partial"
    shutil.copytree(fp8_models["qwen3"], path)
    tensors = load_file(path / "model.safetensors")
    for proj in ("gate_proj", "up_proj", "down_proj"):
        name = f"model.layers.0.mlp.{proj}.weight"
        tensors[name] = dequantize_weight(tensors[name], tensors.pop(name + "_scale_inv"), Fp8Config((BLOCK, BLOCK)))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["modules_to_not_convert"] = ["lm_head", "model.layers.0.mlp"]
    (path / "config.json").write_text(json.dumps(raw))
    engine = llm(str(path))
    params = dict(engine.engine.model.named_parameters())
    assert params["model.layers.0.mlp.gate_up_proj.weight"].dtype == torch.float32
    assert params["model.layers.1.mlp.gate_up_proj.weight"].dtype == FP8_DTYPE
    assert "model.layers.0.mlp.gate_up_proj.weight_scale_inv" not in params
    assert_close_logprobs(minisgl_logprobs(engine, prompts()), minisgl_logprobs(llm(fp8_models["qwen3"]), prompts()))


@pytest.mark.parametrize("raw, message", [
    ({"quant_method": "fp8", "activation_scheme": "static", "weight_block_size": [128, 128]}, "static activation"),
    ({"quant_method": "fp8", "activation_scheme": "dynamic"}, "per-tensor"),
    ({"quant_method": "fp8", "fmt": "e5m2", "weight_block_size": [128, 128]}, "e5m2"),
])
def test_unsupported_fp8_schemes_are_named(raw, message):
    with pytest.raises(ValueError, match=message):
        Fp8Config.from_hf(raw)
