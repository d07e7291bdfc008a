"""The "last to arrive reduces" step shared by the kernels that split one output over several programs (the
split-K GEMV, the few-token MoE's down GEMV, the split-KV decode attention): each program writes its float32
partial, counts its arrival on a counter, and the last of them combines the partials in a fixed order, so the
reduction needs no second launch and the result does not depend on which program finished last."""

import triton
import triton.language as tl


@triton.jit
def last_to_arrive(counter_ptr, count):
    """After this program wrote its partial: whether it is the last of the `count` programs that count their
    arrival on counter_ptr (that one then reduces the partials, loading them with .cg, and sets the counter
    back to zero)."""
    tl.debug_barrier()  # every thread's partial is written before the (one-thread) release below
    arrived = tl.atomic_add(counter_ptr, 1, sem="acq_rel", scope="gpu")
    return arrived == count - 1
