"""Host values onto the device without making the host wait for the device.

Assigning a CPU tensor or a Python number into a device tensor (`table[row] = torch.tensor(...)`,
`table[row] = 0`) is torch's blocking copy: it returns only once the device has run everything queued before it.
Under overlap scheduling the host builds the next batch while the device computes the last one, so one such copy
at an admission holds the host for the rest of that step, and the next step's launch (milliseconds of host time)
then leaves the device idle: on an H200 at 256 streams it made every mixed step of qwen3-8b about half idle. A
non-blocking copy from pageable memory is staged by the driver before it returns (the host tensor may go at
once) and runs in stream order; `fill_` and `zero_` take the number as a kernel argument.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def upload(values: Sequence | torch.Tensor, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """`values` as a tensor on `device`, enqueued on the current stream; the host does not wait. A list becomes a
    host tensor of the named dtype: inferring it element by element doubles the cost."""
    host = values if isinstance(values, torch.Tensor) else torch.tensor(values, dtype=dtype)
    return host.to(device=device, dtype=dtype, non_blocking=True)
