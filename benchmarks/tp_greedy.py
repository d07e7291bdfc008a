"""TP=2 against TP=1 on dummy weights (two GPUs): the same model, so the same greedy tokens.

    python benchmarks/tp_greedy.py .bench_models/qwen3-0.6b.json .bench_models/qwen3-30b-a3b.json

Dummy weights are drawn per checkpoint tensor from a seed of its name and sliced like a real checkpoint,
so a TP=2 engine is the TP=1 model. Each phase (one engine: a model at TP=1 or TP=2, or the death check)
runs in its own process group under a hard timeout: a hung or dead rank ends its phase, never the run.

Per model, in bf16 (the ranks' partial sums are added in another order, so logits differ by rounding):
- greedy: TP=2 generates TP=1's tokens. A divergence is allowed only where TP=1's two best tokens were
  within --near-tie nats; the rest of that sequence is not compared.
- scored: both engines score the same fixed token sequences (prompt logprobs), so every position is
  compared: max and mean |logprob difference|, and the best token must agree wherever TP=1's two best
  are more than --near-tie apart.
The death check (--death) kills rank 1 of a TP=2 engine in the middle of a generation: rank 0 must
fail within the phase's timeout, not wait for its peer for ever.
Prints a line per phase and per model, then one JSON line: {"tp_greedy": "PASS" | "FAIL", ...}.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from offline import model_dir

from minisgl import LLM, SamplingParams
from minisgl.models.config import ModelConfig

PROMPT_LENGTHS = (5, 60, 300, 1000)  # greedy generation
SCORED_LENGTHS = (64, 256, 1024)  # teacher-forced: every position scored
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}  # no NVLink multicast on the loaners


def token_ids(lengths: tuple[int, ...], vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab) for _ in range(n)] for n in lengths]


def gap(top: list[tuple[int, float]]) -> float:
    """How far the best token is ahead of the second, in nats."""
    return top[0][1] - top[1][1]


def engine(args: argparse.Namespace) -> LLM:
    return LLM(args.model, device=args.device, dtype=args.dtype, dummy_weights=True, tp_size=args.tp,
               max_seq_len=4096, memory_ratio=0.8, cuda_graph_max_bs=args.cuda_graph_max_bs)


def phase_generate(args: argparse.Namespace) -> dict:
    """One engine's greedy tokens (with the top-2 gap at each step) and scores of the fixed sequences."""
    vocab = ModelConfig.from_dir(args.model).vocab_size
    start = time.perf_counter()
    llm = engine(args)
    ready = time.perf_counter() - start
    greedy = llm.generate(token_ids(PROMPT_LENGTHS, vocab, 5),
                          SamplingParams(temperature=0, max_tokens=args.tokens, ignore_eos=True, logprobs=2))
    scored = llm.generate(token_ids(SCORED_LENGTHS, vocab, 6),
                          SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=2))
    llm.shutdown()
    return {"ready_s": round(ready, 1),
            "greedy": [[(lp.token_id, gap(lp.top)) for lp in out.logprobs] for out in greedy],
            "scored": [[(lp.logprob, lp.top[0][0], gap(lp.top)) for lp in out.prompt_logprobs] for out in scored]}


def phase_death(args: argparse.Namespace) -> dict:
    """Kill rank 1 while a long generation runs; rank 0 must raise (or be torn down), not wait."""
    vocab = ModelConfig.from_dir(args.model).vocab_size
    llm = engine(args)
    follower = llm._followers.procs[0]
    killed = []

    def kill_soon() -> None:
        time.sleep(3)
        killed.append(time.perf_counter())
        os.kill(follower.pid, signal.SIGKILL)

    threading.Thread(target=kill_soon, daemon=True).start()
    try:
        llm.generate(token_ids((200,) * 64, vocab, 7), SamplingParams(temperature=0, max_tokens=3000,
                                                                        ignore_eos=True))
    except RuntimeError as exc:
        return {"raised": str(exc)[:300], "seconds_after_kill": round(time.perf_counter() - killed[0], 1)}
    return {"raised": None}


def compare(one: dict, two: dict, near_tie: float) -> dict:
    """Greedy agreement (divergences only at TP=1 near ties) and teacher-forced logprob differences."""
    equal = total = ties = 0
    unexplained = []
    for i, (a, b) in enumerate(zip(one["greedy"], two["greedy"])):
        total += len(a)
        for step, ((token_a, gap_a), (token_b, _)) in enumerate(zip(a, b)):
            if token_a != token_b:
                ties += gap_a < near_tie
                if gap_a >= near_tie:
                    unexplained.append({"prompt": i, "step": step, "tp1_gap": round(gap_a, 4)})
                break
            equal += 1
    diffs, flips, bad_flips = [], 0, []
    for i, (a, b) in enumerate(zip(one["scored"], two["scored"])):
        for pos, ((lp_a, top_a, gap_a), (lp_b, top_b, _)) in enumerate(zip(a, b)):
            diffs.append(abs(lp_a - lp_b))
            if top_a != top_b:
                flips += 1
                if gap_a >= near_tie:
                    bad_flips.append({"sequence": i, "position": pos + 1, "tp1_gap": round(gap_a, 4)})
    return {"greedy_tokens_equal": equal, "greedy_tokens": total, "diverged_at_near_tie": ties,
            "unexplained_divergences": unexplained, "scored_positions": len(diffs),
            "max_abs_logprob_diff": round(max(diffs), 4), "mean_abs_logprob_diff": round(statistics.mean(diffs), 5),
            "top1_flips": flips, "unexplained_flips": bad_flips[:10],
            "ok": not unexplained and not bad_flips}


def run_phase(args: argparse.Namespace, config: str, phase: str, tp: int, log_dir: Path) -> tuple[dict | None, str]:
    """Run one phase in a new session under --timeout; kill its whole process group whatever happens."""
    name = f"{Path(config).stem}-{phase}-tp{tp}"
    out, log = log_dir / f"{name}.json", log_dir / f"{name}.log"
    cmd = [sys.executable, __file__, config, "--phase", phase, "--tp", str(tp), "--out", str(out),
           "--device", args.device, "--dtype", args.dtype, "--tokens", str(args.tokens),
           "--cuda-graph-max-bs", str(args.cuda_graph_max_bs)]
    env = {**NCCL_ENV, **os.environ}
    start = time.perf_counter()
    with open(log, "w") as log_file:
        proc = subprocess.Popen(cmd, stdout=log_file, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            proc.wait(timeout=args.timeout)
        except subprocess.TimeoutExpired:
            pass
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its TP followers too, if any outlived it
            except ProcessLookupError:
                pass
            proc.wait()
    seconds = time.perf_counter() - start
    tail = " | ".join(log.read_text(errors="replace").strip().splitlines()[-3:])[-400:]
    if proc.returncode == -signal.SIGKILL and seconds >= args.timeout:
        status = f"TIMEOUT: killed after the {args.timeout} s timeout ({log}): {tail}"
        return None, status
    if proc.returncode != 0 or not out.exists():
        return None, f"exit code {proc.returncode} after {seconds:.0f} s ({log}): {tail}"
    return json.loads(out.read_text()), f"ok in {seconds:.0f} s"


def check_model(args: argparse.Namespace, config: str, log_dir: Path) -> dict:
    results = {}
    for tp in (1, 2):
        results[tp], status = run_phase(args, config, "generate", tp, log_dir)
        print(f"[{Path(config).stem} tp={tp}] {status}"
              + (f" (engine ready in {results[tp]['ready_s']} s)" if results[tp] else ""), flush=True)
    if results[1] is None or results[2] is None:
        return {"ok": False, "error": "a phase failed"}
    report = compare(results[1], results[2], args.near_tie)
    print(f"[{Path(config).stem}] greedy {report['greedy_tokens_equal']}/{report['greedy_tokens']} tokens equal "
          f"({report['diverged_at_near_tie']} divergence(s) at near ties, {len(report['unexplained_divergences'])} "
          f"not); scored {report['scored_positions']} positions: |dlogprob| max {report['max_abs_logprob_diff']} "
          f"mean {report['mean_abs_logprob_diff']}, top-1 flips {report['top1_flips']} "
          f"({len(report['unexplained_flips'])} not at near ties) -> {'PASS' if report['ok'] else 'FAIL'}", flush=True)
    return report


def check_death(args: argparse.Namespace, config: str, log_dir: Path) -> dict:
    result, status = run_phase(args, config, "death", 2, log_dir)
    if result is not None and result["raised"]:
        report = {"ok": True, **result}
        status = f"rank 0 raised {result['seconds_after_kill']} s after rank 1 was killed: {result['raised']}"
    elif result is not None:
        report = {"ok": False, "error": "generation finished although rank 1 was killed"}
        status = report["error"]
    else:  # ended some other way within the timeout (the NCCL watchdog tears a process down): no hang
        report = {"ok": not status.startswith("TIMEOUT"), "error": status}
    print(f"[{Path(config).stem} death] {status} -> {'PASS' if report['ok'] else 'FAIL'}", flush=True)
    return report


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("configs", nargs="+", help="model config.json files (e.g. .bench_models/qwen3-0.6b.json)")
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens per prompt")
    parser.add_argument("--near-tie", type=float, default=0.05, help="nats: closer top-2 tokens may flip")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per phase before it is killed")
    parser.add_argument("--cuda-graph-max-bs", type=int, default=8, help="0: no CUDA graphs")
    parser.add_argument("--death", action="store_true", help="also kill rank 1 mid-generation (first config)")
    parser.add_argument("--device", default="cuda", help="cuda; cpu (gloo) for a smoke test of this script")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--log-dir", default=os.environ.get("OUT") or tempfile.mkdtemp(prefix="tp-greedy-"))
    parser.add_argument("--phase", choices=["generate", "death"], help=argparse.SUPPRESS)  # internal: one phase
    parser.add_argument("--tp", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        args.model = model_dir(args.configs[0])
        result = (phase_generate if args.phase == "generate" else phase_death)(args)
        Path(args.out).write_text(json.dumps(result))
        return
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    reports = {Path(config).stem: check_model(args, config, log_dir) for config in args.configs}
    if args.death:
        reports["death"] = check_death(args, args.configs[0], log_dir)
    verdict = "PASS" if all(r["ok"] for r in reports.values()) else "FAIL"
    print(json.dumps({"tp_greedy": verdict, "cuda_graph_max_bs": args.cuda_graph_max_bs, "near_tie": args.near_tie,
                      "logs": str(log_dir), **reports}), flush=True)
    sys.exit(verdict != "PASS")


if __name__ == "__main__":
    main()
