"""Sampler tests on fixed logits: greedy, seeded reproducibility, top-k/top-p/min-p, penalties,
min_tokens, logprobs, thinking budgets and re-admission; and thinking budgets through the whole engine."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from helpers import hf_greedy, make_llm, random_prompts

from minisgl.core import SamplingParams, ThinkingBudget, check_request
from minisgl.engine.sampler import Sampler

V = 32


def fixed_logits(probs: list[float], vocab: int = V) -> torch.Tensor:
    """[vocab] logits whose softmax puts `probs` on the first ids and (almost) nothing elsewhere."""
    logits = torch.full((vocab,), -1e4)
    logits[: len(probs)] = torch.tensor([math.log(p) for p in probs])
    return logits


def make(params: list[SamplingParams], seeds: list[int] | None = None, vocab: int = V,
         prompt: list[int] | None = None, banned: list[int] | None = None) -> tuple[Sampler, torch.Tensor]:
    """A sampler with one prepared row per params entry, and the rows tensor covering them all."""
    sampler = Sampler(len(params), vocab, "cpu")
    for row, p in enumerate(params):
        seed = seeds[row] if seeds is not None else row
        sampler.prepare_row(row, p, seed, prompt or [], [], banned or [])
    return sampler, torch.arange(len(params))


def counts_of(tokens: torch.Tensor, vocab: int) -> torch.Tensor:
    return torch.bincount(tokens, minlength=vocab).float()


def test_greedy_is_argmax_and_top_k_1_is_greedy() -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, V)
    sampler, rows = make([SamplingParams(temperature=0)] * 2 + [SamplingParams(temperature=1.0, top_k=1)] * 2)
    for _ in range(5):
        assert torch.equal(sampler.sample(logits, rows).token_ids, logits.argmax(-1))
    # top_k=1 rows are greedy even when other rows in the batch sample randomly.
    sampler, rows = make([SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=1.5)])
    for _ in range(5):
        assert sampler.sample(logits[:2], rows).token_ids[0] == logits[0].argmax()


def test_same_seed_same_tokens_whatever_the_batch() -> None:
    torch.manual_seed(1)
    steps = [torch.randn(V) for _ in range(20)]
    params = SamplingParams(temperature=0.9, top_p=0.95)
    alone, rows = make([params], seeds=[1234])
    expected = [alone.sample(s[None], rows).token_ids[0] for s in steps]

    others = [SamplingParams(temperature=0.5, top_k=5), SamplingParams(temperature=0),
              SamplingParams(temperature=1.2, min_p=0.1, presence_penalty=1.0),
              SamplingParams(temperature=1.0, repetition_penalty=1.3, frequency_penalty=0.5),
              SamplingParams(temperature=0.7, top_p=0.5, top_k=10)]
    batch, rows = make(others[:3] + [params] + others[3:], seeds=[7, 8, 9, 1234, 10, 11], prompt=[1, 2, 3])
    for s, token in zip(steps, expected):
        out = batch.sample(torch.stack([torch.randn(V), torch.randn(V), torch.randn(V), s,
                                        torch.randn(V), torch.randn(V)]), rows).token_ids
        assert out[3] == token

    # A different row index (a bigger sampler, batch holding that row only) gives the same stream too.
    moved = Sampler(16, V, "cpu")
    moved.prepare_row(11, params, 1234, [5, 6], [], [])
    assert [moved.sample(s[None], torch.tensor([11])).token_ids[0] for s in steps] == expected


def test_different_seeds_give_different_streams() -> None:
    flat = torch.zeros(2, 100)
    sampler, rows = make([SamplingParams(temperature=1.0)] * 2, seeds=[1, 2], vocab=100)
    streams = torch.stack([sampler.sample(flat, rows).token_ids for _ in range(50)])
    assert (streams[:, 0] == streams[:, 1]).sum() < 8  # about 0.5 expected by chance
    assert streams[:, 0].unique().numel() > 25  # and each stream moves around


def test_flat_distribution_is_uniform_over_seeds() -> None:
    n, vocab = 4000, 8
    sampler, rows = make([SamplingParams(temperature=1.0)] * n, vocab=vocab)
    freq = counts_of(sampler.sample(torch.zeros(n, vocab), rows).token_ids, vocab) / n
    assert torch.allclose(freq, torch.full((vocab,), 1 / vocab), atol=0.025)


def test_temperature_scales_the_distribution() -> None:
    n = 4000
    logits = fixed_logits([0.6, 0.3, 0.1])
    sampler, rows = make([SamplingParams(temperature=0.5)] * n)
    freq = counts_of(sampler.sample(logits.expand(n, V), rows).token_ids, V)[:3] / n
    expected = torch.softmax(logits[:3] / 0.5, -1)
    assert torch.allclose(freq, expected, atol=0.03)


def test_top_k_stays_within_top_k_and_covers_it() -> None:
    n, k = 2000, 5
    torch.manual_seed(2)
    logits = torch.randn(V)
    sampler, rows = make([SamplingParams(temperature=1.0, top_k=k)] * n)
    tokens = sampler.sample(logits.expand(n, V), rows).token_ids
    assert set(tokens.tolist()) == set(logits.topk(k).indices.tolist())


@pytest.mark.parametrize("top_p, allowed", [(0.8, 2), (0.81, 3), (1.0, 4)])
def test_top_p_keeps_the_smallest_set_reaching_top_p(top_p: float, allowed: int) -> None:
    n = 4000
    probs = [0.5, 0.3, 0.15, 0.05]
    sampler, rows = make([SamplingParams(temperature=1.0, top_p=top_p)] * n)
    tokens = sampler.sample(fixed_logits(probs).expand(n, V), rows).token_ids
    assert set(tokens.tolist()) == set(range(allowed))
    expected = torch.tensor(probs[:allowed]) / sum(probs[:allowed])
    assert torch.allclose(counts_of(tokens, V)[:allowed] / n, expected, atol=0.03)


def test_top_p_applies_after_top_k() -> None:
    n = 2000
    # After top_k=2 the distribution is 0.625 / 0.375, so top_p=0.6 keeps token 0 only.
    sampler, rows = make([SamplingParams(temperature=1.0, top_k=2, top_p=0.6)] * n)
    tokens = sampler.sample(fixed_logits([0.5, 0.3, 0.15, 0.05]).expand(n, V), rows).token_ids
    assert set(tokens.tolist()) == {0}


def test_min_p_drops_tokens_below_the_threshold() -> None:
    n = 4000
    probs = [0.5, 0.2, 0.13, 0.1, 0.07]  # threshold 0.25 * 0.5 = 0.125
    sampler, rows = make([SamplingParams(temperature=1.0, min_p=0.25)] * n)
    tokens = sampler.sample(fixed_logits(probs).expand(n, V), rows).token_ids
    assert set(tokens.tolist()) == {0, 1, 2}


def test_penalties_match_hand_computed_logits() -> None:
    logits = torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]])
    vocab = logits.shape[1]
    params = SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25)
    sampler = Sampler(2, vocab, "cpu")
    # Token 0, 1 in the prompt; token 2 once and token 3 twice in the output; 4 and 5 unseen.
    sampler.prepare_row(1, params, 0, [0, 1], [2, 3, 3], [])
    got = sampler.process_logits(logits, torch.tensor([1]))
    expected = torch.tensor([[2.0 / 2, -2.0 * 2, 1.0 / 2 - 0.5 - 0.25, -1.0 * 2 - 1.0 - 0.25, 0.5, 3.0]])
    assert torch.allclose(got, expected)
    assert torch.equal(logits, torch.tensor([[2.0, -2.0, 1.0, -1.0, 0.5, 3.0]]))  # input untouched

    # Each penalty alone.
    for p, want in [(SamplingParams(repetition_penalty=1.5), [2 / 1.5, -2 * 1.5, 1 / 1.5, -1.5, 0.5, 3.0]),
                    (SamplingParams(frequency_penalty=-1.0), [2.0, -2.0, 2.0, 1.0, 0.5, 3.0]),
                    (SamplingParams(presence_penalty=2.0), [2.0, -2.0, -1.0, -3.0, 0.5, 3.0])]:
        sampler.prepare_row(0, p, 0, [0, 1], [2, 3, 3], [])
        assert torch.allclose(sampler.process_logits(logits, torch.tensor([0])), torch.tensor([want]))


def test_presence_penalty_prevents_greedy_repeats() -> None:
    logits = torch.zeros(1, V)
    logits[0, :8] = torch.linspace(5.0, 4.3, 8)  # eight favourites within the penalty of each other
    sampler, rows = make([SamplingParams(temperature=0, presence_penalty=2.0)])
    tokens = [int(sampler.sample(logits, rows).token_ids[0]) for _ in range(8)]
    assert tokens == list(range(8))  # each step takes the best token not yet generated
    no_penalty, rows = make([SamplingParams(temperature=0)])
    assert {int(no_penalty.sample(logits, rows).token_ids[0]) for _ in range(8)} == {0}


def test_rows_without_penalties_are_untouched_by_others_penalties() -> None:
    torch.manual_seed(4)
    logits = torch.randn(2, V)
    sampler, rows = make([SamplingParams(temperature=0), SamplingParams(temperature=0, presence_penalty=2.0)],
                         prompt=[1, 2, 3])
    for _ in range(3):
        sampler.sample(logits, rows)
    assert torch.equal(sampler.process_logits(logits, rows)[0], logits[0])


def test_min_tokens_bans_until_reached() -> None:
    logits = torch.zeros(1, V)
    logits[0, 5] = 10.0  # EOS, the favourite
    logits[0, 9] = 5.0  # a stop token, second
    sampler, rows = make([SamplingParams(temperature=0, min_tokens=3)], banned=[5, 9])
    tokens = [int(sampler.sample(logits, rows).token_ids[0]) for _ in range(4)]
    assert tokens[:3] != [5, 5, 5] and not {5, 9} & set(tokens[:3])
    assert tokens[3] == 5
    # Sampled (non-greedy) rows obey the ban too.
    sampler, rows = make([SamplingParams(temperature=1.0, min_tokens=2)] * 200, banned=[5])
    assert not (sampler.sample(logits.expand(200, V), rows).token_ids == 5).any()


def test_logprobs_come_from_raw_logits() -> None:
    torch.manual_seed(5)
    logits = torch.randn(3, V).to(torch.bfloat16)
    sampler, rows = make([SamplingParams(temperature=1.0, repetition_penalty=1.5),
                          SamplingParams(temperature=0, presence_penalty=1.0),
                          SamplingParams(temperature=0.5, top_k=3)], prompt=[0, 1, 2, 3])
    out = sampler.sample(logits, rows, top_n=4)
    raw = torch.log_softmax(logits.float(), -1)
    assert out.token_ids.dtype == torch.int64 and out.logprobs.dtype == torch.float32
    assert torch.allclose(out.logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    top = raw.topk(4, -1)
    assert torch.equal(out.top_ids, top.indices) and torch.allclose(out.top_logprobs, top.values)
    assert sampler.sample(logits, rows).logprobs is None


def test_readmission_restores_counter_and_counts() -> None:
    params = SamplingParams(temperature=0.8, frequency_penalty=0.5, min_tokens=5)
    sampler = Sampler(4, V, "cpu")
    sampler.prepare_row(2, params, 99, [1, 2], [], [0])
    row = torch.tensor([2])
    torch.manual_seed(6)
    steps = [torch.randn(1, V) for _ in range(6)]
    first = [int(sampler.sample(s, row).token_ids[0]) for s in steps]
    assert int(sampler.generated[2]) == 6
    assert torch.equal(sampler.counts[2], counts_of(torch.tensor(first), V))

    # Retracted after 3 tokens, re-admitted into another row: same counter, counts and continuation.
    again = Sampler(4, V, "cpu")
    again.prepare_row(0, SamplingParams(presence_penalty=1.0), 5, [3], [4, 4], [])  # stale state in row 0
    again.prepare_row(0, params, 99, [1, 2], first[:3], [0])
    assert int(again.generated[0]) == 3
    assert torch.equal(again.counts[0], counts_of(torch.tensor(first[:3]), V))
    assert [int(again.sample(s, torch.tensor([0])).token_ids[0]) for s in steps[3:]] == first[3:]


def test_extreme_values_still_sample_a_real_token():
    """top_p at the smallest float keeps the most likely token; a repetition penalty of 1e-300 (dividing a
    positive logit by it overflows) still gives a finite distribution, not NaN and token 0."""
    logits = torch.tensor([[0.5, 3.0, 1.0, 2.0]])
    tiny_top_p = Sampler(2, 4, "cpu")
    tiny_top_p.prepare_row(0, SamplingParams(temperature=1.0, top_p=5e-324, seed=1), 1, [0], [], [])
    assert tiny_top_p.sample(logits, torch.tensor([0])).token_ids.tolist() == [1]
    tiny_penalty = Sampler(2, 4, "cpu")
    tiny_penalty.prepare_row(0, SamplingParams(temperature=1.0, repetition_penalty=1e-300, seed=1), 1, [3], [], [])
    assert tiny_penalty.sample(logits, torch.tensor([0])).token_ids.tolist() == [3]  # the seen, boosted token


def test_logit_bias_is_added_per_row_before_sampling() -> None:
    """OpenAI's logit_bias: +100 forces a token, -100 bans the best one; rows without a bias in the same batch,
    and a row re-prepared for a request without one, are untouched; logprobs stay the model's."""
    torch.manual_seed(3)
    logits = torch.randn(3, V)
    best = logits.argmax(-1)
    forced, banned = (int(best[0]) + 1) % V, int(best[1])
    params = [SamplingParams(temperature=0, logit_bias={forced: 100}), SamplingParams(temperature=0, logit_bias={
        banned: -100}), SamplingParams(temperature=0)]
    sampler, rows = make(params)
    out = sampler.sample(logits, rows, top_n=1)
    assert out.token_ids[0] == forced
    assert out.token_ids[1] == logits[1].masked_fill(torch.arange(V) == banned, -1e9).argmax()
    assert out.token_ids[2] == best[2]
    assert torch.allclose(out.logprobs, torch.log_softmax(logits, -1).gather(-1, out.token_ids[:, None])[:, 0])
    hot = SamplingParams(temperature=1.0, logit_bias={forced: 100, banned: 5.0})
    sampler.prepare_row(1, hot, 9, [], [], [])
    assert all(sampler.sample(logits[:2], rows[:2]).token_ids[1] == forced for _ in range(5))
    sampler.prepare_row(0, SamplingParams(temperature=0), 0, [], [], [])  # its bias must not linger
    assert sampler.sample(logits[:2], rows[:2]).token_ids[0] == best[0]  # beside row 1, still biased


def test_thinking_budget_forces_the_end_marker_after_n_thinking_tokens() -> None:
    """vLLM's thinking_token_budget: with markers start (3, 4) and end (5, 6, 7) and a budget of 3, a block
    holding 3 tokens gets the end marker next, whether the prompt or the output opened it; a block the model
    closes itself, and a row without a budget, take what they draw; an end marker begun when the budget runs
    out is forced whole (the block holds exactly the budget, as vLLM counts it). A row prepared again from its
    tokens (re-admission) goes on where it was."""
    think = ThinkingBudget(3, (3, 4), (5, 6, 7))
    wants = {  # row: (prompt, params, the token the logits pick at each step, the tokens expected)
        "prompt opens": ([1, 3, 4], think, [9] * 9, [9, 9, 9, 5, 6, 7, 9, 9, 9]),
        "no budget": ([1, 3, 4], None, [9] * 9, [9] * 9),
        "output opens": ([1, 2], think, [3, 4] + [9] * 7, [3, 4, 9, 9, 9, 5, 6, 7, 9]),
        "closes itself": ([3, 4], think, [5, 6, 7] + [9] * 6, [5, 6, 7, 9, 9, 9, 9, 9, 9]),
        "end begun at the budget": ([3, 4], think, [9, 5, 6] + [9] * 6, [9, 5, 6, 5, 6, 7, 9, 9, 9]),
        "closed by the prompt": ([3, 4, 8, 5, 6, 7], think, [9] * 9, [9] * 9),
        "end begun, then not": ([3, 4], think, [5, 6, 9] + [9] * 6, [5, 6, 9, 5, 6, 7, 9, 9, 9]),
    }
    sampler = Sampler(len(wants), V, "cpu")
    for row, (prompt, budget, _, _) in enumerate(wants.values()):
        sampler.prepare_row(row, SamplingParams(temperature=0, thinking_budget=budget), 0, prompt, [], [])
    rows = torch.arange(len(wants))
    picks = torch.tensor([picked for _, _, picked, _ in wants.values()])  # [rows, steps]
    taken = []
    for step in range(picks.shape[1]):
        if step == 5:  # re-admit every row from what it has so far, into a fresh sampler
            sampler = Sampler(len(wants), V, "cpu")
            for row, (prompt, budget, _, _) in enumerate(wants.values()):
                sampler.prepare_row(row, SamplingParams(temperature=0, thinking_budget=budget), 0, prompt,
                                    [t[row] for t in taken], [])
        logits = torch.nn.functional.one_hot(picks[:, step], V).float() * 10
        taken.append(sampler.sample(logits, rows, top_n=1).token_ids.tolist())
    for row, (name, (_, _, _, expected)) in enumerate(wants.items()):
        assert [t[row] for t in taken] == expected, name


def test_thinking_budget_zero_and_a_prompt_over_budget_close_at_once() -> None:
    """A budget of 0 ends a block the prompt opened with the end marker first; so does a prompt whose open block
    already holds more tokens than the budget."""
    for budget, prompt in ((0, [3, 4]), (2, [3, 4, 8, 8, 8, 8])):
        sampler, rows = make([SamplingParams(temperature=0, thinking_budget=ThinkingBudget(budget, (3, 4), (5, 6)))],
                             prompt=prompt)
        logits = torch.nn.functional.one_hot(torch.tensor([9]), V).float()
        assert [sampler.sample(logits, rows).token_ids[0].item() for _ in range(4)] == [5, 6, 9, 9]


@pytest.mark.parametrize("overlap", [True, False])
def test_thinking_budget_through_the_engine(tiny_models, overlap):
    """The engine (overlap scheduling or not, decode graphs on a GPU) forces the end marker right after the
    budget's tokens, whether the prompt opened the block or the output did (its first two greedy tokens taken
    as the start marker), and then goes on as transformers does from that context; requests in the same batch
    without a budget are what they are alone."""
    path = tiny_models["qwen3"]
    llm = make_llm(path, overlap_schedule=overlap)
    try:
        greedy = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
        prompts = random_prompts([9, 30, 17], 400, seed=21)
        alone = [out.token_ids for out in llm.generate(prompts, greedy)]
        end = (5, 6, 7)
        opened_by_prompt = ThinkingBudget(4, (11, 12), end)
        opened_by_output = ThinkingBudget(3, tuple(alone[1][:2]), end)
        outs = [o.token_ids for o in llm.generate(
            [prompts[0] + [11, 12], prompts[1], prompts[2]],
            [dataclasses.replace(greedy, thinking_budget=opened_by_prompt),
             dataclasses.replace(greedy, thinking_budget=opened_by_output), greedy])]
        thought = hf_greedy(path, [prompts[0] + [11, 12]], 4)[0]
        assert outs[0][:4] == thought and tuple(outs[0][4:7]) == end
        assert outs[0][7:] == hf_greedy(path, [prompts[0] + [11, 12] + outs[0][:7]], 7)[0]
        assert outs[1][:5] == alone[1][:5] and tuple(outs[1][5:8]) == end
        assert outs[2] == alone[2]
    finally:
        llm.shutdown()


def test_logprobs_are_capped_by_the_vocabulary_not_by_openais_20() -> None:
    """Any count of alternatives up to the vocabulary is a valid request (a server caps it with --max-logprobs);
    more would ask topk for more tokens than there are."""
    check_request([1, 2], SamplingParams(logprobs=V, prompt_logprobs=V), V, 64, 64)
    for field in ("logprobs", "prompt_logprobs"):
        with pytest.raises(ValueError, match=f"{field} must be at most the vocabulary size {V}"):
            check_request([1, 2], SamplingParams(**{field: V + 1}), V, 64, 64)
