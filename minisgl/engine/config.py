"""Everything needed to build an engine; picklable, so TP worker processes get the same settings."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from minisgl.attention import BACKENDS
from minisgl.kvcache.pool import KV_CACHE_DTYPES
from minisgl.tokenizer import TokenizerSource


@dataclass
class EngineArgs:
    model: str
    device: str = "auto"  # auto | cuda | cpu
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    tp_size: int = 1
    page_size: int = 1
    max_prefill_tokens: int = 8192  # tokens of one step, decodes and prefill chunks together (see Scheduler)
    cache_type: str = "radix"  # radix | naive
    num_pages: int | None = None  # None: size the pool from memory left after the weights
    max_running_requests: int = 256
    attention_backend: str = "auto"  # auto (triton on CUDA, torch on CPU) | NAME | PREFILL,DECODE
    max_seq_len: int | None = None  # None: the model's max_position_embeddings
    memory_ratio: float = 0.9  # share of the device's memory the process may fill (GPU)
    dummy_weights: bool = False
    cuda_graph_max_bs: int = 256  # largest decode batch replayed from a CUDA graph; 0 turns graphs off
    overlap_schedule: bool = True  # build step N+1 on the CPU while the device runs step N
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) | fp8 | fp8_e4m3 (float8_e4m3fn, scale 1.0)
    quantization: str | None = None  # None: the checkpoint's own | fp8 (per-channel FP8 weights at load)
    # largest step with prefill tokens replayed from a whole-step CUDA graph (engine/whole_graph.py, which keeps
    # fewer where the device is the bottleneck anyway); 0 turns them off, as does cuda_graph_max_bs 0. The name is
    # SGLang's flag's (--piecewise-cuda-graph-max-tokens), from when these graphs left attention out
    piecewise_graph_max_tokens: int = 8192
    # beside running decodes, prompts come in chunks, and a mixed step under a backlog costs at most this multiple of
    # the decode step alone (by the start-up step cost model, engine/step_cost.py; see Scheduler._prefill_room); 0:
    # the token budget alone. Off here (offline throughput); the server turns it on
    max_mixed_step_ratio: float = 0.0
    # under a light load, compute a burst of prompts in steps of BURST_CHUNK_TOKENS for its median TTFT (see
    # Scheduler._light_burst): the server's --burst-split, on by default there
    burst_split: bool = False
    # the order waiting prompts are admitted in: fcfs (arrival) or sjf (shortest prompt first, aged; see
    # Scheduler._order_waiting). Arrival order offline; the server's --schedule-policy defaults to sjf
    schedule_policy: str = "fcfs"
    tokenizer: str | None = None  # a directory or Hub id; None: the model's own (the grammar compiler loads it)
    trust_remote_code: bool = False  # the tokenizer may run its own code

    def tokenizer_source(self, model_dir: str | Path) -> TokenizerSource:
        """--tokenizer's tokenizer, else the one beside the weights in `model_dir` (the model, resolved)."""
        return TokenizerSource(self.tokenizer or str(model_dir), self.trust_remote_code)

    def __post_init__(self) -> None:
        def check(ok: bool, name: str, rule: str) -> None:
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)!r}")

        check(self.device in ("auto", "cuda", "cpu") or self.device.startswith("cuda:"), "device",
              "'auto', 'cuda' or 'cpu'")
        check(self.kv_cache_dtype in ("auto", *KV_CACHE_DTYPES), "kv_cache_dtype",
              f"'auto' or one of {tuple(KV_CACHE_DTYPES)}")
        check(self.quantization in (None, "fp8"), "quantization", "None or 'fp8'")
        check(self.tp_size >= 1, "tp_size", ">= 1")
        check(self.page_size >= 1, "page_size", ">= 1")
        check(self.max_prefill_tokens >= 1, "max_prefill_tokens", ">= 1")
        check(self.cache_type in ("radix", "naive"), "cache_type", "'radix' or 'naive'")
        check(self.schedule_policy in ("fcfs", "sjf"), "schedule_policy", "'fcfs' or 'sjf'")
        check(self.num_pages is None or self.num_pages >= 1, "num_pages", "None or >= 1")
        check(self.max_running_requests >= 1, "max_running_requests", ">= 1")
        check(self.max_seq_len is None or self.max_seq_len >= 2, "max_seq_len", "None or >= 2")
        check(0 < self.memory_ratio <= 1, "memory_ratio", "in (0, 1]")
        check(self.cuda_graph_max_bs >= 0, "cuda_graph_max_bs", ">= 0")
        check(self.piecewise_graph_max_tokens >= 0, "piecewise_graph_max_tokens", ">= 0")
        check(self.max_mixed_step_ratio == 0 or self.max_mixed_step_ratio >= 1, "max_mixed_step_ratio", "0 or >= 1")
        names = self.attention_backend.split(",")
        check(len(names) <= 2 and all(n.strip() in ("auto", *BACKENDS) for n in names), "attention_backend",
              f"'auto', one of {BACKENDS} or 'PREFILL,DECODE'")
