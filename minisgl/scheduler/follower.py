"""Ranks 1..N-1 of an offline engine, as child processes of its rank 0, and the watch over them."""

from __future__ import annotations

import logging
import multiprocessing
import threading

from minisgl.children import end_all, wait_for_exit
from minisgl.distributed import TPGroup
from minisgl.engine.config import EngineArgs
from minisgl.scheduler.rank import run_follower

logger = logging.getLogger(__name__)


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

    def joined(self, tp: TPGroup) -> None:
        """Rank 0 has joined the group: abort it if a follower dies from now on."""
        self.tp = tp

    def death_within(self, seconds: float) -> str | None:
        """Which follower died, waiting up to `seconds` for the watcher to see one that is dying."""
        self._died.wait(seconds)
        return self.death

    def _watch(self) -> None:
        deaths = wait_for_exit(self.procs, self.stopping)
        if not deaths:
            return
        self.death = deaths[0]
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
        end_all(self.procs, grace)
