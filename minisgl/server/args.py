"""Command-line flags of `python -m minisgl`: mini-sglang's names, plus SGLang's and vLLM's spellings where
cheap (so their launch commands and manifests work unchanged)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import dataclass

from minisgl.engine.config import EngineArgs
from minisgl.server.metrics import NAMINGS
from minisgl.server.parsers.reasoning import REASONING_PARSERS
from minisgl.server.parsers.tools import TOOL_CALL_PARSERS


@dataclass
class ServerArgs:
    engine: EngineArgs
    host: str
    port: int
    served_model_name: str
    api_key: str | None
    max_queued_requests: int
    max_request_bytes: int
    shutdown_timeout: float
    shell: bool
    demo: bool
    log_level: str
    skip_tokenizer_init: bool
    metrics_naming: str = "sglang"
    tool_call_parser: str | None = None
    reasoning_parser: str | None = None
    root_path: str = ""
    force_include_usage: bool = False  # every streamed chunk carries the usage so far, as vLLM's flag has it
    max_stored_responses: int = 1024  # the Responses API's store: past this, the least recently used are dropped
    max_logprobs: int = 20  # the most alternatives a request may ask for per token; -1: the whole vocabulary
    uds: str | None = None  # serve on this Unix domain socket instead of host:port (vLLM's --uds)
    request_id_headers: bool = False  # every response carries X-Request-Id (vLLM's --enable-request-id-headers)
    tokens_as_token_ids: bool = False  # every request's logprobs spell tokens `token_id:N` (vLLM's flag)
    return_hidden_states: bool = False  # requests may ask for their final hidden states (SGLang's flag)

    def logprobs_cap(self, vocab_size: int) -> int:
        """--max-logprobs as a number: -1 (no cap) and a cap beyond the vocabulary are the vocabulary's size."""
        return vocab_size if self.max_logprobs == -1 else min(self.max_logprobs, vocab_size)


DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # vLLM's (and torch's) other names
API_KEY_ENV = "VLLM_API_KEY"  # vLLM's: read when --api-key is not given, so manifests keep the key off the command line
DEFAULT_MAX_LOGPROBS = 20  # OpenAI's cap on top_logprobs, and vLLM's default --max-logprobs
DEFAULT_MAX_REQUEST_BYTES = 4 * 1024 * 1024  # a 128k-token prompt as text is ~0.5 MB, as token ids ~1 MB


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def max_logprobs_flag(text: str) -> int:
    value = int(text)
    if value < -1:
        raise argparse.ArgumentTypeError(f"must be -1 (no cap) or >= 0, got {value}")
    return value


def accepted(group: argparse._ArgumentGroup, *flags: str, by: str, does: str) -> None:
    """A peer's flag for what this server does unasked: taken (and changing nothing), so that the peer's launch
    commands run as they are."""
    group.add_argument(*flags, action="store_true", help=f"{by}, accepted for launch commands; needed for nothing "
                                                         f"here: {does}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m minisgl",
        description="Serve a model with an OpenAI-compatible API (or chat with it: --shell).",
        epilog="Example: python -m minisgl --model Qwen/Qwen3-0.6B --port 1919   |   "
               "python -m minisgl --demo (a tiny random model on the CPU, no GPU or network needed)")
    model = p.add_argument_group("model")
    model.add_argument("--model", "--model-path", dest="model", help="local checkpoint directory or Hugging Face id")
    model.add_argument("--served-model-name", help="the name clients use in 'model' (default: --model)")
    model.add_argument("--dtype", default="auto", type=lambda name: DTYPE_ALIASES.get(name, name),
                       choices=["auto", "float32", "bfloat16", "float16"],
                       help="weight and KV dtype; auto takes config.json's; vLLM's half and float are "
                            "float16 and float32 (default: auto)")
    model.add_argument("--dummy-weight", action="store_true", help="random weights from config.json (benchmarks)")
    model.add_argument("--load-format", choices=["auto", "dummy"], default="auto",
                       help="SGLang spelling: 'dummy' equals --dummy-weight")
    model.add_argument("--quantization", "-q", choices=["fp8"], default=None,
                       help="fp8: quantize a bf16 checkpoint's linear layers and experts to FP8 (e4m3, one scale per "
                            "output channel) at load; FP8 checkpoints (block-scaled) need no flag")
    model.add_argument("--tokenizer", "--tokenizer-path", dest="tokenizer",
                       help="the tokenizer's directory or Hugging Face id, when it is not beside the weights (vLLM's "
                            "and SGLang's spellings; default: --model's)")
    model.add_argument("--trust-remote-code", action="store_true",
                       help="let the tokenizer run its own Python code (tokenizer_config.json's auto_map); the "
                            "model itself is always built from this package's own code")
    model.add_argument("--skip-tokenizer-init", action="store_true",
                       help="serve without a tokenizer: prompts and outputs are token ids (/v1/completions only)")
    model.add_argument("--demo", action="store_true",
                       help="serve a tiny random model made on the spot, on the CPU (no --model needed)")

    engine = p.add_argument_group("engine")
    engine.add_argument("--device", default="auto", help="auto | cuda | cpu (default: auto, CUDA when present)")
    engine.add_argument("--tp", "--tp-size", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor-parallel ranks")
    engine.add_argument("--max-running-requests", "--max-num-seqs", type=int, default=256,
                        help="cap on concurrently running requests")
    engine.add_argument("--max-prefill-length", "--chunked-prefill-size", "--max-num-batched-tokens",
                        dest="max_prefill_tokens", type=int,
                        default=8192, help="token budget of one step: every running decode, then prefill chunks in "
                                           "the rest; longer prompts are chunked")
    accepted(engine, "--enable-chunked-prefill", by="vLLM's", does="prefill is chunked (by --max-prefill-length)")
    engine.add_argument("--max-seq-len", "--context-length", "--max-model-len", dest="max_seq_len", type=int,
                        help="longest prompt + completion, at most the model's max_position_embeddings "
                             "(default: that)")
    engine.add_argument("--page-size", type=int, default=1, help="tokens per KV-cache page (default: 1)")
    engine.add_argument("--kv-cache-dtype", choices=["auto", "fp8", "fp8_e4m3"], default="auto",
                        help="KV-cache storage: auto = --dtype; fp8 (= fp8_e4m3) halves it against bf16, scale 1.0, "
                             "values saturate at +-448 (default: auto)")
    engine.add_argument("--memory-ratio", "--mem-fraction-static", "--gpu-memory-utilization", dest="memory_ratio",
                        type=float, default=0.9,
                        help="share of GPU memory for weights + KV cache (default: 0.9)")
    engine.add_argument("--num-pages", type=int, help="KV-cache pages (default: sized from --memory-ratio)")
    engine.add_argument("--max-total-tokens", type=positive_int,
                        help="SGLang spelling: KV-cache size in tokens (--num-pages = this / --page-size, rounded up)")
    engine.add_argument("--cache", choices=["radix", "naive"], default="radix",
                        help="prefix cache: radix shares prompt prefixes, naive does not (default: radix)")
    engine.add_argument("--disable-radix-cache", "--no-enable-prefix-caching", action="store_true",
                        help="SGLang's and vLLM's spellings of --cache naive")
    accepted(engine, "--enable-prefix-caching", by="vLLM's", does="the prefix cache is on (unless --cache naive)")
    engine.add_argument("--attn", "--attention-backend", dest="attn", default="auto",
                        help="attention backend: auto (triton on CUDA, torch on CPU), triton, torch, or "
                             "PREFILL,DECODE to mix them (default: auto)")
    engine.add_argument("--cuda-graph-max-bs", type=int, default=256,
                        help="largest decode batch replayed from a CUDA graph; 0 turns graphs off (default: 256)")
    engine.add_argument("--enforce-eager", "--disable-cuda-graph", dest="enforce_eager", action="store_true",
                        help="vLLM's and SGLang's spellings of --cuda-graph-max-bs 0 (no CUDA graphs at all)")
    engine.add_argument("--piecewise-cuda-graph-max-tokens", type=int, default=8192,
                        help="largest step with prefill tokens (prefill, or decodes mixed with prefill chunks) "
                             "replayed from a whole-step CUDA graph (attention included, at most 64 prompt "
                             "chunks a step); fewer are "
                             "kept where the model's eager steps are device-bound at start-up; larger steps run "
                             "eagerly; 0 turns them off (default: 8192)")
    engine.add_argument("--disable-piecewise-cuda-graph", action="store_true",
                        help="--piecewise-cuda-graph-max-tokens 0")
    accepted(engine, "--enable-piecewise-cuda-graph", by="SGLang's",
             does="CUDA graphs for steps with prefill tokens are on unless --disable-piecewise-cuda-graph")
    engine.add_argument("--max-mixed-step-ratio", type=float, default=3.0,
                        help="beside 32 or more running decodes, prompts come in chunks of 1,024 tokens (the whole "
                             "budget when every decoding stream has a stall left: one at admission, one per 100 "
                             "tokens); while the waiting prompts would take over 300 ms to drain that way, a mixed "
                             "step instead costs at most this multiple of the decode step alone, and beside more "
                             "than 160 decodes at most that or 60%% of a whole budget's step, whichever is more, by "
                             "a model of the device's step time measured at start-up (CUDA); 0: only the token "
                             "budget bounds the chunks (default: 3)")
    engine.add_argument("--burst-split", action=argparse.BooleanOptionalAction, default=True,
                        help="under a light load (fewer than 32 requests held over the last 512 steps), compute a "
                             "burst of prompts of at most two token budgets that would take over 50 ms whole (by "
                             "the step cost model, CUDA) in steps of 3,072 tokens, so the first of them get their "
                             "first tokens sooner: a burst's median TTFT for a few more stalls of the running "
                             "streams (default: on; the offline LLM keeps it off)")
    engine.add_argument("--schedule-policy", "--scheduling-policy", choices=["fcfs", "sjf"], default="sjf",
                        help="the order waiting prompts are admitted in: sjf, shortest prompt first, except that one "
                             "waiting 16 steps keeps its place (default: a loaded server's median TTFT, for a few "
                             "percent of its TTFT p99); fcfs, arrival order (SGLang's and vLLM's spellings; their "
                             "other policies are not served)")
    engine.add_argument("--disable-overlap-schedule", "--no-async-scheduling", action="store_true",
                        help="run each step to completion before scheduling the next (overlap is on by default; "
                             "vLLM calls it async scheduling)")

    outputs = p.add_argument_group("outputs")
    outputs.add_argument("--tool-call-parser", choices=sorted(TOOL_CALL_PARSERS),
                         help="how the model writes tool calls, for tool_choice auto: hermes (= qwen, qwen25: "
                              "<tool_call> blocks), llama3 (JSON) or mistral ([TOOL_CALLS] and a JSON array); "
                              "without it only forced calls are served")
    accepted(outputs, "--enable-auto-tool-choice", by="vLLM's", does="tool_choice auto is served whenever "
             "--tool-call-parser is given (vLLM, too, requires the parser with it)")
    outputs.add_argument("--grammar-backend", "--structured-outputs-config.backend", choices=["xgrammar"],
                         default="xgrammar", help="SGLang's and vLLM's spellings: structured outputs always use "
                                                  "xgrammar (another backend is refused)")
    outputs.add_argument("--max-logprobs", type=max_logprobs_flag, default=DEFAULT_MAX_LOGPROBS,
                         help="vLLM's: the most alternatives a request may ask for per token (logprobs, "
                              f"top_logprobs, prompt_logprobs); -1: up to the vocabulary (default: "
                              f"{DEFAULT_MAX_LOGPROBS}, OpenAI's cap)")
    outputs.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS),
                         type=lambda name: name.replace("_", "-"),
                         help="move the model's <think>...</think> into reasoning_content (qwen3, deepseek-r1; "
                              "vLLM spells it deepseek_r1)")
    outputs.add_argument("--reasoning-config", type=json.loads,
                         help="vLLM's: accepted when its reasoning_start_str/reasoning_end_str are the reasoning "
                              "parser's own markers (they cannot be changed)")

    server = p.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="bind address (0.0.0.0 in containers)")
    server.add_argument("--port", type=int, default=1919)
    server.add_argument("--uds", help="vLLM's: serve on this Unix domain socket path instead of --host/--port (a "
                                      "sidecar proxy in the same pod reaches it without a TCP port)")
    server.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="require 'Authorization: Bearer KEY' on every route but /health and /metrics "
                             f"(default: ${API_KEY_ENV}, as vLLM reads it)")
    server.add_argument("--root-path", default="",
                        help="the path prefix a reverse proxy serves this server under (e.g. /llm): routes answer "
                             "with and without it, as vLLM's --root-path does")
    server.add_argument("--max-queued-requests", type=positive_int, default=1024,
                        help="sequences waiting for their first token beyond which new requests get 503")
    server.add_argument("--max-request-bytes", "--max-payload-size", type=positive_int,
                        default=DEFAULT_MAX_REQUEST_BYTES,
                        help="larger request bodies get 413 before they are read (default: 4 MiB)")
    server.add_argument("--shutdown-timeout", type=float, default=30.0,
                        help="seconds in-flight requests may take to finish after SIGTERM; then they get an error "
                             "and the server exits")
    accepted(server, "--enable-cache-report", "--enable-prompt-tokens-details", by="SGLang's and vLLM's",
             does="usage reports prompt_tokens_details.cached_tokens")
    accepted(server, "--enable-tokenizer-info-endpoint", by="vLLM's", does="GET /tokenizer_info is served")
    accepted(server, "--enable-server-load-tracking", by="vLLM's", does="GET /load is served")
    server.add_argument("--enable-force-include-usage", action="store_true",
                        help="vLLM's: every streamed chat or text completion carries usage, on each chunk (its "
                             "choice's so far) and in a last chunk, whatever stream_options says")
    server.add_argument("--return-tokens-as-token-ids", action="store_true",
                        help="vLLM's: logprobs spell every token `token_id:N`, as if each request asked with "
                             "return_tokens_as_token_ids")
    server.add_argument("--enable-return-hidden-states", action="store_true",
                        help="SGLang's: chat and text completions may ask for return_hidden_states (each choice's "
                             "final hidden state; a device-to-host copy per step for the batches that hold one)")
    server.add_argument("--enable-request-id-headers", action="store_true",
                        help="vLLM's: every response carries X-Request-Id, the request's own or a new one")
    server.add_argument("--metrics-naming", choices=NAMINGS, default="sglang",
                        help="name /metrics series as SGLang (sglang:*) or vLLM (vllm:*) does, for their "
                             "dashboards and routers (default: sglang)")
    server.add_argument("--max-stored-responses", type=positive_int, default=1024,
                        help="responses kept for GET /v1/responses/{id} and previous_response_id (in memory); past "
                             "this the least recently used finished ones are dropped (default: 1024)")
    server.add_argument("--shell", action="store_true", help="interactive chat in this terminal (/reset, /exit)")
    server.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])
    return p


def dashed(argv: list[str]) -> list[str]:
    """Flags spelled with underscores (`--max_model_len`, as vLLM also takes them) in their dashed form."""
    def fix(arg: str) -> str:
        name, eq, value = arg.partition("=")
        return name.replace("_", "-") + eq + value if arg.startswith("--") else arg
    return [fix(arg) for arg in argv]


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    parser = build_parser()
    a = parser.parse_args(dashed(sys.argv[1:] if argv is None else argv))
    if a.demo:
        a.model = a.model or "demo"
        a.device = "cpu" if a.device == "auto" else a.device
    if not a.model:
        parser.error("--model is required (or --demo)")
    if a.reasoning_config is not None:
        markers = REASONING_PARSERS.get(a.reasoning_parser)
        given = (a.reasoning_config.get("reasoning_start_str"), a.reasoning_config.get("reasoning_end_str"))
        if markers is None or set(a.reasoning_config) - {"reasoning_start_str", "reasoning_end_str"} or \
                any(g is not None and g != m for g, m in zip(given, markers)):
            parser.error(f"--reasoning-config {json.dumps(a.reasoning_config)}: only the reasoning parser's own "
                         f"markers {markers} are served")
    if a.enable_auto_tool_choice and not a.tool_call_parser:
        parser.error("--enable-auto-tool-choice needs --tool-call-parser (how the model writes its calls)")
    if a.root_path and not (a.root_path.startswith("/") and not a.root_path.endswith("/")):
        parser.error(f"--root-path must start with / and not end with one, got {a.root_path!r}")
    if a.max_total_tokens is not None:
        if a.num_pages is not None:
            parser.error("give --num-pages or --max-total-tokens, not both")
        a.num_pages = -(-a.max_total_tokens // a.page_size)
    try:
        engine = EngineArgs(
            model=a.model, device=a.device, dtype=a.dtype, tp_size=a.tp, page_size=a.page_size,
            max_prefill_tokens=a.max_prefill_tokens, cache_type="naive" if a.disable_radix_cache else a.cache,
            num_pages=a.num_pages, max_running_requests=a.max_running_requests, attention_backend=a.attn,
            max_seq_len=a.max_seq_len, memory_ratio=a.memory_ratio,
            dummy_weights=a.dummy_weight or a.load_format == "dummy",
            cuda_graph_max_bs=0 if a.enforce_eager else a.cuda_graph_max_bs,
            piecewise_graph_max_tokens=0 if a.disable_piecewise_cuda_graph else a.piecewise_cuda_graph_max_tokens,
            max_mixed_step_ratio=a.max_mixed_step_ratio, burst_split=a.burst_split, schedule_policy=a.schedule_policy,
            overlap_schedule=not a.disable_overlap_schedule, kv_cache_dtype=a.kv_cache_dtype,
            quantization=a.quantization, tokenizer=a.tokenizer, trust_remote_code=a.trust_remote_code)
    except ValueError as exc:
        parser.error(str(exc))
    return ServerArgs(engine, a.host, a.port, a.served_model_name or a.model, a.api_key, a.max_queued_requests,
                      a.max_request_bytes, a.shutdown_timeout, a.shell, a.demo, a.log_level, a.skip_tokenizer_init,
                      a.metrics_naming, a.tool_call_parser, a.reasoning_parser, a.root_path,
                      a.enable_force_include_usage, a.max_stored_responses, a.max_logprobs, a.uds,
                      a.enable_request_id_headers, a.return_tokens_as_token_ids, a.enable_return_hidden_states)
