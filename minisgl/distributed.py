"""The tensor-parallel group: who we are, and the three collectives the model and scheduler use.

It is passed explicitly to every layer that needs it (no global state). At size 1 every collective
is a no-op, so TP = 1 runs the same code without initialising torch.distributed.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


@dataclass
class TPGroup:
    rank: int = 0
    size: int = 1
    device_group: Any = None  # NCCL on GPU, gloo on CPU: carries tensors
    cpu_group: Any = None  # always gloo: carries scheduler messages (pickled objects)

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def shard(self, n: int, what: str) -> int:
        """n / size, with an error that names what cannot be split."""
        if n % self.size:
            raise ValueError(f"{what} ({n}) is not divisible by the tensor-parallel size {self.size}")
        return n // self.size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.size > 1:
            dist.all_reduce(x, group=self.device_group)
        return x

    def all_gather(self, x: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's `x` along the last dimension."""
        if self.size == 1:
            return x
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.device_group)
        return torch.cat(parts, dim=-1)

    def broadcast_objects(self, objs: list[Any] | None) -> list[Any]:
        """Rank 0's list of picklable objects, delivered to every rank."""
        if self.size == 1:
            return objs or []
        box = [objs if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def destroy(self) -> None:
        if self.size > 1 and dist.is_initialized():
            dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp_group(rank: int, size: int, device: torch.device, port: int) -> TPGroup:
    """Join the group of `size` processes rendezvousing on 127.0.0.1:port."""
    if size == 1:
        return TPGroup()
    backend = "nccl" if device.type == "cuda" else "gloo"
    # Followers wait in a broadcast while the leader is idle (between offline generate calls, say), so
    # collectives must not time out quickly; a peer that dies breaks its sockets and fails them at once.
    idle_ok = timedelta(days=7)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
                            timeout=idle_ok, device_id=device if device.type == "cuda" else None)
    cpu_group = dist.new_group(backend="gloo", timeout=idle_ok) if backend != "gloo" else dist.group.WORLD
    return TPGroup(rank, size, dist.group.WORLD, cpu_group)
