"""f32 matmul throughput: ours (on the default GPU runtime: the direct Vulkan backend or wgpu,
MEGANEURA_BACKEND chooses) beside PyTorch (TF32 off) in one run.

Prints a table and writes JSON. Times are medians of GPU-complete wall times (submit to
result ready) of repeated matmuls queued back to back (ours: in one submit, where the
runtime can; torch: launches on its stream), then a sync, so launch cost is amortised the
same way on both sides; ``ours_each_ms`` is ours with a submit and a wait per matmul.
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


def ours(n, reps, samples, warmup):
    g = mg.Graph()
    a, b = g.input("a", (n, n)), g.input("b", (n, n))
    outs = [mg.ops.mm(a, b)]
    sess = mg.compile(g, outputs=outs, backend="gpu")
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal((n, n)).astype(np.float32), rng.standard_normal((n, n)).astype(np.float32)
    sess.run({"a": A, "b": B})
    # GPU work only: the prepared step run `reps` times per sample, then a sync
    times, ts_gpu = replay_seconds(sess, samples, warmup, reps, back_to_back=True)
    each, _ = replay_seconds(sess, samples, warmup, reps, gpu=False)
    got = sess.run({"a": A, "b": B})[0]
    err = float(np.abs(got - A @ B).max() / np.abs(A @ B).max())
    return times, each, ts_gpu, err


def theirs(n, reps, samples, warmup):
    import torch
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    a = torch.randn(n, n, device="cuda")
    b = torch.randn(n, n, device="cuda")
    for _ in range(warmup):
        a @ b
    torch.cuda.synchronize()
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            a @ b
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return times


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--sizes", default="1024,2048,4096")
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default="bench/results/matmul.json")
    args = p.parse_args()
    dev = gpu_device()
    rows = []
    print(f"device: {dev.name} ({dev.adapter_info.get('backend')}), modules {'trusted' if dev.trusted else 'checked'}")
    print(f"{'n':>6} {'ours ms':>9} {'ours TF/s':>10} {'torch ms':>9} {'torch TF/s':>11} {'ratio':>6} {'max rel err':>12}")
    for n in map(int, args.sizes.split(",")):
        reps = max(1, int(2e10 // (2 * n ** 3)))
        t_ours, t_each, gpu_s, err = ours(n, reps, args.samples, args.warmup)
        t_torch = theirs(n, reps, args.samples, args.warmup)
        flops = 2 * n ** 3
        mo = statistics.median(t_ours)
        row = {"n": n, "ours_ms": mo * 1e3, "ours_tflops": flops / mo / 1e12, "ours_samples_s": t_ours,
               "ours_each_ms": statistics.median(t_each) * 1e3, "ours_gpu_timestamp_s": gpu_s, "max_rel_err": err}
        if t_torch:
            mt = statistics.median(t_torch)
            row.update(torch_ms=mt * 1e3, torch_tflops=flops / mt / 1e12, torch_samples_s=t_torch, ratio=mt / mo)
        rows.append(row)
        print(f"{n:>6} {row['ours_ms']:>9.3f} {row['ours_tflops']:>10.2f} {row.get('torch_ms', float('nan')):>9.3f} "
              f"{row.get('torch_tflops', float('nan')):>11.2f} {row.get('ratio', float('nan')):>6.2f} {err:>12.2e}")
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"device": dev.adapter_info, "trusted": dev.trusted, "python": platform.python_version(),
                   "rows": rows}, f, indent=1, default=str)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
