"""Where the host's time goes when it enqueues a step that mixes a prefill chunk with decodes.

    python benchmarks/step_enqueue.py --config .bench_models/qwen3-0.6b.json --decodes 64 --prefill 2900

Under load a mixed step's enqueue is what a decoding stream's longest gaps are made of (benchmarks/itl_trace.py:
on an H200 at 64 streams of qwen3-0.6b, 6.7 ms of "enqueue pieces" in a long gap of 16 ms, when such steps
replayed piecewise graphs around eager attention; now they replay one whole-step graph, engine/whole_graph.py).
This builds an engine with dummy weights (or a tiny checkpoint with --model), starts --decodes requests
decoding, then admits one prompt of --prefill tokens beside them, --repeats times, and times the host in each
stage of those mixed steps' enqueue: the batch's inputs (extend_input), the whole-step graph's run (its metadata
and inputs copied into static buffers, one replay), or, above the largest bucket (or with --eager), the eager
forward with its attention metadata (prepare) and attention calls; the last positions' logits, and sampling.
The device is not waited for, so these are host times; a stage that fills the launch queue would show the
device's pace instead (the queue holds about a thousand launches).
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from collections import defaultdict
from collections.abc import Callable

from offline import model_dir

from minisgl import LLM, SamplingParams
from minisgl.core import Batch, Req
from minisgl.engine.engine import Engine
from minisgl.messages import AddReq

STAGES = ("extend_input", "whole-graph run", "prepare", "attention calls", "eager forward", "last logits", "forward",
          "sample", "forward + sample")


class StageTimer:
    """Host time per stage, summed within the current mixed step; one dict per mixed step."""

    def __init__(self):
        self.steps: list[dict[str, float]] = []
        self.current: dict[str, float] | None = None

    def wrap(self, owner: object, name: str, stage: str) -> None:
        method: Callable = getattr(owner, name)

        def timed(*args, **kwargs):
            if self.current is None:
                return method(*args, **kwargs)
            start = time.perf_counter()
            try:
                return method(*args, **kwargs)
            finally:
                self.current[stage] += 1000 * (time.perf_counter() - start)

        setattr(owner, name, timed)


def is_mixed(batch: Batch) -> bool:
    return any(n > 1 for n in batch.extend_lens) and 1 in batch.extend_lens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = p.add_mutually_exclusive_group(required=True)
    source.add_argument("--config", help="a model config.json (dummy weights)")
    source.add_argument("--model", help="a checkpoint directory (e.g. from python -m minisgl.tools.tiny_model)")
    p.add_argument("--decodes", type=int, default=64)
    p.add_argument("--prefill", type=int, default=2900)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--device", default="auto")
    p.add_argument("--eager", action="store_true", help="no whole-step graphs: every mixed step runs eagerly")
    args = p.parse_args()

    llm = LLM(model_dir(args.config) if args.config else args.model, device=args.device,
              dummy_weights=bool(args.config), max_prefill_tokens=max(8192, args.prefill + args.decodes),
              max_running_requests=max(256, args.decodes + 1))
    engine, sched, timer = llm.engine, llm.scheduler, StageTimer()
    vocab = engine.config.vocab_size
    rng = random.Random(0)

    def prompt(n: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(n)]

    long_run = SamplingParams(temperature=0, max_tokens=4 * args.repeats + 64, ignore_eos=True)
    sched.tick([AddReq(Req(i, prompt(16), long_run, seed=0)) for i in range(args.decodes)])
    while any(not r.output_ids for r in sched.running) or sched.waiting:
        sched.tick([])

    forward, sample = Engine.forward, Engine.sample

    def timed_forward(self, batch):
        if not is_mixed(batch):
            return forward(self, batch)
        timer.current = defaultdict(float)
        start = time.perf_counter()
        out = forward(self, batch)
        timer.current["forward"] = 1000 * (time.perf_counter() - start)
        return out

    def timed_sample(self, step, *rest):
        if timer.current is None:
            return sample(self, step, *rest)
        start = time.perf_counter()
        out = sample(self, step, *rest)
        timer.current["sample"] = 1000 * (time.perf_counter() - start)
        timer.current["forward + sample"] = timer.current["forward"] + timer.current["sample"]
        timer.steps.append(timer.current)
        timer.current = None
        return out

    Engine.forward, Engine.sample = timed_forward, timed_sample
    timer.wrap(engine, "extend_input", "extend_input")
    timer.wrap(engine.prefill_backend, "prepare", "prepare")
    timer.wrap(engine.prefill_backend, "attend", "attention calls")
    timer.wrap(engine, "_last_logits", "last logits")
    timer.wrap(engine.model, "forward", "eager forward")
    if args.eager and engine.whole is not None:
        engine.whole.release()
        engine.whole = None
    if engine.whole is not None:
        timer.wrap(engine.whole, "run", "whole-graph run")
    for k in range(args.repeats):
        sched.tick([AddReq(Req(10_000 + k, prompt(args.prefill), SamplingParams(max_tokens=2, ignore_eos=True),
                               seed=0))])
        for _ in range(3):  # the prompt's step, its first token, its last
            sched.tick([])
    steps = timer.steps[1:] or timer.steps  # the first one may compile a kernel variant
    whole = engine.whole is not None and engine.whole.fits(args.prefill + args.decodes, 1)
    kind = "a whole-step graph" if whole else "eager"
    print(f"{len(steps)} mixed steps of {args.decodes} decodes + {args.prefill} prompt tokens ({kind}), host ms:")
    print("| stage | mean | min | max |\n|---|---|---|---|")
    for stage in STAGES:
        values = [s.get(stage, 0.0) for s in steps]
        print(f"| {stage} | {statistics.mean(values):.2f} | {min(values):.2f} | {max(values):.2f} |")
    llm.shutdown()


if __name__ == "__main__":
    main()
