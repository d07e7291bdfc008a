"""The fused Triton kernels (RMSNorm, add + RMSNorm, SiLU-and-mul; rope: test_rope_store.py) against the torch
code of the layers (`forward_torch`, `silu_and_mul_torch`), which is their reference and the CPU path;
the fused sampling kernel against `Sampler.sample`.

On the CPU the kernels run in Triton's interpreter (tests/helpers.py sets TRITON_INTERPRET=1), in float32 and
float16 (the interpreter has no bfloat16 arithmetic); on a GPU (MINISGL_TEST_DEVICE=cuda) in float32
and bfloat16.
"""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from helpers import DEVICE

from minisgl.attention.base import StepAttention
from minisgl.core import SamplingParams
from minisgl.distributed import TPGroup
from minisgl.engine.sampler import Sampler
from minisgl.kernels.activation import silu_and_mul
from minisgl.kernels.norm import add_rms_norm, rms_norm
from minisgl.kernels.sampling import sample_exponential_race
from minisgl.kvcache.pool import KVPool
from minisgl.layers import activation as activation_layer
from minisgl.layers import norm as norm_layer
from minisgl.layers import rotary as rotary_layer
from minisgl.layers.activation import silu_and_mul_torch
from minisgl.layers.norm import RMSNorm
from minisgl.layers.rotary import RotaryEmbedding
from minisgl.models.config import ModelConfig
from minisgl.models.decoder import DecoderLayer

LOW_PRECISION = torch.float16 if DEVICE == "cpu" else torch.bfloat16
DTYPES = [torch.float32, LOW_PRECISION]
# The kernels round once where the reference may round after several steps: a few units in the last place.
TOLERANCE = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.float16: dict(rtol=4e-3, atol=4e-3),
             torch.bfloat16: dict(rtol=3e-2, atol=3e-2)}
# (tokens, dtype). The interpreter is slow, so on the CPU the low-precision dtype (whose casts do not
# depend on the token count) skips the largest token count; a GPU runs every pair.
TOKENS_DTYPES = [(tokens, dtype) for tokens in (1, 7, 64) for dtype in DTYPES
                 if DEVICE != "cpu" or tokens < 64 or dtype == torch.float32]
TOKENS_DTYPES_IDS = [f"{tokens}-{str(dtype)[6:]}" for tokens, dtype in TOKENS_DTYPES]


def randn(*shape: int, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    return (torch.randn(*shape) * scale).to(dtype=dtype, device=DEVICE)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """actual against the reference, in the tolerance of the reference's dtype."""
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    torch.testing.assert_close(actual.cpu(), expected.cpu(), **TOLERANCE[expected.dtype])


def make_norm(size: int, dtype: torch.dtype) -> RMSNorm:
    """An RMSNorm whose weight is far from all-ones and whose eps is large enough to change the
    result, so that a kernel ignoring either fails."""
    norm = RMSNorm(size, eps=0.05)
    norm.weight.data = (1.0 + 0.5 * torch.randn(size)).to(dtype)
    return norm.to(DEVICE)


@pytest.mark.parametrize("hidden", [48, 1024, 2560])
@pytest.mark.parametrize("tokens,dtype", TOKENS_DTYPES, ids=TOKENS_DTYPES_IDS)
def test_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(tokens * hidden)
    norm = make_norm(hidden, dtype)
    x = randn(tokens, hidden, dtype=dtype, scale=3.0)
    assert_close(rms_norm(x, norm.weight, norm.eps), norm.forward_torch(x))


@pytest.mark.parametrize("hidden", [48, 1024, 2560])
@pytest.mark.parametrize("tokens,dtype", TOKENS_DTYPES, ids=TOKENS_DTYPES_IDS)
def test_add_rms_norm(tokens: int, hidden: int, dtype: torch.dtype) -> None:
    torch.manual_seed(tokens * hidden + 1)
    norm = make_norm(hidden, dtype)
    x, residual = randn(tokens, hidden, dtype=dtype), randn(tokens, hidden, dtype=dtype, scale=5.0)
    x_before, residual_before = x.clone(), residual.clone()
    out, new_residual = add_rms_norm(x, residual, norm.weight, norm.eps)
    expected_out, expected_residual = norm.forward_torch(x, residual)
    assert torch.equal(new_residual, expected_residual)  # one add in the input dtype on both sides
    assert_close(out, expected_out)
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


def test_rms_norm_strided_rows() -> None:
    """A view whose rows are further apart than their length (a slice of a wider tensor) and a 3-D
    input that cannot be flattened without a copy are both read correctly."""
    torch.manual_seed(0)
    norm = make_norm(48, torch.float32)
    wide = randn(5, 100, dtype=torch.float32)
    assert_close(rms_norm(wide[:, 10:58], norm.weight, norm.eps), norm.forward_torch(wide[:, 10:58]))
    heads = randn(3, 4, 100, dtype=torch.float32)[:, :, :48]
    assert_close(rms_norm(heads, norm.weight, norm.eps), norm.forward_torch(heads))


@pytest.mark.parametrize("intermediate", [48, 1024, 1536])
@pytest.mark.parametrize("tokens,dtype", TOKENS_DTYPES, ids=TOKENS_DTYPES_IDS)
def test_silu_and_mul(tokens: int, intermediate: int, dtype: torch.dtype) -> None:
    torch.manual_seed(tokens + intermediate)
    x = randn(tokens, 2 * intermediate, dtype=dtype, scale=4.0)
    assert_close(silu_and_mul(x), silu_and_mul_torch(x))


def test_empty_batch() -> None:
    """Zero tokens (an idle rank, an empty chunk) launch nothing and return empty tensors."""
    weight = torch.ones(48, device=DEVICE)
    x = torch.empty(0, 48, device=DEVICE)
    assert rms_norm(x, weight, 1e-6).shape == (0, 48)
    assert [t.shape for t in add_rms_norm(x, x, weight, 1e-6)] == [(0, 48), (0, 48)]
    assert silu_and_mul(torch.empty(0, 96, device=DEVICE)).shape == (0, 48)


def tiny_config(qk_norm: bool) -> ModelConfig:
    """A small Qwen3-like (qk_norm) or Llama-like layer, with non-power-of-two hidden and MLP sizes."""
    return ModelConfig(architecture="test", vocab_size=64, hidden_size=96, intermediate_size=160, num_layers=1,
                       num_heads=6, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6, max_position_embeddings=512,
                       rope_theta=1e4, rope_scaling=None, tie_word_embeddings=False, qkv_bias=False,
                       o_proj_bias=False, qk_norm=qk_norm, dtype=torch.float32)


def causal_attention(pool: KVPool, slots: torch.Tensor) -> StepAttention:
    """Attention over one sequence whose tokens' K/V the layer stores at `slots`, read back from the pool."""
    def attend(layer: int, q: torch.Tensor) -> torch.Tensor:
        k, v = pool.load(layer, slots, q.dtype)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True,
                                             enable_gqa=True)
        return out.transpose(0, 1).reshape(q.shape[0], -1)
    return StepAttention(pool, slots, attend)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3"])
def test_decoder_layer_uses_kernels(qk_norm: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole decoder layer with its layers routed to the kernels equals the same layer routed to the
    torch path (both forced, on the test device): the kernels are wired in with the right arguments,
    views and return values, for the first layer (no residual yet) and for a later one; k and v reach the
    pool at the step's slots (attention reads them back from there)."""
    torch.manual_seed(0)
    config = tiny_config(qk_norm)
    layer = DecoderLayer(config, 0, TPGroup()).to(DEVICE)
    for name, param in layer.named_parameters():
        init = 1.0 + 0.3 * torch.randn(param.shape) if "norm" in name else 0.2 * torch.randn(param.shape)
        param.data = init.to(DEVICE)
    rope = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta, None).to(DEVICE)
    x, residual = randn(7, config.hidden_size, dtype=torch.float32), randn(7, config.hidden_size, dtype=torch.float32)
    positions = torch.tensor([3, 4, 5, 6, 7, 8, 9], device=DEVICE)
    slots = torch.tensor([9, 2, 11, 0, 5, 6, 14], device=DEVICE)

    def run(fused: bool) -> list[tuple[torch.Tensor, torch.Tensor]]:
        asked = []
        for module in (norm_layer, rotary_layer, activation_layer):
            monkeypatch.setattr(module, "use_triton", lambda tensor: asked.append(tensor) or fused)
        pool = KVPool(1, 16, 1, config.num_kv_heads, config.head_dim, torch.float32, torch.device(DEVICE))
        with torch.no_grad():
            outputs = [layer(x, None, positions, rope, causal_attention(pool, slots)),
                       layer(x, residual, positions, rope, causal_attention(pool, slots))]
        assert len(asked) == 2 * 4  # two norms, rope and the activation, in each call
        untouched = torch.ones(pool.k.shape[1], dtype=torch.bool, device=DEVICE)
        untouched[slots] = False
        assert not pool.k[:, untouched].any() and not pool.v[:, untouched].any()
        return outputs

    for (out, res), (expected_out, expected_res) in zip(run(fused=True), run(fused=False)):
        assert_close(out, expected_out)
        assert_close(res, expected_res)


def test_sample_exponential_race_matches_sampler() -> None:
    """The kernel picks the token `Sampler.sample` picks for plain temperature (and greedy) rows: rows
    in any order, 64-bit seeds, various generated counts, banned (-inf) ids, and a vocabulary of several
    chunks with a partial last one. Where the tokens differ, the two tokens' race scores must tie within
    float32 rounding."""
    torch.manual_seed(0)
    rng = random.Random(0)
    batch, vocab = 6, 5000
    sampler = Sampler(max_rows=16, vocab_size=vocab, device=DEVICE)
    rows = torch.tensor(rng.sample(range(16), batch), device=DEVICE)
    for i, row in enumerate(rows.tolist()):
        params = SamplingParams(temperature=[0.0, 0.7, 1.0, 1.0, 1.5, 2.0][i])
        sampler.prepare_row(row, params, rng.getrandbits(64), [1, 2, 3], [7] * rng.randrange(0, 3000), [])
    logits = randn(batch, vocab, dtype=torch.float32, scale=2.0)
    logits[:, rng.sample(range(vocab), 100)] = float("-inf")
    # Strided views, as slices of the sampler's state tensors are.
    temperature, seeds = sampler.floats[rows][:, 0], sampler.ints[rows][:, 2:]
    generated = torch.stack([sampler.generated[rows]] * 2, dim=1)[:, 0]
    noise = sampler._exponential(rows)  # the reference's Exp(1) draws, for the tie check below

    tokens = sample_exponential_race(logits, temperature, seeds, generated)
    expected = sampler.sample(logits, rows).token_ids

    assert tokens.dtype == torch.int64 and tokens.shape == (batch,)
    greedy = temperature == 0
    assert torch.equal(tokens[greedy], logits[greedy].argmax(-1))
    # The noise decides: most sampled rows do not take the argmax, so a kernel ignoring it would fail.
    assert (expected[~greedy] != logits[~greedy].argmax(-1)).sum() >= 3
    scores = logits.double() / torch.where(greedy, 1.0, temperature).double()[:, None] - noise.double().log()
    for row in torch.nonzero(tokens != expected).flatten().tolist():
        ours, theirs = scores[row, tokens[row]], scores[row, expected[row]]
        assert abs(ours - theirs) <= 1e-5 * abs(theirs), f"row {row}: {tokens[row]} vs {expected[row]}"
    assert (tokens == expected).sum() >= batch - 1
