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


# ------------------------------------------------------------------ in-place writes
# Archetypes whose every output element is written by the thread that last reads the
# operands at that element, after any reduction over its row has finished (one thread per
# element; rowfuse: one workgroup per row, a barrier after the reductions): an operand
# read only at the element being written may be overwritten.
ELEMENT_LOCAL = ("pointwise", "rowfuse")
# Archetypes whose epilogue reads its operands at the element it stores, in the thread
# that stores it (codegen.expr.OutputStore): an epilogue operand that the archetype itself
# does not read may be overwritten.
EPILOGUE_LOCAL = ("reduce",)


def launch_units(kernels):
    """(launch position, kernel or part of a horizontal fusion) in launch order."""
    for i, k in enumerate(kernels):
        for u in k.spec.get("parts", [k]):
            yield i, u


def unit_views(u):
    return list(u.reads) + list(u.epi_reads) + [u.out] + list(u.outs)


def _indexed_leaves(e) -> set:
    """Read positions that an expression reads at another element than the output's
    (rotate_half's operand)."""
    if not isinstance(e, tuple) or not e:
        return set()
    if e[0] == "rleaf":
        return {e[1]}
    if e[0] == "op":
        return set().union(*(_indexed_leaves(k) for k in e[2]))
    return set()


def _same_view(a, b) -> bool:
    """The same elements at the same coordinates (a size-1 dimension's stride is moot)."""
    return a.shape == b.shape and a.offset == b.offset and a.dtype is b.dtype and \
        all(s == t for s, t, n in zip(a.strides, b.strides, a.shape) if n != 1)


def reads_only_own_element(u, buf, written=None) -> bool:
    """Unit ``u`` reads ``buf`` only at the element it writes through ``written`` (its
    output, or one of its further outputs), in the thread that writes it, so that output
    may replace ``buf``'s value in place."""
    out = u.out if written is None else written
    if u.spec.get("store_map") or u.spec.get("chunks") or u.spec.get("flat_leaf"):
        return False
    if u.archetype in ELEMENT_LOCAL:
        indexed = _indexed_leaves(u.spec.get("expr"))
        return not any(v.buf is buf for v in u.epi_reads) and \
            all(_same_view(v, out) and k not in indexed for k, v in enumerate(u.reads) if v.buf is buf)
    if u.archetype in EPILOGUE_LOCAL:
        return not any(v.buf is buf for v in u.reads) and \
            all(_same_view(v, out) for v in u.epi_reads if v.buf is buf)
    return False


def touching_units(kernels) -> dict:
    """{id(Buf): [(launch position, unit)]} of the units that read or write each buffer."""
    touching: dict = {}
    for i, u in launch_units(kernels):
        for x in unit_views(u):
            lst = touching.setdefault(id(x.buf), [])
            if not lst or lst[-1][1] is not u:
                lst.append((i, u))
    return touching


def move_value(touching, src, dst):
    """Every view of buffer ``src`` now names ``dst`` (the value moves there)."""
    moved = touching.pop(id(src), [])
    for _, u in moved:
        for x in unit_views(u):
            if x.buf is src:
                x.buf = dst
    touching.setdefault(id(dst), []).extend(moved)


def write_over_dying_operands(kernels) -> int:
    """An intermediate computed element by element from an operand of its size that is
    read for the last time by that kernel is written over the operand (attention's
    backward: dS = P * (dP - rowsum(P * dP)) over dP), so the two never need two buffers.
    Returns how many intermediates were placed so."""
    touching = touching_units(kernels)
    done = 0
    for i, u in launch_units(kernels):
        out = u.out
        ob = out.buf
        if u.archetype not in ELEMENT_LOCAL + EPILOGUE_LOCAL or ob.kind != "temp" or out.offset \
                or not out.is_contiguous() \
                or out.size * out.dtype.np.itemsize != ob.nbytes:
            continue
        if any(v.out.buf is ob and v is not u for _, v in touching.get(id(ob), [])):
            continue                    # written by several kernels (a concat's parts)
        for r in list(u.reads) + list(u.epi_reads):
            d = r.buf
            if d is ob or d.kind != "temp" or d.nbytes != ob.nbytes or d.dtype is not ob.dtype \
                    or not reads_only_own_element(u, d) \
                    or any(j >= i and v is not u for j, v in touching.get(id(d), [])):
                continue
            move_value(touching, ob, d)
            done += 1
            break
    return done
