"""Continuous-batching scheduler (one per TP rank) and the messages it takes."""

from minisgl.scheduler.scheduler import AbortReq, AddReq, Scheduler, Shutdown

__all__ = ["AbortReq", "AddReq", "Scheduler", "Shutdown"]
