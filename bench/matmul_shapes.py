"""The GEMM shapes the workloads really run, and ours beside torch's at each (strict f32).

    python bench/matmul_shapes.py [--size real] [--workloads smollm2,...] [--dry] [--out FILE]

Shapes come from the compiled plans, device-free: every phase of every workload
(``meganeura.bench.dispatches.phase_targets``) goes through ``compile_plan`` and each
matmul-archetype kernel (a part of a merged launch counts on its own) gives its M, N, K,
batch, transposes and the variant our planner chose (tiled with its tile and K splits,
or GEMV), with a count per workload and phase. ``source`` says whether the kernel loads
an operand through a gather (implicit-GEMM convolution: im2col computed in the loads) or
a norm prologue; the timing below runs the plain GEMM of the same shape.

Then, on a GPU, each distinct shape is timed: ours (a session of one ``mm`` with that
batch and those transposes, its prepared step replayed back to back in one submit where the
runtime can, GPU-complete wall time) beside
``torch.matmul`` on the same transposed views with TF32 off, median of ``--samples``
after ``--warmup``; printed as a table (TFLOP/s both sides, ratio = ours / torch's
throughput) and written as JSON. ``--dry`` lists shapes only; ``--time-max N`` limits
timing to the N shapes with the most FLOPs per step (after ``--time-shapes`` picks
particular ones, e.g. the tests' small shapes on lavapipe); with no CUDA, torch's column is
its CPU time (not a performance number).

On the H200 (about 300 distinct shapes at real size, 4830 matmul kernels over the five
workloads' four phases; a few minutes):

    python bench/matmul_shapes.py --size real --out bench/results/h200/matmul_shapes.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

PHASES = ("inference", "minimal", "flb", "train_step")


def gemm_of(unit) -> dict:
    """M, N, K, batch, transposes and our variant of one matmul-archetype kernel."""
    a, b = unit.reads[:2]
    spec = unit.spec
    ta, tb = bool(spec["ta"]), bool(spec["tb"])
    m, n = unit.shape[-2:]
    k = a.shape[-2] if ta else a.shape[-1]
    split = int(spec.get("split", 1))
    batch = tuple(spec.get("batch", unit.shape[:-2]) if split > 1 or spec.get("gemv") else unit.shape[:-2])
    source = "conv" if spec.get("gathers") or unit.name.startswith("im2col") else \
        "norm+matmul" if "prologue" in spec else "matmul"
    variant = ("gemv" if spec.get("gemv") else f"tile{spec.get('tile', '?')}") + (f"/split{split}" if split > 1 else "")
    return {"m": int(m), "n": int(n), "k": int(k), "batch": [int(x) for x in batch],
            "a_batch": [int(x) for x in a.shape[:-2]], "b_batch": [int(x) for x in b.shape[:-2]],
            "ta": ta, "tb": tb, "source": source, "variant": variant}


def shape_key(g):
    return (g["m"], g["n"], g["k"], tuple(g["a_batch"]), tuple(g["b_batch"]), g["ta"], g["tb"])


def collect(workloads, size, phases=PHASES, log=print):
    """{shape key: row} over every workload and phase, with counts per (workload, phase)."""
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    from meganeura.compiler import CompileOptions, compile_plan
    opts = CompileOptions(max_bindings=BINDINGS)
    rows = {}
    for name in workloads:
        w = make(name, size=size, device="cpu")
        for phase in phases:
            t0 = time.perf_counter()
            targets, n_fwd, updates = phase_targets(w, phase)
            kp = compile_plan(targets, n_forward=n_fwd, options=opts, updates=updates)
            found = 0
            for d in kp.dispatches:
                for unit in d.kernel.spec.get("parts", [d.kernel]):
                    if unit.archetype != "matmul":
                        continue
                    g = gemm_of(unit)
                    row = rows.setdefault(shape_key(g), {**g, "uses": defaultdict(int), "variants": set(),
                                                         "sources": set()})
                    row["uses"][f"{name}/{phase}"] += 1
                    row["variants"].add(g["variant"])
                    row["sources"].add(g["source"])
                    found += 1
            log(f"  {name:9} {phase:10} {found:4d} matmul kernels ({time.perf_counter() - t0:.1f} s)")
    for r in rows.values():
        r["count"] = sum(r["uses"].values())
        r["flops"] = 2 * r["m"] * r["n"] * r["k"] * int(np.prod(r["batch"] or [1]))
        r["uses"], r["variants"], r["sources"] = dict(r["uses"]), sorted(r["variants"]), sorted(r["sources"])
    return rows


def _operands(r, rng):
    """A and B as stored (transposed where flagged), f32."""
    a = (r["k"], r["m"]) if r["ta"] else (r["m"], r["k"])
    b = (r["n"], r["k"]) if r["tb"] else (r["k"], r["n"])
    return (rng.standard_normal(tuple(r["a_batch"]) + a).astype(np.float32),
            rng.standard_normal(tuple(r["b_batch"]) + b).astype(np.float32))


def time_ours(r, samples, warmup):
    import meganeura as mg
    from meganeura.bench.harness import replay_seconds
    A, B = _operands(r, np.random.default_rng(0))
    g = mg.Graph()
    a, b = g.input("a", A.shape), g.input("b", B.shape)
    sess = mg.compile(g, outputs=[mg.ops.mm(a, b, ta=r["ta"], tb=r["tb"])], backend="gpu")
    try:
        got = sess.run({"a": A, "b": B})[0]
        want = np.matmul(np.swapaxes(A, -1, -2) if r["ta"] else A, np.swapaxes(B, -1, -2) if r["tb"] else B)
        err = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))
        # replays per sample: about 2 GFLOP, queued back to back in one submit as torch
        # queues its launches, so launch cost is amortised alike on both sides; at most 100
        # so the sweep of ~300 shapes stays within minutes
        reps = min(100, max(1, int(2e9 // max(r["flops"], 1))))
        times, _ = replay_seconds(sess, samples, warmup, reps, gpu=False, back_to_back=True)
        return times, err, sess.executor.plan("run").n_dispatches, reps
    finally:
        sess.close()


def time_torch(r, samples, warmup, reps):
    import torch
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    A, B = (torch.as_tensor(x, device=dev) for x in _operands(r, np.random.default_rng(0)))
    a = A.transpose(-1, -2) if r["ta"] else A
    b = B.transpose(-1, -2) if r["tb"] else B
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        torch.matmul(a, b)
    sync()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        sync()
        times.append((time.perf_counter() - t0) / reps)
    return times, dev


def main(argv=None):
    from meganeura.bench.workloads import WORKLOADS
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--phases", default=",".join(PHASES))
    ap.add_argument("--dry", action="store_true", help="shapes only (no device)")
    ap.add_argument("--time-shapes", default="", help="time these shapes first: 'MxNxK[,...]' (plain, batch 1)")
    ap.add_argument("--time-max", type=int, default=None, help="time at most this many shapes (largest first)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default=None, help="JSON (default bench/results/matmul_shapes_<size>.json)")
    args = ap.parse_args(argv)
    out = args.out or f"bench/results/matmul_shapes_{args.size}.json"
    print(f"collecting GEMM shapes ({args.size} size) from the compiled plans", flush=True)
    rows = collect(args.workloads.split(","), args.size, args.phases.split(","),
                   log=lambda s: print(s, flush=True))
    table = sorted(rows.values(), key=lambda r: -r["flops"] * r["count"])
    print(f"\n{len(table)} distinct shapes, {sum(r['count'] for r in table)} matmul kernels")
    result = {"size": args.size, "workloads": args.workloads.split(","), "phases": args.phases.split(","),
              "python": platform.python_version(), "shapes": table}
    if not args.dry:
        import torch

        from meganeura.runtime.backends import gpu_device
        dev = gpu_device()
        picked = []
        for s in filter(None, args.time_shapes.split(",")):
            m, n, k = (int(v) for v in s.lower().split("x"))
            extra = {"m": m, "n": n, "k": k, "batch": [], "a_batch": [], "b_batch": [], "ta": False, "tb": False,
                     "flops": 2 * m * n * k, "count": 0, "uses": {}, "variants": [], "sources": ["requested"]}
            picked.append(rows.get(shape_key(extra), extra))
        rest = [r for r in sorted(table, key=lambda r: -r["flops"]) if all(r is not p for p in picked)]
        picked += rest[:None if args.time_max is None else max(0, args.time_max - len(picked))]
        result.update(device=dev.adapter_info, trusted=dev.trusted, torch=torch.__version__)
        print(f"\ntiming {len(picked)} shapes on {dev.name}, torch on "
              f"{'cuda (TF32 off)' if torch.cuda.is_available() else 'cpu'}")
        print(f"{'M':>6} {'N':>6} {'K':>6} {'batch':>8} {'ta':>2} {'tb':>2} {'uses':>5} {'variant':>14} {'source':>7} "
              f"{'ours us':>9} {'TF/s':>7} {'torch us':>9} {'TF/s':>7} {'ratio':>6}")
        timed = []
        for r in picked:
            t_ours, err, nd, reps = time_ours(r, args.samples, args.warmup)
            t_torch, tdev = time_torch(r, args.samples, args.warmup, reps)
            mo, mt = statistics.median(t_ours), statistics.median(t_torch)
            row = {**r, "ours_us": mo * 1e6, "ours_tflops": r["flops"] / mo / 1e12, "ours_dispatches": nd,
                   "torch_us": mt * 1e6, "torch_tflops": r["flops"] / mt / 1e12, "torch_device": tdev,
                   "ratio": mt / mo, "max_rel_err": err, "reps": reps, "ours_samples_s": t_ours,
                   "torch_samples_s": t_torch}
            timed.append(row)
            batch = "x".join(map(str, r["batch"])) or "-"
            print(f"{r['m']:6d} {r['n']:6d} {r['k']:6d} {batch:>8} {int(r['ta']):2d} {int(r['tb']):2d} {r['count']:5d} "
                  f"{','.join(r['variants']) or '-':>14} {','.join(r['sources'])[:7]:>7} {row['ours_us']:9.1f} "
                  f"{row['ours_tflops']:7.2f} {row['torch_us']:9.1f} {row['torch_tflops']:7.2f} {row['ratio']:6.2f}",
                  flush=True)
        result["timed"] = timed
        if timed:
            w = np.array([r["count"] * r["flops"] for r in timed], np.float64)
            result["weighted_ratio"] = float((w / w.sum() * np.array([r["ratio"] for r in timed])).sum()) \
                if w.sum() else None
    else:
        print(f"{'M':>6} {'N':>6} {'K':>6} {'batch':>8} {'ta':>2} {'tb':>2} {'uses':>5} {'variant':>14}  source")
        for r in table:
            batch = "x".join(map(str, r["batch"])) or "-"
            print(f"{r['m']:6d} {r['n']:6d} {r['k']:6d} {batch:>8} {int(r['ta']):2d} {int(r['tb']):2d} {r['count']:5d} "
                  f"{','.join(r['variants']):>14}  {','.join(r['sources'])}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
