"""Continuous-batching scheduler (one per TP rank); the messages it takes are `minisgl.messages`'."""

from minisgl.scheduler.scheduler import Scheduler

__all__ = ["Scheduler"]
