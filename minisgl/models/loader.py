"""Find a checkpoint, build the model on the target device, and stream its weights in.

Tensors are read one at a time from each safetensors file and copied (this rank's slice only) into
parameters that already live on the device, so peak host memory is about one tensor, not the model.
Dummy weights (benchmarks) take the same path: full tensors drawn on the device one at a time, so a
rank's shard is exactly the slice a TP=1 engine has.

FP8: a checkpoint's e4m3 weights and their `weight_scale_inv` are copied as they are; a weight in another
dtype bound for an FP8 parameter (a bf16 checkpoint under `--quantization fp8`, or dummy weights) is
quantized on the device, whole, before it is sliced, so that every TP size gets the same scales.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from minisgl.distributed import TPGroup
from minisgl.layers.fp8 import FP8_DTYPE, quantize_weight
from minisgl.models.config import DTYPES, ModelConfig
from minisgl.models.decoder import CausalLM
from minisgl.quantization import Fp8Config


class ModelLoadError(ValueError):
    """A checkpoint that cannot be found or does not match its config."""


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory, else a Hugging Face Hub id downloaded into the local HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"{str(path)!r} is not a model directory: it has no config.json")
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(model, allow_patterns=["*.json", "*.safetensors", "*.model", "*.txt"]))
    except Exception as exc:  # offline, unknown repo, gated repo...: say which and why
        raise ModelLoadError(f"model {model!r} is not a local directory and could not be fetched from the "
                             f"Hugging Face Hub: {type(exc).__name__}: {exc}") from None


def resolve_dtype(name: str | torch.dtype, config: ModelConfig) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    if name == "auto":
        return config.dtype
    if name not in DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(DTYPES)}, got {name!r}")
    return DTYPES[name]


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def build_model(config: ModelConfig, tp: TPGroup, device: torch.device) -> CausalLM:
    from minisgl.models import ARCHITECTURES

    if config.architecture not in ARCHITECTURES:
        raise ModelLoadError(f"unsupported architecture {config.architecture!r}; supported: "
                             f"{', '.join(ARCHITECTURES)}")
    with torch.device(device), default_dtype(config.dtype):
        return CausalLM(config, tp)


def checkpoint_files(path: Path) -> list[Path]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        names = dict.fromkeys(json.loads(index.read_text())["weight_map"].values())
        files = [path / name for name in names]
    else:
        files = sorted(path.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weights in {path}")
    return files


class WeightSink:
    """Takes full checkpoint tensors one at a time and copies this rank's slice of each into place, through
    the parameters' own weight loaders (the one slicing code for real and dummy weights); `check_complete`
    then names any parameter that did not get all its pieces."""

    def __init__(self, model: CausalLM):
        self.model = model
        self.params = dict(model.named_parameters())
        self.loaded: Counter[str] = Counter()

    def wants(self, name: str) -> bool:
        return self.model.param_for(name) is not None

    def put(self, name: str, tensor: torch.Tensor, source: str) -> None:
        """Copy this rank's part of checkpoint tensor `name` (read from `source`, for error messages)."""
        target = self.model.param_for(name)
        if target is None:
            return
        param_name, shard = target
        param = self.params.get(param_name)
        if param is None:
            raise ModelLoadError(f"unexpected tensor {name!r} in {source}: the model has no parameter {param_name!r}")
        if (tensor.dtype == FP8_DTYPE) != (param.dtype == FP8_DTYPE):
            if tensor.dtype == FP8_DTYPE or not name.endswith(".weight"):
                raise ModelLoadError(f"tensor {name!r} in {source} is {tensor.dtype} but parameter {param_name!r} "
                                     f"is {param.dtype}: the checkpoint's quantization_config does not match it")
            weight, scale = quantize_weight(tensor.to(param.device), self.model.config.quantization)
            self.put(name, weight, source)
            self.put(name + "_scale_inv", scale, source)
            return
        loader = getattr(param, "weight_loader", None)
        try:
            if loader is None:
                if tensor.shape != param.shape:
                    raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs parameter "
                                     f"{tuple(param.shape)}")
                param.data.copy_(tensor)
            elif shard is None:
                loader(param, tensor)
            else:
                loader(param, tensor, shard)
        except (ValueError, RuntimeError) as exc:  # RuntimeError: a slice outside a short tensor
            raise ModelLoadError(f"tensor {name!r} in {source} (shape {tuple(tensor.shape)}) does not fit "
                                 f"parameter {param_name!r} {tuple(param.shape)}: {exc}") from None
        self.loaded[param_name] += 1

    def check_complete(self, source: str) -> None:
        missing = [n for n, p in self.params.items() if self.loaded[n] < getattr(p, "num_shards", 1)]
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise ModelLoadError(f"{source} lacks tensors for: {shown}")


@torch.no_grad()
def load_weights(model: CausalLM, path: Path) -> None:
    sink = WeightSink(model)
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                if sink.wants(name):
                    sink.put(name, f.get_tensor(name), file.name)
    sink.check_complete(f"checkpoint {path}")


def checkpoint_layout(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name and full shape of every tensor a Hugging Face checkpoint of `config` holds (tied embeddings
    store no lm_head), in the checkpoint's own, unmerged and unsharded, form."""
    c, h = config, config.hidden_size
    q, kv = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    layout: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (c.vocab_size, h), "model.norm.weight": (h,)}
    if not c.tie_word_embeddings:
        layout["lm_head.weight"] = (c.vocab_size, h)
    for i in range(c.num_layers):
        layer, attn, mlp = f"model.layers.{i}.", f"model.layers.{i}.self_attn.", f"model.layers.{i}.mlp."
        layout[layer + "input_layernorm.weight"] = layout[layer + "post_attention_layernorm.weight"] = (h,)
        for proj, rows in (("q_proj", q), ("k_proj", kv), ("v_proj", kv)):
            layout[f"{attn}{proj}.weight"] = (rows, h)
            if c.qkv_bias:
                layout[f"{attn}{proj}.bias"] = (rows,)
        layout[attn + "o_proj.weight"] = (h, q)
        if c.o_proj_bias:
            layout[attn + "o_proj.bias"] = (h,)
        if c.qk_norm:
            layout[attn + "q_norm.weight"] = layout[attn + "k_norm.weight"] = (c.head_dim,)
        if c.is_moe_layer(i):
            layout[mlp + "gate.weight"] = (c.num_experts, h)
            experts = [f"{mlp}experts.{e}." for e in range(c.num_experts)]
            inter = c.moe_intermediate_size
        else:
            experts, inter = [mlp], c.intermediate_size
        for prefix in experts:
            layout[prefix + "gate_proj.weight"] = layout[prefix + "up_proj.weight"] = (inter, h)
            layout[prefix + "down_proj.weight"] = (h, inter)
    return layout


def dummy_tensor(name: str, shape: tuple[int, ...], gen: torch.Generator, dtype: torch.dtype,
                 seed: int = 0) -> torch.Tensor:
    """Checkpoint tensor `name` of the dummy model: ones for norms, else normal(0, 0.02) drawn from a seed
    that depends on the name alone, so every rank and every TP size sees the same full tensor."""
    if name.endswith("norm.weight"):
        return torch.ones(shape, dtype=dtype, device=gen.device)
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    gen.manual_seed(int.from_bytes(digest, "little") >> 1)
    return torch.empty(shape, dtype=dtype, device=gen.device).normal_(0.0, 0.02, generator=gen)


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of the right shapes, for benchmarks. Each full checkpoint tensor is drawn on the
    model's device, one at a time, and sliced like a real checkpoint's: a TP=N engine is the same model
    as a TP=1 engine, and peak memory is one full tensor on top of the shards."""
    param = next(model.parameters())
    gen = torch.Generator(param.device)
    sink = WeightSink(model)
    for name, shape in checkpoint_layout(model.config).items():
        sink.put(name, dummy_tensor(name, shape, gen, param.dtype, seed), "the dummy weights")
    sink.check_complete("the dummy weights")


def resolve_quantization(name: str | None, config: ModelConfig) -> Fp8Config | None:
    """`--quantization`: None keeps the checkpoint's own (FP8 or none); "fp8" also quantizes a bf16
    checkpoint, per channel, at load."""
    if name is None or config.quantization is not None:
        return config.quantization
    if name != "fp8":
        raise ValueError(f"quantization must be 'fp8', got {name!r}")
    return Fp8Config()


def load_model(path: str | Path, tp: TPGroup, device: torch.device, dtype: str | torch.dtype = "auto",
               dummy: bool = False, quantization: str | None = None) -> CausalLM:
    path = Path(path)
    config = ModelConfig.from_dir(path)
    config.dtype = resolve_dtype(dtype, config)
    config.quantization = resolve_quantization(quantization, config)
    model = build_model(config, tp, device)
    if dummy:
        init_dummy_weights(model)
    else:
        load_weights(model, path)
    return model.eval()
