"""lm-evaluation-harness end to end: its `local-completions` model runs a multiple-choice (loglikelihood) task
from a local task file against the real --demo server, as users evaluate a served model. It scores each choice
with `echo`, `max_tokens: 1` and `logprobs: 1` on token-id prompts, summing the continuation's prompt logprobs."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

DOCS = [{"question": "The capital of France is", "choices": ["Paris", "Rome", "Berlin"], "answer": 0},
        {"question": "The capital of Italy is", "choices": ["Paris", "Rome", "Berlin"], "answer": 1},
        {"question": "Two plus two equals", "choices": ["four", "five"], "answer": 0}]

TASK = """task: capitals
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def transformers_loglikelihood(model, tokenizer, context: str, continuation: str) -> float:
    """The oracle, split as lm-eval splits a request: the continuation is what encoding context +
    continuation adds after the context's tokens."""
    whole = tokenizer(context + continuation, add_special_tokens=False)["input_ids"]
    start = len(tokenizer(context, add_special_tokens=False)["input_ids"])
    with torch.no_grad():
        logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].float(), -1)
    return sum(logprobs[i - 1, whole[i]].item() for i in range(start, len(whole)))


def test_local_completions_multiple_choice(demo, http, tokenizer, tmp_path):
    """The run ends with an accuracy, every document is scored, and every choice's loglikelihood is the one
    transformers computes on the served checkpoint."""
    checkpoint = http.get("/get_server_info").json()["model"]
    (tmp_path / "capitals.jsonl").write_text("".join(json.dumps(doc) + "\n" for doc in DOCS))
    (tmp_path / "capitals.yaml").write_text(TASK.format(data=tmp_path / "capitals.jsonl"))
    model_args = (f"model=demo,base_url={demo.url}/v1/completions,tokenizer={checkpoint},tokenized_requests=True,"
                  f"num_concurrent=1,max_retries=1")
    env = os.environ | {"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"}
    command = [sys.executable, "-m", "lm_eval", "--model", "local-completions", "--model_args", model_args, "--tasks",
               "capitals", "--include_path", str(tmp_path), "--output_path", str(tmp_path / "out"), "--log_samples"]
    run = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    [results] = glob.glob(str(tmp_path / "out" / "*" / "results_*.json"))
    scores = json.loads(open(results).read())["results"]["capitals"]
    assert 0 <= scores["acc,none"] <= 1
    [samples] = glob.glob(str(tmp_path / "out" / "*" / "samples_capitals_*.jsonl"))
    samples = sorted((json.loads(line) for line in open(samples)), key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(len(DOCS)))
    model = AutoModelForCausalLM.from_pretrained(checkpoint, torch_dtype=torch.float32)
    for sample, doc in zip(samples, DOCS, strict=True):
        served = [float(loglikelihood) for (loglikelihood, _), in sample["resps"]]
        expected = [transformers_loglikelihood(model, tokenizer, doc["question"], " " + c) for c in doc["choices"]]
        assert served == pytest.approx(expected, abs=1e-3)
        assert sample["acc"] == float(max(range(len(served)), key=served.__getitem__) == doc["answer"])
