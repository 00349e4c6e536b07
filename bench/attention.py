"""Attention forward, f32: our flash kernel beside our decomposition (scores matmul,
softmax, probabilities matmul) and PyTorch's SDPA (CUDA, TF32 off) in one run.

    python bench/attention.py [--size tiny|real] [--out bench/results/attention.json]

Prints a table and writes JSON. ``real`` is Whisper-tiny's encoder self-attention
(1 x 6 heads x 1500 x 64, no mask) and a causal grouped-query prefill; ``tiny`` runs on a
software driver in seconds. Times are medians of GPU-complete wall times (submit to
result ready) over repeated runs, so launch cost is amortised alike on both sides;
per-dispatch GPU timestamps are reported where the adapter has them.
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
from meganeura.codegen import attention as attn, flash  # noqa: E402
from meganeura.compiler import CompileOptions, compile_plan  # noqa: E402
from meganeura.runtime import get_device  # noqa: E402

# name: (q shape, kv heads, causal)
CASES = {
    "real": {"whisper": ((1, 6, 1500, 64), 6, False), "causal_gqa": ((1, 9, 2048, 64), 3, True)},
    "tiny": {"whisper": ((1, 2, 100, 64), 2, False), "causal_gqa": ((1, 4, 80, 64), 2, True)},
}


def _inputs(qs, hkv, seed=0):
    rng = np.random.default_rng(seed)
    ks = qs[:-3] + (hkv,) + qs[-2:]
    return {"q": rng.standard_normal(qs).astype(np.float32), "k": rng.standard_normal(ks).astype(np.float32),
            "v": rng.standard_normal(ks).astype(np.float32)}


def reference(feeds, causal):
    """float64 attention on the host."""
    q, k, v = (feeds[n].astype(np.float64) for n in "qkv")
    g = q.shape[-3] // k.shape[-3]
    k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        s = np.where(np.tril(np.ones(s.shape[-2:], dtype=bool)), s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return (p / p.sum(-1, keepdims=True)) @ v


def ours(feeds, causal, decompose, samples, warmup):
    """(wall-time samples per call, GPU timestamp seconds or None, max relative error,
    dispatch names)."""
    saved = attn.MAX_ROW_WORK, flash.LOOP_BOUND
    if decompose:                 # both attention kernels decline: matmuls and a softmax
        attn.MAX_ROW_WORK, flash.LOOP_BOUND = 0, 0
    try:
        g = mg.Graph()
        q, k, v = (g.input(n, feeds[n].shape) for n in "qkv")
        out = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[-3] != k.shape[-3])
        names = compile_plan([out], options=CompileOptions(max_bindings=64)).names
        sess = mg.compile(g, outputs=[out], backend="gpu")
        got = sess.run(feeds)[0]
    finally:
        attn.MAX_ROW_WORK, flash.LOOP_BOUND = saved
    ex = sess.executor
    plan = ex.plan("run")
    dev = ex.dev
    for _ in range(warmup):
        ex.recorder.run(plan.step)
    dev.sync()
    ts_gpu = None
    if dev.has_timestamps:
        ts = ex.recorder.run(plan.step, timestamps=True)
        ts_gpu = float((ts[:, 1] - ts[:, 0]).sum()) / 1e9
    reps = 10
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            ex.recorder.run(plan.step)
        dev.sync()
        times.append((time.perf_counter() - t0) / reps)
    want = reference(feeds, causal)
    err = float(np.abs(got - want).max() / np.abs(want).max())
    return times, ts_gpu, err, names


def theirs(feeds, causal, samples, warmup):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    F = torch.nn.functional
    q, k, v = (torch.tensor(feeds[n], device="cuda") for n in "qkv")
    gqa = q.shape[-3] != k.shape[-3]

    def call():
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    reps = 10
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        for _ in range(reps):
            call()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) / reps)
    return times


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", default="real", choices=("tiny", "real"))
    p.add_argument("--samples", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", default=None, help="JSON path (default bench/results/attention_<size>.json)")
    args = p.parse_args(argv)
    out = args.out or f"bench/results/attention_{args.size}.json"
    dev = get_device()
    print(f"device: {dev.name} ({dev.adapter_info.get('backend')}), modules {'trusted' if dev.trusted else 'checked'}")
    print(f"{'case':11} {'variant':11} {'dispatches':>10} {'median us':>10} {'GPU ts us':>10} {'GFLOP/s':>9} "
          f"{'torch/ours':>10} {'max rel err':>12}")
    rows = []
    for name, (qs, hkv, causal) in CASES[args.size].items():
        feeds = _inputs(qs, hkv)
        *_, hq, lq, d = qs
        flops = 4 * np.prod(qs[:-2]) * lq * lq * d * (0.5 if causal else 1.0)   # QK^T and PV
        t_torch = theirs(feeds, causal, args.samples, args.warmup)
        mt = statistics.median(t_torch) if t_torch else None
        for variant in ("flash", "decomposed"):
            times, ts, err, names = ours(feeds, causal, variant == "decomposed", args.samples, args.warmup)
            mo = statistics.median(times)
            row = {"case": name, "variant": variant, "q_shape": qs, "kv_heads": hkv, "causal": causal,
                   "dispatches": len(names), "kernels": names, "median_s": mo, "samples_s": times,
                   "gpu_timestamp_s": ts, "gflops": flops / mo / 1e9, "max_rel_err": err}
            if mt:
                row.update(torch_median_s=mt, torch_samples_s=t_torch, ratio_torch_over_ours=mt / mo)
            rows.append(row)
            print(f"{name:11} {variant:11} {len(names):>10d} {mo * 1e6:>10.1f} "
                  f"{(ts * 1e6 if ts is not None else float('nan')):>10.1f} {row['gflops']:>9.1f} "
                  f"{row.get('ratio_torch_over_ours', float('nan')):>10.2f} {err:>12.2e}")
        if mt:
            print(f"{name:11} {'torch sdpa':11} {'':>10} {mt * 1e6:>10.1f}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": dev.adapter_info, "trusted": dev.trusted, "python": platform.python_version(),
                   "size": args.size, "flash_smem_bytes": flash.smem_floats() * 4, "rows": rows},
                  f, indent=1, default=str)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
