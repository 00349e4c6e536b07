"""Activation checkpointing on the SmolLM2 training step (batch 1, seq 128 unless --seq, strict f32):
the planned memory of the step's plan with and without every decoder layer checkpointed
(device-free, the H200's compile options), and with ``--time`` the step time on the GPU.

    python bench/activation_checkpointing.py [--size real|tiny] [--seq 128] [--time] [--out results.json]
"""
import argparse
import json
import time

import numpy as np

import meganeura as mg
from meganeura import nn
from meganeura.bench.compile_time import _h200_options, _plan_args
from meganeura.compiler import compile_plan
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

def training_graph(cfg, checkpointed, seq):
    """llama.build_training's graph (batch 1, labels already shifted), every layer's
    activations recomputed in the backward pass when ``checkpointed``."""
    with nn.init.deferred():
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.activation_checkpointing = checkpointed
    g = mg.Graph()
    ids, target = g.input("input_ids", (1, seq), mg.i32), g.input("target", (seq,), mg.i32)
    loss = mg.ops.cross_entropy(mg.ops.reshape(model(ids), (seq, cfg.vocab_size)), target, ignore_index=-100)
    return g, loss


def planned(cfg, checkpointed, seq) -> dict:
    g, loss = training_graph(cfg, checkpointed, seq)
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4), backend="numpy")
    targets, n_forward, updates = _plan_args(s.program, "step")
    kp = compile_plan(targets, n_forward=n_forward, options=_h200_options(), updates=updates)
    m = kp.memory
    return {"intermediates_mib": m.bytes_with / 2**20, "live_peak_mib": m.live_peak / 2**20,
            "persistent_mib": m.persistent_bytes / 2**20, "peak_mib": m.peak_bytes / 2**20,
            "dispatches": kp.n_dispatches}


def timed(cfg, checkpointed, seq, steps=10) -> float:
    g, loss = training_graph(cfg, checkpointed, seq)
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4), backend="gpu")
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, cfg.vocab_size, (1, seq)).astype(np.int32),
             "target": rng.integers(0, cfg.vocab_size, seq).astype(np.int32)}
    for _ in range(3):
        s.step(feeds)
    samples = []
    for _ in range(steps):
        t0 = time.perf_counter()
        s.step(feeds)           # returns the loss: the step has finished on the device
        samples.append(time.perf_counter() - t0)
    s.close()
    return float(np.median(samples)) * 1e3


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="real", choices=["real", "tiny"])
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--time", action="store_true", help="also time the step on the GPU backend")
    p.add_argument("--out", default=None, help="write the numbers as JSON")
    args = p.parse_args(argv)
    cfg = LlamaConfig.smollm2_135m() if args.size == "real" else LlamaConfig.tiny()
    res = {}
    for ck in (False, True):
        key = "checkpointed" if ck else "plain"
        res[key] = planned(cfg, ck, args.seq)
        if args.time:
            res[key]["step_ms"] = timed(cfg, ck, args.seq)
        print(key, json.dumps(res[key]))
    a, b = res["plain"], res["checkpointed"]
    print(f"planned intermediates {a['intermediates_mib']:.1f} -> {b['intermediates_mib']:.1f} MiB "
          f"({100 * (1 - b['intermediates_mib'] / a['intermediates_mib']):.0f}% less); peak with persistent "
          f"{a['peak_mib']:.1f} -> {b['peak_mib']:.1f} MiB ({100 * (1 - b['peak_mib'] / a['peak_mib']):.0f}% less)"
          + (f"; step {a['step_ms']:.2f} -> {b['step_ms']:.2f} ms ({b['step_ms'] / a['step_ms']:.2f}x)"
             if args.time else ""))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
