"""The scheduler under online load in modelled time, on a CPU: what a scheduling change does to TTFT and ITL
percentiles at 16-256 streams, in seconds and without a GPU.

    python benchmarks/policy_sim.py --cost benchmarks/step_costs/qwen3-0.6b-h100.txt --levels 16,64,256 \
        [--server-args "--max-mixed-step-ratio 4 --max-num-batched-tokens 4096"] [--prefill-error 1.1] \
        [--kv-tokens N] [--one-server] [--repeats 3]

Why: the tails depend on how a wave of prompts is cut into steps beside the running decodes, and a GPU A/B of
one level costs minutes of a scarce machine while its runs vary by 10-20%. Here the real Scheduler decides
every step, with the real page pool and sampler of an engine built on a tiny random model; only the device is
a model. Its forward passes are left out (zero logits), and each step takes the time the GPU's start-up step
cost model gives it (engine/step_cost.py): `--cost` is a file holding the "step cost model:" line a CUDA server
logs at start-up (benchmarks/step_costs/ keeps some). The client is online.py's closed loop: N streams start
together, each sends `--rounds` requests of 256-1024 random prompt tokens and 256 output tokens (ignore_eos),
the next as soon as the previous ends; the API process admits them one at a time (`--admit-ms` each), so a round
that starts together reaches the scheduler over several ticks, as on a server. The last column splits the mean
TTFT as online.py's server columns do: sent to first scheduled (queue), then to the first token (prefill).
Overlap scheduling runs as the server's flags set it (on by default): a tick builds the next step while the one
before still runs on the device and reads that one after, so a step is scheduled a step's time before it starts.

What the model leaves out, so compare policies with each other and confirm a winner on the GPU: the rest of the
host's time (the detokenizer, streaming out, building and enqueuing steps) and the model's own error: on an H100
decode steps took 1.00-1.06x the model, steps with prefill tokens 1.04-1.13x (session 15's traces; 1.2-1.8x before
session 8's tiles; `--prefill-error` scales them). With overlap and 1.1, qwen3-30b-a3b at 64 streams (session 15,
TTFT p50 / p99, ITL p99 ms, queue / prefill mean ms, here against served): sjf with K 3 255 / 737, 71.9, 162 / 149
against 270-291 / 731-747, 73-74, 139-152 / 153-161; fcfs with K 4 330 / 659, 79.3, 157 / 180 against 311-365 /
675-707, 52-81, 133-157 / 173-197. Without overlap its queue came out 236-242 ms and its prefill 108-130. At 256
streams, with `--kv-tokens 134606` (the H100 server's pool, too small for 256 streams), sjf with K 3 1,606 / 9,776,
88.5 against 1,682-1,688 / 10,204-10,231, 95.6-102.5 served. qwen3-8b fits less well: its ITL p99 here is 29-35 ms
against 38-41 served, its throughput 5% high, and sjf with K 3 gives the same TTFT p50 as fcfs here (423 ms) where
the GPU measured 20% less. Checked against an H100 (docs/benchmarks.md, 2026-11-27 sessions 10 and 11): qwen3-0.6b
at 64 streams, the earlier policy's ITL p99 12.5 ms here against 9.2-13.4 measured, and today's (stall credits,
session 11) 5.9 here against 6.1-8.0; TTFTs came out 20-40% low until the API's admissions were modelled (session
12, 64 streams, TTFT p50 here against served: qwen3-0.6b 64 / 74-81 ms, qwen3-8b 514 / 476-511, qwen3-30b-a3b 328 /
308-311). It also mis-ranks: pausing the decodes for a whole burst modelled 3.6 ms and measured no better than the
policy it replaced (the host's gaps, which it leaves out, then set the p99); and sending each round at once (before
`--admit-ms`), it modelled cutting an idle server's burst in two as qwen3-8b's 16-stream TTFT p50 235 -> 172 ms,
where the H100 measured no gain (session 12): admitted one at a time, the burst never waits whole, and the model now
agrees. The model is also the clock here, so compare policies on one model file, never figures across files.
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from online import median_row, percentile  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.core import Batch, Req  # noqa: E402
from minisgl.engine.config import EngineArgs  # noqa: E402
from minisgl.engine.engine import ForwardedStep  # noqa: E402
from minisgl.engine.step_cost import StepCost  # noqa: E402
from minisgl.messages import AddReq  # noqa: E402
from minisgl.server.args import parse_args  # noqa: E402
from minisgl.tools.tiny_model import make_tiny_model  # noqa: E402


def read_cost(path: str) -> StepCost:
    """The StepCost of a server log's "step cost model: (ms, ...) ms at (tokens, ...) tokens, X ms per 1,000
    cached tokens decoded" line."""
    found = re.search(r"step cost model: \(([^)]*)\) ms at \(([^)]*)\) tokens, ([0-9.e-]+) ms per 1,000",
                      Path(path).read_text())
    if found is None:
        raise SystemExit(f"{path}: no 'step cost model:' line")
    linear, tokens = ([float(x) for x in group.split(",")] for group in found.group(1, 2))
    return StepCost(tuple(int(t) for t in tokens), tuple(linear), float(found.group(3)) / 1000)


def simulate(llm: LLM, cost: StepCost, streams: int, a: argparse.Namespace) -> dict:
    """One level: `streams` closed-loop streams from time 0, each step sized (by the scheduler) and timed by `cost`;
    returns its row of figures (ms, modelled)."""
    llm.engine.step_cost = cost
    rng = random.Random(a.seed + streams)
    low, high = a.prompt_len
    vocab = llm.engine.config.vocab_size
    todo = [[[rng.randrange(3, vocab) for _ in range(rng.randint(low, high))] for _ in range(a.rounds)]
            for _ in range(streams)]
    params = SamplingParams(temperature=0, max_tokens=a.max_tokens, ignore_eos=True)
    launched: list[Batch] = []
    forward = llm.engine.forward

    def modelled(batch: Batch) -> ForwardedStep:
        """The step's time is modelled, so its forward pass is left out: every request ignores EOS, and which
        tokens come (from zero logits) does not change the schedule."""
        launched.append(batch)
        return ForwardedStep(batch, torch.zeros(len(batch.reqs), vocab), [])

    llm.engine.forward = modelled
    stream_of, arrived, scheduled, tokens_at = {}, {}, {}, {}  # by rid: sent, first in a step, each token's time
    clock, rid, admitted = 0.0, 0, 0.0
    pending: list[tuple[float, AddReq]] = []  # (when it reaches the scheduler, the message), in that order
    unread: list[float] = []  # when each step launched and not read yet ends on the device, oldest first

    def send(stream: int) -> None:
        """The API process admits one request at a time, `admit_ms` each, then the scheduler's next tick sees it."""
        nonlocal rid, admitted
        rid += 1
        admitted = max(admitted, clock) + a.admit_ms
        stream_of[rid], arrived[rid], tokens_at[rid] = stream, clock, []
        pending.append((admitted, AddReq(Req(rid, todo[stream].pop(0), params, seed=0))))

    for stream in range(streams):
        send(stream)
    try:
        while pending or llm.scheduler.has_work:
            if not llm.scheduler.has_work and pending[0][0] > clock:  # idle until the next request reaches it
                clock = pending[0][0]
            due = sum(t <= clock for t, _ in pending)
            reads = llm.scheduler.unread_step is not None  # with overlap, this tick reads the step launched before
            llm.scheduler.tick([message for _, message in pending[:due]])
            del pending[:due]
            for batch in launched:  # built now, run once the device is free
                for req in batch.reqs:
                    scheduled.setdefault(req.rid, clock)
                ms = cost.batch_ms(batch) * (a.prefill_error if batch.decodes < len(batch.reqs) else 1.0)
                unread.append(max(clock, unread[-1] if unread else clock) + ms)
            if unread and (reads or not llm.scheduler.overlap):  # without overlap, the tick reads its own step
                clock = max(clock, unread.pop(0))
            launched.clear()
            progressed, finished = llm.scheduler.take_outputs()
            for req in progressed + finished:
                tokens_at[req.rid].append(clock)
            for req in finished:
                if todo[stream_of[req.rid]]:
                    send(stream_of[req.rid])
    finally:
        llm.engine.forward = forward
    ttft = [times[0] - arrived[r] for r, times in tokens_at.items() if times]
    queue = [scheduled[r] - arrived[r] for r, times in tokens_at.items() if times]  # the server's queue time
    itl = [b - a_ for times in tokens_at.values() for a_, b in zip(times, times[1:])]
    total, itl_p50 = sum(len(times) for times in tokens_at.values()), percentile(itl, 50)
    return {"streams": streams, "ttft_p50": percentile(ttft, 50), "ttft_p99": percentile(ttft, 99),
            "itl_p50": itl_p50, "itl_p99": percentile(itl, 99),
            "long_pct": 100 * sum(g > 2 * itl_p50 for g in itl) / max(len(itl), 1), "tok_s": 1000 * total / clock,
            "queue_mean": sum(queue) / len(queue), "prefill_mean": (sum(ttft) - sum(queue)) / len(ttft)}


def run_levels(path: str, server: EngineArgs, cost: StepCost, levels: list[int],
               a: argparse.Namespace) -> Iterator[dict]:
    """Each level's row, in order: each on a fresh engine, or all on one with `a.one_server` (as side_by_side.sh's
    server runs them, so that what a level leaves in the scheduler, such as --burst-split's window of recent load,
    meets the next). The engines are offline ones given the server's scheduling settings."""
    for group in [levels] if a.one_server else [[streams] for streams in levels]:
        most = max(group)
        pool = a.kv_tokens or most * (a.prompt_len[1] + a.max_tokens) + server.max_prefill_tokens
        with LLM(path, device="cpu", dtype="float32", num_pages=pool, max_running_requests=max(most, 256),
                 max_prefill_tokens=server.max_prefill_tokens, overlap_schedule=server.overlap_schedule) as llm:
            # the server's settings that the offline LLM leaves off
            llm.scheduler.step_ratio, llm.scheduler.burst_split = server.max_mixed_step_ratio, server.burst_split
            llm.scheduler.shortest_first = server.schedule_policy == "sjf"
            for streams in group:
                yield simulate(llm, cost, streams, a)


def repeated_rows(path: str, server: EngineArgs, cost: StepCost, levels: list[int],
                  a: argparse.Namespace) -> Iterator[dict]:
    """The levels' rows `a.repeats` times over (seeds a.seed, a.seed + 1, ...), in that order; with more than one
    run, each row says its run ("repeat") and each level's median row follows the last run."""
    if a.repeats <= 1:
        yield from run_levels(path, server, cost, levels, a)
        return
    runs: dict[int, list[dict]] = {streams: [] for streams in levels}
    for k in range(a.repeats):
        for row in run_levels(path, server, cost, levels, argparse.Namespace(**{**vars(a), "seed": a.seed + k})):
            runs[row["streams"]].append(row)
            yield {**row, "repeat": k}
    for streams in levels:
        yield median_row(runs[streams])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cost", required=True, help="a file with a CUDA server's 'step cost model:' log line")
    p.add_argument("--levels", default="16,64,256")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", default="256,1024", help="LOW,HIGH prompt tokens (uniform)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-args", default="", help="the server's scheduling flags, e.g. '--max-mixed-step-ratio 3 "
                   "--burst-split' (its defaults otherwise)")
    p.add_argument("--prefill-error", type=float, default=1.1,
                   help="a step with prefill tokens takes this multiple of the model's time (H100: 1.04-1.13)")
    p.add_argument("--admit-ms", type=float, default=0.7,
                   help="the API process's time to admit one request, one at a time (CPU-measured: ~0.7 ms), so a "
                   "round's requests reach the scheduler over several ticks; 0 sends each round at once")
    p.add_argument("--kv-tokens", type=int, default=None,
                   help="the server's K/V capacity in tokens (its 'ready' line's kv_capacity): a level that does not "
                        "fit waits and retracts as served (default: room for every stream)")
    p.add_argument("--one-server", action="store_true",
                   help="run the levels in sequence on one scheduler, as side_by_side.sh's server does (each on a "
                        "fresh one otherwise)")
    p.add_argument("--repeats", type=int, default=1,
                   help="runs of each level, with seeds --seed, --seed + 1, ... (prompts of their own), then a row of "
                        "their medians, as online.py's --repeats: one draw of prompts can sit on either side of a "
                        "p99's cliff (at 1%% of the gaps stalled)")
    a = p.parse_args()
    a.prompt_len = tuple(int(x) for x in a.prompt_len.split(","))
    levels = [int(x) for x in a.levels.split(",")]
    cost = read_cost(a.cost)
    lines = ["| streams | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | gaps over 2x ITL p50 | output tok/s | "
             "queue / prefill mean (ms) |", "|---|---|---|---|---|---|"]
    with tempfile.TemporaryDirectory() as tmp:
        path = make_tiny_model(Path(tmp) / "tiny", "qwen3")
        server = parse_args(["--model", str(path), "--device", "cpu", *a.server_args.split()]).engine
        for r in repeated_rows(str(path), server, cost, levels, a):
            run = f" ({r['repeat']})" if "repeat" in r else ""
            lines.append(f"| {r['streams']}{run} | {r['ttft_p50']:.1f} / {r['ttft_p99']:.1f} | {r['itl_p50']:.2f} / "
                         f"{r['itl_p99']:.2f} | {r['long_pct']:.1f}% | {r['tok_s']:,.0f} | "
                         f"{r['queue_mean']:.1f} / {r['prefill_mean']:.1f} |")
            print(lines[-1], flush=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
