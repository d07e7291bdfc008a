"""The offline API: the same scheduler and engine as the server, driven in-process.

    llm = LLM("path/or/hf-id", device="cpu", dtype="float32")
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))

`llm.shutdown()`, or leaving a `with LLM(...) as llm:` block, frees the engine's memory (device memory included),
so that another LLM can be built in the same process afterwards.

With tp_size > 1 this process is rank 0 and spawns ranks 1..N-1, which follow its decisions. Any rank
failing ends them all: the call that saw it raises, and later calls say the engine has stopped.
"""

from __future__ import annotations

import gc
import random
from dataclasses import dataclass
from itertools import count
from typing import Sequence

import torch

from minisgl.core import Req, SamplingParams, TokenLogprob, check_request
from minisgl.distributed import free_port, leave_tp_group
from minisgl.engine.config import EngineArgs
from minisgl.messages import AddReq, Shutdown
from minisgl.scheduler.follower import Followers
from minisgl.scheduler.rank import build_scheduler


@dataclass
class RequestOutput:
    token_ids: list[int]
    text: str | None  # None when the model directory has no tokenizer
    finish_reason: str  # "stop" | "length" | "abort"
    prompt_tokens: int
    cached_tokens: int
    logprobs: list[TokenLogprob] | None
    prompt_logprobs: list[TokenLogprob] | None  # prompt tokens 1.. (the first has nothing before it)


class LLM:
    def __init__(self, model: str, device: str = "auto", dtype: str = "auto", tp_size: int = 1, page_size: int = 1,
                 max_prefill_tokens: int = 8192, cache_type: str = "radix", num_pages: int | None = None,
                 max_running_requests: int = 256, attention_backend: str = "auto", max_seq_len: int | None = None,
                 memory_ratio: float = 0.9, dummy_weights: bool = False, cuda_graph_max_bs: int = 256,
                 overlap_schedule: bool = True, kv_cache_dtype: str = "auto", quantization: str | None = None,
                 tokenizer: str | None = None, trust_remote_code: bool = False):
        args = EngineArgs(str(model), device, dtype, tp_size, page_size, max_prefill_tokens, cache_type, num_pages,
                          max_running_requests, attention_backend, max_seq_len, memory_ratio, dummy_weights,
                          cuda_graph_max_bs, overlap_schedule, kv_cache_dtype, quantization,
                          tokenizer=tokenizer, trust_remote_code=trust_remote_code)
        port = free_port()
        self._closed = True  # until built: nothing to shut down
        self._followers = Followers(tp_size, port, args)
        try:
            self.scheduler = build_scheduler(0, tp_size, port, args, self._followers)
            self.engine = self.scheduler.engine
            if self.engine.device.type == "cuda":  # kernels compile now, not in the first generate
                self.scheduler.warm_up()
        except BaseException:
            self._followers.stop()
            leave_tp_group()
            raise
        self.tokenizer = args.tokenizer_source(self.engine.model_path).load()
        self._rids = count()
        self._seeds = random.Random()  # seeds for requests that give none; drawn here, shared by all ranks
        self._closed = False
        self._stopped: str | None = None  # why a failed TP engine stopped

    def generate(self, prompts: str | list[int] | Sequence[str] | Sequence[list[int]],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None) -> list[RequestOutput]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if sampling_params is not None else SamplingParams()
        params = list(params) if isinstance(params, (list, tuple)) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(prompts)} prompts but {len(params)} sampling params")
        self._check_running()
        reqs = [self._make_req(prompt, p) for prompt, p in zip(prompts, params)]
        pending = {req.rid for req in reqs}
        messages = [AddReq(req) for req in reqs]
        try:
            while pending:
                self.scheduler.tick(messages)
                messages = []
                _, finished = self.scheduler.take_outputs()
                for req in finished:
                    pending.discard(req.rid)
            while self.scheduler.can_step:  # a stop nobody could foresee leaves the next step launched: read it
                self.scheduler.tick([])
        except BaseException as exc:
            if not self._followers.procs:
                raise
            self._stop_after(exc)
            if isinstance(exc, Exception):  # say which rank died, not just that a socket closed
                raise RuntimeError(f"tensor-parallel engine stopped: {self._stopped}") from exc
            raise
        return [self._output(req) for req in reqs]

    def _stop_after(self, exc: BaseException) -> None:
        """A step failed with tensor parallelism: the ranks are out of lockstep, so stop them all."""
        # A follower dying is the cause, not the broken pipe rank 0 saw: give the watcher a moment to see it.
        reason = self._followers.death_within(1.0) or f"{type(exc).__name__}: {exc}"
        self._followers.stop()
        self._release(reason)

    def _release(self, reason: str) -> None:
        """Drop the engine and give its memory back (weights, KV pool, CUDA graphs), so that another LLM fits
        on the device in this process: its page count is measured from the device's free memory."""
        self._stopped, self._closed = reason, True
        self.engine.close()
        device = self.engine.device
        del self.scheduler, self.engine
        gc.collect()  # tensors held by reference cycles go now, not at some later collection
        if device.type == "cuda":
            torch.cuda.empty_cache()  # the caching allocator's free blocks back to the device

    def _check_running(self) -> None:
        if self._stopped is not None:
            raise RuntimeError(f"this engine has stopped: {self._stopped}")

    def _make_req(self, prompt: str | list[int], params: SamplingParams) -> Req:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this model directory has no tokenizer: pass token ids instead of text")
            ids = self.tokenizer(prompt)["input_ids"]
        else:
            ids = list(prompt)
        engine = self.engine
        check_request(ids, params, engine.config.vocab_size, engine.max_seq_len, engine.num_pages * engine.page_size)
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        return Req(next(self._rids), ids, params, seed)

    def _output(self, req: Req) -> RequestOutput:
        text = self.tokenizer.decode(req.output_ids, skip_special_tokens=True) if self.tokenizer else None
        return RequestOutput(list(req.output_ids), text, req.finish_reason, len(req.prompt_ids), req.cached_tokens,
                             req.output_logprobs if req.params.logprobs is not None else None,
                             req.prompt_logprobs if req.params.prompt_logprobs is not None else None)

    def stats(self) -> dict:
        self._check_running()
        return self.scheduler.stats()

    def shutdown(self) -> None:
        """Stop the engine (and its tensor-parallel ranks) and free its memory; generate and stats raise after it."""
        if self._closed:
            return
        self._closed = True
        if self._followers.procs:
            self._followers.stopping.set()  # their exits are expected now
            self.scheduler.tick([Shutdown()])
            self._followers.stop(grace=30)
        self._release("it was shut down")

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def __del__(self) -> None:
        if hasattr(self, "_closed"):
            self.shutdown()


__all__ = ["LLM", "RequestOutput", "SamplingParams"]
