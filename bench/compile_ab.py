"""Cold and warm compile times of two versions of meganeura, in alternating processes on the
current device: the way to tell a compiler change from the machine's drift.

    python bench/compile_ab.py --old OLD_SRC [--new src] [--workloads smollm2,resnet50]
                               [--graphs inference,train] [--size real] [--rounds 2] [--out DIR]

``OLD_SRC`` is the ``src`` folder of the earlier version (``git archive REV src | tar -x -C
old``). For each workload and graph, every round runs ``meganeura.bench.compile_time --gpu``
once for each version (order swapped each round), each in fresh processes with empty caches
(cold) and then filled ones (warm, the median of three processes; ``again``: the same graph
a second time in a warm process). Prints the medians over rounds per version and the ratio
new / old; writes ``compile_ab.json``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

FIELDS = ("cold_s", "warm_s", "again_s")


def one_run(src, workload, graph, size, mode):
    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "r.json")
        env = dict(os.environ, PYTHONPATH=os.path.abspath(src) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        subprocess.run([sys.executable, "-m", "meganeura.bench.compile_time", "--gpu", "--workloads", workload,
                        "--graphs", graph, "--size", size, "--mode", mode, "--out", out],
                       env=env, check=True, stdout=subprocess.DEVNULL)
        with open(out) as f:
            row = json.load(f)["rows"][0]
    return {k: row[k] for k in FIELDS}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--old", required=True)
    p.add_argument("--new", default="src")
    p.add_argument("--workloads", default="smollm2,resnet50")
    p.add_argument("--graphs", default="inference,train")
    p.add_argument("--size", default="real", choices=("tiny", "real"))
    p.add_argument("--mode", default="strict", choices=("strict", "accelerated"))
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--out", default="compile-ab")
    a = p.parse_args(argv)
    versions = {"old": a.old, "new": a.new}
    rows = []
    print(f"{'workload':9} {'graph':9} " + " ".join(f"{v + ' ' + k[:-2]:>10}" for k in FIELDS for v in versions)
          + "   new/old cold, warm")
    for w in a.workloads.split(","):
        for g in a.graphs.split(","):
            runs = {v: [] for v in versions}
            for r in range(a.rounds):
                order = list(versions) if r % 2 == 0 else list(versions)[::-1]
                for v in order:
                    runs[v].append(one_run(versions[v], w, g, a.size, a.mode))
            med = {v: {k: statistics.median(x[k] for x in runs[v]) for k in FIELDS} for v in versions}
            row = {"workload": w, "graph": g, "runs": runs, "median": med,
                   "cold_ratio": med["new"]["cold_s"] / med["old"]["cold_s"],
                   "warm_ratio": med["new"]["warm_s"] / med["old"]["warm_s"]}
            rows.append(row)
            print(f"{w:9} {g:9} " + " ".join(f"{med[v][k]:10.2f}" for k in FIELDS for v in versions)
                  + f"   {row['cold_ratio']:.2f}, {row['warm_ratio']:.2f}", flush=True)
            os.makedirs(a.out, exist_ok=True)
            with open(os.path.join(a.out, "compile_ab.json"), "w") as f:
                json.dump({"size": a.size, "mode": a.mode, "rounds": a.rounds, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
