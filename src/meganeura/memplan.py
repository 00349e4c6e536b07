"""The memory planner: liveness intervals over the launch order, and buffers shared by
values whose lifetimes do not overlap.

What is planned: every intermediate (live from its first write to its last read) and every
target (a fetched output, a gradient kept for ``Session.grads``, a new value copied into a
state after the step): a target lives from its first write to the end of the call, so it
can take the room of activations that died earlier (gradients in the backward pass mostly
do). Parameters, optimizer state, inputs and constants are persistent: they outlive a call.

Values share a *slot* (one device buffer) when their intervals are disjoint. Slots are
filled greedily by size, largest value first, each into the smallest slot that is free
over its whole interval (the "greedy by size" shared-objects strategy of Pisarchyk and Lee,
2020): the big activations of training claim slots first and small values fill the gaps.
A slot is a whole buffer, never a sub-range, so a kernel never binds one buffer twice
with different access (wgpu refuses a buffer that is both read-only and writable in one
dispatch), and the plan needs no offset alignment.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

PLANNED = ("temp", "target")


@dataclass
class MemoryPlan:
    slot_of: dict          # planned Buf -> slot index
    slot_sizes: list       # bytes per slot
    bytes_without: int     # every planned value in its own buffer
    bytes_with: int        # after sharing (the sum of slot sizes)
    persistent_bytes: int  # parameters, state, inputs, constants
    live_peak: int = 0     # the most bytes of planned values live at one launch: no plan of slots can do better
    intervals: dict = field(default_factory=dict)   # planned Buf -> (first launch, last launch), inclusive

    @property
    def peak_bytes(self):
        """Device bytes a call needs: persistent buffers plus the slots."""
        return self.persistent_bytes + self.bytes_with

    def report(self) -> str:
        saved = self.bytes_without - self.bytes_with
        pct = 100.0 * saved / self.bytes_without if self.bytes_without else 0.0
        return (f"intermediates {self.bytes_without / 2**20:.2f} MiB -> {self.bytes_with / 2**20:.2f} MiB "
                f"with aliasing ({pct:.0f}% saved; live peak {self.live_peak / 2**20:.2f} MiB); "
                f"persistent {self.persistent_bytes / 2**20:.2f} MiB")


def lifetimes(kernels, bufs=()) -> dict:
    """{planned Buf: (first, last)} over ``kernels`` (a list of (written Bufs, read Bufs)
    in launch order). A target lives to ``len(kernels)``: after the last launch its value
    is copied out or read back. A target that no kernel touches (an empty value) lives
    through the whole call, so it never shares."""
    end = len(kernels)
    first, last = {}, {}
    for k, (writes, reads) in enumerate(kernels):
        for b in (*writes, *reads):
            if b.kind in PLANNED:
                first.setdefault(b, k)
                last[b] = k
    for b in bufs:
        if b.kind == "target":
            first.setdefault(b, 0)
            last[b] = end
    return {b: (first[b], last[b]) for b in first}


def plan_memory(kernels, bufs) -> MemoryPlan:
    """``kernels``: list of (written Bufs, read Bufs) in launch order; ``bufs``: every
    logical buffer of the plan."""
    spans = lifetimes(kernels, bufs)
    n = len(kernels) + 1
    order = sorted(spans, key=lambda b: (-b.nbytes, spans[b][0]))
    # busy[s, k]: slot s holds a live value at launch k
    busy = np.zeros((max(8, len(order) // 4), n), dtype=bool)
    sizes: list = []
    slot_of = {}
    for b in order:
        lo, hi = spans[b]
        s = None
        if sizes:
            free = ~busy[:len(sizes), lo:hi + 1].any(axis=1)
            if free.any():
                # slots were opened largest first, so the last free one is the smallest
                s = int(np.flatnonzero(free)[-1])
        if s is None:
            s = len(sizes)
            sizes.append(b.nbytes)
            if s == busy.shape[0]:
                busy = np.concatenate([busy, np.zeros_like(busy)])
        busy[s, lo:hi + 1] = True
        slot_of[b] = s
    live = np.zeros(n + 1, dtype=np.int64)
    for b, (lo, hi) in spans.items():
        live[lo] += b.nbytes
        live[hi + 1] -= b.nbytes
    persistent = sum(b.nbytes for b in bufs if b.kind not in PLANNED)
    return MemoryPlan(slot_of, sizes, sum(b.nbytes for b in spans), sum(sizes), persistent,
                      int(np.cumsum(live).max()) if spans else 0, spans)


def check_plan(plan: MemoryPlan, kernels=None):
    """Raise AssertionError if two values that share a slot are ever live at the same
    launch, or a slot is smaller than a value in it. With ``kernels`` the intervals are
    recomputed from the launches instead of taken from the plan."""
    spans = lifetimes(kernels, plan.slot_of) if kernels is not None else plan.intervals
    missing = [b for b in spans if b not in plan.slot_of]
    assert not missing, f"values without a slot: {missing[:5]}"
    by_slot: dict = {}
    for b, s in plan.slot_of.items():
        assert b.nbytes <= plan.slot_sizes[s], f"{b!r} does not fit slot {s} ({plan.slot_sizes[s]} B)"
        if b in spans:
            by_slot.setdefault(s, []).append((spans[b], b))
    for s, items in by_slot.items():
        items.sort(key=lambda it: it[0])
        for ((lo1, hi1), b1), ((lo2, hi2), b2) in zip(items, items[1:]):
            assert hi1 < lo2, f"slot {s}: {b1!r} live over [{lo1}, {hi1}] overlaps {b2!r} over [{lo2}, {hi2}]"
