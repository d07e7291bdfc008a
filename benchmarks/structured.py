"""The cost of structured decoding under W1-style load: output tok/s with and without a JSON schema.

    python benchmarks/structured.py --config .bench_models/qwen3-0.6b.json
    python benchmarks/structured.py --config .bench_models/qwen3-0.6b.json --host-only [--rows 256]

W1's 256 prompts (100-1024 random tokens) and output budgets (100-1024 tokens), temperature 0.6, dummy weights,
run twice: free, then every request constrained by one JSON schema (an object holding a list of strings, so
that a random model keeps writing until its budget). Output tok/s counts the tokens each run really produced.
The first constrained request is timed apart: it loads the tokenizer, compiles the grammar (cached by its
text afterwards) and the mask kernel (one Triton compile for every batch size).

--host-only times, without a model or a GPU, what a constrained decode step costs the host through the
scheduler's own calls: `Grammars.accept` for each row's new token, then `Grammars.bitmask` for the batch
(the matchers each take a random token their mask allows, so most rows sit inside the schema's strings, as
with a random model). On a GPU that host time runs while the forward pass does.

The grammar needs a tokenizer the size of the model's vocabulary, and there is no model hub: a synthetic
byte-level BPE of that size is built (every byte, then merges of an earlier token and a letter into words of up
to 12 characters), so the masks cost what they would with a real vocabulary of that size.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import tempfile
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from minisgl import LLM, SamplingParams
from minisgl.constrained import Grammars
from minisgl.core import Constraint
from minisgl.tokenizer import TokenizerSource

SCHEMA = {"type": "object", "properties": {"title": {"type": "string"},
                                           "notes": {"type": "array", "items": {"type": "string"}}},
          "required": ["title", "notes"]}
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]


def synthetic_tokenizer(regular: int, seed: int = 0) -> PreTrainedTokenizerFast:
    """A byte-level BPE with `regular` ordinary tokens (an earlier token and a letter, merged), then SPECIALS."""
    rng = random.Random(seed)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokens = sorted(alphabet)
    vocab = {t: i for i, t in enumerate(tokens)}
    letters = [t for t in tokens if t.isalpha() and t.isascii()]
    merges = []
    while len(tokens) < regular:
        left, right = tokens[rng.randrange(len(tokens))], rng.choice(letters)
        word = left + right
        if len(word) <= 12 and word not in vocab:
            vocab[word] = len(tokens)
            tokens.append(word)
            merges.append((left, right))
    for special in SPECIALS:
        vocab[special] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=SPECIALS[0], eos_token=SPECIALS[2],
                                   pad_token=SPECIALS[0])


def model_dir(config_path: str) -> str:
    """config.json and a synthetic tokenizer whose special tokens sit at the config's EOS id."""
    config = json.loads(Path(config_path).read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], int) else config["eos_token_id"][0]
    path = Path(tempfile.mkdtemp(prefix="minisgl-structured-"))
    shutil.copy(config_path, path / "config.json")
    synthetic_tokenizer(eos - SPECIALS.index("<|im_end|>")).save_pretrained(path)
    return str(path)


def run(llm: LLM, prompts: list[list[int]], params: list[SamplingParams]) -> tuple[float, int]:
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - start, sum(len(o.token_ids) for o in outs)


def random_allowed(masks: torch.Tensor, vocab: int, gen: torch.Generator) -> list[int]:
    """For each row of a host bitmask, a token it allows, drawn uniformly (as a random model would): the first
    allowed one of 64 random candidates, or where none is, one of all it allows."""
    candidates = torch.randint(0, vocab, (len(masks), 64), generator=gen)
    allowed = (masks.gather(1, candidates // 32) >> (candidates % 32)) & 1
    tokens = candidates.gather(1, allowed.argmax(1, keepdim=True))[:, 0]
    for i in torch.nonzero(allowed.sum(1) == 0)[:, 0].tolist():
        every = torch.nonzero(((masks[i, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab])
        tokens[i] = every[torch.randint(len(every), (1,), generator=gen), 0]
    return tokens.tolist()


def host_only(config_path: str, rows: int, steps: int) -> None:
    """Per-step host cost of `rows` constrained requests: matcher advance and mask fill (ms, median and p90)."""
    path = model_dir(config_path)
    config = json.loads((Path(path) / "config.json").read_text())
    eos = config["eos_token_id"] if isinstance(config["eos_token_id"], list) else [config["eos_token_id"]]
    grammars = Grammars(TokenizerSource(path), config["vocab_size"], eos)
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    rids = list(range(rows))
    for rid in rids:
        grammars.start(rid, schema)
    for rid in rids:
        grammars.activate(rid)
    gen = torch.Generator().manual_seed(0)
    accept_s, fill_s = [], []
    mask = grammars.bitmask(rids)
    for _ in range(steps):
        tokens = random_allowed(mask, config["vocab_size"], gen)
        start = time.perf_counter()
        for rid, token in zip(rids, tokens):
            if grammars.accept(rid, token):  # a finished request's place goes to a new one
                grammars.matchers[rid].reset()
        filled = time.perf_counter()
        mask = grammars.bitmask(rids)
        accept_s.append(filled - start)
        fill_s.append(time.perf_counter() - filled)

    def ms(times: list[float], q: float) -> float:
        return round(1e3 * sorted(times)[int(q * (len(times) - 1))], 3)

    print(json.dumps({"model": Path(config_path).stem, "workload": "structured-host", "rows": rows, "steps": steps,
                      "accept_ms_p50": ms(accept_s, .5), "accept_ms_p90": ms(accept_s, .9),
                      "bitmask_ms_p50": ms(fill_s, .5), "bitmask_ms_p90": ms(fill_s, .9)}), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="a model config.json (e.g. a Hugging Face model's config.json)")
    parser.add_argument("--host-only", action="store_true", help="time the host side of a constrained step alone")
    parser.add_argument("--rows", type=int, default=256, help="--host-only: requests in the batch")
    parser.add_argument("--steps", type=int, default=200, help="--host-only: steps timed")
    args = parser.parse_args()
    if args.host_only:
        host_only(args.config, args.rows, args.steps)
        return
    llm = LLM(model_dir(args.config), dtype="bfloat16", dummy_weights=True, max_seq_len=4096,
              max_prefill_tokens=16384, max_running_requests=256)
    rng = random.Random(0)
    prompts = [[rng.randint(0, 10000) for _ in range(rng.randint(100, 1024))] for _ in range(256)]
    budgets = [rng.randint(100, 1024) for _ in range(256)]
    schema = Constraint("json_schema", json.dumps(SCHEMA))
    run(llm, prompts[:4], [SamplingParams(temperature=0.6, max_tokens=16, ignore_eos=True)] * 4)
    compile_s, _ = run(llm, prompts[:1], [SamplingParams(temperature=0.6, max_tokens=1, constraint=schema)])
    free_s, free_tokens = run(llm, prompts, [SamplingParams(temperature=0.6, max_tokens=m, ignore_eos=True)
                                             for m in budgets])
    json_s, json_tokens = run(llm, prompts, [SamplingParams(temperature=0.6, max_tokens=m, constraint=schema)
                                             for m in budgets])
    llm.shutdown()
    free, constrained = free_tokens / free_s, json_tokens / json_s
    print(json.dumps({"model": Path(args.config).stem, "workload": "W1-structured", "first_request_s":
                      round(compile_s, 2), "free_tok_s": round(free), "json_schema_tok_s": round(constrained),
                      "json_schema_tokens": json_tokens, "free_tokens": free_tokens,
                      "ratio": round(constrained / free, 3)}), flush=True)


if __name__ == "__main__":
    main()
