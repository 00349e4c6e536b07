"""The memory planner: liveness intervals over the launch order, and best-fit reuse of
intermediate buffers whose lifetimes do not overlap. Parameters, optimizer state, inputs,
constants and targets (outputs, gradients, updates) are never shared."""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class MemoryPlan:
    slot_of: dict          # temp Buf -> slot index
    slot_sizes: list       # bytes per slot
    bytes_without: int     # every temp in its own buffer
    bytes_with: int        # after aliasing
    persistent_bytes: int

    def report(self) -> str:
        saved = self.bytes_without - self.bytes_with
        pct = 100.0 * saved / self.bytes_without if self.bytes_without else 0.0
        return (f"intermediates {self.bytes_without / 2**20:.2f} MiB -> {self.bytes_with / 2**20:.2f} MiB "
                f"with aliasing ({pct:.0f}% saved); persistent {self.persistent_bytes / 2**20:.2f} MiB")


def plan_memory(kernels, bufs) -> MemoryPlan:
    """``kernels``: list of (written Bufs, read Bufs) in launch order."""
    first, last = {}, {}
    for k, (writes, reads) in enumerate(kernels):
        for b in list(writes) + list(reads):
            if b.kind != "temp":
                continue
            first.setdefault(b, k)
            last[b] = k
    temps = sorted(first, key=lambda b: first[b])
    # free slots at launch k are those whose owner's last use is < k
    slot_sizes, slot_free_at, slot_of = [], [], {}
    for b in temps:
        best = None
        for s, free_at in enumerate(slot_free_at):
            if free_at < first[b] and slot_sizes[s] >= b.nbytes and (best is None or slot_sizes[s] < slot_sizes[best]):
                best = s
        if best is None:    # grow the largest free slot if none fits, else a new slot
            cands = [s for s, f in enumerate(slot_free_at) if f < first[b]]
            if cands:
                best = max(cands, key=lambda s: slot_sizes[s])
                slot_sizes[best] = b.nbytes
            else:
                slot_sizes.append(b.nbytes)
                slot_free_at.append(-1)
                best = len(slot_sizes) - 1
        slot_of[b] = best
        slot_free_at[best] = last[b]
    persistent = sum(b.nbytes for b in bufs if b.kind != "temp")
    return MemoryPlan(slot_of, slot_sizes, sum(b.nbytes for b in temps), sum(slot_sizes), persistent)
