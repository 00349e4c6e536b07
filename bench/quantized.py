"""Quantized products beside the f32 linear of the same shape, GPU time per dispatch.

    python bench/quantized.py [--backends gpu,wgpu] [--shapes 4096x4096,14336x4096] [--rows 1,128]

For each (out_features x in_features) shape and row count, the f32 ``mg.ops.linear`` and
``mg.ops.quantized_linear`` on each block type we read (random blocks with finite f16
scales) run in a session of their own; the GPU time of the step is the median over
``--samples`` profiled runs (timestamps around every dispatch). Printed as JSON lines with
the weight bytes streamed per microsecond (GB/s) and TFLOP/s; the GEMV's output is checked
against our NumPy dequantization. On lavapipe the numbers say nothing about speed.
"""
from __future__ import annotations

import argparse
import json

import numpy as np

import meganeura as mg
from meganeura.ops.quantized import QTYPES, dequantize_words, weight_words


def random_blocks(rng, qtype, n, k):
    """Random (n, k) blocks of ``qtype`` whose f16 scales are finite."""
    bs, nb = QTYPES[qtype]
    raw = rng.integers(0, 256, (n, k // bs, nb), dtype=np.uint8)
    halves = 2 if qtype == "Q4_K" else 1
    d = (rng.standard_normal((n, k // bs, halves)) * 0.01).astype(np.float16)
    raw[..., :2 * halves] = d.view(np.uint8).reshape(n, k // bs, 2 * halves)
    return raw


def gpu_us(sess, feeds, samples):
    sess.run(feeds)
    totals, names = [], []
    for _ in range(samples):
        rows = sess.profile(feeds)
        totals.append(sum(r[1] for r in rows))
        names = [r[0] for r in rows]
    return float(np.median(totals)), names


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--backends", default="gpu,wgpu", help="comma-separated GPU backends")
    ap.add_argument("--shapes", default="4096x4096,14336x4096,4096x14336", help="out x in features, comma-separated")
    ap.add_argument("--rows", default="1,128", help="rows of x, comma-separated")
    ap.add_argument("--samples", type=int, default=7, help="profiled runs per case (median)")
    a = ap.parse_args(argv)
    rng = np.random.default_rng(0)
    for shape in a.shapes.split(","):
        n, k = (int(v) for v in shape.split("x"))
        for m in (int(r) for r in a.rows.split(",")):
            x = rng.standard_normal((m, k)).astype(np.float32)
            for qtype in ["f32", *QTYPES]:
                g = mg.Graph()
                xt = g.input("x", (m, k))
                if qtype == "f32":
                    w = (rng.standard_normal((n, k)) * 0.02).astype(np.float32)
                    y, nbytes = mg.ops.linear(xt, g.input("w", (n, k))), w.nbytes
                else:
                    raw = random_blocks(rng, qtype, n, k)
                    w, nbytes = weight_words(raw), raw.nbytes
                    y = mg.ops.quantized_linear(xt, g.input("w", w.shape, mg.u32), qtype, n, k)
                for be in a.backends.split(","):
                    sess = mg.compile(g, outputs=[y], backend=be)
                    us, names = gpu_us(sess, {"x": x, "w": w}, a.samples)
                    err = None
                    if m == 1 and qtype != "f32":
                        ref = x.astype(np.float64) @ dequantize_words(w, qtype, n, k).T
                        err = float(np.abs(sess.run({"x": x, "w": w})[0] - ref).max() / np.abs(ref).max())
                    print(json.dumps({"backend": be, "n": n, "k": k, "m": m, "qtype": qtype, "gpu_us": round(us, 2),
                                      "GBps": round(nbytes / us / 1e3, 1), "TFLOPs": round(2 * m * n * k / us / 1e6, 3),
                                      "dispatches": names, "rel_err": err}), flush=True)
                    sess.close()


if __name__ == "__main__":
    main()
