"""An optional per-tick timestamp trace, to see where a request's first token waits (MINISGL_STEP_TRACE=FILE).

One JSON line per tick that did something, on the TP leader: `t` (time.monotonic at the tick's start, the
clock that the server and a client's `time.perf_counter` share on Linux), `launch_s` (until its batch was
enqueued), `tick_s`, the requests that arrived (`added`: [rid, prompt length]), what the launched batch holds
(`decodes`, and `chunks`: [rid, tokens] of its prefill part) and the requests whose first token it read (`first`).
"""

from __future__ import annotations

import json
import os
import time

from minisgl.core import Batch, Req


class StepTrace:
    def __init__(self, path: str):
        self.file = open(path, "a", buffering=1)  # line by line: a server is stopped by a signal

    @classmethod
    def from_env(cls, is_leader: bool) -> StepTrace | None:
        path = os.environ.get("MINISGL_STEP_TRACE")
        return cls(path) if path and is_leader else None

    def record(self, start: float, launched: float, added: list[Req], batch: Batch | None, read: list[Req]) -> None:
        if not (added or batch or read):  # an idle tick
            return
        chunks = [[r.rid, n] for r, n in zip(batch.reqs, batch.extend_lens) if n > 1] if batch else []
        self.file.write(json.dumps({
            "t": round(start, 6), "launch_s": round(launched - start, 6) if batch else None,
            "tick_s": round(time.monotonic() - start, 6), "added": [[r.rid, len(r.prompt_ids)] for r in added],
            "decodes": len(batch.reqs) - len(chunks) if batch else 0, "chunks": chunks,
            "first": [r.rid for r in read if len(r.output_ids) == 1]}) + "\n")
