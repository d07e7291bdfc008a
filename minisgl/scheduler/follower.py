"""Scheduler processes: rank 0 serves messages from ZMQ (server) or from the offline LLM; ranks
1..N-1 follow rank 0's broadcast, making the same decisions and running the same steps."""

from __future__ import annotations

from minisgl.distributed import init_tp_group
from minisgl.engine.config import EngineArgs
from minisgl.engine.engine import Engine, resolve_device
from minisgl.scheduler.scheduler import Scheduler


def build_scheduler(rank: int, size: int, port: int, args: EngineArgs) -> Scheduler:
    device = resolve_device(args.device, rank)
    tp = init_tp_group(rank, size, device, port)
    return Scheduler(Engine(args, tp, device), tp)


def follow(scheduler: Scheduler) -> None:
    while not scheduler.shutdown:
        scheduler.tick(None)
        scheduler.finished.clear()  # rank 0 reports results
    scheduler.tp.destroy()


def run_follower(rank: int, size: int, port: int, args: EngineArgs) -> None:
    follow(build_scheduler(rank, size, port, args))
