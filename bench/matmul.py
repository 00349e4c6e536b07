"""f32 matmul throughput: ours (on the default GPU runtime: the direct Vulkan backend or wgpu,
MEGANEURA_BACKEND chooses) beside PyTorch (TF32 off) in one run.

Prints a table and writes JSON. Times are medians of GPU-complete wall times (submit to
result ready) of repeated matmuls queued back to back (ours: in one submit, where the
runtime can; torch: launches on its stream), then a sync, so launch cost is amortised the
same way on both sides; ``ours_each_ms`` is ours with a submit and a wait per matmul, and
"GPU TF/s" ours from timestamps around one matmul's dispatches (no launch or wait).

``--shapes`` times rectangular products too, written ``MxKxN``; a ``t`` suffix stores B as
(N, K), the linear-layer layout (``x @ w.T``). Whisper-tiny's encoder at batch 1, say:
``--shapes 1500x384x1536t,1500x1536x384t,1500x384x384t``.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import meganeura as mg  # noqa: E402
from meganeura.bench.harness import replay_seconds  # noqa: E402
from meganeura.runtime.backends import gpu_device  # noqa: E402


def parse_shape(text):
    """``MxKxN`` or ``MxKxNt`` (B stored as (N, K)) -> (M, K, N, tb)."""
    tb = text.endswith("t")
    try:
        m, k, n = (int(v) for v in text.rstrip("t").split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} is not MxKxN or MxKxNt (three positive integers)")
    if min(m, k, n) <= 0:
        raise SystemExit(f"--shapes: {text!r} has a dimension below 1")
    return m, k, n, tb


def operands(m, k, n, tb):
    rng = np.random.default_rng(0)
    A = rng.standard_normal((m, k)).astype(np.float32)
    B = rng.standard_normal((n, k) if tb else (k, n)).astype(np.float32)
    return A, B


def ours(m, k, n, tb, reps, samples, warmup):
    g = mg.Graph()
    A, B = operands(m, k, n, tb)
    a, b = g.input("a", A.shape), g.input("b", B.shape)
    outs = [mg.ops.mm(a, b, tb=tb)]
    sess = mg.compile(g, outputs=outs, backend="gpu")
    sess.run({"a": A, "b": B})
    # GPU work only: the prepared step run `reps` times per sample, then a sync
    times, ts_gpu = replay_seconds(sess, samples, warmup, reps, back_to_back=True)
    each, _ = replay_seconds(sess, samples, warmup, reps, gpu=False)
    got = sess.run({"a": A, "b": B})[0]
    want = A.astype(np.float64) @ (B.T if tb else B).astype(np.float64)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return times, each, ts_gpu, err


def theirs(m, k, n, tb, reps, samples, warmup):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    A, B = (torch.from_numpy(x).cuda() for x in operands(m, k, n, tb))
    mul = (lambda: A @ B.T) if tb else (lambda: A @ B)
    for _ in range(warmup):
        mul()
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            mul()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1024,2048,4096", help="square sizes (empty: none)")
    p.add_argument("--shapes", default="", help="rectangular products MxKxN[t], comma-separated")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results/matmul.json")
    args = p.parse_args()
    dev = gpu_device()
    rows = []
    print(f"device: {dev.name} ({dev.adapter_info.get('backend')}), modules {'trusted' if dev.trusted else 'checked'}")
    shapes = [(n, n, n, False) for n in map(int, filter(None, args.sizes.split(",")))]
    shapes += [parse_shape(x) for x in filter(None, args.shapes.split(","))]
    print(f"{'shape':>16} {'ours ms':>9} {'ours TF/s':>10} {'GPU TF/s':>9} {'torch ms':>9} {'torch TF/s':>11} {'ratio':>6} {'max rel err':>12}")
    for m, k, n, tb in shapes:
        flops = 2 * m * k * n
        reps = max(1, min(200, -(-int(2e11) // flops)))     # at least 200 GFLOP a sample (5 ms at 40 TFLOP/s)
        t_ours, t_each, gpu_s, err = ours(m, k, n, tb, reps, args.samples, args.warmup)
        t_torch = theirs(m, k, n, tb, reps, args.samples, args.warmup)
        mo = statistics.median(t_ours)
        label = f"{m}x{k}x{n}{'t' if tb else ''}"
        row = {"n": n, "m": m, "k": k, "tb": tb, "shape": label, "ours_ms": mo * 1e3, "ours_tflops": flops / mo / 1e12, "ours_samples_s": t_ours,
               "ours_each_ms": statistics.median(t_each) * 1e3, "ours_gpu_timestamp_s": gpu_s, "max_rel_err": err}
        if t_torch:
            mt = statistics.median(t_torch)
            row.update(torch_ms=mt * 1e3, torch_tflops=flops / mt / 1e12, torch_samples_s=t_torch, ratio=mt / mo)
        rows.append(row)
        gpu_tf = flops / gpu_s / 1e12 if gpu_s else float("nan")
        print(f"{label:>16} {row['ours_ms']:>9.3f} {row['ours_tflops']:>10.2f} {gpu_tf:>9.2f} {row.get('torch_ms', float('nan')):>9.3f} "
              f"{row.get('torch_tflops', float('nan')):>11.2f} {row.get('ratio', float('nan')):>6.2f} {err:>12.2e}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": dev.adapter_info, "trusted": dev.trusted, "python": platform.python_version(),
                   "rows": rows}, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
