"""Host cost of recording tiny dispatches into one compute pass.

Paths: (a) the wgpu-py wrapper (set_bind_group + dispatch_workgroups per dispatch),
(b) direct cffi calls on prepared raw handles (StepRecorder), and for reference
(c) one compute pass per dispatch through the wrapper. Every dispatch binds a
different bind group (cycling over a few) so both paths do the same calls.

    python bench/dispatch_overhead.py [--n 2000] [--reps 15] [--out PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import numpy as np

from meganeura.runtime import StepRecorder, get_device

KERNEL = """
@group(0) @binding(0) var<storage, read_write> a: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&a)) {
        a[i] = a[i] + 1.0;
    }
}
"""


def _stats(samples_s, n):
    us = [s * 1e6 / n for s in samples_s]
    return {
        "median_us": statistics.median(us),
        "min_us": min(us),
        "max_us": max(us),
        "samples_us": us,
    }


def bench(n=2000, reps=15, n_bind_groups=16):
    dev = get_device()
    pipe = dev.pipeline(KERNEL)
    bufs = [dev.create_buffer(256) for _ in range(n_bind_groups)]
    for b in bufs:
        dev.upload(b, np.zeros(64, np.float32))
    bgs = [dev.bind_group(pipe, [b]) for b in bufs]
    disp = [(pipe, bgs[i % n_bind_groups], (1, 1, 1)) for i in range(n)]
    rec = StepRecorder(dev)
    step = rec.prepare(disp)

    def wrapper_record(enc):
        cpass = enc.begin_compute_pass()
        cpass.set_pipeline(pipe.raw)
        t0 = time.perf_counter()
        for _, bg, (x, y, z) in disp:
            cpass.set_bind_group(0, bg)
            cpass.dispatch_workgroups(x, y, z)
        t = time.perf_counter() - t0
        cpass.end()
        return t

    def cffi_record(enc):
        cpass = enc.begin_compute_pass()
        p = cpass._internal
        t0 = time.perf_counter()
        StepRecorder._record(p, step.ops)
        t = time.perf_counter() - t0
        cpass.end()
        return t

    def pass_per_dispatch(enc, m):
        t0 = time.perf_counter()
        for _, bg, (x, y, z) in disp[:m]:
            cpass = enc.begin_compute_pass()
            cpass.set_pipeline(pipe.raw)
            cpass.set_bind_group(0, bg)
            cpass.dispatch_workgroups(x, y, z)
            cpass.end()
        return time.perf_counter() - t0

    results = {}
    for name, fn in (("wgpu-py wrapper", wrapper_record), ("direct cffi", cffi_record)):
        rec_s, e2e_s = [], []
        for r in range(reps + 2):
            dev.sync()
            t0 = time.perf_counter()
            enc = dev.raw.create_command_encoder()
            t_rec = fn(enc)
            dev.queue.submit([enc.finish()])
            dev.sync()
            t1 = time.perf_counter()
            if r >= 2:  # warm-up
                rec_s.append(t_rec)
                e2e_s.append(t1 - t0)
        results[name] = {"record": _stats(rec_s, n), "end_to_end": _stats(e2e_s, n)}

    # full StepRecorder.run (encoder + pass + loop + submit), host side only
    run_s = []
    for r in range(reps + 2):
        dev.sync()
        t0 = time.perf_counter()
        rec.run(step)
        t = time.perf_counter() - t0
        if r >= 2:
            run_s.append(t)
    dev.sync()
    results["StepRecorder.run host"] = {"record": _stats(run_s, n), "end_to_end": None}

    m = max(1, n // 10)
    pp_s = []
    for r in range(max(3, reps // 3) + 1):
        enc = dev.raw.create_command_encoder()
        t = pass_per_dispatch(enc, m)
        dev.queue.submit([enc.finish()])
        dev.sync()
        if r >= 1:
            pp_s.append(t)
    results["pass per dispatch (wrapper)"] = {"record": _stats(pp_s, m), "end_to_end": None,
                                              "n": m}
    return dev, results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=2000, help="dispatches per pass")
    ap.add_argument("--reps", type=int, default=15, help="timed repetitions")
    ap.add_argument("--out", default=os.path.join("bench", "results", "dispatch_overhead.json"))
    args = ap.parse_args(argv)

    dev, res = bench(args.n, args.reps)
    print(f"device: {dev.name} ({dev.adapter_info['backend']})"
          + ("  [software/CPU adapter]" if dev.is_software else ""))
    print(f"{args.n} tiny dispatches in one compute pass, {args.reps} reps (median / min)")
    print(f"{'path':<30} {'record us/dispatch':>22} {'end-to-end us/dispatch':>26}")
    for name, r in res.items():
        rec = f"{r['record']['median_us']:.2f} / {r['record']['min_us']:.2f}"
        e2e = (f"{r['end_to_end']['median_us']:.2f} / {r['end_to_end']['min_us']:.2f}"
               if r["end_to_end"] else "-")
        print(f"{name:<30} {rec:>22} {e2e:>26}")
    w = res["wgpu-py wrapper"]["record"]["median_us"]
    c = res["direct cffi"]["record"]["median_us"]
    print(f"speedup of direct cffi recording: {w / c:.2f}x")

    doc = {
        "benchmark": "dispatch_overhead",
        "n_dispatches": args.n,
        "reps": args.reps,
        "device": dev.adapter_info.get("name"),
        "backend": dev.adapter_info.get("backend"),
        "software_adapter": dev.is_software,
        "trusted_modules": dev.trusted,
        "host": platform.node(),
        "python": platform.python_version(),
        "results": res,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S"),
    }
    d = os.path.dirname(args.out)
    if d:
        os.makedirs(d, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(doc, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
