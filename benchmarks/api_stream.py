"""The API process under many streams, without a GPU: the real API process and detokenizer, fed by a stand-in
scheduler that emits one token for every running request each `--step-ms`, driven by `online.py`'s client.

    python benchmarks/api_stream.py --levels 64,256 --step-ms 18 [--profile api.txt]

At 256 streams and one step every 18 ms the stand-in produces ~14k tokens/s, what qwen3-0.6b decodes on an
H100: a server that keeps up delivers that rate with ITL ~ the step time. Per level it prints online.py's row
plus the API process's CPU time per delivered token (`api_us_per_token`), the cost this benchmark exists to
cut. `--profile FILE` records the API process with py-spy (if installed) while the levels run.

    python benchmarks/api_stream.py --burst 64 --background 64 [--profile burst.txt]

`--burst N` measures admission instead: `--background` streams run, and `--bursts` times N new requests (prompts
`--prompt-len` ids long, one output token) arrive at once. Per burst it prints the API event loop's CPU time per
admitted request (the burst window's CPU less the background's own rate) and how long the running streams'
chunks waited: the largest gap between two chunks of a background stream around the burst, against the
largest in a quiet window of the same length before it. The bursts are sent from a process of their own: the
loop that timestamps the background's chunks does not also encode and send 64 prompts.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # online.py's client

import aiohttp  # noqa: E402
from online import level, one_request, percentile, table, wait_ready, warm_up  # noqa: E402

from minisgl.core import TokenLogprob  # noqa: E402
from minisgl.messages import AbortReq, AddReq, Ready, ReqOutput, StatsReply, StatsRequest  # noqa: E402
from minisgl.server.ipc import IpcPaths, become_child, freeze_startup_heap, inbox, outbox  # noqa: E402

FAKE_STATS = {"total_pages": 1, "page_size": 1, "free_pages": 1, "evictable_pages": 0, "cached_pages": 0,
              "num_running": 0, "num_waiting": 0, "num_retracted": 0, "cache_hit_tokens": 0,
              "prompt_tokens_admitted": 0, "gen_throughput": 0.0, "step_tokens": {}}


def stand_in_scheduler(ipc: IpcPaths, step_s: float, vocab: int) -> None:
    """Scheduler rank 0's messages without a model: every step, one token (and its logprob, when asked) for
    every running request; a request's first output carries its scheduling time, its last its finish."""
    import zmq

    become_child()
    freeze_startup_heap()
    ctx = zmq.Context()
    pull, to_detok, to_api = inbox(ctx, ipc.scheduler), outbox(ctx, ipc.detokenizer), outbox(ctx, ipc.api)
    to_api.send_pyobj(Ready("scheduler", {"max_seq_len": 1 << 20, "num_pages": 1 << 20, "page_size": 1,
                                          "kv_capacity_tokens": 1 << 20, "vocab_size": vocab, "dtype": "none",
                                          "device": "stand-in", "tp_size": 1, "model_path": "stand-in"}))
    running: dict[int, tuple] = {}  # rid -> (req, tokens sent)
    next_step = time.monotonic()
    while True:
        timeout = max(0.0, next_step - time.monotonic())
        if pull.poll(int(timeout * 1000) if running else 50):
            while True:
                try:
                    m = pull.recv_pyobj(zmq.NOBLOCK)
                except zmq.Again:
                    break
                if isinstance(m, AddReq):
                    running[m.req.rid] = (m.req, 0)
                elif isinstance(m, AbortReq) and m.rid in running:
                    req, sent = running.pop(m.rid)
                    to_detok.send_pyobj([ReqOutput(m.rid, [], [], "abort", len(req.prompt_ids), 0)])
                elif isinstance(m, StatsRequest):
                    to_api.send_pyobj(StatsReply(m.ask_id, dict(FAKE_STATS, num_running=len(running))))
        if not running or time.monotonic() < next_step:
            continue
        now, outputs = time.monotonic(), []
        for rid, (req, sent) in list(running.items()):
            token = (rid * 7919 + sent) % vocab
            done = sent + 1 >= req.params.max_tokens
            lp = [TokenLogprob(token, -0.5, [(token, -0.5)] * req.params.logprobs)] if req.params.logprobs else []
            outputs.append(ReqOutput(rid, [token], lp, "length" if done else None, len(req.prompt_ids), 0,
                                     scheduled_at=now if sent == 0 else None))
            if done:
                del running[rid]
            else:
                running[rid] = (req, sent + 1)
        to_detok.send_pyobj(outputs)
        next_step = max(next_step + step_s, time.monotonic() - step_s)  # never a burst of steps to catch up


def serve_api(argv: list[str], step_s: float, vocab: int) -> None:
    """The real API process (launch.serve), its children the stand-in scheduler and the real detokenizer."""
    from minisgl.server import launch
    from minisgl.server.args import parse_args
    from minisgl.server.detokenizer_worker import run_detokenizer

    def children(args, ipc: IpcPaths) -> list[multiprocessing.Process]:
        spawn = multiprocessing.get_context("spawn")
        procs = [spawn.Process(target=stand_in_scheduler, args=(ipc, step_s, vocab), daemon=True),
                 spawn.Process(target=run_detokenizer, args=(None, ipc, "warning"), daemon=True)]
        for p in procs:
            p.start()
        return procs

    launch.start_children = children
    sys.exit(launch.serve(parse_args(argv)))


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def background_stream(session: aiohttp.ClientSession, url: str, arrivals: list[float]) -> None:
    """One long stream, its chunks' arrival times appended to `arrivals` (perf_counter), until cancelled."""
    body = {"model": "m", "prompt": [11, 12, 13], "max_tokens": 1 << 16, "ignore_eos": True, "stream": True}
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        async for line in resp.content:
            if line.startswith(b"data: "):
                arrivals.append(time.perf_counter())


def burst_sender(url: str, conn) -> None:
    """A process that sends each burst it is given (a list of prompts) at once, on one session kept across
    bursts (as a closed-loop client's connections are), and answers with the requests' timings."""
    async def serve() -> None:
        loop = asyncio.get_running_loop()
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                         timeout=aiohttp.ClientTimeout(total=600)) as session:
            while (prompts := await loop.run_in_executor(None, conn.recv)) is not None:
                conn.send(await asyncio.gather(*(one_request(session, url, "m", p, 1) for p in prompts)))

    asyncio.run(serve())


async def bursts(url: str, a: argparse.Namespace, api_pid: int) -> list[dict]:
    """`a.bursts` bursts of `a.burst` requests into `a.background` running streams, one every `a.every` s."""
    rng = random.Random(0)
    connector = aiohttp.TCPConnector(limit=0)
    rows = []
    conn, child_conn = multiprocessing.Pipe()
    sender = multiprocessing.get_context("spawn").Process(target=burst_sender, args=(url, child_conn), daemon=True)
    sender.start()
    loop = asyncio.get_running_loop()
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        streams = [[] for _ in range(a.background)]
        tasks = [asyncio.create_task(background_stream(session, url, s)) for s in streams]
        await asyncio.sleep(2.0)  # every background stream is running
        for _ in range(a.bursts):
            quiet_from, cpu_quiet = time.perf_counter(), loop_cpu_seconds(api_pid)
            await asyncio.sleep(a.every / 2)
            start, cpu_start = time.perf_counter(), loop_cpu_seconds(api_pid)
            prompts = [[rng.randint(10, 10000) for _ in range(rng.randint(*a.prompt_len))] for _ in range(a.burst)]
            conn.send(prompts)
            timings = await loop.run_in_executor(None, conn.recv)
            end, cpu_end = time.perf_counter(), loop_cpu_seconds(api_pid)
            errors = [t.error for t in timings if t.error]
            background_rate = (cpu_start - cpu_quiet) / (start - quiet_from)
            window = end - start

            def largest_gap(lo: float, hi: float) -> float:
                gaps = [b - a for s in streams for a, b in zip(s, s[1:]) if lo <= b <= hi]
                return 1000 * max(gaps, default=float("nan"))

            await asyncio.sleep(0.2)  # the chunks that waited behind the burst have arrived
            rows.append({"burst": a.burst, "background": a.background, "errors": len(errors),
                         "burst_ms": round(1000 * window, 1),
                         "ttft_p50_ms": round(percentile([1000 * (t.chunks[0][0] - t.start) for t in timings
                                                          if t.chunks], 50), 1),
                         "api_us_per_request": round(1e6 * (cpu_end - cpu_start - background_rate * window)
                                                     / a.burst),
                         "stall_ms": round(largest_gap(start, end + 0.2), 1),
                         "quiet_gap_ms": round(largest_gap(quiet_from, start), 1)})
            print(json.dumps(rows[-1]), flush=True)
            await asyncio.sleep(a.every / 2 - 0.2)
        for task in tasks:  # they run as long as the bursts take, however slow the machine is
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    conn.send(None)
    sender.join(30)
    return rows


def loop_cpu_seconds(pid: int) -> float:
    """CPU time of the process's main thread, the API's event loop, in ns resolution (/proc/PID/schedstat): a
    burst of 64 requests is a few clock ticks of cpu_seconds' resolution."""
    with open(f"/proc/{pid}/schedstat") as f:
        return int(f.read().split()[0]) / 1e9


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--levels", default="64,256")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=lambda v: tuple(map(int, v.split(","))), default=(16, 64))
    p.add_argument("--step-ms", type=float, default=18.0, help="the stand-in scheduler's step time")
    p.add_argument("--config", default=".bench_models/qwen3-0.6b.json", help="a config.json (its vocab size)")
    p.add_argument("--port", type=int, default=19191)
    p.add_argument("--clients", type=int, default=2, help="client processes a level's streams are spread over")
    p.add_argument("--profile", help="record the API process with py-spy into this file (raw, collapsed stacks)")
    p.add_argument("--burst", type=int, help="measure admission: bursts of this many requests (see above)")
    p.add_argument("--background", type=int, default=64, help="running streams the bursts arrive into")
    p.add_argument("--bursts", type=int, default=5)
    p.add_argument("--every", type=float, default=2.0, help="seconds between bursts")
    p.add_argument("--serve-api", action="store_true", help=argparse.SUPPRESS)
    a, rest = p.parse_known_args()
    vocab = json.loads(Path(a.config).read_text())["vocab_size"]
    if a.serve_api:
        return serve_api(["--port", str(a.port), *rest], a.step_ms / 1000, vocab)
    model_dir = tempfile.mkdtemp(prefix="api-stream-")
    shutil.copy(a.config, Path(model_dir) / "config.json")
    url = f"http://127.0.0.1:{a.port}"
    api = subprocess.Popen([sys.executable, __file__, "--serve-api", "--step-ms", str(a.step_ms), "--config", a.config,
                            "--model", model_dir, "--served-model-name", "m", "--skip-tokenizer-init",
                            "--port", str(a.port), "--log-level", "warning"])
    spy = None
    try:
        asyncio.run(wait_ready(url, api, 120))
        if a.profile:
            spy = subprocess.Popen(["py-spy", "record", "-p", str(api.pid), "-f", "raw", "-o", a.profile, "-r", "1000"],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        knobs = argparse.Namespace(seed=0, rounds=a.rounds, prompt_len=a.prompt_len, max_id=10000,
                                   max_tokens=a.max_tokens, requests_out=None, url=url, model="m", clients=a.clients)
        asyncio.run(warm_up(knobs))
        if a.burst:
            found = asyncio.run(bursts(url, a, api.pid))
            print("| burst | background | API CPU us/request p50 (min-max) | stall ms p50 (max) | quiet gap ms p50 |")
            print("|---|---|---|---|---|")
            cost, stall = [r["api_us_per_request"] for r in found], [r["stall_ms"] for r in found]
            print(f"| {a.burst} | {a.background} | {percentile(cost, 50)} ({min(cost)}-{max(cost)}) | "
                  f"{percentile(stall, 50)} ({max(stall)}) | {percentile([r['quiet_gap_ms'] for r in found], 50)} |")
            return
        rows = []
        for n in map(int, a.levels.split(",")):
            before = cpu_seconds(api.pid)
            row = asyncio.run(level(url, "m", n, knobs))
            tokens = row["output_tok_s"] * row["seconds"]
            row.update(step_ms=a.step_ms, target_tok_s=round(n * 1000 / a.step_ms),
                       api_us_per_token=round(1e6 * (cpu_seconds(api.pid) - before) / max(tokens, 1), 1))
            print(json.dumps(row), flush=True)
            rows.append(row)
        print(table(rows))
        print("| streams | target tok/s | delivered tok/s | API CPU us/token |\n|---|---|---|---|")
        for r in rows:
            print(f"| {r['streams']} | {r['target_tok_s']:,} | {r['output_tok_s']:,} | {r['api_us_per_token']} |")
    finally:
        if spy is not None:
            spy.send_signal(2)
            spy.wait(30)
        api.terminate()
        api.wait(30)
        shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__":
    main()
