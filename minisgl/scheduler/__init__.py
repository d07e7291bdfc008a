"""Continuous-batching scheduler (one per TP rank) and the messages it takes."""

from minisgl.scheduler.scheduler import AbortReq, AddReq, GrammarReady, Scheduler, Shutdown

__all__ = ["AbortReq", "AddReq", "GrammarReady", "Scheduler", "Shutdown"]
