"""Grammars for constrained decoding, on top of xgrammar.

A request's mask for step N+1 depends on its token of step N, so the scheduler advances a request's
matcher with every token it commits and asks for the batch's bitmask before it samples the next step
(with overlap scheduling, while the device runs that step's forward pass).

Compilation (token masks for every grammar state, with the model's tokenizer) takes from milliseconds
to seconds, so it never runs on the scheduling loop: `Grammars.start` hands it to a thread of this
process (xgrammar releases the GIL while it compiles), and the request waits aside until it is done.
Every TP rank compiles the same text; rank 0 alone decides when a grammar is ready and broadcasts it,
so that all ranks admit the request at the same step. The compiler caches what it compiled, keyed by
the grammar's text: a schema sent again is ready at once. Compiling here (rather than in the API
process and shipping the result) keeps messages small: a compiled grammar of a 150k-token vocabulary
serializes to megabytes.
"""

from __future__ import annotations

import json
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import torch

from minisgl.constrained.staging import MaskStaging
from minisgl.core import Constraint
from minisgl.kernels import use_triton
from minisgl.tokenizer import TokenizerSource

if TYPE_CHECKING:
    import xgrammar

COMPILE_THREADS = 2  # grammars compile concurrently; xgrammar also spreads one compilation over threads


def check(constraint: Constraint) -> None:
    """Parse the constraint as the scheduler will, without a tokenizer (fast): a ValueError says what
    is wrong with it."""
    try:
        _grammar(constraint)
    except RuntimeError as exc:  # xgrammar reports every parse error as a RuntimeError from its C++ core
        raise ValueError(_clean(str(exc))) from None


def _grammar(constraint: Constraint) -> "xgrammar.Grammar":
    import xgrammar as xgr

    if constraint.kind == "json_schema":
        # Compact JSON (no free whitespace, which a sampler can spin in forever), and "strict": a schema
        # that leaves additionalProperties open still gets exactly its own properties. Both only narrow
        # what the schema allows, so every output still validates.
        schema = _lengths_as_patterns(json.loads(constraint.spec)) if constraint.spec.lstrip()[:1] == "{" \
            else constraint.spec
        return xgr.Grammar.from_json_schema(schema if isinstance(schema, str) else json.dumps(schema),
                                            any_whitespace=False, strict_mode=True)
    if constraint.kind == "json_object":
        return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
    if constraint.kind == "regex":
        return xgr.Grammar.from_regex(constraint.spec)
    if constraint.kind == "ebnf":
        return xgr.Grammar.from_ebnf(constraint.spec)
    if constraint.kind == "structural_tag":
        return xgr.Grammar.from_structural_tag({"type": "structural_tag", "format": json.loads(constraint.spec)})
    raise ValueError(f"unknown constraint kind {constraint.kind!r}")


def _lengths_as_patterns(schema: Any) -> Any:
    """The schema with each string's minLength/maxLength (and no pattern) spelled as a pattern of that
    many characters. xgrammar 0.2.8 lowers length bounds to a character class that admits raw control
    characters, which strict JSON parsers refuse (mlc-ai/xgrammar#800); its pattern path does not. The
    pattern leaves out surrogates, whose UTF-8 bytes decode to three U+FFFD (three characters, not one)."""
    if isinstance(schema, list):
        return [_lengths_as_patterns(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    schema = {key: _lengths_as_patterns(value) for key, value in schema.items()}
    bounds = [schema.get("minLength"), schema.get("maxLength")]
    if schema.get("type") == "string" and "pattern" not in schema and any(b is not None for b in bounds) \
            and all(b is None or (isinstance(b, int) and not isinstance(b, bool) and b >= 0) for b in bounds):
        low, high = schema.pop("minLength", 0), schema.pop("maxLength", "")
        schema["pattern"] = f"^[^\\uD800-\\uDFFF]{{{low},{high}}}$"
    return schema


def _clean(message: str) -> str:
    """xgrammar's message without its C++ source location ('[12:00:00] /project/cpp/x.cc:42: ')."""
    lines = [re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", line) for line in message.strip().splitlines()]
    return " ".join(line for line in lines if line)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> None:
    """Set the logits of the tokens a row's bitmask leaves out to -inf, in place, vectorised over the batch.
    Bit j of word i allows token 32 * i + j; a row of all ones (-1) changes nothing. `Grammars.bitmask` hands
    it over on the logits' device already; a host bitmask is copied there first. On a GPU, one Triton kernel
    (`minisgl.kernels.bitmask`); this torch code is its reference."""
    bitmask = bitmask.to(logits.device, non_blocking=True)
    if use_triton(logits):
        from minisgl.kernels.bitmask import apply_bitmask_triton

        apply_bitmask_triton(logits, bitmask)
        return
    token = torch.arange(logits.shape[-1], device=logits.device, dtype=torch.int32)
    logits.masked_fill_(((bitmask[:, token // 32] >> (token % 32)) & 1) == 0, float("-inf"))


class Grammars:
    """The scheduler's grammars: compilations under way, and one matcher per constrained request that
    was admitted and has not finished (running, or retracted and waiting again)."""

    def __init__(self, tokenizer: TokenizerSource, vocab_size: int, eos_ids: list[int],
                 device: str | torch.device = "cpu"):
        self.vocab_size = vocab_size
        self.pool = ThreadPoolExecutor(COMPILE_THREADS, thread_name_prefix="grammar")
        # The tokenizer loads in the pool too: the first constrained request pays for it, the loop never does.
        self._compiler = self.pool.submit(self._make_compiler, tokenizer, vocab_size, eos_ids)
        self.compiling: dict[int, Future] = {}  # rid -> compiled grammar, in arrival order
        self.matchers: dict[int, "xgrammar.GrammarMatcher"] = {}
        self._filler: "xgrammar.BatchGrammarMatcher | None" = None
        self._masks = MaskStaging(torch.device(device), (vocab_size + 31) // 32)

    @staticmethod
    def _make_compiler(source: TokenizerSource, vocab_size: int, eos_ids: list[int]) -> "xgrammar.GrammarCompiler":
        import xgrammar as xgr

        tokenizer = source.load()
        if tokenizer is None:
            raise ValueError(f"structured outputs need a tokenizer, and {source.path} has none")
        # vocab_size is the model's (often padded past the tokenizer's): ids no text maps to stay masked.
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=list(eos_ids))
        return xgr.GrammarCompiler(info, max_threads=min(8, os.cpu_count() or 1))

    def start(self, rid: int, constraint: Constraint) -> None:
        """Begin compiling a request's grammar in the background."""
        self.compiling[rid] = self.pool.submit(self._compile, constraint)

    def _compile(self, constraint: Constraint) -> "xgrammar.CompiledGrammar":
        return self._compiler.result().compile_grammar(_grammar(constraint))

    def ready(self) -> list[int]:
        """Requests whose compilation has ended (well or not), in arrival order (rank 0 asks)."""
        return [rid for rid, future in self.compiling.items() if future.done()]

    def activate(self, rid: int) -> None:
        """Give the request its matcher (waiting for its compilation on a rank that is behind); raises
        the compilation's error, which fails that request alone."""
        import xgrammar as xgr

        compiled = self.compiling.pop(rid).result()
        self.matchers[rid] = xgr.GrammarMatcher(compiled)

    def accept(self, rid: int, token: int) -> bool:
        """Advance the request's matcher by its new token; True once the grammar is complete and has
        taken its end (an EOS token): the request is finished."""
        matcher = self.matchers[rid]
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} does not fit the request's grammar")
        return matcher.is_terminated()

    def bitmask(self, rids: list[int]) -> torch.Tensor | None:
        """[len(rids), ceil(V/32)] int32 on the device: each constrained request's allowed tokens, all ones
        for the others; None when none of them is constrained. Valid for the step it is filled for: the
        buffer is refilled two calls later (see `MaskStaging`)."""
        import xgrammar as xgr

        rows = [i for i, rid in enumerate(rids) if rid in self.matchers]
        if not rows:
            return None
        if self._filler is None:  # one thread: threads cost more than they saved at tens of microseconds a row
            self._filler = xgr.BatchGrammarMatcher(max_threads=1)
        mask = self._masks.host(len(rids))
        if len(rows) < len(rids):
            mask[[i for i, rid in enumerate(rids) if rid not in self.matchers]] = -1  # all allowed
        self._filler.batch_fill_next_token_bitmask([self.matchers[rids[i]] for i in rows], mask, rows)
        return self._masks.ship()

    def release(self, rid: int) -> None:
        """The request finished (or was aborted): forget its matcher or compilation."""
        self.matchers.pop(rid, None)
        future = self.compiling.pop(rid, None)
        if future is not None:
            future.cancel()

