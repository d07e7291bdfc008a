"""Child processes that must not die unnoticed: the server's (scheduler ranks, detokenizer) and the offline
engine's tensor-parallel followers. Both fronts watch theirs and end them the same way."""

from __future__ import annotations

import multiprocessing
import multiprocessing.connection
import threading
import time


def wait_for_exit(procs: list[multiprocessing.Process], expected: threading.Event) -> list[str]:
    """Block until one of `procs` exits; then say which have ("NAME (pid N) exited with code C"), or nothing
    when `expected` is set by then (the owner is stopping them)."""
    ended = multiprocessing.connection.wait([proc.sentinel for proc in procs])
    if expected.is_set():
        return []
    deaths = []
    for proc in procs:
        if proc.sentinel in ended:
            proc.join(timeout=1)  # its pipe closes a moment before it can be reaped: join for the exit code
            deaths.append(f"{proc.name} (pid {proc.pid}) exited with code {proc.exitcode}")
    return deaths


def end_all(procs: list[multiprocessing.Process], grace: float = 0.0) -> None:
    """Wait up to `grace` seconds for `procs` to exit on their own, then kill what is left and reap it."""
    deadline = time.monotonic() + grace
    for proc in procs:
        proc.join(timeout=max(0.0, deadline - time.monotonic()))
    for proc in procs:
        if proc.exitcode is None:
            proc.kill()
    for proc in procs:
        proc.join(timeout=10)
