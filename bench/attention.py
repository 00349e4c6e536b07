"""Attention, f32: our flash kernels beside our decomposition (scores matmul, softmax,
probabilities matmul, and their gradients) and PyTorch's SDPA (CUDA, TF32 off) in one run,
forward alone and forward + backward (the gradients of q, k and v for a given dO).

    python bench/attention.py [--size tiny|real] [--phases forward,backward] [--split 2,4] [--precision strict|accelerated] [--out bench/results/attention.json]

Prints a table (with each kernel's GPU time where there are several) and writes JSON. ``--split`` (default: MEGANEURA_FLASH_SPLIT where set) adds a
row per S for the flash forward split over keys into S workgroups per query tile
(``flash_sS``); the ``flash`` row is always the unsplit kernel. ``real`` is Whisper-tiny's
encoder self-attention (1 x 6 heads x 1500 x 64, no mask) and SmolLM2's causal grouped-query prefill (9 query and
3 kv heads x 2048 x 64); ``tiny`` runs on a software driver in seconds. The backward rows
time forward + backward on both sides (the backward needs the forward's output and LSE);
their error is the largest of dQ, dK and dV's against float64 on the host. Times are medians of GPU-complete wall times (submit to
result ready) over repeated runs, so launch cost is amortised alike on both sides;
per-dispatch GPU timestamps are reported where the adapter has them.

``--precision accelerated`` compiles ours in accelerated precision (on the Vulkan backend the
flash forward then runs on cooperative matrices where the device has them, f16 operands:
``MEGANEURA_COOPMAT=off`` keeps the f32 kernel) and runs PyTorch with TF32 on, plus its SDPA
on f16 operands (``torch f16`` rows). The error is still against float64 of the f32 inputs.
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
from meganeura.codegen import attention as attn, flash  # noqa: E402
from meganeura.compiler import CompileOptions, compile_plan  # noqa: E402
from meganeura.runtime.backends import gpu_device  # noqa: E402

# name: (q shape, kv heads, causal)
CASES = {
    "real": {"whisper": ((1, 6, 1500, 64), 6, False), "causal_gqa": ((1, 9, 2048, 64), 3, True)},
    "tiny": {"whisper": ((1, 2, 100, 64), 2, False), "causal_gqa": ((1, 4, 80, 64), 2, True)},
}
# seconds of replays before each variant's samples: the GPU's clocks fall while the host
# compiles the next variant (an H200 ran one flash kernel 26 then 125 us in one process)
BUSY_S = 0.3
# the scaled U-Net's self-attention (head dim 32), with --unet
UNET = {"real": ((1, 2, 1024, 32), 2, False), "tiny": ((1, 2, 70, 32), 2, False)}


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


def _graph(feeds, causal, backward):
    """The attention graph and what it computes: the output, or dQ, dK and dV for the
    cotangent ``do`` (the gradients of sum(out * do))."""
    g = mg.Graph()
    q, k, v = (g.input(n, feeds[n].shape) for n in "qkv")
    out = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[-3] != k.shape[-3])
    if not backward:
        return g, [out]
    do = g.input("do", out.shape)
    return g, mg.grad(mg.ops.sum(out * do), [q, k, v])


def reference_grads(feeds, causal):
    """float64 dQ, dK, dV on the host (the NumPy interpreter of the same graph)."""
    from meganeura.reference import evaluate
    g, outs = _graph(feeds, causal, True)
    return evaluate(g, outs, {n: a.astype(np.float64) for n, a in feeds.items()}, compute=np.float64)


def kernel_seconds(sess, runs=5):
    """[(dispatch name, median GPU seconds over ``runs`` timestamped runs)] of ``sess``'s
    inference call, or None where the device has no timestamps."""
    ex = sess.executor
    plan = ex.plan("run")
    if not ex.dev.has_timestamps:
        return None
    spans = [ex.recorder.run(plan.step, timestamps=True) for _ in range(runs)]
    per = np.median(np.stack([(ts[:, 1] - ts[:, 0]) / 1e9 for ts in spans]), axis=0)
    return [(name, float(s)) for name, s in zip(plan.names, per)]


def ours(feeds, causal, decompose, samples, warmup, backward=False, want=None, split=1, precision="strict"):
    """(wall-time samples per call, GPU timestamp seconds or None, max relative error,
    dispatch names, per-dispatch GPU seconds or None, dispatches on cooperative matrices).
    ``split``: key splits of the flash forward (1: none)."""
    saved = attn.MAX_ROW_WORK, flash.LOOP_BOUND, os.environ.get("MEGANEURA_FLASH_SPLIT"), attn.ACCELERATED_MAX_ROW_WORK
    # the flash kernels also at tiny size (the one-row kernel declines, in either precision)
    attn.MAX_ROW_WORK = attn.ACCELERATED_MAX_ROW_WORK = 0
    if decompose:                 # both attention kernels decline: matmuls and a softmax
        flash.LOOP_BOUND = 0
    os.environ["MEGANEURA_FLASH_SPLIT"] = str(split)     # read when the plan is compiled
    try:
        g, outs = _graph(feeds, causal, backward)
        names = compile_plan(outs, options=CompileOptions(max_bindings=64, precision=precision)).names
        stats = getattr(gpu_device(), "stats", {})
        before = stats.get("coopmat_kernels", 0)
        sess = mg.compile(g, outputs=outs, backend="gpu", precision=precision)
        feeds = {n: a for n, a in feeds.items() if n in g.inputs}
        got = sess.run(feeds)
    finally:
        attn.MAX_ROW_WORK, flash.LOOP_BOUND = saved[:2]
        attn.ACCELERATED_MAX_ROW_WORK = saved[3]
        if saved[2] is None:
            os.environ.pop("MEGANEURA_FLASH_SPLIT", None)
        else:
            os.environ["MEGANEURA_FLASH_SPLIT"] = saved[2]
    times, ts_gpu = replay_seconds(sess, samples, warmup, reps=10, busy_s=BUSY_S)
    want = want if want is not None else [reference(feeds, causal)]
    err = max(float(np.abs(a - w).max() / np.abs(w).max()) for a, w in zip(got, want))
    return times, ts_gpu, err, names, kernel_seconds(sess), stats.get("coopmat_kernels", 0) - before


def theirs(feeds, causal, samples, warmup, backward=False, tf32=False, f16=False):
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available():
        return None
    torch.backends.cuda.matmul.allow_tf32 = tf32
    torch.backends.cudnn.allow_tf32 = tf32
    F = torch.nn.functional
    dt = torch.float16 if f16 else torch.float32
    q, k, v = (torch.tensor(feeds[n], device="cuda", dtype=dt, requires_grad=backward) for n in "qkv")
    gqa = q.shape[-3] != k.shape[-3]
    do = torch.tensor(feeds["do"], device="cuda", dtype=dt) if backward else None

    def call():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)
        if backward:
            torch.autograd.grad(out, (q, k, v), do)
        return out
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
    p.add_argument("--phases", default="forward,backward", help="forward, backward (forward + backward) or both")
    p.add_argument("--split", default=os.environ.get("MEGANEURA_FLASH_SPLIT", ""),
                   help="key splits of the flash forward to time besides the unsplit one, e.g. 2,4 "
                        "(default: MEGANEURA_FLASH_SPLIT)")
    p.add_argument("--precision", default="strict", choices=("strict", "accelerated"))
    p.add_argument("--unet", action="store_true", help="also the U-Net's self-attention (head dim 32)")
    p.add_argument("--out", default=None, help="JSON path (default bench/results/attention_<size>.json)")
    args = p.parse_args(argv)
    accel = args.precision == "accelerated"
    cases = dict(CASES[args.size], **({"unet": UNET[args.size]} if args.unet else {}))
    splits = [int(x) for x in args.split.split(",") if x.strip() and int(x) > 1]
    variants = [("flash", False, 1)] + [(f"flash_s{s}", False, s) for s in splits] + [("decomposed", True, 1)]
    out = args.out or f"bench/results/attention_{args.size}.json"
    dev = gpu_device()
    print(f"device: {dev.name} ({dev.adapter_info.get('backend')}), modules {'trusted' if dev.trusted else 'checked'}")
    print(f"{'case':11} {'phase':8} {'variant':11} {'dispatches':>10} {'median us':>10} {'GPU ts us':>10} "
          f"{'GFLOP/s':>9} {'torch/ours':>10} {'max rel err':>12}")
    rows = []
    for name, (qs, hkv, causal) in cases.items():
        feeds = _inputs(qs, hkv)
        feeds["do"] = np.random.default_rng(1).standard_normal(qs[:-1] + (feeds["v"].shape[-1],)).astype(np.float32)
        *_, hq, lq, d = qs
        fwd_flops = 4 * np.prod(qs[:-2]) * lq * lq * d * (0.5 if causal else 1.0)   # QK^T and PV
        for phase in args.phases.split(","):
            backward = phase == "backward"
            # the backward recomputes QK^T and takes dP, dV, dQ, dK: 2.5 forwards more
            flops = fwd_flops * (3.5 if backward else 1.0)
            want = reference_grads(feeds, causal) if backward else None
            t_torch = theirs(feeds, causal, args.samples, args.warmup, backward, tf32=accel)
            mt = statistics.median(t_torch) if t_torch else None
            t_half = theirs(feeds, causal, args.samples, args.warmup, backward, f16=True) if accel else None
            for variant, decompose, split in variants:
                times, ts, err, names, per_kernel, coop = ours(feeds, causal, decompose, args.samples, args.warmup,
                                                               backward, want, split, args.precision)
                mo = statistics.median(times)
                row = {"case": name, "phase": phase, "variant": variant, "split": split, "q_shape": qs, "kv_heads": hkv,
                       "precision": args.precision, "coop_dispatches": coop,
                       "causal": causal, "dispatches": len(names), "kernels": names, "median_s": mo,
                       "samples_s": times, "gpu_timestamp_s": ts, "kernel_gpu_s": per_kernel,
                       "gflops": flops / mo / 1e9, "max_rel_err": err}
                if mt:
                    row.update(torch_median_s=mt, torch_samples_s=t_torch, ratio_torch_over_ours=mt / mo)
                rows.append(row)
                print(f"{name:11} {phase:8} {variant:11} {len(names):>10d} {mo * 1e6:>10.1f} "
                      f"{(ts * 1e6 if ts is not None else float('nan')):>10.1f} {row['gflops']:>9.1f} "
                      f"{row.get('ratio_torch_over_ours', float('nan')):>10.2f} {err:>12.2e}")
                if per_kernel and len(per_kernel) > 1:
                    print(" " * 21 + "GPU us: " + "; ".join(f"{n} {s * 1e6:.1f}" for n, s in per_kernel))
            if mt:
                print(f"{name:11} {phase:8} {'torch sdpa':11} {'':>10} {mt * 1e6:>10.1f}")
            if t_half:
                rows.append({"case": name, "phase": phase, "variant": "torch f16", "median_s": statistics.median(t_half),
                             "samples_s": t_half})
                print(f"{name:11} {phase:8} {'torch f16':11} {'':>10} {statistics.median(t_half) * 1e6:>10.1f}")
    os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
    with open(out, "w") as f:
        json.dump({"device": dev.adapter_info, "trusted": dev.trusted, "python": platform.python_version(),
                   "size": args.size, "precision": args.precision, "coopmat": os.environ.get("MEGANEURA_COOPMAT", "auto"),
                   "flash_smem_bytes": flash.smem_floats() * 4, "rows": rows},
                  f, indent=1, default=str)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
