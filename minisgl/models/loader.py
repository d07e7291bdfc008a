"""Find a checkpoint, build the model on the target device, and stream its weights in.

Tensors are read one at a time from each safetensors file and copied (this rank's slice only) into
parameters that already live on the device, so peak host memory is about one tensor, not the model.
"""

from __future__ import annotations

import contextlib
import json
from collections import Counter
from pathlib import Path

import torch
from safetensors import safe_open

from minisgl.distributed import TPGroup
from minisgl.models.config import DTYPES, ModelConfig
from minisgl.models.decoder import CausalLM


class ModelLoadError(ValueError):
    """A checkpoint that cannot be found or does not match its config."""


def resolve_model_path(model: str) -> Path:
    """A local checkpoint directory, else a Hugging Face Hub id downloaded into the local HF cache."""
    path = Path(model).expanduser()
    if path.is_dir():
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


@torch.no_grad()
def load_weights(model: CausalLM, path: Path) -> None:
    params = dict(model.named_parameters())
    loaded: Counter[str] = Counter()
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():
                target = model.param_for(name)
                if target is None:
                    continue
                param_name, shard = target
                param = params.get(param_name)
                if param is None:
                    raise ModelLoadError(f"unexpected tensor {name!r} in {file.name}: the model has no "
                                         f"parameter {param_name!r}")
                loader = getattr(param, "weight_loader", None)
                tensor = f.get_tensor(name)
                try:
                    if loader is None:
                        if tensor.shape != param.shape:
                            raise ValueError(f"shape mismatch: checkpoint {tuple(tensor.shape)} vs "
                                             f"parameter {tuple(param.shape)}")
                        param.data.copy_(tensor)
                    elif shard is None:
                        loader(param, tensor)
                    else:
                        loader(param, tensor, shard)
                except (ValueError, RuntimeError) as exc:  # RuntimeError: a slice outside a short tensor
                    raise ModelLoadError(f"tensor {name!r} in {file.name} (shape {tuple(tensor.shape)}) does not "
                                         f"fit parameter {param_name!r} {tuple(param.shape)}: {exc}") from None
                loaded[param_name] += 1
    missing = [n for n, p in params.items() if loaded[n] < getattr(p, "num_shards", 1)]
    if missing:
        shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
        raise ModelLoadError(f"checkpoint {path} lacks tensors for: {shown}")


@torch.no_grad()
def init_dummy_weights(model: CausalLM, seed: int = 0) -> None:
    """Random weights of the right shapes, for benchmarks: small normal matrices, unit norms."""
    gen = torch.Generator(next(model.parameters()).device).manual_seed(seed)
    for name, param in model.named_parameters():
        if name.endswith("norm.weight"):
            param.fill_(1.0)
        else:
            param.normal_(0.0, 0.02, generator=gen)


def load_model(path: str | Path, tp: TPGroup, device: torch.device, dtype: str | torch.dtype = "auto",
               dummy: bool = False) -> CausalLM:
    path = Path(path)
    config = ModelConfig.from_dir(path)
    config.dtype = resolve_dtype(dtype, config)
    model = build_model(config, tp, device)
    if dummy:
        init_dummy_weights(model)
    else:
        load_weights(model, path)
    return model.eval()
