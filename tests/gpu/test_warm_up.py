"""After the start-up warm-up, serving compiles no Triton kernel.

Triton compiles a kernel variant the first time a launch needs it (a new tile config, a new value class of a
specialized argument): seconds in the middle of somebody's request. The warm-up must cover what real traffic
launches. Each case runs in a fresh process, because Triton's in-memory kernel cache is process-wide and other
tests of the session would have compiled variants already.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from helpers import DEVICE

# W1-like traffic (random prompt and answer lengths, sampled, one big batch whose prefill is chunked), then
# W3-like (an odd number of requests extending a shared prefix), then greedy batches of odd sizes. With the
# default CUDA graphs (up to batch 256, the default limit of running requests) every decode replays a graph.
SCRIPT = """
import json, random, sys
from triton import knobs
from minisgl import LLM, SamplingParams

llm = LLM(sys.argv[1], device=sys.argv[2], dtype="bfloat16", num_pages=32768, cache_type=sys.argv[3])
compiled = []
knobs.runtime.jit_post_compile_hook = lambda *, fn, **_: compiled.append(fn.name)
rng = random.Random(0)
vocab = llm.engine.config.vocab_size
prompt = lambda n: [rng.randrange(3, vocab) for _ in range(n)]
lengths = [rng.randint(1, 1500) for _ in range(40)]
llm.generate([prompt(n) for n in lengths],
             [SamplingParams(temperature=0.6, max_tokens=rng.randint(1, 40), ignore_eos=True) for _ in lengths])
prefix = prompt(700)
llm.generate([prefix + prompt(rng.randint(1, 64)) for _ in range(33)],
             SamplingParams(temperature=0.6, max_tokens=8, ignore_eos=True))
for batch in (33, 47):
    llm.generate([prompt(rng.randint(1, 300)) for _ in range(batch)],
                 SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
llm.shutdown()
print(json.dumps(compiled))
"""


@pytest.mark.parametrize("cache_type", ["radix", "naive"])
@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen3"])
def test_serving_compiles_nothing_after_the_warm_up(tiny_models, arch, cache_type):
    done = subprocess.run([sys.executable, "-c", SCRIPT, tiny_models[arch], DEVICE, cache_type],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout.strip().splitlines()[-1]) == []
