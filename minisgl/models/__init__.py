"""Model definitions, their registry and the checkpoint loader."""

from minisgl.models.config import ModelConfig
from minisgl.models.decoder import CausalLM
from minisgl.models.loader import load_model, resolve_model_path

# Every supported architecture is the one configurable decoder (see decoder.py).
ARCHITECTURES = ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")

__all__ = ["ARCHITECTURES", "CausalLM", "ModelConfig", "load_model", "resolve_model_path"]
