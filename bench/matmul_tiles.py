"""Matmul tile, K split and K step choice on the workloads' hot shapes: GPU microseconds of
one linear layer (optionally with a layer norm fused in front, as the decoders use it) for
every tile (MEGANEURA_MATMUL_TILE), K split (MEGANEURA_MATMUL_SPLIT) and K step
(MEGANEURA_MATMUL_TK), beside the automatic choice. Prints the automatic choice and the four
best per shape, and writes JSON with every configuration.

Each call runs 8 copies of the layer back to back (separate launches, a barrier after each)
right after about 20 ms of other GPU work, so clocks are up as in a model; a sample is the
call's GPU time per layer from timestamps.

    python bench/matmul_tiles.py [--out bench/results/h200/matmul_tiles.json] [--quick] [--shapes a,b]
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import meganeura as mg  # noqa: E402
from meganeura.runtime.backends import gpu_device  # noqa: E402

# (label, M, K, N, norm in front): Whisper-tiny encoder, SmolVLA expert, SmolLM2 prefill
SHAPES = [("whisper qkv", 1500, 384, 1152, True), ("whisper fc1", 1500, 384, 1536, True),
          ("whisper fc1 plain", 1500, 384, 1536, False),
          ("whisper fc2", 1500, 1536, 384, False), ("whisper out", 1500, 384, 384, False),
          ("smolvla gate", 50, 720, 2048, True), ("smolvla down", 50, 2048, 720, False),
          ("smolvla o", 50, 960, 720, False),
          ("smollm2 gate", 128, 576, 1536, True), ("smollm2 down", 128, 1536, 576, False)]
WARMUP = 5
REPS = 8          # layers per call: the GPU stays busy, so clocks and caches are as in a model
CONFIGS = [("auto", None, None, None)] + [(f"t{t}/s{s}/k{k}", t, s, k) for t in (32, 64, 128) for s in (1, 2, 4, 8)
                                          for k in (8, 16, 32) if k * t <= 2048]


_HEATER = []


def heat():
    """About 20 ms of GPU work with a scalar result, right before a timed call: an idle GPU
    lowers its clocks (an H200 idles at 345 of 1980 MHz) and isolated calls time that."""
    if not _HEATER:
        g = mg.Graph()
        a = g.input("a", (4096, 4096))
        y = a
        for _ in range(4):
            y = mg.ops.mm(y, a)
        s = mg.compile(g, outputs=[mg.ops.reduce_sum(y, (0, 1))], backend="gpu", plan_cache=False)
        feeds = {"a": np.random.default_rng(1).standard_normal((4096, 4096)).astype(np.float32) / 64}
        _HEATER.append(lambda: s.run(feeds))
    _HEATER[0]()


def gpu_us(M, K, N, norm, tile, split, tk, samples):
    """Median GPU microseconds of one layer (its matmul and any split-K sum): REPS
    layers per call, kept apart (no horizontal merge) and run one after another (a barrier
    after every dispatch)."""
    env = {"MEGANEURA_MATMUL_TILE": tile, "MEGANEURA_MATMUL_SPLIT": split, "MEGANEURA_MATMUL_TK": tk,
           "MEGANEURA_NO_FUSE": "horizontal"}     # the layers stay separate launches
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    try:
        g = mg.Graph()
        ys = []
        for r in range(REPS):
            x = g.input(f"x{r}", (M, K))
            h = mg.ops.layer_norm(x, (K,)) if norm else x
            ys.append(mg.ops.linear(h, g.parameter(f"w{r}", (N, K))))
        s = mg.compile(g, outputs=ys, backend="gpu", plan_cache=False)
        rng = np.random.default_rng(0)
        feeds = {f"x{r}": rng.standard_normal((M, K)).astype(np.float32) for r in range(REPS)}
        for _ in range(WARMUP):
            s.run(feeds)
        times = []
        for _ in range(samples):
            heat()
            times.append(sum(r[1] for r in s.profile(feeds)) / REPS)
        names = sorted(set(s.executor.plans["run"].names))
        s.close()
        return statistics.median(times), names
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="bench/results/h200/matmul_tiles.json")
    ap.add_argument("--quick", action="store_true", help="3 samples (default 9)")
    ap.add_argument("--shapes", default=None, help="comma-separated labels (default: all)")
    args = ap.parse_args(argv)
    samples = 3 if args.quick else 9
    rt = gpu_device()
    if hasattr(rt, "use_levels"):
        rt.use_levels = False     # serial, as a model's dependent layers run
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    rows = []
    print(f"{'shape':17} {'M':>5} {'K':>5} {'N':>5}  auto  best (GPU us per layer)")
    for label, M, K, N, norm in shapes:
        row = {"shape": label, "M": M, "K": K, "N": N, "norm": norm, "us": {}, "kernels": {}}
        for name, tile, split, tk in CONFIGS:
            us, names = gpu_us(M, K, N, norm, tile, split, tk, samples)
            row["us"][name], row["kernels"][name] = us, names
        best = min(row["us"], key=row["us"].get)
        row["best"] = best
        rows.append(row)
        top = sorted(row["us"], key=row["us"].get)[:4]
        print(f"{label:17} {M:5d} {K:5d} {N:5d} {row['us']['auto']:6.1f}  "
              + "  ".join(f"{c} {row['us'][c]:.1f}" for c in top), flush=True)
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"kind": "matmul_tiles", "samples": samples, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
