"""Where a step's grammar bitmask is filled on the host, and how it reaches the device without holding up
either side (see `MaskStaging`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


class MaskStaging:
    """The host buffer a step's bitmask is filled into, and its copy to the device.

    On a GPU the masks (5 MB at batch 256 of a 150k vocabulary) are filled into pinned memory and copied by
    a side stream, while the forward pass still runs; the compute stream waits for the copy only where
    sampling starts. A "non-blocking" copy from pageable memory is not: CUDA stages it through pinned
    memory of its own and may first synchronize with the stream, holding the host until the forward pass
    ends (the device then idles while the next batch is scheduled); and on the compute stream the copy
    queues behind the forward pass.
    Two slots alternate, so that a fill never overwrites memory a copy or a sampling step may still read:
    a slot comes back two steps later, after its copy (the host waits for that) and after the sampling
    that read it (the side stream waits for the compute stream's position at the step between). On the
    CPU the host buffer is the mask itself."""

    def __init__(self, device: torch.device, words: int):
        self.device, self.words, self.turn = device, words, 0
        self.cuda = device.type == "cuda"
        self.stream = torch.cuda.Stream(device) if self.cuda else None
        self.slots = [_Slot(), _Slot()]

    def host(self, rows: int) -> torch.Tensor:
        """[rows, words] host memory that no copy or sampling step reads any more, to fill."""
        previous, self.turn = self.slots[self.turn], 1 - self.turn
        slot = self.slots[self.turn]
        if self.cuda:
            previous.read = torch.cuda.Event()  # after everything enqueued so far: the sampling that read `previous`
            previous.read.record(torch.cuda.current_stream(self.device))
            if slot.copied is not None:
                slot.copied.synchronize()
        if slot.capacity < rows:
            self._grow(slot, max(rows, 2 * slot.capacity))
        slot.rows = rows
        return slot.host[:rows]

    def ship(self) -> torch.Tensor:
        """The buffer `host` returned, as filled, on the device (its copy enqueued before sampling)."""
        slot = self.slots[self.turn]
        if not self.cuda:
            return slot.host[:slot.rows]
        with torch.cuda.stream(self.stream):
            if slot.read is not None:
                self.stream.wait_event(slot.read)
            slot.device[:slot.rows].copy_(slot.host[:slot.rows], non_blocking=True)
            slot.copied = torch.cuda.Event()
            slot.copied.record(self.stream)
        torch.cuda.current_stream(self.device).wait_event(slot.copied)
        return slot.device[:slot.rows]

    def _grow(self, slot: "_Slot", rows: int) -> None:
        if self.cuda:  # rare (the batch outgrew every earlier one): nothing may still use the old buffers
            torch.cuda.synchronize(self.device)
        slot.host = torch.empty(rows, self.words, dtype=torch.int32, pin_memory=self.cuda)
        if self.cuda:
            slot.device = torch.empty(rows, self.words, dtype=torch.int32, device=self.device)
        slot.capacity = rows


@dataclass
class _Slot:
    host: torch.Tensor | None = None
    device: torch.Tensor | None = None
    capacity: int = 0
    rows: int = 0
    copied: "torch.cuda.Event | None" = None  # the copy from `host` is done: the host may refill it
    read: "torch.cuda.Event | None" = None  # the sampling that read `device` is done: a copy may overwrite it
