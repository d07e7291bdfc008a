"""Batched token sampling, with each request's settings and state kept in one row of device tensors.

For every row of a logits batch, in this order:
1. logprobs and top-N come from log_softmax of the RAW logits, before anything below.
2. logit_bias (OpenAI's) is added to its tokens' logits, as a sparse row of (id, bias) pairs: one
   scatter-add over the batch. Then penalties: the repetition penalty p (CTRL / HF style) applies to
   every token seen in the prompt or the output (positive logits are divided by p, negative ones multiplied by p); then
   `frequency_penalty * count_in_output` and `presence_penalty * (count_in_output > 0)` are subtracted.
3. min_tokens: while the row has generated fewer than min_tokens tokens, its banned ids (EOS ids and
   stop_token_ids) get -inf. Grammar: tokens the row's bitmask leaves out get -inf too (structured
   outputs); after the penalties, which could turn a -inf into NaN (times a penalty that is 0 in float32).
4. Greedy rows (temperature 0, or top_k 1) take the argmax of the processed logits.
5. Other rows: softmax(logits / temperature); top-k keeps the k most likely tokens; top-p, over the
   distribution renormalised after top-k, keeps the smallest set of most likely tokens whose mass
   reaches top_p (the most likely token is always kept; a relative slack of 1e-6 absorbs float32
   rounding, so probabilities 0.5, 0.3, ... with top_p 0.8 keep exactly two); min-p drops tokens whose
   probability is below min_p * the largest probability. The token is then drawn from what is left by
   the exponential race, argmax(p / E) with E = -log(u).

6. Thinking budget (vLLM's thinking_token_budget): a row whose thinking block holds its budget of tokens
   gets the block's end marker, one token per step, in place of the token drawn (`thinking_budget.py`).

The uniform noise u is a counter-based integer hash of (request seed, tokens generated so far, token
id), so a request draws the same token from the same logits at the same step whatever else is in the
batch, whichever row it sits in, and after being retracted and re-admitted. `sample` never waits on
the device: choices about skipping work are made from host-side bookkeeping.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.constrained import apply_bitmask
from minisgl.core import GREEDY_TEMPERATURE, MAX_LOGIT_BIAS, SamplingParams
from minisgl.engine.host_copy import upload
from minisgl.engine.thinking_budget import ThinkingBudgets
from minisgl.kernels import use_triton

_M32 = 0xFFFFFFFF
# Settings are kept in float32, where extreme values (valid requests) would make logits +-inf or NaN and
# leave a row, a grammar-constrained one above all, drawing a token nothing allows: a repetition penalty
# past 1e6 (or below 1e-6), a temperature past 1e6 (-inf / inf is NaN) act as those (their effect is
# saturated long before), and a top_p below float32's smallest normal as that one (0 would cut every token).
REPETITION_LIMIT = 1e6
TEMPERATURE_LIMIT = 1e6
TOP_P_FLOOR = torch.finfo(torch.float32).tiny


def _mix(x: torch.Tensor) -> torch.Tensor:
    """A bijective avalanche hash of the low 32 bits of an int64 tensor. Every product stays below
    2**59, so int64 never overflows and the values stay non-negative on every backend."""
    x = x & _M32
    for _ in range(2):
        x = (((x >> 16) ^ x) * 0x45D9F3B) & _M32
    return (x >> 16) ^ x


@dataclass
class SampleOutput:
    token_ids: torch.Tensor  # [B] int64
    logprobs: torch.Tensor | None  # [B] float32, log_softmax(raw logits) at the chosen token
    top_ids: torch.Tensor | None  # [B, top_n] int64, most likely tokens of the raw logits, descending
    top_logprobs: torch.Tensor | None  # [B, top_n] float32


class Sampler:
    """Samples one token per row of a logits batch; `prepare_row` loads a request into a row."""

    def __init__(self, max_rows: int, vocab_size: int, device: torch.device | str):
        self.max_rows, self.vocab_size, self.device = max_rows, vocab_size, torch.device(device)
        # Columns: temperature, top_p, min_p, presence, frequency, repetition penalty.
        self.floats = torch.zeros(max_rows, 6, device=self.device)
        # Columns: top_k (vocab_size when off), min_tokens, seed low 32 bits, seed high 32 bits.
        self.ints = torch.zeros(max_rows, 4, dtype=torch.int64, device=self.device)
        self.generated = torch.zeros(max_rows, dtype=torch.int64, device=self.device)
        self.token_keys = _mix(torch.arange(vocab_size, device=self.device) + 0x9E3779B9)
        # [max_rows, V], allocated the first time a request needs them: most batches use neither.
        self.counts: torch.Tensor | None = None  # output token counts (float32)
        self.in_prompt: torch.Tensor | None = None  # prompt token presence (bool)
        self.banned: torch.Tensor | None = None  # ids banned before min_tokens (bool)
        # [max_rows, MAX_LOGIT_BIAS] logit_bias pairs (a row's unused slots add 0 to token 0), allocated likewise.
        self.bias_ids: torch.Tensor | None = None
        self.bias_values: torch.Tensor | None = None
        self.thinking = ThinkingBudgets(max_rows, self.device)  # step 6
        # Rows that sample randomly / need the sort for top-k or top-p / use min-p, so that `sample` can
        # skip that work, or take the fused kernel, without a device sync.
        self._random: set[int] = set()
        self._sorting: set[int] = set()
        self._min_p: set[int] = set()
        self._biased: set[int] = set()

    def _ids(self, ids: list[int]) -> torch.Tensor:
        return upload(ids, torch.int64, self.device)

    def prepare_row(self, row: int, params: SamplingParams, seed: int, prompt_ids: list[int],
                    output_ids: list[int], min_tokens_banned: list[int]) -> None:
        """Load a request into `row` on (re-)admission; output_ids restores the counter and counts. Nothing here
        waits for the device (host_copy.py says why that matters): `t[row] = python_number` would, hence fill_."""
        p, vocab = params, self.vocab_size
        top_k = vocab if p.top_k == -1 else min(p.top_k, vocab)
        min_tokens = p.min_tokens if min_tokens_banned else 0  # 0 keeps a stale ban row inert
        repetition = min(max(p.repetition_penalty, 1 / REPETITION_LIMIT), REPETITION_LIMIT)
        temperature = 0.0 if p.temperature < GREEDY_TEMPERATURE else min(p.temperature, TEMPERATURE_LIMIT)
        self.floats[row] = upload([temperature, max(p.top_p, TOP_P_FLOOR), p.min_p, p.presence_penalty,
                                   p.frequency_penalty, repetition], torch.float32, self.device)
        self.ints[row] = upload([top_k, min_tokens, seed & _M32, (seed >> 32) & _M32], torch.int64, self.device)
        self.generated[row].fill_(len(output_ids))
        (self._random.add if not p.greedy else self._random.discard)(row)
        (self._sorting.add if not p.greedy and (top_k < vocab or p.top_p < 1) else self._sorting.discard)(row)
        (self._min_p.add if not p.greedy and p.min_p > 0 else self._min_p.discard)(row)
        # Rows without penalties keep whatever counts are left in their row: neutral penalties ignore them.
        if p.has_penalties:
            if self.counts is None:
                self.counts = torch.zeros(self.max_rows, vocab, device=self.device)
                self.in_prompt = torch.zeros(self.max_rows, vocab, dtype=torch.bool, device=self.device)
            output = self._ids(output_ids)  # counted by index_add: a CUDA bincount reads the largest id back
            self.counts[row].zero_().index_add_(0, output, torch.ones(len(output_ids), device=self.device))
            self.in_prompt[row].zero_().index_fill_(0, self._ids(prompt_ids), True)
        self._prepare_bias(row, p.logit_bias)
        self.thinking.prepare_row(row, p.thinking_budget, prompt_ids, output_ids)
        if min_tokens > 0:
            if self.banned is None:
                self.banned = torch.zeros(self.max_rows, vocab, dtype=torch.bool, device=self.device)
            self.banned[row].zero_().index_fill_(0, self._ids(min_tokens_banned), True)

    def _prepare_bias(self, row: int, bias: dict[int, float] | None) -> None:
        """Load the row's logit_bias; a row without one adds zeros (batches with a biased row add every row's)."""
        if bias:
            if self.bias_ids is None:
                self.bias_ids = torch.zeros(self.max_rows, MAX_LOGIT_BIAS, dtype=torch.int64, device=self.device)
                self.bias_values = torch.zeros(self.max_rows, MAX_LOGIT_BIAS, device=self.device)
            ids, values = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.int64), torch.zeros(MAX_LOGIT_BIAS)
            ids[:len(bias)], values[:len(bias)] = torch.tensor(list(bias)), torch.tensor(list(bias.values()))
            self.bias_ids[row] = upload(ids, torch.int64, self.device)
            self.bias_values[row] = upload(values, torch.float32, self.device)
            self._biased.add(row)
        elif self.bias_values is not None:
            self.bias_values[row].zero_()
            self._biased.discard(row)

    def release_row(self, row: int) -> None:
        """The row's request left: greedy batches after it need not pay for random sampling or its bias."""
        self._random.discard(row)
        self._sorting.discard(row)
        self._min_p.discard(row)
        self._biased.discard(row)
        self.thinking.release_row(row)

    @property
    def needs_random(self) -> bool:
        return bool(self._random)

    def process_logits(self, logits: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Steps 2-3 (logit_bias, penalties, min_tokens), in float32 when there are any; never modifies `logits`
        in place. Without them the logits come back as they are: argmax and the fused race read any dtype."""
        if self.counts is not None or self.banned is not None or self._biased:
            logits = logits.float()
        if self._biased:
            logits = logits.scatter_add(1, self.bias_ids[rows], self.bias_values[rows])
        if self.counts is not None:
            presence, frequency, repetition = self.floats[rows, 3:].T.unsqueeze(-1)
            counts = self.counts[rows]
            seen = self.in_prompt[rows] | (counts > 0)
            repeated = torch.where(logits > 0, logits / repetition, logits * repetition)
            logits = torch.where(seen, repeated, logits)
            logits = logits - frequency * counts - presence * (counts > 0)
            big = torch.finfo(logits.dtype).max  # a tiny repetition penalty must not make +-inf (softmax NaN)
            logits = logits.clamp(-big, big)
        if self.banned is not None:
            active = self.generated[rows] < self.ints[rows, 1]
            logits = logits.masked_fill(self.banned[rows] & active[:, None], float("-inf"))
        return logits

    def _exponential(self, rows: torch.Tensor) -> torch.Tensor:
        """[B, V] Exp(1) noise that depends only on (seed, generated count, token id)."""
        seed = self.ints[rows]
        key = _mix(_mix(_mix(seed[:, 3]) ^ seed[:, 2]) ^ self.generated[rows])
        bits = _mix(key[:, None] ^ self.token_keys)
        uniform = ((bits >> 9).float() + 0.5) * 2.0**-23  # 23 bits: exact in float32, strictly in (0, 1)
        return -torch.log(uniform)

    def _top_k_top_p(self, probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Zero the probabilities that top-k and then top-p drop (top_k [B], top_p [B, 1])."""
        sorted_p, order = probs.sort(-1, descending=True)
        rank = torch.arange(probs.shape[-1], device=probs.device)
        sorted_p = sorted_p.masked_fill(rank >= top_k[:, None], 0)
        before = sorted_p.cumsum(-1) - sorted_p  # mass of the more likely tokens
        cut = (before >= top_p * sorted_p.sum(-1, keepdim=True) * (1 - 1e-6)) & (top_p < 1) & (rank > 0)
        return torch.zeros_like(probs).scatter_(-1, order, sorted_p.masked_fill(cut, 0))

    def sample(self, logits: torch.Tensor, rows: torch.Tensor, top_n: int | None = None,
               bitmask: torch.Tensor | None = None) -> SampleOutput:
        """Sample one token for each row of logits [B, V] (V == vocab_size), then advance the rows;
        `bitmask` [B, ceil(V/32)] int32 allows each row's tokens (step 3; it may change `logits`)."""
        logprobs = torch.log_softmax(logits.float(), -1) if top_n is not None else None
        processed = self.process_logits(logits, rows)
        if bitmask is not None:
            apply_bitmask(processed, bitmask)
        if self._random and not (self._sorting or self._min_p) and use_triton(processed):
            tokens = self._race_fused(processed, rows)
        else:
            tokens = self._race_torch(processed, rows)
        if self.thinking.rows:
            tokens = self.thinking.force_end(tokens, rows)
        self.generated[rows] += 1
        if self.counts is not None:  # every row: a row without penalties ignores its counts
            self.counts[rows, tokens] += 1
        if logprobs is None:
            return SampleOutput(tokens, None, None, None)
        top = logprobs.topk(top_n, -1)
        return SampleOutput(tokens, logprobs.gather(-1, tokens[:, None])[:, 0], top.indices, top.values)

    def _race_fused(self, processed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Step 5 for rows with temperature only, in one pass over the logits (the same tokens, up to
        float rounding on near-ties: see kernels/sampling.py)."""
        from minisgl.kernels.sampling import sample_exponential_race

        temperature = self.floats[rows, 0]
        temperature = temperature.masked_fill(self.ints[rows, 0] == 1, 0.0)  # top_k 1 is greedy too
        return sample_exponential_race(processed, temperature, self.ints[rows, 2:], self.generated[rows])

    def _race_torch(self, processed: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """Steps 4-5 in torch: the reference, and the path for top-k, top-p and min-p."""
        tokens = processed.argmax(-1)
        if self._random:
            temperature, top_p, min_p = self.floats[rows, :3].T.unsqueeze(-1)
            top_k = self.ints[rows, 0]
            greedy = (temperature == 0) | (top_k == 1)[:, None]
            probs = torch.softmax(processed.float() / torch.where(greedy, 1.0, temperature), -1)
            if self._sorting:
                probs = self._top_k_top_p(probs, top_k, top_p)
            if self._min_p:
                probs = probs.masked_fill(probs < min_p * probs.amax(-1, keepdim=True), 0)
            tokens = torch.where(greedy[:, 0], tokens, (probs / self._exponential(rows)).argmax(-1))
        return tokens
