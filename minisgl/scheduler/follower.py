"""Scheduler processes: rank 0 serves messages from ZMQ (server) or from the offline LLM; ranks
1..N-1 follow rank 0's broadcast, making the same decisions and running the same steps."""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading

from minisgl.distributed import TPGroup, init_tp_group
from minisgl.engine.config import EngineArgs
from minisgl.engine.engine import Engine, resolve_device
from minisgl.scheduler.scheduler import Scheduler

logger = logging.getLogger(__name__)


def build_scheduler(rank: int, size: int, port: int, args: EngineArgs) -> Scheduler:
    device = resolve_device(args.device, rank)
    tp = init_tp_group(rank, size, device, port)
    return Scheduler(Engine(args, tp, device), tp)


def follow(scheduler: Scheduler) -> None:
    while not scheduler.shutdown:
        scheduler.tick(None)
        scheduler.finished.clear()  # rank 0 reports results
    scheduler.engine.close()


def run_follower(rank: int, size: int, port: int, args: EngineArgs) -> None:
    follow(build_scheduler(rank, size, port, args))


class Followers:
    """Ranks 1..N-1 of an offline engine, as child processes of this one (rank 0).

    A follower that exits on its own leaves rank 0 waiting for it: at the rendezvous, or on a collective
    that can never complete (for ever on a GPU, where an NCCL kernel spins for its peer). A watcher
    thread notices at once: it logs which rank died, stops the other followers and aborts rank 0's
    device group, so that the caller gets an error rather than a hang.
    """

    def __init__(self, size: int, port: int, args: EngineArgs):
        spawn = multiprocessing.get_context("spawn")
        self.procs = [spawn.Process(target=run_follower, args=(rank, size, port, args), name=f"tp-rank-{rank}",
                                    daemon=True) for rank in range(1, size)]
        for proc in self.procs:
            proc.start()
        self.tp: TPGroup | None = None  # rank 0's group, once joined: aborted when a follower dies
        self.death: str | None = None  # which follower died, once one has
        self._died = threading.Event()
        self.stopping = threading.Event()  # set: followers exiting now are expected to
        if self.procs:
            threading.Thread(target=self._watch, name="tp-followers-watch", daemon=True).start()

    def check(self) -> None:
        """Raise if a follower has died."""
        if self.death is not None:
            raise RuntimeError(self.death)

    def death_within(self, seconds: float) -> str | None:
        """Which follower died, waiting up to `seconds` for the watcher to see one that is dying."""
        self._died.wait(seconds)
        return self.death

    def _watch(self) -> None:
        ended = multiprocessing.connection.wait([proc.sentinel for proc in self.procs])
        if self.stopping.is_set():
            return
        dead = next(proc for proc in self.procs if proc.sentinel in ended)
        dead.join(timeout=1)  # its pipe closes a moment before it can be reaped: join for the exit code
        self.death = f"{dead.name} (pid {dead.pid}) exited with code {dead.exitcode}"
        self._died.set()
        logger.error("%s; stopping the other ranks", self.death)
        self.stop()
        if self.tp is not None:
            try:
                self.tp.abort()
            except Exception:  # aborting is best effort: the collectives still fail (gloo) or time out
                logger.exception("could not abort the device group")

    def stop(self, grace: float = 0.0) -> None:
        """Wait up to `grace` seconds for the followers to exit on their own, then kill what is left."""
        self.stopping.set()
        for proc in self.procs:
            proc.join(timeout=grace)
            if proc.exitcode is None:
                proc.kill()
                proc.join(timeout=5)
