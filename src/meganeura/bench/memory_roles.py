"""Where a training step's planned bytes go, by role, read from the plan alone (no device):
weights, optimizer moments, inputs and constants (persistent), and of the planned values
(intermediates and targets): gradients, logits and cross-entropy buffers, forward values
kept for the backward pass, recomputed forward values (activation checkpointing),
other backward values (cotangents), forward temporaries, and targets.

The roles of planned values come from the launches: the forward pass ends at the launch
that writes the loss; a gradient is a value that a launch writing a parameter or a state
(the optimizer's update of a moment or a weight) reads, or one summed elementwise into
such a value (a tied weight's two contributions); a logits buffer holds ``rows * vocab``
f32 values; a recomputed value is written in the backward pass by a launch reading only forward values,
recomputed values and persistent ones, at least one recomputed (the chain starts at the
``recompute`` copies of a region's inputs)."""
from __future__ import annotations

import numpy as np

from ..memplan import launch_units
from .memory import live_peak_launch

ROLES = ("gradients", "logits_ce", "kept_for_backward", "recompute", "backward_other", "forward_temp", "targets")
PERSISTENT_ROLES = ("weights", "optimizer_moments", "inputs_constants")
MIB = 2 ** 20


def _persistent_role(b) -> str:
    if b.kind == "parameter":
        return "weights"
    if b.kind == "state":
        return "optimizer_moments"
    return "inputs_constants"


def value_roles(kp, loss_buf, logits_bytes) -> dict:
    """{planned Buf: role} of a step's plan; ``loss_buf``: the loss's buffer; a planned
    value of ``logits_bytes`` that is no gradient counts as logits."""
    m = kp.memory
    units = list(launch_units([d.kernel for d in kp.dispatches]))
    end_fwd = max((i for i, u in units if loss_buf in u.written_bufs()), default=-1)
    grads, written_at, recomputed = set(), {}, set()
    for i, u in units:
        writes = u.written_bufs()
        if any(b.kind in ("parameter", "state") for b in writes):
            grads.update(v.buf for v in u.read_views() if v.buf in m.slot_of)
        for b in writes:
            written_at.setdefault(b, i)
    # parts of a gradient: summed elementwise into one (a tied weight's two contributions)
    for i, u in reversed(units):
        out = [b for b in u.written_bufs() if b in grads]
        if out and u.archetype == "pointwise":
            grads.update(v.buf for v in u.read_views() if v.buf in m.slot_of and v.buf.nbytes == out[0].nbytes)
    for i, u in units:
        if i <= end_fwd:
            continue
        reads = [v.buf for v in u.read_views() if v.buf in m.slot_of]
        fwd_or_re = all(written_at.get(b, -1) <= end_fwd or b in recomputed for b in reads)
        if u.name.startswith("recompute") or (fwd_or_re and any(b in recomputed for b in reads)):
            recomputed.update(b for b in u.written_bufs() if b in m.slot_of)
    roles = {}
    for b, (lo, hi) in m.intervals.items():
        if b in grads:
            r = "gradients"
        elif b.kind == "target":
            r = "targets"
        elif b.nbytes == logits_bytes:
            r = "logits_ce"
        elif lo <= end_fwd < hi:
            r = "kept_for_backward"
        elif lo <= end_fwd:
            r = "forward_temp"
        elif b in recomputed:
            r = "recompute"
        else:
            r = "backward_other"
        roles[b] = r
    return roles


def role_breakdown(kp, loss_buf, logits_bytes) -> dict:
    """MiB per role: persistent bytes by role, planned bytes live at the launch of the live
    peak by role, the most bytes of each role live at one launch, and the slots' total
    (the planned peak is persistent + slots)."""
    m = kp.memory
    roles = value_roles(kp, loss_buf, logits_bytes)
    n = len(kp.dispatches)
    at, _ = live_peak_launch(kp)
    out = {r: 0.0 for r in PERSISTENT_ROLES}
    for b in kp.bufs:
        if b not in m.slot_of:
            out[_persistent_role(b)] += b.nbytes / MIB
    at_peak = {r: 0.0 for r in ROLES}
    for b, (lo, hi) in m.intervals.items():
        if lo <= at <= hi:
            at_peak[roles[b]] += b.nbytes / MIB
    # per role, the most bytes of it live at one launch (anywhere in the call)
    most = {}
    for r in ROLES:
        diff = np.zeros(n + 2, dtype=np.int64)
        for b, (lo, hi) in m.intervals.items():
            if roles[b] == r:
                diff[lo] += b.nbytes
                diff[hi + 1] -= b.nbytes
        most[r] = float(np.cumsum(diff).max()) / MIB if n else 0.0
    return {"persistent": out, "live_peak_launch": at,
            "live_peak_kernel": kp.dispatches[min(at, n - 1)].kernel.name[:80] if n else None,
            "at_live_peak": at_peak, "most_live": most, "slots_mib": m.bytes_with / MIB}


def print_breakdown(label, d):
    p = ", ".join(f"{k} {v:.1f}" for k, v in d["persistent"].items())
    live = ", ".join(f"{k} {v:.1f}" for k, v in d["at_live_peak"].items() if v >= 0.05)
    print(f"  {label}: persistent MiB: {p}")
    print(f"  {label}: live at launch {d['live_peak_launch']} ({d['live_peak_kernel']}) MiB: {live}; "
          f"slots {d['slots_mib']:.1f}")
