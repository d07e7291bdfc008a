"""The tensor-parallel group: who we are, and the collectives the model, engine and scheduler use.

It is passed explicitly to every layer that needs it (no global state). At size 1 every collective
is a no-op, so TP = 1 runs the same code without initialising torch.distributed.

Two groups, two timeouts. The device group (NCCL on GPUs) carries the model's collectives, which the
ranks only enter together, inside one step: a wait of STEP_TIMEOUT there means a peer died or went
its own way, and torch's NCCL watchdog then tears this process down instead of letting it spin for
ever. The CPU group (gloo) carries rank 0's messages, which followers may await for as long as rank 0
is idle; a peer that dies closes its sockets, which fails those waits at once.
"""

from __future__ import annotations

import socket
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable

import torch
import torch.distributed as dist

STEP_TIMEOUT = timedelta(minutes=10)  # device collectives and the start-up rendezvous
IDLE_TIMEOUT = timedelta(days=7)  # followers waiting for rank 0's next message
JOINED = "minisgl/joined"  # store key: followers that reached the rendezvous


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

    def agree(self, value: int, op: dist.ReduceOp) -> int:
        """One host integer every rank ends up with (e.g. the MIN of each rank's KV pages), over the CPU group."""
        if self.size == 1:
            return value
        box = torch.tensor([value])
        dist.all_reduce(box, op=op, group=self.cpu_group)
        return int(box.item())

    def broadcast_objects(self, objs: list[Any] | None) -> list[Any]:
        """Rank 0's list of picklable objects, delivered to every rank."""
        if self.size == 1:
            return objs or []
        box = [objs if self.is_leader else None]
        dist.broadcast_object_list(box, src=0, group=self.cpu_group)
        return box[0]

    def abort(self) -> None:
        """End waits on device collectives that can never complete (a peer died): an NCCL kernel spinning
        for the dead peer returns and the next collective raises. Gloo needs none of this."""
        if self.size > 1 and dist.is_initialized() and dist.get_backend(self.device_group) == "nccl":
            self.device_group.abort()

    def destroy(self) -> None:
        if self.size > 1:
            leave_tp_group()


def leave_tp_group() -> None:
    """Drop this process's membership (if any), so that a new engine can form a new group."""
    if dist.is_initialized():
        dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_tp_group(rank: int, size: int, device: torch.device, port: int,
                  check_peers: Callable[[], None] = lambda: None) -> TPGroup:
    """Join the group of `size` processes rendezvousing on 127.0.0.1:port. Rank 0 waits for the others to
    arrive calling `check_peers` meanwhile, which raises if one of them died before it could join."""
    if size == 1:
        return TPGroup()
    if device.type == "cuda":
        if size > torch.cuda.device_count():
            raise ValueError(f"tensor-parallel size {size} needs {size} GPUs, but {torch.cuda.device_count()} "
                             f"are visible")
        # Before anything touches CUDA: NCCL and Triton use the current device, and a rank left on GPU 0
        # would put a context there (and launch kernels on GPU 0's stream with its own GPU's pointers).
        torch.cuda.set_device(device)
    store = dist.TCPStore("127.0.0.1", port, size, is_master=rank == 0, timeout=STEP_TIMEOUT,
                          wait_for_workers=False)
    if rank > 0:
        store.add(JOINED, 1)
    else:
        while store.add(JOINED, 0) < size - 1:
            check_peers()
            time.sleep(0.05)
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=STEP_TIMEOUT,
                            device_id=device if device.type == "cuda" else None)
    return TPGroup(rank, size, dist.group.WORLD, dist.new_group(backend="gloo", timeout=IDLE_TIMEOUT))
