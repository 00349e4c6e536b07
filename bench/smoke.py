"""Compile and run each workload's training step and inference at a given size on the
default device: compile seconds, dispatches, memory and step time. A quick health check
before the full harness (python -m meganeura.bench)."""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import meganeura as mg  # noqa: E402
from meganeura.models import llama, resnet, smolvla, unet, whisper  # noqa: E402
from meganeura.runtime import get_device  # noqa: E402


def graphs(name, size):
    real = size == "real"
    if name == "smollm2":
        cfg = llama.LlamaConfig.smollm2_135m() if real else llama.LlamaConfig.tiny()
        g, ids, logits = llama.build_causal_lm(cfg, 1, 128 if real else 8)
        gt, *_, loss = llama.build_training(cfg, 1, 128 if real else 8)
        return (g, [logits]), (gt, loss), cfg.vocab_size
    if name == "whisper":
        cfg = whisper.WhisperEncoderConfig.tiny_real() if real else whisper.WhisperEncoderConfig.tiny()
        g, x, out = whisper.build_whisper_encoder(cfg, 1)
        gt, _, _, _, loss = whisper.build_whisper_encoder_training(cfg, 1)
        return (g, [out]), (gt, loss), 2
    if name == "resnet50":
        cfg = resnet.ResNetConfig.resnet50() if real else resnet.ResNetConfig.tiny()
        r = resnet.build_resnet(cfg, 4, bn="folded")
        t = resnet.build_resnet_training(cfg, 4)
        return (r.graph, [r.logits]), (t.graph, t.loss), 10
    if name == "unet":
        cfg = unet.UNetConfig.sd_scaled() if real else unet.UNetConfig.tiny()
        u, t = unet.build_unet_inference(cfg, 1), unet.build_unet_training(cfg, 1)
        return (u.graph, [u.output]), (t.graph, t.loss), 2
    if name == "smolvla":
        cfg = smolvla.SmolVLAConfig.real() if real else smolvla.SmolVLAConfig.tiny()
        i, t = smolvla.build_smolvla_inference(cfg, 1), smolvla.build_smolvla_training(cfg, 1)
        return (i.graph, [i.output]), (t.graph, t.loss), 2
    raise ValueError(name)


def feeds_for(sess, int_high, rng):
    out = {}
    for n, t in sess.feeds.items():
        if t.dtype.is_float:
            out[n] = rng.standard_normal(t.shape).astype(np.float32)
        else:
            out[n] = rng.integers(0, int_high, t.shape).astype(t.dtype.np)
    return out


def timed(fn, n):
    ts = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts) * 1e3


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--size", default="tiny", choices=["tiny", "real"])
    p.add_argument("--workloads", default="smollm2,smolvla,unet,resnet50,whisper")
    p.add_argument("--precision", default="strict")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--out", default=None)
    args = p.parse_args()
    dev = get_device()
    print(f"device: {dev.name}")
    rows = []
    for name in args.workloads.split(","):
        rng = np.random.default_rng(0)
        (g, outs), (gt, loss), high = graphs(name, args.size)
        row = {"workload": name}
        for phase, make in (("inference", lambda: mg.compile(g, outputs=outs, backend="gpu", precision=args.precision)),
                            ("train_step", lambda: mg.compile(gt, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4),
                                                              backend="gpu", precision=args.precision))):
            s = make()
            f = feeds_for(s, high, rng)
            run = (lambda: s.run(f)) if phase == "inference" else (lambda: s.step(f))
            c0 = dev.stats["pipelines_compiled"]
            t0 = time.perf_counter()
            run()
            first = time.perf_counter() - t0
            plan = next(iter(s.executor.plans.values()))
            ms = timed(run, args.samples)
            row[phase] = {"first_call_s": first, "plan_compile_s": plan.compile_seconds,
                          "new_pipelines": dev.stats["pipelines_compiled"] - c0, "dispatches": plan.n_dispatches,
                          "median_ms": ms, "memory": plan.memory.report()}
            top = s.profile(f)[:5]
            row[phase]["top_kernels"] = [(r[0], round(r[1], 1), r[2]) for r in top]
            print(f"{name:9s} {phase:10s} first {first:6.2f} s  pipelines +{row[phase]['new_pipelines']:4d}  "
                  f"dispatches {plan.n_dispatches:5d}  median {ms:9.2f} ms  {plan.memory.report()}", flush=True)
            print("    top kernels (us, count):", row[phase]["top_kernels"], flush=True)
        rows.append(row)
    if args.out:
        with open(args.out, "w") as fh:
            json.dump({"device": dev.adapter_info, "size": args.size, "rows": rows}, fh, indent=1, default=str)


if __name__ == "__main__":
    main()
