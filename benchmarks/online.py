"""Online serving under load: a closed-loop streaming client for /v1/completions, one table per server.

    python benchmarks/online.py --url http://localhost:1919 --levels 1,16,64,256
    python benchmarks/online.py --serve minisgl --config .bench_models/qwen3-0.6b.json [--server-args "..."]
    python benchmarks/online.py --serve vllm --config .bench_models/qwen3-0.6b.json   # VLLM_ENV as PEER.md

At each level N, N streams start together and each sends `--rounds` requests one after another (closed loop):
token-id prompts of 256-1024 random ids, 256 output tokens, `ignore_eos`, `stream`, `return_token_ids`, so
any server that takes vLLM's fields (minisgl, vLLM) runs the same load. Per level: TTFT, ITL (the gap
between consecutive chunks that carry tokens) and TPOT ((end - first token) / (tokens - 1)) at p50 and p99,
output tokens per second over the level's wall time, and the server's own mean queue and prefill times
from the vLLM-named histograms of its /metrics (where the first token's wait is spent server-side). A level's
streams are spread over `--clients` processes, so the client keeps up with the fastest server.
`--repeats K` runs each level K times on the same server, each run with prompts of its own (no prefix-cache hit
across runs), and adds a row of each figure's median over the runs: a 64-stream level's ITL p99 is set by a few
hundred gaps, and on one H100 the same tree gave anything from 7.9 to 17.6 ms, so one run per server start says
little, while a run costs a few seconds and a server start half a minute.
`--serve` starts a server on a directory holding only the config (dummy weights, no tokenizer), waits for
/health, runs the levels and stops it. Prints a markdown table and one JSON line per level.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import multiprocessing
import os
import random
import re
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPEAT_SEED_STRIDE = 100_003  # a level's k-th run draws its prompts from seed + streams + k * this

STAGES = {  # vLLM's histogram names (minisgl exports the same): their _sum / _count per level
    "server_ttft": "vllm:time_to_first_token_seconds",
    "server_queue": "vllm:request_queue_time_seconds",
    "server_prefill": "vllm:request_prefill_time_seconds",
}


@dataclass
class Timing:
    prompt_len: int
    start: float
    chunks: list[tuple[float, int]] = field(default_factory=list)  # (arrival, tokens carried)
    error: str | None = None

    @property
    def tokens(self) -> int:
        return sum(n for _, n in self.chunks)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


async def one_request(session: aiohttp.ClientSession, url: str, model: str, prompt: list[int],
                      max_tokens: int) -> Timing:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0,
            "stream": True, "return_token_ids": True}
    timing = Timing(len(prompt), time.perf_counter())
    async with session.post(f"{url}/v1/completions", json=body) as resp:
        if resp.status != 200:
            timing.error = f"{resp.status}: {(await resp.text())[:200]}"
            return timing
        async for line in resp.content:  # server-sent events, one `data: {...}` line per chunk
            if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                continue
            choice = (json.loads(line[6:]).get("choices") or [{}])[0]
            n = len(choice.get("token_ids") or []) or (1 if choice.get("text") else 0)
            if n:
                timing.chunks.append((time.perf_counter(), n))
    return timing


async def scrape(session: aiohttp.ClientSession, url: str) -> dict[str, tuple[float, float]]:
    """(sum, count) of each STAGES histogram, summed over its label sets; empty if /metrics is not there."""
    try:
        async with session.get(f"{url}/metrics") as resp:
            text = await resp.text()
    except aiohttp.ClientError:
        return {}
    found = {}
    for key, name in STAGES.items():
        parts = [sum(float(v) for v in re.findall(rf"^{re.escape(name)}_{part}(?:{{[^}}]*}})? (\S+)$", text, re.M))
                 for part in ("sum", "count")]
        found[key] = (parts[0], parts[1])
    return found


async def run_streams(url: str, model: str, streams: list[list[list[int]]], max_tokens: int,
                      start_at: float) -> list[Timing]:
    """Each stream's prompts one after another, every stream concurrently, from `start_at` (perf_counter)."""
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=3600)) as session:
        async def stream(prompts: list[list[int]]) -> list[Timing]:
            return [await one_request(session, url, model, prompt, max_tokens) for prompt in prompts]

        await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
        return [t for ts in await asyncio.gather(*(stream(p) for p in streams)) for t in ts]


def client_process(url: str, model: str, streams: list[list[list[int]]], max_tokens: int,
                   start_at: float) -> list[Timing]:
    """One client process's share of a level. The collector is off while it runs: a full collection over the
    timings gathered so far would pause every stream of this process, and read as the server's inter-token gap."""
    gc.disable()
    return asyncio.run(run_streams(url, model, streams, max_tokens, start_at))


async def level(url: str, model: str, streams: int, a: argparse.Namespace, repeat: int = 0) -> dict:
    """One level's `repeat`-th run: `streams` closed-loop streams, spread over `--clients` processes (one event loop
    parsing every chunk of 256 streams is itself a bottleneck, and its lag would count against the faster server)."""
    rng = random.Random(a.seed + streams + REPEAT_SEED_STRIDE * repeat)
    rounds, (shortest, longest) = a.rounds, a.prompt_len
    prompts = [[rng.randint(10, a.max_id) for _ in range(rng.randint(shortest, longest))]
               for _ in range(streams * rounds)]
    per_stream = [prompts[i * rounds: (i + 1) * rounds] for i in range(streams)]
    clients = max(1, min(a.clients, streams))
    shares = [per_stream[c::clients] for c in range(clients)]
    async with aiohttp.ClientSession() as session:
        before = await scrape(session, url)
        start = time.perf_counter() + 1.0  # every client process has started its loop by then
        loop = asyncio.get_running_loop()
        with ProcessPoolExecutor(clients, mp_context=multiprocessing.get_context("spawn")) as pool:
            done = await asyncio.gather(*(loop.run_in_executor(pool, client_process, url, model, share,
                                                               a.max_tokens, start) for share in shares))
        timings = [t for ts in done for t in ts]
        wall = max(t.chunks[-1][0] if t.chunks else t.start for t in timings) - start
        after = await scrape(session, url)
    ok = [t for t in timings if t.error is None and t.chunks]
    ttft = [1000 * (t.chunks[0][0] - t.start) for t in ok]
    itl = [1000 * (b[0] - a[0]) for t in ok for a, b in zip(t.chunks, t.chunks[1:])]
    tpot = [1000 * (t.chunks[-1][0] - t.chunks[0][0]) / (t.tokens - 1) for t in ok if t.tokens > 1]
    row = {"streams": streams, "requests": len(timings), "errors": len(timings) - len(ok), "seconds": round(wall, 2),
           "output_tok_s": round(sum(t.tokens for t in ok) / wall),
           **{f"{name}_p{q}_ms": round(percentile(values, q), 2)
              for name, values in (("ttft", ttft), ("itl", itl), ("tpot", tpot)) for q in (50, 99)}}
    for key in STAGES:
        if key in before and key in after and after[key][1] > before[key][1]:
            row[f"{key}_mean_ms"] = round(1000 * (after[key][0] - before[key][0]) / (after[key][1] - before[key][1]), 2)
    if a.requests_out:  # each request's timestamps, for benchmarks/ttft_trace.py and itl_trace.py
        with open(a.requests_out, "a") as f:
            for t in ok:
                f.write(json.dumps(request_line(streams, t), separators=(",", ":")) + "\n")
    if len(timings) > len(ok):
        row["first_error"] = next(t.error for t in timings if t not in ok)
    return row


def median_row(runs: list[dict]) -> dict:
    """One level's runs in one row: each figure's median (an integer figure stays one), the requests and errors
    summed; a figure some run lacks is left out, and so is the first error (the failing run's own row says it)."""
    row = {}
    for key, value in runs[0].items():
        values = [r.get(key) for r in runs]
        if key in ("streams", "repeat") or not isinstance(value, (int, float)):
            row[key] = value
        elif key in ("requests", "errors"):
            row[key] = sum(values)
        elif all(isinstance(v, int) for v in values):
            row[key] = round(statistics.median(values))
        elif all(isinstance(v, (int, float)) for v in values):
            row[key] = round(statistics.median(values), 2)
    row.pop("first_error", None)
    return {**row, "repeat": "median"}


def request_line(streams: int, t: Timing) -> dict:
    """One request's timestamps (perf_counter, the server's monotonic clock): sent, first chunk, and every chunk's
    arrival as microseconds after the first (`after_us`) with the tokens it carried (`n`, only when some chunk
    carried more than one)."""
    line = {"streams": streams, "prompt_len": t.prompt_len, "start": t.start, "first": t.chunks[0][0],
            "tokens": t.tokens, "after_us": [round(1e6 * (at - t.chunks[0][0])) for at, _ in t.chunks]}
    if t.tokens > len(t.chunks):
        line["n"] = [n for _, n in t.chunks]
    return line


async def warm_up(a: argparse.Namespace) -> None:
    """One short request first, untimed: whatever a server sets up on its first request is not level 1's TTFT."""
    async with aiohttp.ClientSession() as session:
        timing = await one_request(session, a.url, a.model, list(range(10, 10 + a.prompt_len[0])), 8)
    if timing.error:
        raise RuntimeError(f"the warm-up request failed: {timing.error}")


def table(rows: list[dict]) -> str:
    lines = ["| streams | TTFT p50 / p99 (ms) | ITL p50 / p99 (ms) | TPOT p50 / p99 (ms) | output tok/s | "
             "server TTFT / queue / prefill mean (ms) |", "|---|---|---|---|---|---|"]
    for r in rows:
        stages = " / ".join(str(r.get(f"{k}_mean_ms", "-")) for k in STAGES)
        label = f"{r['streams']} ({r['repeat']})" if "repeat" in r else r["streams"]
        lines.append(f"| {label} | {r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['itl_p50_ms']} / "
                     f"{r['itl_p99_ms']} | {r['tpot_p50_ms']} / {r['tpot_p99_ms']} | {r['output_tok_s']:,} | "
                     f"{stages} |")
    lines += [f"{r['streams']} streams: {r['errors']} of {r['requests']} requests failed (first: {r['first_error']})"
              for r in rows if r.get("errors") and r.get("repeat") != "median"]  # else the table hides a failure
    return "\n".join(lines)


def server_command(kind: str, model_dir: str, port: int, max_len: int, extra: str) -> list[str]:
    if kind == "minisgl":
        return [sys.executable, "-m", "minisgl", "--model", model_dir, "--served-model-name", "m", "--dummy-weight",
                "--skip-tokenizer-init", "--max-seq-len", str(max_len), "--metrics-naming", "vllm", "--port", str(port),
                *shlex.split(extra)]
    return [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--served-model-name",
            "m", "--load-format", "dummy", "--skip-tokenizer-init", "--max-model-len", str(max_len),
            "--gpu-memory-utilization", "0.85", "--port", str(port), *shlex.split(extra)]


async def wait_ready(url: str, proc: subprocess.Popen, limit: float) -> float:
    start = time.perf_counter()
    async with aiohttp.ClientSession() as session:
        while time.perf_counter() - start < limit:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode} before it was ready")
            try:
                async with session.get(f"{url}/health") as resp:
                    if resp.status == 200:
                        return time.perf_counter() - start
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
    raise TimeoutError(f"server not ready in {limit:.0f} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--url", default="http://localhost:1919")
    p.add_argument("--model", default="m", help="the request's model field (--serve names its server's so)")
    p.add_argument("--levels", default="1,16,64,256", help="concurrent streams, comma-separated")
    p.add_argument("--rounds", type=int, default=3, help="requests each stream sends, one after another")
    p.add_argument("--repeats", type=int, default=1, help="runs of each level, each with prompts of its own; "
                   "with more than one, a row of their medians follows")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--prompt-len", type=lambda v: tuple(map(int, v.split(","))), default=(256, 1024),
                   help="SHORTEST,LONGEST prompt, in tokens")
    p.add_argument("--max-id", type=int, default=10000, help="largest prompt token id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=4, help="client processes a level's streams are spread over")
    p.add_argument("--serve", choices=["minisgl", "vllm"], help="start this server on --config first, stop it after")
    p.add_argument("--config", help="a model's config.json (dummy weights), with --serve")
    p.add_argument("--server-args", default="", help="extra server flags, with --serve")
    p.add_argument("--max-model-len", type=int, default=4096, help="the started server's longest sequence")
    p.add_argument("--log", help="the started server's log file (default: discard)")
    p.add_argument("--json", help="append the rows to this file as JSON lines")
    p.add_argument("--requests-out", help="append every request's timestamps to this file (JSON lines)")
    a = p.parse_args()
    levels = [int(n) for n in a.levels.split(",")]
    proc, tag = None, {}
    if a.serve:
        model_dir = tempfile.mkdtemp(prefix="online-")
        shutil.copy(a.config, Path(model_dir) / "config.json")
        port = int(a.url.rsplit(":", 1)[1])
        log = open(a.log, "w") if a.log else subprocess.DEVNULL
        proc = subprocess.Popen(server_command(a.serve, model_dir, port, a.max_model_len, a.server_args), stdout=log,
                                stderr=subprocess.STDOUT, env=os.environ.copy())
        tag = {"engine": a.serve, "model": Path(a.config).stem, "server_args": a.server_args}
    try:
        if proc is not None:
            tag["ready_s"] = round(asyncio.run(wait_ready(a.url, proc, 600)), 1)
            print(f"ready in {tag['ready_s']} s", flush=True)
        asyncio.run(warm_up(a))
        rows = []

        def keep(row: dict) -> None:
            print(json.dumps(row), flush=True)
            rows.append(row)
            if a.json:
                with open(a.json, "a") as f:
                    f.write(json.dumps(row) + "\n")

        for n in levels:
            runs = []
            for k in range(a.repeats):
                runs.append({**tag, **asyncio.run(level(a.url, a.model, n, a, k)),
                             **({"repeat": k} if a.repeats > 1 else {})})
                keep(runs[-1])
            if a.repeats > 1:
                keep(median_row(runs))
        print(table(rows))
    finally:
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()


if __name__ == "__main__":
    main()
