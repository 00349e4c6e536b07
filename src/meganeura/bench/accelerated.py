"""What accelerated precision runs per call, device-free: dispatches and bytes touched of
each workload and phase in strict mode, in accelerated mode with the weights cast to f16
by every call (the old way), and with persistent f16 copies of the weights (written when
a weight is set and by the optimizer step).

    python -m meganeura.bench.accelerated [--size real] [--workloads smollm2,...] [--out bench/results/accelerated.json]

"Bytes touched" counts, per launch, each bound view's elements once (reads, writes and
extra stores): a lower bound of the memory traffic that ignores re-reads of matmul tiles.
"Persistent" is the device memory that outlives a call (weights, optimizer state, copies).
"""
from __future__ import annotations

import argparse
import json
import time

from .dispatches import BINDINGS, phase_targets
from .workloads import WORKLOADS, make, parse_list

PHASES = ("inference", "minimal", "flb", "train_step")
VARIANTS = ("strict", "cast_per_call", "f16_copies")


def bytes_touched(kp) -> int:
    total = 0
    for d in kp.dispatches:
        for u in d.kernel.spec.get("parts", [d.kernel]):
            seen = {}
            for v in [*u.reads, *u.epi_reads, u.out, *u.spec.get("stores", ())]:
                n = min(v.size * v.dtype.np.itemsize, v.buf.nbytes)
                seen[id(v.buf)] = max(seen.get(id(v.buf), 0), n)
            total += sum(seen.values())
    return total


def measure(w, phase) -> dict:
    from ..compiler import CompileOptions, compile_plan, f16_weights
    targets, n_fwd, updates = phase_targets(w, phase)
    copies = f16_weights(targets[:n_fwd])
    opts = {"strict": CompileOptions("strict", max_bindings=BINDINGS),
            "cast_per_call": CompileOptions("accelerated", max_bindings=BINDINGS),
            "f16_copies": CompileOptions("accelerated", max_bindings=BINDINGS, f16_weights=copies)}
    row = {"workload": w.name, "phase": phase, "f16_copies": len(copies)}
    for variant, o in opts.items():
        t0 = time.perf_counter()
        kp = compile_plan(targets, n_forward=n_fwd, options=o, updates=updates)
        casts = sum(1 for d in kp.dispatches for u in d.kernel.spec.get("parts", [d.kernel])
                    if u.archetype == "pointwise" and u.out.dtype.name == "f16"
                    and any(v.buf.kind == "parameter" for v in u.reads))
        row[variant] = {"dispatches": kp.n_dispatches, "weight_cast_units": casts, "bytes_touched": bytes_touched(kp),
                        "persistent_bytes": kp.memory.persistent_bytes, "planned_bytes": kp.memory.bytes_with,
                        "compile_plan_s": round(time.perf_counter() - t0, 3)}
    return row


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--out", default="bench/results/accelerated.json")
    args = ap.parse_args(argv)
    rows = []
    mib = 2 ** 20
    print(f"{'workload':9} {'phase':10} | {'dispatches strict / cast / copies':>33} | "
          f"{'MiB touched strict / cast / copies':>36} | {'persistent MiB cast -> copies':>30}")
    for name in parse_list(args.workloads, WORKLOADS, "workloads"):
        w = make(name, size=args.size)
        for phase in PHASES:
            r = measure(w, phase)
            rows.append(r)
            d = [r[v]["dispatches"] for v in VARIANTS]
            b = [r[v]["bytes_touched"] / mib for v in VARIANTS]
            print(f"{name:9} {phase:10} | {d[0]:10d} {d[1]:10d} {d[2]:11d} | {b[0]:11.1f} {b[1]:11.1f} {b[2]:12.1f} | "
                  f"{r['cast_per_call']['persistent_bytes'] / mib:13.1f} {r['f16_copies']['persistent_bytes'] / mib:16.1f}",
                  flush=True)
    with open(args.out, "w") as f:
        json.dump({"size": args.size, "bindings": BINDINGS, "variants": VARIANTS, "rows": rows}, f, indent=1)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
