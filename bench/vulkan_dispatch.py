"""The direct Vulkan backend's costs: per-dispatch GPU time under dependency levels, and
GEMM throughput (f32 tiled; f16 on KHR cooperative matrices where the device has them).

Dispatch cases (a tiny saxpy over 256 elements, ``--dispatches`` of them in one command
buffer, GPU time from timestamps / dispatches, median of ``--repeats`` submits):

- dependent chain: every dispatch updates the same y: one level each, a barrier between each;
- independent level: every dispatch writes its own slice: one level, no barrier;
- levels of 8: eight slices reused in turn: a barrier every 8 dispatches.

GEMMs: C = A @ B at M = N = K = ``--size`` (default 4096), checked against numpy on sampled
rows, ``--gemm-reps`` dispatches per submit, TFLOP/s from GPU timestamps. Timestamps are
written only before and after each step, so they do not serialise a level.

    python bench/vulkan_dispatch.py [--size 4096] [--dispatches 2000] [--repeats 5] [--out PATH]

Prints a table and writes JSON (``--out``, default vulkan_dispatch.json). On lavapipe use a
small ``--size`` (the tests run ``--size 64``).
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

from meganeura.compilation import glslang
from meganeura.runtime.vulkan import Dispatch, Program, VulkanDevice, pack_push, samples

SLICE = 256   # floats per tiny dispatch (4 workgroups of 64)


def dispatch_cases(dev, n_disp, repeats):
    k = glslang.kernel_from_glsl(dev, samples.SAXPY, name="saxpy")
    x = dev.array(np.ones(SLICE, np.float32))
    slots = [dev.alloc(SLICE * 4) for _ in range(n_disp)]
    chain_y = dev.alloc(SLICE * 4)
    for s in slots + [chain_y]:
        dev.upload(s, np.zeros(SLICE, np.float32))
    push = pack_push(SLICE, 1.0)
    cases = {
        "dependent chain": [chain_y] * n_disp,
        "independent level": slots,
        "levels of 8": [slots[i % 8] for i in range(n_disp)],
    }
    rows = []
    for name, ys in cases.items():
        ops = [Dispatch(k, [x, y], SLICE // 64, push) for y in ys]
        with Program(dev, ops, timestamps="step", name=name) as p:
            rec = p.record()
            p.run()                                    # warm-up (lavapipe compiles on first use)
            gpu, wall = [], []
            for _ in range(repeats):
                t0 = time.perf_counter()
                p.run()
                wall.append(time.perf_counter() - t0)
                gpu.append(p.gpu_seconds())
            st = p.stats
        rows.append(dict(case=name, dispatches=n_disp, levels=st["levels"], barriers=st["barriers"],
                         gpu_us_per_dispatch=statistics.median(gpu) * 1e6 / n_disp,
                         wall_us_per_dispatch=statistics.median(wall) * 1e6 / n_disp,
                         record_us_per_dispatch=rec * 1e6 / n_disp))
    # the result of the chain: every dispatch added x once to slot 0 (warm-up + repeats submits)
    expect = float(n_disp * (repeats + 1))
    got = dev.download(chain_y, np.float32)
    ok = bool(np.allclose(got, expect, rtol=1e-5))
    for s in slots + [chain_y]:
        dev.free(s)
    dev.free(x)
    return rows, ok


def gemm_case(dev, kind, n, reps, repeats):
    rng = np.random.default_rng(0)
    A = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    B = rng.uniform(-1, 1, (n, n)).astype(np.float32)
    if kind == "sgemm_f32":
        p = samples.SGEMM_LARGE if n >= 128 else samples.SGEMM_SMALL
        k = glslang.kernel_from_glsl(dev, samples.SGEMM, samples.defines(p), name=kind)
        groups = samples.sgemm_groups(n, n, n, p)
        a, b = A, B
        tile = f"{p['BM']}x{p['BN']}x{p['BK']}"
    else:
        p = samples.HGEMM_COOP_DEFAULT
        why = coop_unavailable(dev)
        if why:
            return dict(kernel=kind, skipped=why)
        try:
            groups = samples.hgemm_coop_groups(n, n, n, p)
        except ValueError as e:
            return dict(kernel=kind, skipped=str(e))
        sub = 32 if dev.features["subgroupSizeControl"] and dev.subgroup["min_size"] <= 32 <= dev.subgroup["max_size"] \
            else None
        k = glslang.kernel_from_glsl(dev, samples.HGEMM_COOP, samples.defines(p), name=kind, required_subgroup_size=sub)
        a, b = A.astype(np.float16), B.astype(np.float16)
        tile = f"{p['BM']}x{p['BN']}x{p['BK']}"
    ba, bb, bc = dev.array(a), dev.array(b), dev.alloc(n * n * 4)
    try:
        ops = [Dispatch(k, [ba, bb, bc], groups, pack_push(n, n, n)) for _ in range(reps)]
        with Program(dev, ops, timestamps="step", name=kind) as prog:
            prog.run()
            times = []
            for _ in range(repeats):
                prog.run()
                times.append(prog.gpu_seconds() / reps)
        rows = np.random.default_rng(1).choice(n, size=min(n, 32), replace=False)
        C = dev.download(bc, np.float32, (n, n))
        ref = a[rows].astype(np.float64) @ b.astype(np.float64)
        err = float(np.abs(C[rows] - ref).max() / max(np.abs(ref).max(), 1e-30))
    finally:
        for r in (ba, bb, bc):
            dev.free(r)
    t = statistics.median(times)
    return dict(kernel=kind, size=n, tile=tile, ms=t * 1e3, tflops=2.0 * n ** 3 / t / 1e12 if t > 0 else 0.0,
                max_rel_err=err, pipeline_create_s=k.create_seconds)


def coop_unavailable(dev):
    if not dev.features["cooperativeMatrix"]:
        return f"no cooperative matrices: {dev.cooperative_matrix_reason}"
    if not dev.has_coop_shape(16, 16, 16, "f16", "f16", "f32"):
        return "no 16x16x16 f16 x f16 -> f32 subgroup shape"
    sub_ok = dev.subgroup["size"] == 32 or (dev.features["subgroupSizeControl"]
                                             and dev.subgroup["min_size"] <= 32 <= dev.subgroup["max_size"])
    if not sub_ok:
        return f"the kernel needs subgroups of 32; the device has {dev.subgroup['size']}"
    return ""


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size", type=int, default=4096, help="GEMM M = N = K (default 4096)")
    ap.add_argument("--dispatches", type=int, default=2000, help="tiny dispatches per command buffer")
    ap.add_argument("--repeats", type=int, default=5, help="timed submits per case (median reported)")
    ap.add_argument("--gemm-reps", type=int, default=None, help="GEMMs per submit (default 10, 1 below 1024)")
    ap.add_argument("--out", default="vulkan_dispatch.json", help="JSON output path")
    args = ap.parse_args(argv)
    reps = args.gemm_reps or (10 if args.size >= 1024 else 1)
    with VulkanDevice() as dev:
        cap = dev.capabilities()
        print(f"{dev.name} ({dev.driver['name']} {dev.driver['info']}), Vulkan {cap['api_version']}, "
              f"subgroup {dev.subgroup['size']}, cooperative matrix: "
              f"{'yes' if dev.features['cooperativeMatrix'] else 'no (' + dev.cooperative_matrix_reason + ')'}")
        drows, chain_ok = dispatch_cases(dev, args.dispatches, args.repeats)
        grows = [gemm_case(dev, kind, args.size, reps, args.repeats) for kind in ("sgemm_f32", "hgemm_coop_f16")]
    print(f"\n{'case':20s} {'disp':>6s} {'levels':>6s} {'barriers':>8s} {'GPU us/disp':>11s} "
          f"{'wall us/disp':>12s} {'record us/disp':>14s}")
    for r in drows:
        print(f"{r['case']:20s} {r['dispatches']:6d} {r['levels']:6d} {r['barriers']:8d} "
              f"{r['gpu_us_per_dispatch']:11.3f} {r['wall_us_per_dispatch']:12.3f} {r['record_us_per_dispatch']:14.3f}")
    print(f"chain result {'ok' if chain_ok else 'WRONG'}")
    print(f"\n{'kernel':16s} {'size':>6s} {'tile':>12s} {'ms':>10s} {'TFLOP/s':>9s} {'rel err':>9s}")
    for r in grows:
        if "skipped" in r:
            print(f"{r['kernel']:16s} skipped: {r['skipped']}")
        else:
            print(f"{r['kernel']:16s} {r['size']:6d} {r['tile']:>12s} {r['ms']:10.3f} {r['tflops']:9.3f} "
                  f"{r['max_rel_err']:9.1e}")
    out = dict(host=dict(python=sys.version.split()[0], platform=platform.platform(), numpy=np.__version__,
                         glslang=glslang.glslang_version()),
               args=vars(args), device=cap, dispatch=drows, chain_result_ok=chain_ok, gemm=grows)
    d = os.path.dirname(os.path.abspath(args.out))
    os.makedirs(d, exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=1, default=str)
    print(f"\nwrote {args.out}")
    bad = not chain_ok or any(r.get("max_rel_err", 0) > (1e-3 if r["kernel"] == "sgemm_f32" else 1e-2) for r in grows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
