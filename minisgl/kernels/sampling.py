"""The sampler's exponential race for plain temperature sampling, in one pass over each logits row.

`Sampler.sample` draws a row without top-k, top-p or min-p as argmax(softmax(logits / T) / E), with
Exp(1) noise E = -log(u) hashed from (seed, tokens generated so far, token id). It materialises
several [B, V] tensors to do so. Since softmax only shifts log-probabilities by a per-row constant,
the same token is argmax(logits / T - log E), which needs neither the row's maximum nor its sum: one
read of the logits, with the hash computed in registers. Rows with T = 0 take argmax(logits).

Two launches: programs of (row, chunk of the vocabulary) each write their best (score, token), and a
second kernel picks each row's best chunk. Ties go to the lowest token id, as torch's argmax does.
The token can differ from the torch path's only where the two best scores are equal within float32
rounding (the torch path rounds through exp and a division, and the GPU's log may differ by an ulp).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

CHUNK = 4096  # vocabulary entries per program
BLOCK = 2048  # entries per loop step


@triton.jit
def _mix(x):
    """`minisgl.engine.sampler._mix` on uint32: wrapping multiplication is its `& 0xFFFFFFFF`."""
    for _ in tl.static_range(2):
        x = ((x >> 16) ^ x) * 0x45D9F3B
    return (x >> 16) ^ x


@triton.jit
def _race_chunk_kernel(logits_ptr, logits_row_stride, temperature_ptr, temperature_stride, seeds_ptr, seeds_row_stride,
                       generated_ptr, generated_stride, best_score_ptr, best_token_ptr, vocab, n_chunks,
                       CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunk = tl.program_id(1)
    temperature = tl.load(temperature_ptr + row * temperature_stride).to(tl.float32)
    greedy = temperature == 0.0
    divisor = tl.where(greedy, 1.0, temperature)
    # The row's key: _mix(_mix(_mix(seed_high) ^ seed_low) ^ generated), on the low 32 bits of each.
    seed_low = tl.load(seeds_ptr + row * seeds_row_stride).to(tl.uint32)
    seed_high = tl.load(seeds_ptr + row * seeds_row_stride + 1).to(tl.uint32)
    key = _mix(_mix(_mix(seed_high) ^ seed_low) ^ tl.load(generated_ptr + row * generated_stride).to(tl.uint32))
    best_score = tl.full([BLOCK], float("-inf"), tl.float32)
    best_token = tl.full([BLOCK], 2**31 - 1, tl.int32)
    for start in tl.range(chunk * CHUNK, tl.minimum(chunk * CHUNK + CHUNK, vocab), BLOCK):
        tokens = start + tl.arange(0, BLOCK)
        mask = tokens < vocab
        logits = tl.load(logits_ptr + row * logits_row_stride + tokens, mask=mask, other=float("-inf"))
        bits = _mix(key ^ _mix(tokens.to(tl.uint32) + 0x9E3779B9))
        uniform = ((bits >> 9).to(tl.float32) + 0.5) * (1.0 / 8388608.0)  # 23 bits, strictly in (0, 1)
        noise = tl.where(greedy, 0.0, tl.log(-tl.log(uniform)))  # log E
        score = tl.math.div_rn(logits.to(tl.float32), divisor) - noise  # rounded as torch's division
        better = score > best_score  # strict: each lane keeps its earliest token on ties
        best_score = tl.where(better, score, best_score)
        best_token = tl.where(better, tokens, best_token)
    top = tl.max(best_score, axis=0)
    token = tl.min(tl.where(best_score == top, best_token, 2**31 - 1), axis=0)
    tl.store(best_score_ptr + row * n_chunks + chunk, top)
    tl.store(best_token_ptr + row * n_chunks + chunk, token)


@triton.jit
def _best_chunk_kernel(best_score_ptr, best_token_ptr, out_ptr, n_chunks, BLOCK_CHUNKS: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    chunks = tl.arange(0, BLOCK_CHUNKS)
    mask = chunks < n_chunks
    scores = tl.load(best_score_ptr + row * n_chunks + chunks, mask=mask, other=float("-inf"))
    tokens = tl.load(best_token_ptr + row * n_chunks + chunks, mask=mask, other=2**31 - 1)
    token = tl.min(tl.where(scores == tl.max(scores, axis=0), tokens, 2**31 - 1), axis=0)
    tl.store(out_ptr + row, token.to(tl.int64))


def sample_exponential_race(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                            generated: torch.Tensor) -> torch.Tensor:
    """The token `Sampler.sample` picks for rows without top-k, top-p and min-p.

    logits: [B, V] processed logits (penalties and bans applied), any float dtype, unit stride along V.
    temperature: [B] float (any stride, e.g. a column of the sampler's `floats`); 0 means greedy, the
        argmax of the logits (pass 0 for the sampler's top_k = 1 rows too).
    seeds: [B, 2] int64, the low and high 32 bits of each request's seed (the sampler's `ints[rows, 2:]`).
    generated: [B] int64 (any stride), tokens generated so far (before this one).
    Returns [B] int64 token ids. Rows whose logits are all -inf or NaN get an unspecified id. No host
    sync and no data-dependent allocation, so it can be captured in a CUDA graph.
    """
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    if seeds.stride(-1) != 1:
        seeds = seeds.contiguous()
    n_chunks = triton.cdiv(vocab, CHUNK)
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    best_score = torch.empty(rows, n_chunks, dtype=torch.float32, device=logits.device)
    best_token = torch.empty(rows, n_chunks, dtype=torch.int32, device=logits.device)
    _race_chunk_kernel[(rows, n_chunks)](logits, logits.stride(0), temperature, temperature.stride(0), seeds,
                                         seeds.stride(0), generated, generated.stride(0), best_score, best_token,
                                         vocab, n_chunks, CHUNK=CHUNK, BLOCK=BLOCK, num_warps=8)
    _best_chunk_kernel[(rows,)](best_score, best_token, out, n_chunks,
                                BLOCK_CHUNKS=triton.next_power_of_2(n_chunks))
    return out
