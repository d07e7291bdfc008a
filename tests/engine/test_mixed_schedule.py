"""The decode-first schedule: every step carries all running decodes, and prefill chunks fill the rest of
one token budget in the same batch.

Each step's batch is read where the scheduler hands it to the (real) engine. The checks: while a long
prompt is chunked in, no step leaves a decode out and none exceeds the budget; admission is FIFO and
starves nobody; with chunks mixed into decodes, retraction and overlap give the greedy tokens of a plain
run (each request alone, one big prefill, no overlap). With a step cost model (--max-mixed-step-ratio), a
prompt comes in chunks beside decodes once they have spent their stall, a backlog or many decodes bound the
step by the ratio of their cost instead, and a prompt still advances every step and keeps its place in line.
"""

from __future__ import annotations

import pytest
from helpers import make_llm, random_prompts

from minisgl import LLM, SamplingParams
from minisgl.attention.triton_backend import MixedMeta
from minisgl.core import Batch, Req
from minisgl.engine.step_cost import StepCost
from minisgl.messages import AddReq
from minisgl.scheduler import scheduler as policy
from minisgl.scheduler.scheduler import PREFILL_FLOOR

VOCAB = 400


def prompts(lengths: list[int], seed: int = 0) -> list[list[int]]:
    return random_prompts(lengths, VOCAB, seed)


def greedy(max_tokens: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)


def record_batches(llm: LLM) -> list[Batch]:
    """The batches the scheduler launches from now on, each checked as it is launched: every running request
    left out of it is still prefilling, or has nothing left to compute (its last token is in flight)."""
    sched, forward, seen = llm.scheduler, llm.engine.forward, []

    def checked(batch: Batch):
        taken = {id(r) for r in batch.reqs}
        for req in sched.running:
            if id(req) not in taken:  # after the batch's bookkeeping: a left-out decode still has 1 token to do
                assert req.device_len - req.kv_len > 1 or sched._awaits_last_token(req), f"decode {req.rid} left out"
        seen.append(batch)
        return forward(batch)

    llm.engine.forward = checked
    return seen


def drive(llm: LLM, reqs: list[Req], arrivals: dict[int, list[Req]] | None = None) -> list[Req]:
    """Tick until every request finished; `arrivals[k]` are added before tick k. Returns them in finish order."""
    arrivals = arrivals or {}
    llm.scheduler.tick([AddReq(r) for r in reqs])
    done, tick = [], 1
    while llm.scheduler.has_work or any(k >= tick for k in arrivals):
        llm.scheduler.tick([AddReq(r) for r in arrivals.get(tick, [])])
        tick += 1
        done += llm.scheduler.take_outputs()[1]
    return done


def first_token_ticks(llm: LLM, first: list[Req], later: list[Req], arrive_at: int, ticks: int) -> dict[int, int]:
    """Tick (at most `ticks` times) until every request finished, `later` added before tick `arrive_at`: the
    tick at which each request had its first token, by rid."""
    sched, at = llm.scheduler, {}
    sched.tick([AddReq(r) for r in first])
    for k in range(1, ticks):
        if not sched.has_work and k > arrive_at:
            break
        sched.tick([AddReq(r) for r in later] if k == arrive_at else [])
        for r in (*first, *later):
            if r.output_ids and r.rid not in at:
                at[r.rid] = k
    return at


def alone(path: str, reqs: list[Req]) -> list[list[int]]:
    """The plain run: each request by itself, its prompt in one step, no overlap."""
    llm = make_llm(path, overlap_schedule=False)
    try:
        return [llm.generate(r.prompt_ids, r.params)[0].token_ids for r in reqs]
    finally:
        llm.shutdown()


@pytest.mark.parametrize("overlap", [True, False])
def test_long_prompt_chunks_in_beside_every_decode_within_the_budget(tiny_models, overlap):
    path = tiny_models["qwen3"]
    llm = make_llm(path, max_prefill_tokens=16, max_running_requests=8, overlap_schedule=overlap)
    try:
        batches = record_batches(llm)
        short = [Req(i, p, greedy(24), seed=0) for i, p in enumerate(prompts([5, 7, 6]))]
        long = Req(9, prompts([90], seed=1)[0], greedy(4), seed=0)
        drive(llm, short, arrivals={3: [long]})
    finally:
        llm.shutdown()
    assert all(sum(b.extend_lens) <= 16 for b in batches)
    chunked = [b for b in batches if long in b.reqs and b.extend_lens[b.reqs.index(long)] > 1]
    assert len(chunked) >= 6  # 90 tokens next to 3 decodes: 13 a step at most
    for b in chunked:  # mixed: all three short requests decode in the very step the chunk runs in
        assert [n for r, n in zip(b.reqs, b.extend_lens) if r is not long] == [1, 1, 1]
        assert sum(b.extend_lens) == 16 or b is chunked[-1]  # the chunk takes all the room the decodes leave
    assert [len(r.output_ids) for r in short] == [24] * 3 and len(long.output_ids) == 4
    assert [r.output_ids for r in [*short, long]] == alone(path, [*short, long])


def mixed_split_run(path: str, split_bytes: int) -> tuple[list[list[int]], list[int]]:
    """Three short requests decode while a long prompt is chunked in beside them, on the Triton backend whose
    mixed steps split their decode rows off from `split_bytes` of K/V a layer: the greedy tokens, and the number
    of decode rows each split step gave the decode kernel."""
    # no CUDA graphs: on a GPU the whole-step graphs would run the mixed steps without `prepare` (their attention
    # is captured)
    llm = make_llm(path, attention_backend="triton", max_prefill_tokens=16, max_running_requests=8, cuda_graph_max_bs=0)
    backend, split_rows = llm.engine.prefill_backend, []
    backend.mixed_split_kv_bytes, prepare = split_bytes, backend.prepare

    def recorded(batch):
        meta = prepare(batch)
        if isinstance(meta, MixedMeta):
            split_rows.append(meta.decode.rows.numel())
        return meta

    backend.prepare = recorded
    short = [Req(i, p, greedy(20), seed=0) for i, p in enumerate(prompts([5, 7, 6]))]
    long = Req(9, prompts([90], seed=1)[0], greedy(4), seed=0)
    try:
        drive(llm, short, arrivals={3: [long]})
    finally:
        llm.shutdown()
    return [r.output_ids for r in [*short, long]], split_rows


def test_mixed_steps_decode_rows_through_the_decode_kernel_keep_the_greedy_tokens(tiny_models):
    """The decode rows of every mixed step through the split-KV decode kernel (threshold 0) give the tokens of
    the same run with the split off (every mixed step one extend launch)."""
    split_tokens, split_rows = mixed_split_run(tiny_models["qwen3"], 0)
    plain_tokens, plain_rows = mixed_split_run(tiny_models["qwen3"], 1 << 62)
    assert len(split_rows) >= 6 and max(split_rows) == 3 and plain_rows == []  # up to all three decodes
    assert split_tokens == plain_tokens


def test_pure_decode_steps_stay_decode_batches(tiny_models):
    """A step without prefill tokens is a decode batch (CUDA graphs replay those)."""
    llm = make_llm(tiny_models["qwen3"], max_prefill_tokens=32)
    try:
        batches = record_batches(llm)
        drive(llm, [Req(i, p, greedy(6), seed=0) for i, p in enumerate(prompts([4, 9]))])
    finally:
        llm.shutdown()
    assert not batches[0].is_decode and all(b.is_decode for b in batches[1:]) and len(batches) >= 6


def test_admission_is_fifo_and_starves_no_one(tiny_models):
    """More requests than may run, arriving over time, long and short mixed: they start (first token) in
    arrival order, and every running one gets a token in every step until it finishes."""
    llm = make_llm(tiny_models["qwen2"], max_prefill_tokens=24, max_running_requests=3)
    lengths = [40, 3, 30, 5, 60, 4, 8, 50]
    reqs = [Req(i, p, greedy(5 + i % 3), seed=0) for i, p in enumerate(prompts(lengths, seed=2))]
    try:
        batches = record_batches(llm)
        first_token_at = first_token_ticks(llm, reqs[:5], reqs[5:], arrive_at=4, ticks=200)
    finally:
        llm.shutdown()
    assert all(r.finish_reason == "length" for r in reqs)
    order = sorted(first_token_at, key=lambda rid: (first_token_at[rid], rid))
    assert order == [r.rid for r in reqs]
    assert all(sum(b.extend_lens) <= 24 for b in batches)


@pytest.mark.parametrize("overlap", [True, False])
def test_retraction_amid_mixed_steps_keeps_the_greedy_tokens(tiny_models, overlap):
    """A pool too small for all of them: decodes retract the newest request while others are still being
    chunked in; everyone still ends with the tokens of a plain run."""
    path = tiny_models["qwen2"]
    llm = make_llm(path, page_size=4, num_pages=30, max_prefill_tokens=12, max_running_requests=4,
                   overlap_schedule=overlap)
    reqs = [Req(i, p, greedy(24), seed=0) for i, p in enumerate(prompts([10, 26, 14, 20], seed=3))]
    try:
        batches = record_batches(llm)
        drive(llm, reqs)
        retracted = llm.stats()["num_retracted"]
    finally:
        llm.shutdown()
    assert retracted > 0
    assert any(not b.is_decode and 1 in b.extend_lens for b in batches)  # some steps mixed decodes and chunks
    assert [r.output_ids for r in reqs] == alone(path, reqs)


def launches_and_first_tokens(path: str, running: list[int], arriving: list[int]) -> tuple[list, list[Req]]:
    """Prompts `running` start together, `arriving` come at the fourth tick (budget 16 tokens a step, overlap
    on); per tick, (the batches it launched, the rids whose first token it read), and the requests."""
    llm = make_llm(path, max_prefill_tokens=16)
    sched = llm.scheduler
    reqs = [Req(i, p, greedy(12), seed=0) for i, p in enumerate(prompts(running + arriving))]
    try:
        batches, ticks = record_batches(llm), []
        for k in range(300):
            if k > 3 and not sched.has_work:
                break
            launched, started = len(batches), {r.rid for r in reqs if r.output_ids}
            added = reqs[:len(running)] if k == 0 else reqs[len(running):] if k == 3 else []
            sched.tick([AddReq(r) for r in added])
            ticks.append((batches[launched:], {r.rid for r in reqs if r.output_ids} - started))
    finally:
        llm.shutdown()
    assert [len(r.output_ids) for r in reqs] == [12] * len(reqs)
    return ticks, reqs


def test_first_tokens_are_read_before_a_prefill_launch_only_when_they_outnumber_the_other_decodes(tiny_models):
    """With overlap, a batch with prefill tokens (costly to launch: no CUDA graph) is launched before the step in
    flight is read, as every batch is, unless that step samples first tokens of at least as many requests as
    the batch decodes others: then the step is read first (its first tokens go out before the launch) and the
    batch launched at the next tick."""
    path = tiny_models["qwen3"]
    # Light load: three short prompts end their prefill together beside no other decode, a long one behind them.
    ticks, _ = launches_and_first_tokens(path, [5, 5, 5, 40], [])
    read_first = [k for k, (launched, first) in enumerate(ticks) if first and not launched]
    assert read_first and not ticks[read_first[0] + 1][0][0].is_decode  # the prefill batch waited one tick
    # Under load: six requests decode when a short prompt's first token is sampled beside a long prompt's chunks.
    ticks, reqs = launches_and_first_tokens(path, [5] * 6, [7, 40])
    launched, _ = next(t for t in ticks if reqs[6].rid in t[1])
    assert launched and not launched[0].is_decode  # read in the tick that launched the next chunk
    assert [r.output_ids for r in reqs] == alone(path, reqs)


# A model of the device's step time, as engine/step_cost.py measures on a GPU: flat up to 64 tokens, then linear;
# decode attention 1 ms per 1,000 cached tokens.
COST = StepCost(tokens=(16, 64, 256, 512), linear_ms=(1.0, 1.0, 2.0, 3.0), kv_ms_per_token=0.001)


@pytest.fixture(autouse=True)
def one_timed_decode(monkeypatch):
    """The scheduler keeps its cost ratio from one decode on here (the server's MIN_TIMED_DECODES would need dozens
    of requests running on the CPU); a test may set its own minimum after this."""
    monkeypatch.setattr(policy, "MIN_TIMED_DECODES", 1)


def timed(llm: LLM, ratio: float) -> LLM:
    """The engine with COST as its step cost model and the scheduler keeping `ratio`."""
    llm.engine.step_cost, llm.scheduler.step_ratio = COST, ratio
    return llm


def split(b: Batch) -> tuple[int, int, int]:
    """(decodes, cached tokens they read, prefill tokens) of a batch (no prompt here leaves a 1-token chunk)."""
    decodes = [k for k, n in zip(b.kv_lens, b.extend_lens) if n == 1]
    return len(decodes), sum(decodes), sum(b.extend_lens) - len(decodes)


def chunk_steps(batches: list[Batch], req: Req) -> list[tuple[int, int, int]]:
    """split() of each batch that carries a chunk of `req`'s prompt."""
    return [split(b) for b in batches if req in b.reqs and b.extend_lens[b.reqs.index(req)] > 1]


def beside_three_decodes(path: str, arrivals: dict[int, list[Req]], tokens: int = 30,
                         **kwargs) -> tuple[list[Batch], list[Req]]:
    """Three short requests decode `tokens` tokens each while `arrivals` (tick -> requests) come, on a timed engine
    (ratio 1.5, budget 1024): the batches launched, and the three."""
    llm = timed(make_llm(path, max_prefill_tokens=1024, max_running_requests=8, **kwargs), 1.5)
    try:
        batches = record_batches(llm)
        short = [Req(i, p, greedy(tokens), seed=0) for i, p in enumerate(prompts([5, 7, 6]))]
        drive(llm, short, arrivals=arrivals)
    finally:
        llm.shutdown()
    return batches, short


@pytest.mark.parametrize("overlap", [True, False])
def test_a_prompt_beside_decodes_takes_the_whole_budget_once_then_comes_in_chunks(tiny_models, overlap, monkeypatch):
    """Three streams decode, each with one stall to spend (and no more earned: STALL_TOKENS is large): the first
    prompt to come takes the whole budget beside them in one step, spending it; the next comes in chunks of
    CHUNK_TOKENS beside all four decodes; the tokens are those of a plain run."""
    monkeypatch.setattr(policy, "CHUNK_TOKENS", 128)
    monkeypatch.setattr(policy, "STALL_TOKENS", 1000)
    path = tiny_models["qwen3"]
    first, second = (Req(8 + i, p, greedy(20), seed=0) for i, p in enumerate(prompts([700, 500], seed=1)))
    batches, short = beside_three_decodes(path, {3: [first], 8: [second]}, overlap_schedule=overlap)
    assert [prefill for decodes, _, prefill in chunk_steps(batches, first)] == [700]  # all in one, beside 3 decodes
    chunks = chunk_steps(batches, second)
    assert [prefill for _, _, prefill in chunks] == [128, 128, 128, 116]
    assert all(decodes == 4 for decodes, _, _ in chunks)  # every stream decodes in each chunk's step
    assert [r.stalls for r in short] == [1, 1, 1] and first.stalls == 0
    assert [r.output_ids for r in [*short, first, second]] == alone(path, [*short, first, second])


def test_a_backlog_is_drained_within_the_cost_ratio_then_in_chunks(tiny_models, monkeypatch):
    """A prompt that would take longer than DRAIN_MS to drain in chunks is a backlog: its steps stay within the
    ratio of the decodes' cost and take all of that room, until no more than DRAIN_LEFT chunks are left; then
    it comes in chunks (the decodes' stall spent on the first prompt)."""
    monkeypatch.setattr(policy, "CHUNK_TOKENS", 64)
    monkeypatch.setattr(policy, "STALL_TOKENS", 1000)
    monkeypatch.setattr(policy, "DRAIN_MS", 12.0)
    path = tiny_models["qwen3"]
    spend, long = (Req(8 + i, p, greedy(4), seed=0) for i, p in enumerate(prompts([100, 900], seed=1)))
    batches, short = beside_three_decodes(path, {3: [spend], 6: [long]}, tokens=40)
    left, timed_steps, chunked = 900, 0, []
    for decodes, kv, prefill in chunk_steps(batches, long):
        drain_ms = left / 64 * COST.ms(decodes + 64, kv)
        if drain_ms > 12.0 or (timed_steps and not chunked and left > 4 * 64):  # entered, and not left yet
            assert prefill == min(left, max(PREFILL_FLOOR, COST.prefill_room(decodes, kv, 1.5, 1024 - decodes)))
            timed_steps += 1
        else:
            chunked.append(prefill)
        left -= prefill
    assert timed_steps >= 3 and len(chunked) >= 2 and all(n == 64 for n in chunked[:-1]) and chunked[-1] <= 64
    assert [r.output_ids for r in [*short, long]] == alone(path, [*short, long])


@pytest.mark.parametrize("share", [0.0, 0.6])
def test_beside_more_decodes_than_chunks_serve_steps_stay_within_their_time_bound(tiny_models, monkeypatch, share):
    """More decodes than MAX_CHUNKED_DECODES: no chunks and no stalls, each step takes all the room its time bound
    leaves, which is the larger of K (1.5) decode steps and HEAVY_BUDGET_SHARE of a whole budget's step (here a
    budget's step, 1,024 tokens, costs ~5 decode steps: a share of 0.6 allows ~3, and fewer, larger steps)."""
    monkeypatch.setattr(policy, "MAX_CHUNKED_DECODES", 2)
    monkeypatch.setattr(policy, "HEAVY_BUDGET_SHARE", share)
    long = Req(9, prompts([900], seed=1)[0], greedy(4), seed=0)
    batches, short = beside_three_decodes(tiny_models["qwen3"], {3: [long]})
    chunks, left = chunk_steps(batches, long), 900
    assert len(chunks) >= 3 if share == 0 else len(chunks) == 2  # 900 tokens: ~160 a step by K, ~500 by the share
    for decodes, kv, prefill in chunks:
        assert decodes == 3
        decode_ms = COST.ms(decodes, kv)
        allowed = max(1.5 * decode_ms, share * COST.ms(1024, kv))
        assert COST.ms(decodes + prefill, kv) <= allowed + 1e-9  # within the bound ...
        assert prefill == left or COST.ms(decodes + prefill + 1, kv) > allowed  # ... and all the room it leaves
        if share and prefill < left:
            assert COST.ms(decodes + prefill, kv) > 2 * decode_ms  # beyond what K alone allows
        left -= prefill
    assert left == 0 and [r.stalls for r in short] == [0, 0, 0]


def test_without_decodes_the_token_budget_alone_bounds_a_step(tiny_models):
    llm = timed(make_llm(tiny_models["qwen3"], max_prefill_tokens=512), 1.0)
    try:
        batches = record_batches(llm)
        drive(llm, [Req(0, prompts([700])[0], greedy(3), seed=0)])
    finally:
        llm.shutdown()
    assert [sum(b.extend_lens) for b in batches[:2]] == [512, 188]


def test_beside_fewer_decodes_than_the_minimum_a_prompt_is_not_cut_by_time(tiny_models, monkeypatch):
    """Three decodes, a minimum of four: the long prompt takes what the budget leaves, as without a model."""
    monkeypatch.setattr(policy, "MIN_TIMED_DECODES", 4)
    llm = timed(make_llm(tiny_models["qwen3"], max_prefill_tokens=1024, max_running_requests=8), 1.5)
    try:
        batches = record_batches(llm)
        long = Req(9, prompts([900], seed=1)[0], greedy(2), seed=0)
        drive(llm, [Req(i, p, greedy(12), seed=0) for i, p in enumerate(prompts([5, 7, 6]))], arrivals={3: [long]})
    finally:
        llm.shutdown()
    chunks = [split(b) for b in batches if long in b.reqs and b.extend_lens[b.reqs.index(long)] > 1]
    assert chunks == [(3, chunks[0][1], 900)]  # one step: every token beside the three decodes


def test_under_the_cost_ratio_admission_stays_fifo_and_every_decode_runs_each_step(tiny_models, monkeypatch):
    """Prompts of every length arriving while others decode, more than may run at once: first tokens come in
    arrival order, no running request misses a step (record_batches checks), each within its ratio or floor
    (no chunks: MAX_CHUNKED_DECODES 0; K alone: HEAVY_BUDGET_SHARE 0)."""
    monkeypatch.setattr(policy, "MAX_CHUNKED_DECODES", 0)
    monkeypatch.setattr(policy, "HEAVY_BUDGET_SHARE", 0.0)
    llm = timed(make_llm(tiny_models["qwen2"], max_prefill_tokens=600, max_running_requests=3), 1.3)
    lengths = [400, 30, 300, 20, 500, 10, 90]
    reqs = [Req(i, p, greedy(6 + i % 3), seed=0) for i, p in enumerate(prompts(lengths, seed=4))]
    try:
        batches = record_batches(llm)
        first_token_at = first_token_ticks(llm, reqs[:4], reqs[4:], arrive_at=3, ticks=300)
    finally:
        llm.shutdown()
    assert all(r.finish_reason == "length" for r in reqs)
    assert sorted(first_token_at, key=lambda rid: (first_token_at[rid], rid)) == [r.rid for r in reqs]
    for decodes, kv, prefill in map(split, batches):
        if decodes and prefill:
            assert COST.ms(decodes + prefill, kv) <= 1.3 * COST.ms(decodes, kv) + 1e-9 \
                or prefill <= PREFILL_FLOOR
