"""Matmul tile and split-K choice on the workloads' hot shapes: GPU microseconds of one
linear layer (optionally with a layer norm fused in front, as the decoders use it) for
every tile (MEGANEURA_MATMUL_TILE) and K split (MEGANEURA_MATMUL_SPLIT), beside the
automatic choice. Prints a table and writes JSON.

Each sample is one call timed alone (GPU timestamps around its dispatches, after warm-up
calls), so a few tens of microseconds of per-submission latency are in every number: the
table ranks configurations, the workloads' profiles give kernel times. On the H200
(bench/results/h200/matmul_tiles.json) the automatic choice was best or within 10% of the
best on 7 of 9 shapes; Whisper's QKV projection gains 7% from 128-wide tiles.

    python bench/matmul_tiles.py [--out bench/results/h200/matmul_tiles.json] [--quick]
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

# (label, M, K, N, norm in front): Whisper-tiny encoder, SmolVLA expert, SmolLM2 prefill
SHAPES = [("whisper qkv", 1500, 384, 1152, True), ("whisper fc1", 1500, 384, 1536, True),
          ("whisper fc2", 1500, 1536, 384, False), ("whisper out", 1500, 384, 384, False),
          ("smolvla gate", 50, 720, 2048, True), ("smolvla down", 50, 2048, 720, False),
          ("smolvla o", 50, 960, 720, False),
          ("smollm2 gate", 128, 576, 1536, True), ("smollm2 down", 128, 1536, 576, False)]
WARMUP = 40
CONFIGS = [("auto", None, None)] + [(f"t{t}/s{s}", t, s) for t in (32, 64, 128) for s in (1, 2, 4)]


def gpu_us(M, K, N, norm, tile, split, samples):
    env = {"MEGANEURA_MATMUL_TILE": tile, "MEGANEURA_MATMUL_SPLIT": split}
    old = {k: os.environ.get(k) for k in env}
    for k, v in env.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = str(v)
    try:
        g = mg.Graph()
        x = g.input("x", (M, K))
        h = mg.ops.layer_norm(x, (K,)) if norm else x
        y = mg.ops.linear(h, g.parameter("w", (N, K)))
        s = mg.compile(g, outputs=[y], backend="gpu", plan_cache=False)
        feeds = {"x": np.random.default_rng(0).standard_normal((M, K)).astype(np.float32)}
        for _ in range(WARMUP):       # clocks up, memory touched: isolated calls time the idle GPU
            s.run(feeds)
        times = []
        for _ in range(samples):
            for _ in range(WARMUP // 4):
                s.run(feeds)
            times.append(sum(r[1] for r in s.profile(feeds)))
        names = s.executor.plans["run"].names
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
    shapes = [s for s in SHAPES if args.shapes is None or s[0] in args.shapes.split(",")]
    rows = []
    print(f"{'shape':14} {'M':>5} {'K':>5} {'N':>5} " + " ".join(f"{c[0]:>9}" for c in CONFIGS) + "   (GPU us)")
    for label, M, K, N, norm in shapes:
        row = {"shape": label, "M": M, "K": K, "N": N, "norm": norm, "us": {}, "kernels": {}}
        for name, tile, split in CONFIGS:
            us, names = gpu_us(M, K, N, norm, tile, split, samples)
            row["us"][name], row["kernels"][name] = us, names
        best = min(row["us"], key=row["us"].get)
        row["best"] = best
        rows.append(row)
        print(f"{label:14} {M:5d} {K:5d} {N:5d} " + " ".join(f"{row['us'][c[0]]:9.1f}" for c in CONFIGS)
              + f"   best {best}")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"kind": "matmul_tiles", "samples": samples, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
