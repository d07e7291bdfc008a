"""The loop of TP ranks 1..N-1: take rank 0's messages, make the same decisions, run the same steps."""

from __future__ import annotations

from minisgl.distributed import init_tp_group
from minisgl.engine.config import EngineArgs
from minisgl.engine.engine import Engine, resolve_device
from minisgl.scheduler.scheduler import Scheduler


def run_follower(rank: int, size: int, port: int, args: EngineArgs) -> None:
    device = resolve_device(args.device, rank)
    tp = init_tp_group(rank, size, device, port)
    scheduler = Scheduler(Engine(args, tp, device), tp)
    while not scheduler.shutdown:
        scheduler.sync_and_apply(None)
        if scheduler.has_work:
            scheduler.step()
        scheduler.finished.clear()  # rank 0 reports results
    tp.destroy()
