"""What one streamed request measured, and the serving metrics over many of them.

The definitions follow vLLM's `bench serve` and SGLang's `bench_serving`, so numbers compare:
TTFT is the time from sending the request to the first chunk that carries content (a chat chunk with
only the assistant role does not count); ITL are the gaps between successive content chunks; TPOT is
(E2E - TTFT) / (output tokens - 1); output tokens come from the server's `usage`. A chunk may carry several
tokens, so ITL is per chunk and TPOT per token. Goodput counts the requests that meet every SLO, per second.

Pure Python on purpose (no Locust, gevent or numpy): the locustfile, report.py and the tests share it, and it
must also run in the stock Locust image in a cluster.
"""

from __future__ import annotations

import csv
import json
import math
import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

FIELDS = ["start", "endpoint", "status", "error", "prompt_tokens", "output_tokens", "ttft_ms", "e2e_ms",
          "itl_ms"]


@dataclass
class RequestRecord:
    """One request as the client saw it; times in milliseconds, `start` in seconds since the epoch."""

    start: float
    endpoint: str
    status: int = 0  # HTTP status; 0 when no response came (connection refused, reset)
    error: str = ""  # empty when the request succeeded
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_ms: float | None = None
    e2e_ms: float = 0.0
    itl_ms: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def tpot_ms(self) -> float | None:
        """(E2E - TTFT) / (output tokens - 1); undefined for fewer than two tokens."""
        if self.ttft_ms is None or self.output_tokens < 2:
            return None
        return (self.e2e_ms - self.ttft_ms) / (self.output_tokens - 1)

    def to_row(self) -> dict[str, str]:
        return {"start": f"{self.start:.6f}", "endpoint": self.endpoint,
                "status": str(self.status), "error": self.error, "prompt_tokens": str(self.prompt_tokens),
                "output_tokens": str(self.output_tokens),
                "ttft_ms": "" if self.ttft_ms is None else f"{self.ttft_ms:.3f}", "e2e_ms": f"{self.e2e_ms:.3f}",
                "itl_ms": " ".join(f"{x:.3f}" for x in self.itl_ms)}

    @classmethod
    def from_row(cls, row: dict[str, str]) -> RequestRecord:
        return cls(start=float(row["start"]), endpoint=row["endpoint"],
                   status=int(row["status"]), error=row["error"], prompt_tokens=int(row["prompt_tokens"]),
                   output_tokens=int(row["output_tokens"]),
                   ttft_ms=float(row["ttft_ms"]) if row["ttft_ms"] else None, e2e_ms=float(row["e2e_ms"]),
                   itl_ms=[float(x) for x in row["itl_ms"].split()])


def read_records(path: str) -> list[RequestRecord]:
    with open(path, newline="") as f:
        return [RequestRecord.from_row(row) for row in csv.DictReader(f)]


# ---- one stream ------------------------------------------------------------------------------------------------

class StreamError(Exception):
    """The server reported an error inside a 200 stream."""


def chunk_tokens(chunk: dict) -> int:
    """How many generated tokens an OpenAI stream chunk carries, as far as it shows: its `token_ids` when it has
    them (servers that skip detokenization stream ids, as vLLM's `return_token_ids` does), else one per choice
    with completion text or a chat delta's content. 0 means no content (a role-only or finish-only chunk)."""
    count = 0
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        if choice.get("token_ids"):
            count += len(choice["token_ids"])
        elif choice.get("text") or delta.get("content") or delta.get("reasoning_content"):
            count += 1
    return count


def measure_stream(lines: Iterable[bytes], clock: Callable[[], float], sent_at: float,
                   record: RequestRecord) -> None:
    """Read a server-sent-event stream line by line and fill `record`'s TTFT, ITL, E2E and token counts.

    `clock()` is read as each line arrives; `sent_at` is its value when the request was sent. Raises
    StreamError for an `error` event or a stream that ends without `data: [DONE]`."""
    last = None
    chunk_token_count = 0
    done = False
    for raw in lines:
        line = raw.strip()
        if not line.startswith(b"data:"):
            continue  # blank separators, comments and keep-alives
        now = clock()
        payload = line[5:].strip()
        if payload == b"[DONE]":
            done = True
            break
        chunk = json.loads(payload)
        if error := chunk.get("error"):
            raise StreamError(error.get("message", str(error)) if isinstance(error, dict) else str(error))
        if tokens := chunk_tokens(chunk):
            chunk_token_count += tokens
            if last is None:
                record.ttft_ms = (now - sent_at) * 1000
            else:
                record.itl_ms.append((now - last) * 1000)
            last = now
        if usage := chunk.get("usage"):
            record.prompt_tokens = usage.get("prompt_tokens", 0)
            record.output_tokens = usage.get("completion_tokens", 0)
    record.e2e_ms = (clock() - sent_at) * 1000
    if not done:
        raise StreamError("stream ended without data: [DONE]")
    if not record.output_tokens:  # a server that ignores stream_options.include_usage
        record.output_tokens = chunk_token_count
    if record.ttft_ms is None and record.output_tokens:  # tokens whose text never showed (held-back bytes):
        record.ttft_ms = record.e2e_ms  # the client saw its first output only when the stream ended


# ---- many requests ---------------------------------------------------------------------------------------------

def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation between ranks, as numpy.percentile's default;
    None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


SLO_METRICS = ("ttft", "tpot", "e2e")
_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*(ms|s)?\s*$")


def parse_slo(spec: str) -> dict[str, float]:
    """'ttft:500ms,tpot:50ms,e2e:10s' -> {'ttft': 500.0, 'tpot': 50.0, 'e2e': 10000.0} in milliseconds (a bare
    number is ms)."""
    slo: dict[str, float] = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        name, _, value = part.partition(":")
        name = name.strip().lower()
        match = _DURATION.match(value)
        if name not in SLO_METRICS or not match:
            raise ValueError(f"bad SLO {part!r}: expected NAME:VALUE[ms|s] with NAME in {', '.join(SLO_METRICS)}")
        slo[name] = float(match.group(1)) * (1000 if match.group(2) == "s" else 1)
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    """A successful request within every bound. As in vLLM, a one-token answer has TPOT 0."""
    if not record.ok:
        return False
    observed = {"ttft": record.ttft_ms if record.ttft_ms is not None else math.inf,
                "tpot": record.tpot_ms or 0.0, "e2e": record.e2e_ms}
    return all(observed[name] <= bound for name, bound in slo.items())


@dataclass
class RunSummary:
    """The report's numbers for one run (one load level)."""

    completed: int
    failed: int
    duration_s: float
    request_throughput: float
    output_throughput: float
    goodput: float | None
    mean_prompt_tokens: float
    mean_output_tokens: float
    latency_ms: dict[str, dict[int, float | None]]  # metric -> percentile -> value


PERCENTILES = (50, 90, 99)


def summarize(records: list[RequestRecord], duration_s: float, slo: dict[str, float] | None = None) -> RunSummary:
    """Throughput over the run's wall time and latency percentiles over the successful requests; ITL pools the
    gaps of all requests (as vLLM does), the others take one value per request."""
    ok = [r for r in records if r.ok]
    samples = {"ttft": [r.ttft_ms for r in ok if r.ttft_ms is not None],
               "itl": [gap for r in ok for gap in r.itl_ms],
               "tpot": [r.tpot_ms for r in ok if r.tpot_ms is not None],
               "e2e": [r.e2e_ms for r in ok]}
    output_tokens = sum(r.output_tokens for r in ok)
    return RunSummary(
        completed=len(ok), failed=len(records) - len(ok), duration_s=duration_s,
        request_throughput=len(ok) / duration_s, output_throughput=output_tokens / duration_s,
        goodput=sum(meets_slo(r, slo) for r in ok) / duration_s if slo else None,
        mean_prompt_tokens=sum(r.prompt_tokens for r in ok) / len(ok) if ok else 0.0,
        mean_output_tokens=output_tokens / len(ok) if ok else 0.0,
        latency_ms={name: {q: percentile(values, q) for q in PERCENTILES} for name, values in samples.items()})
