"""GPU timestamps -> Chrome/Perfetto trace and a per-kernel time table."""

from __future__ import annotations

import atexit
import json
import os
import threading
import warnings

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


class TraceWriter:
    """A Chrome trace in the JSON array format, appended step by step (``MEGANEURA_TRACE``).

    The file is opened (and so checked writable) before the first step runs, each step's
    events are appended and flushed as soon as its timestamps arrive, and the closing
    bracket is written at ``close`` or exit. Trace viewers accept the array without it,
    so a crash loses nothing already traced; ``load_trace`` reads either form. One
    writer per path serves every session (a thread per session)."""

    def __init__(self, path):
        self.path = os.fspath(path)
        try:
            d = os.path.dirname(self.path)
            if d:
                os.makedirs(d, exist_ok=True)
            self._f = open(self.path, "w")
            self._f.write('[{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, '
                          '"args": {"name": "meganeura GPU"}}')
            self._f.flush()
        except OSError as e:
            raise OSError(e.errno, f"MEGANEURA_TRACE={self.path!r}: cannot write the trace file "
                                   f"({e.strerror or e}); nothing was run") from None
        self._lock = threading.Lock()
        self._t0 = None
        self._steps = 0
        self._events = 0
        self._full = False

    # about 250 MB of JSON: a long run keeps its first steps rather than filling the disk
    max_events = 2_000_000

    def add(self, names, timestamps_ns, session=0, label=""):
        """Append one step's dispatches (times from the trace's first dispatch)."""
        ts = _as_pairs(timestamps_ns)
        with self._lock:
            if self._f is None:
                raise ValueError(f"trace {self.path!r} is closed")
            if self._events + len(ts) > self.max_events:
                if not self._full:
                    self._full = True
                    warnings.warn(f"MEGANEURA_TRACE={self.path!r}: {self._events} events written, "
                                  f"later steps are not traced", stacklevel=3)
                return
            self._events += len(ts)
            if self._t0 is None and len(ts):
                self._t0 = int(ts[:, 0].min())
            t0 = self._t0 or 0
            lines = []
            for i, (name, (s, e)) in enumerate(zip(names, ts)):
                lines.append(json.dumps({"name": str(name), "cat": "gpu", "ph": "X", "ts": (int(s) - t0) / 1e3,
                                         "dur": max(int(e) - int(s), 0) / 1e3, "pid": 0, "tid": session,
                                         "args": {"index": i, "step": self._steps, "phase": label}}))
            self._steps += 1
            if lines:
                self._f.write(",\n" + ",\n".join(lines))
            self._f.flush()

    def close(self):
        with self._lock:
            if self._f is not None:
                self._f.write("\n]\n")
                self._f.close()
                self._f = None


_writers: dict = {}
_writers_lock = threading.Lock()


def trace_writer(path) -> TraceWriter:
    """The process-wide writer of ``path`` (opened on first use, closed at exit)."""
    key = os.path.abspath(os.fspath(path))
    with _writers_lock:
        w = _writers.get(key)
        if w is None or w._f is None:
            w = _writers[key] = TraceWriter(path)
        return w


@atexit.register
def close_traces():
    """Finish every open ``MEGANEURA_TRACE`` file (also runs at exit)."""
    with _writers_lock:
        ws = list(_writers.values())
        _writers.clear()
    for w in ws:
        w.close()


def load_trace(path) -> list:
    """The events of a trace file: an object with ``traceEvents``, or an array that may
    lack its closing bracket (a trace still being written)."""
    text = open(path).read().rstrip()
    if text.startswith("[") and not text.endswith("]"):
        text += "]"
    d = json.loads(text)
    return d["traceEvents"] if isinstance(d, dict) else d


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
