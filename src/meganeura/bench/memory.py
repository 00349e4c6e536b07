"""Planned device memory per call of each workload and phase (real size by default), from
the device-free compile stage (no GPU needed), beside PyTorch's measured peak
(``torch.cuda.max_memory_allocated``, eager, from a committed benchmark run).

    python bench/memory.py [--workloads resnet50,...] [--phases flb,train_step] [--detail 10]
                           [--torch bench/results/h200/bench.json] [--out bench/results/memory.json]

Per cell: persistent bytes (parameters, optimizer state, inputs, constants), the planner's
slots (intermediates and targets, shared by lifetime), their sum (the planned peak, what
the benchmark reports as ours), and the live peak: the most bytes of planned values live at
one launch, which no assignment of values to buffers can beat. ``--detail N`` lists, per
cell, the N largest values live at the launch where the live peak is reached, with their
lifetimes and writers: where the bytes go.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from meganeura.bench.dispatches import phase_targets
from meganeura.bench.workloads import WORKLOADS, make
from meganeura.compiler import CompileOptions, compile_plan

PHASES = ("inference", "minimal", "flb", "train_step")
MIB = 2 ** 20
# the H200's limits, as the GPU executor would read them from the adapter
H200_LIMITS = {"max-storage-buffers-per-shader-stage": 524288, "max-compute-workgroup-storage-size": 49152}


def torch_peaks(path) -> dict:
    """{(workload, phase): bytes} of PyTorch eager's (and torch.compile's) peak, strict
    mode, from a benchmark result file (bench.json); empty if there is none."""
    if not path or not os.path.exists(path):
        return {}
    with open(path) as f:
        cells = json.load(f).get("cells", [])
    out = {}
    for c in cells:
        if c.get("mode", "strict") != "strict":
            continue
        peaks = {k: c.get(k, {}).get("max_memory_allocated") for k in ("torch_eager", "torch_compile")}
        if any(peaks.values()):
            out[(c["workload"], c["phase"])] = peaks
    return out


def live_peak_launch(kp) -> tuple[int, int]:
    """(launch, bytes) of a plan's live peak: the launch at which its planned values' live
    bytes (``memory.intervals``) sum highest."""
    n = len(kp.dispatches)
    live = [0] * (n + 2)
    for b, (lo, hi) in kp.memory.intervals.items():
        live[lo] += b.nbytes
        live[hi + 1] -= b.nbytes
    acc, at, best = 0, 0, -1
    for k in range(n + 1):
        acc += live[k]
        if acc > best:
            best, at = acc, k
    return at, best


def breakdown(kp, top=10) -> dict:
    """Where a plan's bytes go: persistent bytes by kind, and the ``top`` largest values
    live at the launch of the live peak (name, kind, bytes, first and last launch, writer)."""
    m = kp.memory
    persistent = {}
    for b in kp.bufs:
        if b not in m.slot_of:
            persistent[b.kind] = persistent.get(b.kind, 0) + b.nbytes
    n = len(kp.dispatches)
    at, _ = live_peak_launch(kp)
    writer = {}
    for k, d in enumerate(kp.dispatches):
        for b in d.kernel.written_bufs():
            writer.setdefault(id(b), d.kernel.name)
    alive = sorted((b for b, (lo, hi) in m.intervals.items() if lo <= at <= hi), key=lambda b: -b.nbytes)
    return {"persistent_by_kind": persistent, "live_peak_launch": at,
            "live_peak_kernel": kp.dispatches[min(at, n - 1)].kernel.name if n else None,
            "largest_live": [{"name": b.name, "kind": b.kind, "bytes": b.nbytes, "first": m.intervals[b][0],
                              "last": m.intervals[b][1], "writer": writer.get(id(b), "")} for b in alive[:top]]}


def measure(name, phase, size="real", top=0, limits=None) -> dict:
    """One cell: compile the workload's phase as the GPU executor would and read the plan."""
    w = make(name, size=size, device="cpu")
    targets, n_fwd, updates = phase_targets(w, phase)
    opts = CompileOptions.from_env("strict", limits or H200_LIMITS)
    t0 = time.perf_counter()
    kp = compile_plan(targets, n_forward=n_fwd, options=opts, updates=updates)
    m = kp.memory
    row = {"workload": name, "phase": phase, "persistent": m.persistent_bytes, "planned": m.bytes_with,
           "unshared": m.bytes_without, "peak": m.peak_bytes, "live_peak": m.persistent_bytes + m.live_peak,
           "slots": len(m.slot_sizes), "dispatches": kp.n_dispatches, "in_place_updates": kp.stats["in_place"],
           "compile_plan_s": round(time.perf_counter() - t0, 3)}
    if top:
        row["detail"] = breakdown(kp, top)
    return row


def _mib(x):
    return "-" if x is None else f"{x / MIB:.1f}"


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--torch", default="bench/results/h200/bench.json",
                    help="benchmark result with PyTorch's measured peaks ('' for none)")
    ap.add_argument("--detail", type=int, default=0, metavar="N",
                    help="list the N largest values live at each cell's live peak")
    ap.add_argument("--out", default="bench/results/memory.json")
    args = ap.parse_args(argv)
    ref = torch_peaks(args.torch) if args.size == "real" else {}
    rows = []
    head = (f"{'workload':9} {'phase':10} {'persistent':>10} {'planned':>8} {'peak':>8} {'live pk':>8} "
            f"{'torch':>8} {'t.compile':>9} {'ours/torch':>10} {'slots':>5} {'s':>5}")
    print("MiB; peak = persistent + planned slots; live pk = persistent + most planned bytes live at once")
    print(head)
    for name in args.workloads.split(","):
        for phase in args.phases.split(","):
            row = measure(name, phase, args.size, args.detail)
            peaks = ref.get((name, phase), {})
            row["torch_eager_peak"], row["torch_compile_peak"] = peaks.get("torch_eager"), peaks.get("torch_compile")
            te = row["torch_eager_peak"]
            ratio = f"{row['peak'] / te:10.2f}" if te else f"{'-':>10}"
            print(f"{name:9} {phase:10} {_mib(row['persistent']):>10} {_mib(row['planned']):>8} {_mib(row['peak']):>8} "
                  f"{_mib(row['live_peak']):>8} {_mib(te):>8} {_mib(row['torch_compile_peak']):>9} {ratio} "
                  f"{row['slots']:5d} {row['compile_plan_s']:5.1f}", flush=True)
            if args.detail:
                d = row["detail"]
                kinds = ", ".join(f"{k} {_mib(v)}" for k, v in sorted(d["persistent_by_kind"].items()))
                print(f"    persistent: {kinds}; live peak at launch {d['live_peak_launch']} "
                      f"({(d['live_peak_kernel'] or '')[:60]})")
                for v in d["largest_live"]:
                    print(f"      {v['name'][:28]:28} {v['kind']:6} {_mib(v['bytes']):>7} [{v['first']:5d},{v['last']:5d}] "
                          f"{v['writer'][:60]}")
            rows.append(row)
    over = [f"{r['workload']} {r['phase']}" for r in rows
            if r["phase"] == "train_step" and r["torch_eager_peak"] and r["peak"] > r["torch_eager_peak"]]
    if any(r["torch_eager_peak"] for r in rows):
        print("train-step cells over PyTorch's peak: " + (", ".join(over) if over else "none"))
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump({"size": args.size, "torch_reference": args.torch, "limits": H200_LIMITS, "rows": rows}, f,
                      indent=1)
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
