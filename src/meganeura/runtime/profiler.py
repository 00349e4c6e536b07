"""GPU timestamps -> Chrome/Perfetto trace and a per-kernel time table."""

from __future__ import annotations

import json
import os

import numpy as np


def _as_pairs(timestamps_ns):
    ts = np.asarray(timestamps_ns, dtype=np.int64)
    if ts.ndim != 2 or ts.shape[1] != 2:
        raise ValueError(f"timestamps must be (n, 2) [start, end] ns, got shape {ts.shape}")
    return ts


def trace_events(names, timestamps_ns, pid=0, tid=0, args=None):
    """Complete ('X') events, one per dispatch, times in microseconds from the first start."""
    ts = _as_pairs(timestamps_ns)
    if len(names) != len(ts):
        raise ValueError(f"{len(names)} names for {len(ts)} timestamp pairs")
    t0 = int(ts[:, 0].min()) if len(ts) else 0
    events = []
    for i, (name, (s, e)) in enumerate(zip(names, ts)):
        ev = {
            "name": str(name),
            "cat": "gpu",
            "ph": "X",
            "ts": (int(s) - t0) / 1e3,
            "dur": max(int(e) - int(s), 0) / 1e3,
            "pid": pid,
            "tid": tid,
            "args": {"index": i},
        }
        if args is not None:
            ev["args"].update(args[i])
        events.append(ev)
    return events


def write_chrome_trace(path, names, timestamps_ns, args=None, process_name="meganeura GPU"):
    """Write a trace JSON (open in ui.perfetto.dev or chrome://tracing).

    names: kernel name per dispatch; timestamps_ns: (n, 2) [start, end] in ns;
    args: optional per-dispatch dicts added to each event."""
    events = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0,
               "args": {"name": process_name}}]
    events += trace_events(names, timestamps_ns, args=args)
    d = os.path.dirname(os.fspath(path))
    if d:
        os.makedirs(d, exist_ok=True)
    with open(path, "w") as f:
        json.dump({"traceEvents": events, "displayTimeUnit": "ns"}, f)
    return path


def kernel_table(names, timestamps_ns):
    """Rows (name, total_us, count, mean_us, percent), largest total first."""
    ts = _as_pairs(timestamps_ns)
    if len(names) != len(ts):
        raise ValueError(f"{len(names)} names for {len(ts)} timestamp pairs")
    dur = np.maximum(ts[:, 1] - ts[:, 0], 0) / 1e3
    totals, counts = {}, {}
    for name, d in zip(names, dur):
        totals[name] = totals.get(name, 0.0) + float(d)
        counts[name] = counts.get(name, 0) + 1
    grand = sum(totals.values()) or 1.0
    rows = [(n, t, counts[n], t / counts[n], 100.0 * t / grand) for n, t in totals.items()]
    rows.sort(key=lambda r: -r[1])
    return rows


def format_kernel_table(rows, limit=None):
    lines = [f"{'kernel':<40} {'total us':>11} {'count':>6} {'mean us':>10} {'%':>6}"]
    for name, tot, cnt, mean, pct in rows[:limit]:
        lines.append(f"{name[:40]:<40} {tot:>11.1f} {cnt:>6d} {mean:>10.2f} {pct:>6.1f}")
    return "\n".join(lines)
