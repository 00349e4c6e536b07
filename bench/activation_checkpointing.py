"""Activation checkpointing on the SmolLM2 training step (strict f32, AdamW; batch 1 x seq 128,
the shape of meganeura.bench's SmolLM2 training workload, unless --batch/--seq): the planned
memory of the step's plan with and without every decoder layer checkpointed (device-free,
the H200's compile options), where its bytes go by role (meganeura.bench.memory_roles), and
with ``--time`` the step time of each on the GPU backend.

Three plans: "plain_updates_at_end" (no checkpointing, the optimizer's updates all after the
backward pass, as before passes/order.py), "plain" (no checkpointing) and "checkpointed";
the last two are compiled with the same options, so their ratio is the checkpointing's own.

    python bench/activation_checkpointing.py [--size real|tiny] [--batch 1] [--seq 128] [--time]
                                             [--steps 10] [--out results.json]
"""
import argparse
import json
import time

import numpy as np

import meganeura as mg
from meganeura import nn
from meganeura.bench.compile_time import _h200_options, _plan_args
from meganeura.bench.memory_roles import PERSISTENT_ROLES, ROLES, role_breakdown
from meganeura.compiler import compile_plan
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

MIB = 2 ** 20
PLANS = {"plain_updates_at_end": (False, frozenset({"early_updates"})), "plain": (False, frozenset()),
         "checkpointed": (True, frozenset())}


def training_graph(cfg, checkpointed, batch, seq):
    """llama.build_training's graph (labels already shifted), every layer's activations
    recomputed in the backward pass when ``checkpointed``."""
    with nn.init.deferred():
        model = LlamaForCausalLM(cfg)
    for layer in model.model.layers:
        layer.activation_checkpointing = checkpointed
    g = mg.Graph()
    ids, target = g.input("input_ids", (batch, seq), mg.i32), g.input("target", (batch * seq,), mg.i32)
    logits = mg.ops.reshape(model(ids), (batch * seq, cfg.vocab_size))
    return g, mg.ops.cross_entropy(logits, target, ignore_index=-100)


def planned(cfg, checkpointed, batch, seq, disabled=frozenset()) -> dict:
    g, loss = training_graph(cfg, checkpointed, batch, seq)
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4), backend="numpy")
    targets, n_forward, updates = _plan_args(s.program, "step")
    kp = compile_plan(targets, n_forward=n_forward, options=_h200_options(disabled=disabled), updates=updates)
    m = kp.memory
    roles = role_breakdown(kp, kp.target_locs[0][0], batch * seq * cfg.vocab_size * 4)
    return {"peak_mib": m.peak_bytes / MIB, "slots_mib": m.bytes_with / MIB, "live_peak_mib": m.live_peak / MIB,
            "persistent_mib": m.persistent_bytes / MIB, "dispatches": kp.n_dispatches,
            "in_place_updates": kp.stats["in_place"], "roles": roles}


def timed(cfg, checkpointed, batch, seq, steps) -> dict:
    t0 = time.perf_counter()
    g, loss = training_graph(cfg, checkpointed, batch, seq)
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4), backend="gpu")
    rng = np.random.default_rng(0)
    feeds = {"input_ids": rng.integers(0, cfg.vocab_size, (batch, seq)).astype(np.int32),
             "target": rng.integers(0, cfg.vocab_size, batch * seq).astype(np.int32)}
    losses = [s.step(feeds) for _ in range(3)]          # the first compiles the step's pipelines
    compile_s = time.perf_counter() - t0
    samples = []
    for _ in range(steps):
        t1 = time.perf_counter()
        losses.append(s.step(feeds))   # returns the loss: the step has finished on the device
        samples.append(time.perf_counter() - t1)
    runtime = type(getattr(s, "executor", s)).__module__
    s.close()
    return {"step_ms": float(np.median(samples)) * 1e3, "step_ms_min": float(np.min(samples)) * 1e3,
            "setup_s": compile_s, "losses": [float(x) for x in losses[:3]], "runtime": runtime}


def print_table(res):
    keys = list(res["plans"])
    print(f"{'MiB':26}" + "".join(f"{k:>22}" for k in keys))
    for field in ("peak_mib", "slots_mib", "live_peak_mib", "persistent_mib"):
        print(f"{field:26}" + "".join(f"{res['plans'][k][field]:22.1f}" for k in keys))
    for field in ("dispatches", "in_place_updates"):
        print(f"{field:26}" + "".join(f"{res['plans'][k][field]:22d}" for k in keys))
    if all("step_ms" in res["plans"][k] for k in keys):
        print(f"{'step ms (median)':26}" + "".join(f"{res['plans'][k]['step_ms']:22.2f}" for k in keys))
    for r in PERSISTENT_ROLES:
        print(f"{'persistent ' + r:26}" + "".join(f"{res['plans'][k]['roles']['persistent'][r]:22.1f}" for k in keys))
    for r in ROLES:
        print(f"{'at live peak ' + r:26}" + "".join(f"{res['plans'][k]['roles']['at_live_peak'][r]:22.1f}" for k in keys))
    for r in ROLES:
        print(f"{'most live ' + r:26}" + "".join(f"{res['plans'][k]['roles']['most_live'][r]:22.1f}" for k in keys))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size", default="real", choices=["real", "tiny"])
    p.add_argument("--batch", type=int, default=1, help="sequences per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--time", action="store_true", help="also time the plain and checkpointed steps on the GPU backend")
    p.add_argument("--steps", type=int, default=10, help="timed steps per plan (after 3 untimed)")
    p.add_argument("--out", default=None, help="write the numbers as JSON")
    args = p.parse_args(argv)
    cfg = LlamaConfig.smollm2_135m() if args.size == "real" else LlamaConfig.tiny()
    res = {"size": args.size, "batch": args.batch, "seq": args.seq, "options": "H200 (device-free)",
           "optimizer": "AdamW", "precision": "strict", "plans": {}}
    for key, (ck, disabled) in PLANS.items():
        res["plans"][key] = planned(cfg, ck, args.batch, args.seq, disabled)
    if args.time:
        for key in ("plain", "checkpointed"):
            res["plans"][key].update(timed(cfg, key == "checkpointed", args.batch, args.seq, args.steps))
    a, b = res["plans"]["plain"], res["plans"]["checkpointed"]
    res["peak_reduction"] = 1 - b["peak_mib"] / a["peak_mib"]
    print_table(res)
    print(f"planned peak (persistent + slots) {a['peak_mib']:.1f} -> {b['peak_mib']:.1f} MiB checkpointed "
          f"({100 * res['peak_reduction']:.1f}% less; before the early updates: "
          f"{res['plans']['plain_updates_at_end']['peak_mib']:.1f} MiB)"
          + (f"; step {a['step_ms']:.2f} -> {b['step_ms']:.2f} ms ({b['step_ms'] / a['step_ms']:.2f}x)"
             if args.time else ""))
    if args.time:
        res["step_ratio"] = b["step_ms"] / a["step_ms"]
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)
    return res


if __name__ == "__main__":
    main()
