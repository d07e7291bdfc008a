"""One scheduler rank, built the one way whoever runs it (the offline LLM's rank 0, the server's scheduler
processes, the offline followers); ranks 1..N-1 then follow rank 0's broadcast."""

from __future__ import annotations

from typing import Protocol

from minisgl.distributed import TPGroup, init_tp_group
from minisgl.engine.config import EngineArgs
from minisgl.engine.engine import Engine, resolve_device
from minisgl.scheduler.scheduler import Scheduler


class Peers(Protocol):
    """Rank 0's watch over the other ranks, when it spawned them (the offline engine's `Followers`)."""

    def check(self) -> None:
        """Raise if one of them has died (called while rank 0 waits for them at the rendezvous)."""

    def joined(self, tp: TPGroup) -> None:
        """The group to abort if one of them dies from now on (rank 0 would wait for it for ever)."""


def build_scheduler(rank: int, size: int, port: int, args: EngineArgs, peers: Peers | None = None) -> Scheduler:
    """Join the TP group on its device, then build the engine and its scheduler."""
    device = resolve_device(args.device, rank)
    tp = init_tp_group(rank, size, device, port, peers.check if peers is not None else lambda: None)
    if peers is not None:
        peers.joined(tp)
    return Scheduler(Engine(args, tp, device), tp)


def follow(scheduler: Scheduler) -> None:
    """Ranks 1..N-1: apply rank 0's messages and run its steps until it says Shutdown."""
    while not scheduler.shutdown:
        scheduler.tick(None)
        scheduler.take_outputs()  # rank 0 reports them
    scheduler.engine.close()


def run_follower(rank: int, size: int, port: int, args: EngineArgs) -> None:
    follow(build_scheduler(rank, size, port, args))
