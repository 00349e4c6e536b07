"""Accelerated-precision matmuls on cooperative matrices (the direct Vulkan backend) beside
PyTorch's, in TFLOP/s.

    python bench/coopmat.py [--sizes 1024,2048,4096] [--no-workload-shapes] [--no-sweep] [--out FILE]

Cases: square GEMMs at ``--sizes`` (B plain and B transposed, the linear layout), then the
distinct tiled f16 matmuls of the five workloads at real size (``--size``), taken device-free
from their accelerated plans' forward phases (each part of a merged launch on its own), with
how often each runs per call. Per case:

- ``ours``: a session of one matmul in accelerated precision (f32 inputs: the f16 casts, the
  matmul and, with K splits, the sum of the partials). Its time is the GPU time of the matmul
  kernels alone (a timestamp around each dispatch; the casts left out; median of
  ``--samples`` after ``--warmup`` and ``WARM_S`` of back-to-back steps); ``kernel`` says
  ``coop`` when it ran on cooperative matrices, else why not;
- ``fma``: the same session with ``MEGANEURA_COOPMAT=off`` (f32 FMA tiles on f16 loads, what
  accelerated precision ran before); ``--no-fma`` skips it;
- ``torch.matmul`` with TF32 on (f32 operands) and with f16 operands, CUDA events around
  ``reps`` back-to-back calls (with no CUDA: CPU time, not a performance number).

``err``: max |ours - ref| / max |ref| on 16 sampled rows, ref in float64 from the f16-rounded
operands. ``--sweep`` (on by default) times the largest square GEMM under each tile
configuration of ``SWEEP`` (``MEGANEURA_COOPMAT_CONFIG``: workgroup tile, subgroups, K chunk, chunks ahead).
Prints tables and writes JSON. On the H200:

    python bench/coopmat.py --out bench/results/h200/coopmat.json
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "src"))
sys.path.insert(0, HERE)

# tile configurations for the 128 tile (T:BMxBNxSG_MxSG_NxBKxDEPTH); the first is the default,
# the second the default's wide tile (coopmat.WIDE) for grids of at least WIDE_MIN_GROUPS
SWEEP = ["128:128x128x2x4x16x2", "128:128x256x2x4x16x4", "128:128x128x2x4x16x1", "128:128x128x2x4x16x3",
         "128:128x256x2x4x16x2", "128:128x256x2x4x16x3", "128:256x128x4x2x16x4", "128:128x256x4x4x16x2"]
# seconds of back-to-back steps before the timed samples: the GPU's clocks fall in the gaps
# between sessions (an H200 went 1980 -> 345 MHz from the fourth session of one process on,
# and five warm-up steps of 0.7 ms did not bring them back)
WARM_S = 0.3


def square_cases(sizes):
    return [{"m": n, "n": n, "k": n, "batch": [], "a_batch": [], "b_batch": [], "ta": False, "tb": tb,
             "count": 0, "uses": {}, "source": f"square {'nt' if tb else 'nn'}"} for n in sizes for tb in (False, True)]


def workload_cases(size, workloads, log=print):
    """The distinct tiled f16 matmuls of the workloads' accelerated forward plans."""
    from matmul_shapes import gemm_of, shape_key

    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    from meganeura.codegen import coopmat
    from meganeura.compiler import CompileOptions, compile_plan
    opts = CompileOptions(precision="accelerated", max_bindings=BINDINGS, workgroup_storage=49152)
    rows = {}
    for name in workloads:
        w = make(name, size=size, device="cpu")
        for phase in ("inference", "minimal"):
            targets, n_fwd, updates = phase_targets(w, phase)
            kp = compile_plan(targets, n_forward=n_fwd, options=opts, updates=updates)
            found = 0
            for d in kp.dispatches:
                for unit in d.kernel.spec.get("parts", [d.kernel]):
                    if unit.archetype != "matmul" or coopmat.select(unit):
                        continue
                    g = gemm_of(unit)
                    row = rows.setdefault(shape_key(g), {**g, "uses": {}, "source": "workload"})
                    key = f"{name}/{phase}"
                    row["uses"][key] = row["uses"].get(key, 0) + 1
                    found += 1
            log(f"  {name:9} {phase:10} {found:4d} tiled f16 matmuls")
    for r in rows.values():
        r["count"] = sum(r["uses"].values())
    return sorted(rows.values(), key=lambda r: -2 * r["m"] * r["n"] * r["k"] * int(np.prod(r["batch"] or [1])))


def flops(r):
    return 2 * r["m"] * r["n"] * r["k"] * int(np.prod(r["batch"] or [1]))


def operands(r, rng):
    a = (r["k"], r["m"]) if r["ta"] else (r["m"], r["k"])
    b = (r["n"], r["k"]) if r["tb"] else (r["k"], r["n"])
    return (rng.uniform(-1, 1, tuple(r["a_batch"]) + a).astype(np.float32),
            rng.uniform(-1, 1, tuple(r["b_batch"]) + b).astype(np.float32))


def reference_rows(A, B, r, rows):
    """float64 C[..., rows, :] from the f16-rounded operands."""
    a = A.astype(np.float16).astype(np.float64)
    b = B.astype(np.float16).astype(np.float64)
    a = np.swapaxes(a, -1, -2) if r["ta"] else a
    b = np.swapaxes(b, -1, -2) if r["tb"] else b
    return np.matmul(a[..., rows, :], b)


def time_ours(r, samples, warmup, coopmat):
    """(GEMM GPU seconds per sample, step seconds, max relative error, kernel) of one
    accelerated matmul session."""
    import meganeura as mg
    from meganeura.codegen import coopmat as cm
    os.environ["MEGANEURA_COOPMAT"] = coopmat
    A, B = operands(r, np.random.default_rng(0))
    g = mg.Graph()
    a, b = g.input("a", A.shape), g.input("b", B.shape)
    from meganeura.runtime.vulkan.backend import get_vulkan_runtime
    dev = get_vulkan_runtime()
    before = dev.stats["coopmat_kernels"]
    sess = mg.compile(g, outputs=[mg.ops.mm(a, b, ta=r["ta"], tb=r["tb"])], backend="vulkan", precision="accelerated")
    try:
        ex = sess.executor
        plan = ex.plan("run")
        swapped = dev.stats["coopmat_kernels"] > before
        kernels = [d.kernel for d in plan.kernel_plan.dispatches]
        mm = [i for i, k in enumerate(kernels) if k.archetype == "matmul" or k.name.startswith("matmul.splitk")]
        got = sess.run({"a": A, "b": B})[0]
        rows = np.random.default_rng(1).choice(r["m"], size=min(r["m"], 16), replace=False)
        want = reference_rows(A, B, r, rows)
        err = float(np.abs(got[..., rows, :] - want).max() / max(np.abs(want).max(), 1e-30))
        ns = ex.recorder.run(plan.step, timestamps=True)
        for _ in range(warmup):
            ns = ex.recorder.run(plan.step, timestamps=True)
        repeated = getattr(ex.recorder, "run_repeated", None)
        if repeated is not None:
            reps = int(min(max(0.05 / max(int(ns[-1, 1] - ns[0, 0]) * 1e-9, 1e-7), 1), 2000))
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < WARM_S:
                repeated(plan.step, reps)
        gemm, step = [], []
        for _ in range(samples):
            ns = ex.recorder.run(plan.step, timestamps=True)
            gemm.append(sum(int(ns[i, 1] - ns[i, 0]) for i in mm) * 1e-9)
            step.append(int(ns[-1, 1] - ns[0, 0]) * 1e-9)
        if swapped:      # the SPIR-V says whether the fragments are real or emulated
            caps = getattr(plan.dispatches[mm[0]][0], "capabilities", ())
            kernel = "coop" if "CooperativeMatrixKHR" in caps else "emulated"
        elif coopmat == "off":
            kernel = "fma (MEGANEURA_COOPMAT=off)"
        else:
            kernel = dev.coopmat_reason or cm.select(kernels[mm[0]]) or "fma (workgroup memory of the tile config)"
        return gemm, step, err, kernel
    finally:
        sess.close()
        os.environ.pop("MEGANEURA_COOPMAT", None)


def time_torch(r, dtype, samples, warmup):
    import torch
    cuda = torch.cuda.is_available()
    dev = "cuda" if cuda else "cpu"
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    A, B = (torch.as_tensor(x, device=dev) for x in operands(r, np.random.default_rng(0)))
    if dtype == "f16":
        if not cuda:
            return None, dev, 0
        A, B = A.half(), B.half()
    a = A.transpose(-1, -2) if r["ta"] else A
    b = B.transpose(-1, -2) if r["tb"] else B
    reps = max(3, min(200, int(2e10 // max(flops(r), 1))))
    for _ in range(warmup):
        torch.matmul(a, b)
    times = []
    for _ in range(samples):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            for _ in range(reps):
                torch.matmul(a, b)
            e.record()
            torch.cuda.synchronize()
            times.append(s.elapsed_time(e) * 1e-3 / reps)
        else:
            t0 = time.perf_counter()
            for _ in range(reps):
                torch.matmul(a, b)
            times.append((time.perf_counter() - t0) / reps)
    return times, dev, reps


def tflops(r, seconds):
    return flops(r) / seconds / 1e12 if seconds else float("nan")


def measure(r, args, mode):
    row = dict(r)
    gemm, step, err, kernel = time_ours(r, args.samples, args.warmup, mode)
    row.update(ours_s=statistics.median(gemm), ours_step_s=statistics.median(step), ours_samples_s=gemm,
               max_rel_err=err, kernel=kernel)
    row["ours_tflops"] = tflops(r, row["ours_s"])
    if args.fma:
        g2, _, err2, _ = time_ours(r, args.samples, args.warmup, coopmat="off")
        row.update(fma_s=statistics.median(g2), fma_tflops=tflops(r, statistics.median(g2)), fma_err=err2)
    for dt in ("tf32", "f16"):
        t, tdev, reps = time_torch(r, "f32" if dt == "tf32" else "f16", args.samples, args.warmup)
        row["torch_device"] = tdev
        if t is not None:
            row[f"torch_{dt}_s"] = statistics.median(t)
            row[f"torch_{dt}_tflops"] = tflops(r, row[f"torch_{dt}_s"])
            row[f"ours_vs_{dt}"] = row[f"torch_{dt}_s"] / row["ours_s"] if row["ours_s"] else None
    return row


HEADER = (f"{'M':>6} {'N':>6} {'K':>6} {'batch':>7} {'ta':>2} {'tb':>2} {'uses':>4} {'kernel':>6} "
          f"{'ours us':>9} {'TF/s':>7} {'fma TF/s':>8} {'TF32 TF/s':>9} {'f16 TF/s':>8} {'/TF32':>6} {'/f16':>6} {'err':>8}")


def fmt(row):
    nan = float("nan")
    batch = "x".join(map(str, row["batch"])) or "-"
    return (f"{row['m']:6d} {row['n']:6d} {row['k']:6d} {batch:>7} {int(row['ta']):2d} {int(row['tb']):2d} "
            f"{row.get('count', 0):4d} {row['kernel'][:6]:>6} {row['ours_s'] * 1e6:9.1f} {row['ours_tflops']:7.1f} "
            f"{row.get('fma_tflops', nan):8.1f} {row.get('torch_tf32_tflops', nan):9.1f} "
            f"{row.get('torch_f16_tflops', nan):8.1f} {row.get('ours_vs_tf32') or nan:6.2f} "
            f"{row.get('ours_vs_f16') or nan:6.2f} {row['max_rel_err']:8.1e}")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1024,2048,4096", help="square GEMM sizes")
    ap.add_argument("--size", default="real", choices=("tiny", "real"), help="workload size for their shapes")
    ap.add_argument("--workloads", default="smollm2,smolvla,unet,resnet50,whisper")
    ap.add_argument("--no-workload-shapes", dest="workload_shapes", action="store_false")
    ap.add_argument("--no-sweep", dest="sweep", action="store_false", help="skip the tile-configuration sweep")
    ap.add_argument("--no-fma", dest="fma", action="store_false", help="skip the f32 FMA tiles (MEGANEURA_COOPMAT=off)")
    ap.add_argument("--configs", nargs="+", default=SWEEP, metavar="T:BMxBNxSG_MxSG_NxBKxDEPTH",
                    help="the sweep's tile configurations (default: SWEEP)")
    ap.add_argument("--samples", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--out", default="bench/results/coopmat.json")
    args = ap.parse_args(argv)
    import torch

    from meganeura.runtime.vulkan.backend import get_vulkan_runtime
    dev = get_vulkan_runtime()
    sizes = [int(s) for s in args.sizes.split(",") if s]
    print(f"{dev.name}: cooperative matrices {'yes' if not dev.coopmat_reason else 'no (' + dev.coopmat_reason + ')'}"
          f"{', MEGANEURA_COOPMAT=' + os.environ['MEGANEURA_COOPMAT'] if os.environ.get('MEGANEURA_COOPMAT') else ''}; "
          f"torch {torch.__version__} on {'cuda' if torch.cuda.is_available() else 'cpu (not a performance number)'}",
          flush=True)
    mode = os.environ.pop("MEGANEURA_COOPMAT", "auto")
    cases = square_cases(sizes)
    if args.workload_shapes:
        print(f"collecting the workloads' tiled f16 matmuls ({args.size} size)", flush=True)
        cases += workload_cases(args.size, args.workloads.split(","), log=lambda s: print(s, flush=True))
    result = {"device": dev.adapter_info, "coopmat": dev.coopmat_reason or "yes", "mode": mode,
              "torch": torch.__version__, "python": platform.python_version(), "samples": args.samples,
              "warmup": args.warmup, "cases": [], "sweep": []}
    print(HEADER)
    for r in cases:
        row = measure(r, args, mode)
        result["cases"].append(row)
        print(fmt(row), flush=True)
    if args.sweep and sizes:
        big = square_cases([max(sizes)])
        print(f"\ntile configurations at {max(sizes)}^3 (MEGANEURA_COOPMAT_CONFIG; SWEEP's first is the default)")
        print(f"{'config':>22} {'layout':>6} {'kernel':>6} {'ours us':>9} {'TF/s':>7} {'err':>8}")
        for cfg in args.configs:
            os.environ["MEGANEURA_COOPMAT_CONFIG"] = cfg
            for r in big:
                gemm, _, err, kernel = time_ours(r, args.samples, args.warmup, mode)
                t = statistics.median(gemm)
                result["sweep"].append({"config": cfg, "layout": r["source"], "ours_s": t, "tflops": tflops(r, t),
                                        "max_rel_err": err, "kernel": kernel})
                print(f"{cfg:>22} {r['source'][-2:]:>6} {kernel[:6]:>6} {t * 1e6:9.1f} {tflops(r, t):7.1f} {err:8.1e}",
                      flush=True)
        os.environ.pop("MEGANEURA_COOPMAT_CONFIG", None)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(f"wrote {args.out}")
    return result


if __name__ == "__main__":
    main()
