"""Dispatches per call of each workload and phase (real size by default), computed by the device-free
compile stage (no GPU needed): with every compiler pass, and with the fusion passes and
in-place updates switched off (the schedule's elementwise fusion still applies).

    python bench/dispatches.py [--workloads smollm2,...] [--out bench/results/dispatches.json]

``phase_targets`` is what the GPU executor compiles for a workload's phase; the dispatch
budgets in tests/test_fusion.py use it at tiny size.
"""
from __future__ import annotations

import argparse
import json
import time

import meganeura as mg
from meganeura.bench.workloads import WORKLOADS, make
from meganeura.compiler import FUSION_PASSES, OTHER_PASSES, CompileOptions, compile_plan

BINDINGS = 1 << 16     # a large GPU's storage-buffer limit (the H200 offers 524288)


def phase_targets(w, phase):
    """(targets, n_forward, updates) of a workload's phase, as the GPU executor compiles them."""
    if phase in ("inference", "minimal"):
        b = w.build(phase)
        ups = list((b.state_updates or {}).items())
        targets = list(b.outputs) + [v for _, v in ups]
        return targets, len(b.outputs), {len(b.outputs) + j: s.name for j, (s, _) in enumerate(ups)}
    b = w.build("train")
    opt = mg.optim.AdamW(lr=1e-4) if phase == "train_step" else None
    s = mg.compile(b.graph, loss=b.loss, optimizer=opt, backend="numpy")
    fetches, grad_names, upd, targets = s.program.targets("step" if opt is not None else "grads")
    base = len(fetches) + len(grad_names)
    return targets, len(fetches), {base + j: n for j, (n, _) in enumerate(upd)}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--out", default="bench/results/dispatches.json")
    args = ap.parse_args(argv)
    off = CompileOptions(max_bindings=BINDINGS, disabled=frozenset(list(FUSION_PASSES) + list(OTHER_PASSES)))
    on = CompileOptions(max_bindings=BINDINGS)
    rows = []
    print(f"{'workload':10} {'phase':11} {'passes off':>10} {'all passes':>10} {'ratio':>6} {'compile s':>9}")
    for name in args.workloads.split(","):
        w = make(name, size=args.size)
        for phase in ("inference", "minimal", "flb", "train_step"):
            targets, n_fwd, updates = phase_targets(w, phase)
            t0 = time.perf_counter()
            kp = compile_plan(targets, n_forward=n_fwd, options=on, updates=updates)
            dt = time.perf_counter() - t0
            base = compile_plan(targets, n_forward=n_fwd, options=off, updates=updates).n_dispatches
            rows.append({"workload": name, "phase": phase, "dispatches": kp.n_dispatches, "passes_off": base,
                         "in_place_updates": kp.stats["in_place"], "compile_plan_s": round(dt, 3)})
            print(f"{name:10} {phase:11} {base:10d} {kp.n_dispatches:10d} {base / kp.n_dispatches:6.2f} {dt:9.2f}")
    with open(args.out, "w") as f:
        json.dump({"bindings": BINDINGS, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
