"""The engine: weights, KV pool, page and token tables, attention backends and sampler on one device.

It knows nothing of queues or requests' life cycles: the scheduler hands it a Batch, `forward` enqueues
its forward pass and `sample` its sampling on the device, and both return at once. Every input token is read
on the device from the token table (`token_table[row, position]`), where admission writes the prompt
and sampling writes each new token, so the next step can be enqueued before the host has seen this
step's tokens (overlap scheduling). The host learns them through one device->host copy per step.
A batch whose grammar masks need the tokens of the step before it is sampled only once the host has
read those and filled the masks, while the device ran the forward pass.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from minisgl.attention import ForwardInput, StepAttention, make_backend
from minisgl.attention.triton_backend import TritonBackend
from minisgl.core import GREEDY_TEMPERATURE, Batch
from minisgl.distributed import TPGroup
from minisgl.engine.config import EngineArgs
from minisgl.engine.cuda_graph import DecodeGraphs
from minisgl.engine.host_copy import upload
from minisgl.engine.sampler import Sampler
from minisgl.engine.step_cost import StepCost
from minisgl.engine.step_cost import measure as measure_step_cost
from minisgl.engine.whole_graph import WholeGraphs, bucket_for
from minisgl.kvcache.pool import KVPool, kv_cache_dtype
from minisgl.models import load_model, resolve_model_path

logger = logging.getLogger(__name__)

CPU_KV_BUDGET = 256 << 20  # bytes of KV pool on a CPU when num_pages is not given
PROMPT_SCORE_ROWS = 256  # prompt positions scored at once: bounds the [rows, vocab] float32 logits


def resolve_device(name: str, rank: int) -> torch.device:
    """'auto' prefers CUDA; TP rank r of a CUDA run uses GPU r."""
    if name == "auto":
        name = "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda":
        return torch.device("cuda", rank)
    return torch.device(name)


def backend_names(spec: str, device: torch.device) -> tuple[str, str]:
    """`--attn` as (prefill backend, decode backend): 'auto', 'NAME' or 'PREFILL,DECODE'."""
    names = [n.strip() for n in spec.split(",")]
    if len(names) not in (1, 2):
        raise ValueError(f"attention backend must be 'NAME' or 'PREFILL,DECODE', got {spec!r}")
    auto = "triton" if device.type == "cuda" else "torch"
    names = [auto if n == "auto" else n for n in names]
    return names[0], names[-1]


@dataclass
class PromptScores:
    """Log-probabilities of prompt tokens `first + 1 .. first + len(logprobs)` of request `index` in the
    batch (each predicted by the position before it), with the top alternatives at each position."""

    index: int
    first: int
    logprobs: list[float]
    top_ids: list[list[int]]
    top_logprobs: list[list[float]]


@dataclass
class StepResult:
    """Host copies of what one step sampled, in the order of `Batch.sampled`, and its prompt scores."""

    token_ids: list[int]
    logprobs: list[float] | None
    top_ids: list[list[int]] | None
    top_logprobs: list[list[float]] | None
    hidden: list[list[float]] | None  # the final hidden state each token was sampled from (some request asked)
    prompt: list[PromptScores]


@dataclass
class ForwardedStep:
    """A step whose forward pass is enqueued and whose sampling is not yet: the host may still fill grammar
    masks (which need the previous step's tokens) while the device computes these logits."""

    batch: Batch
    logits: torch.Tensor  # [len(batch.reqs), V], at each request's last new token
    prompt: list[tuple[int, int, list[torch.Tensor]]]  # (index, first, device tensors on their way to the host)


class LaunchedStep:
    """A step enqueued on the device; `result()` waits for its device->host copy only."""

    def __init__(self, batch: Batch, host: list[torch.Tensor | None], done: torch.cuda.Event | None,
                 prompt: list[tuple[int, int, list[torch.Tensor]]] = ()):
        self.batch, self._host, self._done, self._prompt = batch, host, done, prompt

    def result(self) -> StepResult:
        if self._done is not None:
            self._done.synchronize()
        prompt = [PromptScores(index, first, *(t.tolist() for t in tensors)) for index, first, tensors in self._prompt]
        return StepResult(*(t.tolist() if t is not None else None for t in self._host), prompt)


class Engine:
    def __init__(self, args: EngineArgs, tp: TPGroup, device: torch.device):
        self.args, self.tp, self.device = args, tp, device
        if device.type == "cuda":  # Triton kernels and CUDA graphs use the current device, not the tensors'
            torch.cuda.set_device(device)
        start = time.perf_counter()
        self.model_path = resolve_model_path(args.model)
        self.model = load_model(self.model_path, tp, device, args.dtype, dummy=args.dummy_weights,
                                quantization=args.quantization)
        config = self.config = self.model.config
        self.max_seq_len = min(args.max_seq_len or config.max_position_embeddings, config.max_position_embeddings)
        attn = self.model.model.layers[0].self_attn
        self.page_size = args.page_size
        prefill_name, decode_name = backend_names(args.attention_backend, device)
        graph_bs = min(args.cuda_graph_max_bs, args.max_running_requests) if device.type == "cuda" else 0
        prefill_graph_tokens = args.piecewise_graph_max_tokens if graph_bs else 0
        self.kv_dtype = kv_cache_dtype(args.kv_cache_dtype, config.dtype)
        self.num_pages = args.num_pages or self._pages_from_memory(attn.kv_heads, config.head_dim, graph_bs,
                                                                     prefill_graph_tokens)
        self.pool = KVPool(config.num_layers, self.num_pages, args.page_size, attn.kv_heads, config.head_dim,
                           config.dtype, device, self.kv_dtype)
        # One row per running request, plus a last row that CUDA-graph padding points at: its pages
        # are the pool's scratch page, and its tokens are zeros.
        rows = args.max_running_requests + 1
        self.pad_row = rows - 1
        pages_per_seq = -(-(self.max_seq_len + 1) // args.page_size)
        self.page_table = torch.zeros(rows, pages_per_seq, dtype=torch.int32, device=device)
        self.page_table[self.pad_row] = self.pool.scratch_page
        self.token_table = torch.zeros(rows, self.max_seq_len + 1, dtype=torch.int32, device=device)
        # Each row's final hidden state at its last position of the last step (decode graphs write it too), copied
        # out by `sample` only for batches with a request that returns its hidden states.
        self.last_hidden = torch.zeros(rows, config.hidden_size, dtype=config.dtype, device=device)
        self.prefill_backend = make_backend(prefill_name, self.pool, self.page_table)
        self.decode_backend = (self.prefill_backend if decode_name == prefill_name
                               else make_backend(decode_name, self.pool, self.page_table))
        self.sampler = Sampler(rows, config.vocab_size, device)
        self.load_seconds = time.perf_counter() - start
        self.graphs: DecodeGraphs | None = None
        self.whole: WholeGraphs | None = None  # made after the decode graphs, which capture `_hidden`
        if graph_bs > 0 and tp.size > 1:  # start together: a rank still loading must not hold the others inside
            dist.barrier(group=tp.cpu_group)  # a captured collective
        if graph_bs > 0 and self.decode_backend.supports_cuda_graph:
            self.graphs = DecodeGraphs(self._decode_logits, graph_bs, self.pad_row, device)
        if prefill_graph_tokens:
            self.whole = self._capture_whole(prefill_graph_tokens)
        self.step_cost: StepCost | None = None  # the scheduler's model of a step's device time (CUDA only)
        if self.whole is not None:
            bytes_per_token = KVPool.bytes_per_token(config.num_layers, attn.kv_heads, config.head_dim, self.kv_dtype)
            self.step_cost = measure_step_cost(self.whole.replay_without_attention, self.whole.buckets,
                                               bytes_per_token, device, lambda us: self.tp.agree(us, dist.ReduceOp.MAX))
            logger.info("step cost model: %s ms at %s tokens, %.2g ms per 1,000 cached tokens decoded",
                        self.step_cost.linear_ms, self.step_cost.tokens, 1000 * self.step_cost.kv_ms_per_token)

    def _capture_whole(self, max_tokens: int) -> WholeGraphs | None:
        """Whole-step graphs for steps with prefill tokens (engine/whole_graph.py); None, with a warning, for a
        prefill backend other than Triton's (its metadata are not static) or a model whose forward cannot be
        captured (an op that waits for the host): those steps then run eagerly."""
        if not isinstance(self.prefill_backend, TritonBackend):
            logger.warning("CUDA graphs for steps with prefill tokens need the triton prefill attention backend: "
                           "those steps run eagerly (slower to enqueue)")
            return None
        try:
            return WholeGraphs(self.model, self.prefill_backend, self.pool.scratch_page * self.page_size,
                               self.pad_row, max_tokens, self.args.max_running_requests,
                               self.model.model.layers[0].self_attn.heads, self.config.vocab_size, self.device,
                               self._any_rank)
        except RuntimeError as e:
            logger.warning("CUDA graphs for steps with prefill tokens are OFF for this model, those steps run "
                           "eagerly (slower to enqueue): its forward could not be captured: %s", e)
            torch.cuda.synchronize(self.device)
            return None

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any tensor-parallel rank."""
        return bool(self.tp.agree(int(flag), dist.ReduceOp.MAX))

    def close(self) -> None:
        """Leave the tensor-parallel group, after the CUDA graphs: destroying an NCCL communicator waits
        until every graph that captured one of its collectives is gone, so graphs still alive then hang the
        rank's exit for ever."""
        for graphs in (self.graphs, self.whole):
            if graphs is not None:
                graphs.release()
        self.graphs = self.whole = None
        self.tp.destroy()

    def _pages_from_memory(self, kv_heads: int, head_dim: int, graph_bs: int, prefill_graph_tokens: int) -> int:
        """Fill what `memory_ratio` of the device leaves after the weights and a reserve for the CUDA
        graphs' activations; the same on every rank."""
        per_token = KVPool.bytes_per_token(self.config.num_layers, kv_heads, head_dim, self.kv_dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = free - total * (1 - self.args.memory_ratio) - self._graph_reserve(graph_bs, prefill_graph_tokens)
        else:
            budget = CPU_KV_BUDGET
        pages = int(budget // (per_token * self.args.page_size))
        pages = self.tp.agree(pages, dist.ReduceOp.MIN)
        if pages < 1:
            raise RuntimeError(f"no memory left for the KV cache (budget {budget / 2**30:.2f} GiB); "
                               f"raise memory_ratio or set num_pages")
        return pages

    def _graph_reserve(self, graph_bs: int, prefill_graph_tokens: int) -> int:
        """Bytes the CUDA graphs keep: the largest decode batch's logits (model dtype, and float32 while
        sampling) and, for it and the largest whole-step bucket, the widest activations, with a margin.
        The real figures are logged at capture."""
        c = self.config
        widest = max(c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim) * 4
        return (graph_bs * (c.vocab_size * 10 + widest * c.dtype.itemsize)
                + prefill_graph_tokens * widest * c.dtype.itemsize + (64 << 20) if graph_bs else 0)

    # ---- inputs ---------------------------------------------------------------------------------

    def load_tokens(self, row: int, start: int, ids: list[int]) -> None:
        """Write a request's known tokens from `start` on into its token-table row (at admission)."""
        if ids:
            self.token_table[row, start: start + len(ids)] = upload(ids, torch.int32, self.device)

    def _slots(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        ps = self.page_size
        return self.page_table[rows, positions // ps].long() * ps + positions % ps

    def decode_input(self, rows: torch.Tensor, kv_lens: torch.Tensor, max_seq_len: int) -> ForwardInput:
        """One token per request, built on the device from rows and kv_lens alone (CUDA-graph safe)."""
        bs = rows.shape[0]
        return ForwardInput(
            input_ids=self.token_table[rows, kv_lens].long(), positions=kv_lens, out_slots=self._slots(rows, kv_lens),
            rows=rows, kv_lens=kv_lens, extend_lens=torch.ones_like(kv_lens), seq_lens=kv_lens + 1,
            last_index=torch.arange(bs, device=rows.device), max_extend=1, max_seq_len=max_seq_len, is_decode=True)

    def extend_input(self, batch: Batch) -> ForwardInput:
        """Any mix of prefill chunks, prefix-cache extends and decodes, with one host->device copy."""
        lens, total, decodes = batch.extend_lens, sum(batch.extend_lens), batch.decodes
        rows, kv_lens, extend_lens = upload([[r.row for r in batch.reqs], batch.kv_lens, lens], torch.int64,
                                            self.device)
        arange = torch.arange(total, device=self.device)
        owner = torch.repeat_interleave(torch.arange(len(lens), device=self.device), extend_lens, output_size=total)
        ends = torch.cumsum(extend_lens, 0)
        positions = kv_lens[owner] + arange - (ends - extend_lens)[owner]
        return ForwardInput(
            input_ids=self.token_table[rows[owner], positions].long(), positions=positions,
            out_slots=self._slots(rows[owner], positions), rows=rows, kv_lens=kv_lens, extend_lens=extend_lens,
            seq_lens=kv_lens + extend_lens, last_index=ends - 1, max_extend=max(lens),
            max_seq_len=max(k + n for k, n in zip(batch.kv_lens, lens)), decode_rows=decodes,
            decode_kv_tokens=batch.decode_kv_tokens)

    # ---- forward --------------------------------------------------------------------------------

    def step_kind(self, batch: Batch) -> tuple[str, int | None]:
        """How `forward` runs the batch (for the step trace): ("graph", batch size) for a decode CUDA graph,
        ("whole", token bucket) for a whole-step graph (a step with prefill tokens, or a decode batch above the
        decode graphs' largest), ("eager", None) otherwise."""
        if batch.is_decode and self._graph_fits(batch):
            return "graph", bucket_for(self.graphs.buckets, len(batch.reqs))
        tokens = sum(batch.extend_lens)
        if self._whole_fits(tokens, len(batch.reqs) - batch.decodes):
            return "whole", bucket_for(self.whole.buckets, tokens)
        return "eager", None

    def _graph_fits(self, batch: Batch) -> bool:
        return self.graphs is not None and len(batch.reqs) <= self.graphs.max_bs

    def _whole_fits(self, tokens: int, chunks: int) -> bool:
        return self.whole is not None and self.whole.fits(tokens, chunks)

    def _hidden(self, inputs: ForwardInput, backend) -> torch.Tensor:
        """The final hidden state of every input token, eagerly (the decode graphs capture this)."""
        meta = backend.prepare(inputs)
        attn = StepAttention(self.pool, inputs.out_slots, lambda layer, q: backend.attend(layer, q, meta))
        return self.model(inputs.input_ids, inputs.positions, attn)

    def _step_hidden(self, batch: Batch, inputs: ForwardInput, backend) -> torch.Tensor:
        """The final hidden state of an eager-launched step's tokens: from a whole-step graph when it fits one."""
        if self._whole_fits(inputs.input_ids.shape[0], len(batch.reqs) - inputs.decode_rows):
            return self.whole.run(inputs, [r.row for r in batch.reqs], batch.kv_lens, batch.extend_lens)
        return self._hidden(inputs, backend)

    def _last_logits(self, inputs: ForwardInput, hidden: torch.Tensor) -> torch.Tensor:
        """Logits at each request's last position; its hidden state there is kept in `last_hidden`."""
        last = hidden[inputs.last_index]
        self.last_hidden[inputs.rows] = last
        return self.model.compute_logits(last)

    def _decode_logits(self, rows: torch.Tensor, kv_lens: torch.Tensor) -> torch.Tensor:
        """What a decode graph captures: inputs from the tables, the model, the logits."""
        inputs = self.decode_input(rows, kv_lens, self.max_seq_len)
        return self._last_logits(inputs, self._hidden(inputs, self.decode_backend))

    @torch.inference_mode()
    def forward(self, batch: Batch) -> ForwardedStep:
        """Enqueue the forward pass: logits at each request's last new token, and the scores of `batch.scored`."""
        if batch.is_decode:
            kv = batch.kv_lens
            if self._graph_fits(batch):
                return ForwardedStep(batch, self.graphs.replay([r.row for r in batch.reqs], kv), [])
            meta = upload([[r.row for r in batch.reqs], kv], torch.int64, self.device)
            inputs = replace(self.decode_input(meta[0], meta[1], max(kv) + 1), decode_rows=len(kv))
            return ForwardedStep(batch, self._last_logits(inputs, self._step_hidden(batch, inputs,
                                                                                    self.decode_backend)), [])
        inputs = self.extend_input(batch)
        hidden = self._step_hidden(batch, inputs, self.prefill_backend)
        return ForwardedStep(batch, self._last_logits(inputs, hidden), self._score_prompts(batch, hidden))

    def _score_prompts(self, batch: Batch, hidden: torch.Tensor) -> list[tuple[int, int, list[torch.Tensor]]]:
        """For each (request, first, count) of batch.scored: the log-probability of prompt tokens first+1 ..
        first+count, and the top-N alternatives, from the hidden states of the positions before them. One
        computation for any front that asks for prompt logprobs (echo, vLLM's prompt_logprobs)."""
        scores = []
        for index, first, count in batch.scored:
            req = batch.reqs[index]
            start = sum(batch.extend_lens[:index]) + first - batch.kv_lens[index]  # hidden row of `first`
            targets = upload(req.prompt_ids[first + 1: first + 1 + count], torch.int64, self.device)
            parts = []
            for at in range(0, count, PROMPT_SCORE_ROWS):
                rows = slice(start + at, start + min(count, at + PROMPT_SCORE_ROWS))
                logits = self.model.compute_logits(hidden[rows]).float()
                if req.params.prompt_logprobs_temperature != 1:  # floored as sampling's: smaller ones overflow
                    logits = logits / max(req.params.prompt_logprobs_temperature, GREEDY_TEMPERATURE)
                logprobs = torch.log_softmax(logits, -1)
                top = logprobs.topk(req.params.prompt_logprobs, -1)
                parts.append((logprobs.gather(-1, targets[at: at + PROMPT_SCORE_ROWS, None])[:, 0], top.indices,
                              top.values))
            scores.append((index, first, [torch.cat(column).to("cpu", non_blocking=True) for column in zip(*parts)]))
        return scores

    @torch.inference_mode()
    def sample(self, step: ForwardedStep, bitmask: torch.Tensor | None = None) -> LaunchedStep:
        """Enqueue sampling after `step`'s forward pass; sampled tokens go into the token table on the device
        and into pinned host memory, which `LaunchedStep.result()` waits for. `bitmask` (one row per sampled
        request, on the device or the host) holds the tokens their grammars allow."""
        batch, logits, picked = step.batch, step.logits, step.batch.sampled
        if not picked:
            return LaunchedStep(batch, [torch.zeros(0, dtype=torch.int64), None, None, None, None], self._done(),
                                step.prompt)
        reqs = [batch.reqs[i] for i in picked]
        if len(picked) < len(batch.reqs):
            logits = logits[upload(picked, torch.int64, self.device)]
        top_n = max((r.params.logprobs for r in reqs if r.params.logprobs is not None), default=None)
        rows, next_pos = upload([[r.row for r in reqs], [batch.kv_lens[i] + batch.extend_lens[i] for i in picked]],
                                torch.int64, self.device)
        out = self.sampler.sample(logits, rows, top_n, bitmask)
        self.token_table[rows, next_pos] = out.token_ids.int()
        hidden = self.last_hidden[rows] if any(r.params.return_hidden_states for r in reqs) else None
        host = [t.to("cpu", non_blocking=True) if t is not None else None
                for t in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs, hidden)]
        return LaunchedStep(batch, host, self._done(), step.prompt)

    def _done(self) -> torch.cuda.Event | None:
        """An event after everything enqueued so far (device->host copies included); None on the CPU."""
        if self.device.type != "cuda":
            return None
        done = torch.cuda.Event()
        done.record()
        return done
