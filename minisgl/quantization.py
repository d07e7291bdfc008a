"""The FP8 configuration of a model (`Fp8Config`): what a checkpoint's `quantization_config` says, or what
`--quantization fp8` asks for. Its own module, below both `minisgl.kernels` and `minisgl.layers`, so that the
kernels can take it without importing the layer that calls them."""

from __future__ import annotations

import math
from dataclasses import dataclass

DEFAULT_GROUP = 128  # activation group of per-channel weights


@dataclass(frozen=True)
class Fp8Config:
    """block: a checkpoint's `weight_block_size` [rows, columns], or None for per-channel scales.
    ignored: `modules_to_not_convert`, module names (or their prefixes) that stay in the model dtype."""

    block: tuple[int, int] | None = None
    ignored: tuple[str, ...] = ()

    @property
    def group(self) -> int:
        """Input columns per activation (and weight) scale."""
        return self.block[1] if self.block else DEFAULT_GROUP

    @property
    def scale_rows(self) -> int:
        """Output rows per weight scale."""
        return self.block[0] if self.block else 1

    def scale_shape(self, rows: int, cols: int) -> tuple[int, int]:
        return math.ceil(rows / self.scale_rows), math.ceil(cols / self.group) if self.block else 1

    def covers(self, module: str) -> bool:
        """Whether the module named `module` (e.g. "model.layers.0.self_attn.q_proj") holds FP8 weights."""
        return not any(module == m or module.startswith(m + ".") or f".{m}." in f".{module}." for m in self.ignored)

    @classmethod
    def from_hf(cls, raw: dict | None) -> "Fp8Config | None":
        """The `quantization_config` of a config.json; None without one. Raises ValueError for schemes
        minisgl does not run (other methods, static activation scales, per-tensor FP8)."""
        if not raw:
            return None
        method = raw.get("quant_method")
        if method != "fp8":
            raise ValueError(f"quantization method {method!r} is not supported (only block-scaled 'fp8')")
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise ValueError("FP8 checkpoints with static activation scales are not supported (dynamic only)")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise ValueError(f"FP8 format {raw['fmt']!r} is not supported (e4m3 only)")
        block = raw.get("weight_block_size")
        if not block or len(block) != 2:
            raise ValueError("FP8 checkpoints without `weight_block_size` (per-tensor scales) are not supported")
        return cls(block=(int(block[0]), int(block[1])), ignored=tuple(raw.get("modules_to_not_convert") or ()))
