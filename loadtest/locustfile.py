"""Locust users that stream an OpenAI-compatible LLM server and measure TTFT, ITL, TPOT and E2E.

    locust -f loadtest/locustfile.py --host http://127.0.0.1:1919 --headless -u 16 -r 16 -t 60s --csv out/run

Each request streams `/v1/completions` or `/v1/chat/completions` with `stream_options.include_usage`. Locust sees
a `POST` event per request (its time is E2E, its size the output tokens, a failure carries the server's error
message) and `TTFT`, `ITL` (one per gap between content chunks) and `TPOT` events, so its console, web UI and
CSVs show them. Locust keeps whole milliseconds in its CSV percentiles and cannot tell which request met an
SLO, so with `--csv PREFIX` every request is also written to `PREFIX_llm_requests.csv` and the run's settings
to `PREFIX_llm_run.json`, which `report.py` reads. The options are below (`add_options`) and in docs/loadtest.md;
each also reads an environment variable (LOCUST_ENDPOINT, ...) and shows in the web UI's custom parameters.
"""

from __future__ import annotations

import csv
import json
import logging
import random
import sys
import time
from dataclasses import asdict, dataclass
from urllib.parse import urlsplit

import gevent
import locust.stats
from gevent.pool import Pool
from geventhttpclient import HTTPClient
from locust import User, constant, events, task
from locust.runners import MasterRunner, WorkerRunner
from stream_metrics import FIELDS, RequestRecord, StreamError, measure_stream

# Common English words: with a leading space each is about one token for BPE tokenizers, so text prompts of N
# words are about N tokens long. The exact count comes back in `usage` and is what the report shows.
WORDS = ("the of and to in is you that it he was for on are as with his they at be this have from or one had by "
         "word but not what all were we when your can said there use an each which she do how their if will up "
         "other about out many then them these so some her would make like him into time has look two more write "
         "go see number no way could people my than first water been call who oil its now find long down day did "
         "get come made may part over new sound take only little work know place year live me back give most very "
         "after thing our just name good sentence man think say great where help through much before line right "
         "too mean old any same tell boy follow came want show also around form three small set put end does "
         "another well large must big even such because turn here why ask went men read need land different home "
         "us move try kind hand picture again change off play spell air away animal house point page letter").split()


# ---- options ---------------------------------------------------------------------------------------------------

@events.init_command_line_parser.add_listener
def add_options(parser) -> None:
    def option(name: str, **kwargs) -> None:
        parser.add_argument(name, env_var="LOCUST_" + name[2:].upper().replace("-", "_"), **kwargs)

    option("--endpoint", choices=["completions", "chat"], default="completions",
           help="stream /v1/completions or /v1/chat/completions")
    option("--model", default="", help="model name to request (default: the first one /v1/models lists)")
    option("--prompt-tokens", default="128", help="prompt length: N, or A:B for uniform in [A, B]")
    option("--output-tokens", default="128", help="max_tokens: N, or A:B for uniform in [A, B]")
    option("--ignore-eos", action="store_true", default=False,
           help="exact output lengths: send ignore_eos and min_tokens = max_tokens")
    option("--temperature", type=float, default=0.0, help="sampling temperature (default: 0, greedy)")
    option("--token-ids", action="store_true", default=False,
           help="prompts are random token ids (/v1/completions only; for servers without a tokenizer)")
    option("--vocab-size", type=int, default=10000, help="token ids are drawn from [0, N) with --token-ids")
    option("--dataset", default="", help="JSONL of prompts: {\"prompt\": text or ids} or {\"messages\": [...]}, "
                                         "optionally with \"output_tokens\"; replaces --prompt-tokens")
    option("--shared-prefix", type=int, default=0,
           help="every generated prompt starts with the same N tokens (the prefix cache under load)")
    option("--request-rate", type=float, default=0.0,
           help="open loop: Poisson arrivals at this many requests/s in total, shared by the -u users, whatever "
                "the server's speed (default 0: closed loop, each user sends its next request when one ends)")
    option("--max-concurrency", type=int, default=0,
           help="open loop: at most this many requests in flight per user; arrivals wait (default 0: no cap)")
    option("--max-requests", type=int, default=0, help="stop after this many finished requests (0: no bound)")
    option("--api-key", default="", is_secret=True, help="sent as 'Authorization: Bearer KEY'")
    option("--request-timeout", type=float, default=600.0, help="seconds without data before a request fails")


def length_range(spec: str, name: str) -> tuple[int, int]:
    """'128' -> (128, 128); '64:256' -> (64, 256)."""
    low, _, high = spec.partition(":")
    try:
        bounds = int(low), int(high or low)
    except ValueError:
        raise ValueError(f"--{name} must be N or A:B, got {spec!r}") from None
    if not 0 < bounds[0] <= bounds[1]:
        raise ValueError(f"--{name} must be positive with A <= B, got {spec!r}")
    return bounds


@dataclass
class Workload:
    """What every request of this run looks like, checked once at the start."""

    endpoint: str
    model: str
    prompt_tokens: tuple[int, int]
    output_tokens: tuple[int, int]
    ignore_eos: bool
    temperature: float
    token_ids: bool
    vocab_size: int
    dataset: str
    shared_prefix: int
    request_rate: float
    max_concurrency: int
    max_requests: int
    api_key: str
    request_timeout: float

    @classmethod
    def from_options(cls, o) -> Workload:
        workload = cls(o.endpoint, o.model, length_range(o.prompt_tokens, "prompt-tokens"),
                       length_range(o.output_tokens, "output-tokens"), o.ignore_eos, o.temperature, o.token_ids,
                       o.vocab_size, o.dataset, o.shared_prefix, o.request_rate, o.max_concurrency, o.max_requests,
                       o.api_key, o.request_timeout)
        if workload.token_ids and workload.endpoint == "chat":
            raise ValueError("--token-ids needs --endpoint completions (chat messages are text)")
        if workload.dataset and workload.shared_prefix:
            raise ValueError("--shared-prefix applies to generated prompts, not to --dataset")
        if workload.vocab_size < 1 or workload.shared_prefix < 0:
            raise ValueError("--vocab-size must be positive and --shared-prefix not negative")
        return workload

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"


class PromptSource:
    """Prompts and output lengths: from the dataset, or generated (words or token ids) after a shared prefix."""

    def __init__(self, workload: Workload):
        self.workload = workload
        self.dataset = load_dataset(workload.dataset, workload.endpoint) if workload.dataset else []
        self.prefix = self.generate(random.Random(0), workload.shared_prefix)  # the same in every process

    def generate(self, rng: random.Random, n: int) -> str | list[int]:
        if self.workload.token_ids:
            return [rng.randrange(self.workload.vocab_size) for _ in range(n)]
        return " ".join(rng.choice(WORDS) for _ in range(n))

    def sample(self, rng: random.Random) -> tuple[dict, int]:
        """(the prompt part of a request body, max_tokens)."""
        max_tokens = rng.randint(*self.workload.output_tokens)
        if self.dataset:
            entry = rng.choice(self.dataset)
            max_tokens = int(entry.get("output_tokens", max_tokens))
            if "messages" in entry:
                return {"messages": entry["messages"]}, max_tokens
            prompt = entry["prompt"]
        else:
            own = self.generate(rng, rng.randint(*self.workload.prompt_tokens))
            separator = [] if self.workload.token_ids else " "
            prompt = self.prefix + separator + own if self.prefix else own
        if self.workload.endpoint == "completions":
            return {"prompt": prompt}, max_tokens
        return {"messages": [{"role": "user", "content": prompt}]}, max_tokens


def load_dataset(path: str, endpoint: str) -> list[dict]:
    entries = []
    with open(path) as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            entry = json.loads(line)
            if not isinstance(entry, dict) or not ("prompt" in entry or "messages" in entry):
                raise ValueError(f"{path}:{number}: expected an object with 'prompt' or 'messages'")
            if "messages" in entry and endpoint == "completions":
                raise ValueError(f"{path}:{number}: 'messages' needs --endpoint chat")
            if isinstance(entry.get("prompt"), list) and endpoint == "chat":
                raise ValueError(f"{path}:{number}: a token-id prompt needs --endpoint completions")
            entries.append(entry)
    if not entries:
        raise ValueError(f"{path}: no prompts")
    return entries


# ---- per-request records ---------------------------------------------------------------------------------------

@dataclass
class RunInfo:
    """The settings and wall time of one run, beside its records: report.py needs the load level and duration."""

    host: str
    users: int
    workload: dict
    start: float
    stop: float = 0.0


class RecordSink:
    """Writes every finished request to PREFIX_llm_requests.csv on the process that owns the CSVs (the only one,
    or the master with --processes / --master; workers forward theirs), and ends the run after --max-requests."""

    def __init__(self, environment, prefix: str | None, max_requests: int):
        self.environment, self.max_requests, self.count = environment, max_requests, 0
        self.file = open(f"{prefix}_llm_requests.csv", "w", newline="") if prefix else None
        self.writer = csv.DictWriter(self.file, FIELDS) if self.file else None
        if self.writer:
            self.writer.writeheader()

    @property
    def full(self) -> bool:
        return 0 < self.max_requests <= self.count

    def add(self, row: dict[str, str]) -> None:
        if self.full:
            return  # a worker's request that ended while the run was stopping
        self.count += 1
        if self.writer:
            self.writer.writerow(row)
            self.file.flush()
        if self.count == self.max_requests:
            gevent.spawn(self.environment.runner.quit)  # not from this greenlet: quitting kills the users

    def close(self) -> None:
        if self.file:
            self.file.close()


state: dict = {}  # this process's Workload, PromptSource, RecordSink and RunInfo for the current run


@events.init.add_listener
def on_init(environment, **_kwargs) -> None:
    """Fail fast on bad options, before any user starts."""
    try:
        if not environment.host:
            raise ValueError("--host is required, e.g. --host http://127.0.0.1:1919")
        PromptSource(Workload.from_options(environment.parsed_options))
    except (ValueError, OSError) as exc:
        logging.error("loadtest: %s", exc)
        sys.exit(2)
    if isinstance(environment.runner, MasterRunner):
        environment.runner.register_message("llm_record", lambda msg, **_: state["sink"].add(msg.data))


@events.test_start.add_listener
def on_test_start(environment, **_kwargs) -> None:
    """Read the options again: the web UI may have changed them."""
    o = environment.parsed_options
    workload = Workload.from_options(o)
    state.update(workload=workload, prompts=PromptSource(workload))
    if not isinstance(environment.runner, WorkerRunner):
        if "sink" in state:
            state["sink"].close()
        state["sink"] = RecordSink(environment, o.csv_prefix, workload.max_requests)
        settings = {k: v for k, v in asdict(workload).items() if k != "api_key"}
        state["run"] = RunInfo(environment.host, 0, settings, time.time())


@events.test_stop.add_listener
def on_test_stop(environment, **_kwargs) -> None:
    """Write the run's settings and wall time. The sink stays open: workers' last records may still come."""
    run = state.get("run")
    if run is None or isinstance(environment.runner, WorkerRunner):
        return
    run.stop = time.time()
    run.users = environment.runner.target_user_count
    if environment.parsed_options.csv_prefix:
        with open(f"{environment.parsed_options.csv_prefix}_llm_run.json", "w") as f:
            json.dump(asdict(run), f, indent=1)


@events.quitting.add_listener
def on_quitting(environment, **_kwargs) -> None:
    if environment.parsed_options.csv_prefix and not isinstance(environment.runner, WorkerRunner):
        # Locust's CSV writer runs once a second and not at exit, so its files would miss the run's last second
        # (locust issue 2299): give it one more pass now that the numbers are final.
        gevent.sleep(locust.stats.CSV_STATS_INTERVAL_SEC + 0.2)
    if "sink" in state:
        state["sink"].close()


def record_finished(environment, record: RequestRecord) -> None:
    row = record.to_row()
    if isinstance(environment.runner, WorkerRunner):
        environment.runner.send_message("llm_record", row)
    elif "sink" in state:
        state["sink"].add(row)


# ---- the user --------------------------------------------------------------------------------------------------

def error_message(status: int, body: bytes) -> str:
    """`HTTP 400: <the server's message>`, from an OpenAI-style error body when there is one."""
    try:
        message = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = body.decode("utf-8", "replace").strip()[:300]
    return f"HTTP {status}: {message}"


class LLMUser(User):
    """Closed loop: send, read the whole stream, send again. Open loop (--request-rate): Poisson arrivals, each
    request in its own greenlet, however long the earlier ones take."""

    wait_time = constant(0)

    def on_start(self) -> None:
        self.workload: Workload = state["workload"]
        self.prompts: PromptSource = state["prompts"]
        self.rng = random.Random()
        open_loop = self.workload.request_rate > 0
        self.inflight = Pool(self.workload.max_concurrency or None) if open_loop else None
        url = urlsplit(self.host)
        self.base_path = url.path.rstrip("/")
        self.http = HTTPClient.from_url(self.host, concurrency=(self.workload.max_concurrency or 1024) if open_loop
                                        else 1, connection_timeout=10, network_timeout=self.workload.request_timeout)
        self.headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
        if self.workload.api_key:
            self.headers["Authorization"] = f"Bearer {self.workload.api_key}"
        self.model = self.workload.model

    def on_stop(self) -> None:
        if self.inflight is not None:
            self.inflight.kill()
        self.http.close()

    @task
    def send(self) -> None:
        if self.inflight is None:
            self.request()
            return
        users = self.environment.parsed_options.num_users or self.environment.runner.target_user_count or 1
        gevent.sleep(self.rng.expovariate(self.workload.request_rate / users))
        self.inflight.spawn(self.request)

    def request(self) -> None:
        record = RequestRecord(start=time.time(), endpoint=self.workload.path)
        sent_at = time.perf_counter()
        try:
            body, max_tokens = self.prompts.sample(self.rng)
            body.update(model=self.model or self.first_model(), max_tokens=max_tokens, stream=True,
                        stream_options={"include_usage": True}, temperature=self.workload.temperature)
            if self.workload.ignore_eos:
                body.update(ignore_eos=True, min_tokens=max_tokens)
            sent_at = time.perf_counter()
            with self.http.post(self.base_path + self.workload.path, body=json.dumps(body),
                                headers=self.headers) as response:
                record.status = response.status_code
                if record.status != 200:
                    raise StreamError(error_message(record.status, response.read()))
                measure_stream(iter(lambda: response.readline(b"\n"), b""), time.perf_counter, sent_at, record)
        except Exception as exc:  # every failure is the request's: report it and go on (GreenletExit is not one)
            record.error = str(exc) or type(exc).__name__
            record.e2e_ms = (time.perf_counter() - sent_at) * 1000
        self.report(record)

    def first_model(self) -> str:
        with self.http.get(self.base_path + "/v1/models", headers=self.headers) as response:
            if response.status_code != 200:
                raise StreamError("listing models: " + error_message(response.status_code, response.read()))
            self.model = json.loads(response.read())["data"][0]["id"]
        return self.model

    def report(self, record: RequestRecord) -> None:
        if state.get("sink") is not None and state["sink"].full:
            return  # ended after the run reached --max-requests, while it was stopping: neither stats nor record
        fire = self.environment.events.request.fire
        fire(request_type="POST", name=record.endpoint, response_time=record.e2e_ms,
             response_length=record.output_tokens, exception=record.error or None, context={})
        if record.ok:
            metrics = [("TTFT", record.ttft_ms), *(("ITL", gap) for gap in record.itl_ms), ("TPOT", record.tpot_ms)]
            for kind, ms in metrics:
                if ms is not None:
                    fire(request_type=kind, name=record.endpoint, response_time=ms, response_length=0,
                         exception=None, context={})
        record_finished(self.environment, record)
