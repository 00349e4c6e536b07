"""``meganeura bench [run|gates|train|report] ...`` (or ``python -m meganeura.bench``); ``run``
is the default. See ``DESCRIPTION``."""
from __future__ import annotations

import argparse
import sys

from ..cli import HelpFormatter

COMMANDS = ("run", "gates", "train", "report")
DESCRIPTION = """The five workloads against PyTorch on the same device; run is the default command.

  run     time the workloads against PyTorch (JSON, Markdown, ratio chart, top kernels)
  gates   forward/backward accuracy gates per workload and precision mode
  train   N AdamW steps of ours vs torch's on the same data: loss curves side by side
  report  merge bench JSON files (e.g. one per workload) and re-render the table and chart

Try it on any machine: meganeura bench --size tiny --quick"""


def _common(p, modes_default="strict,accelerated"):
    p.add_argument("--size", choices=("tiny", "real"), default="tiny",
                   help="tiny: test configs (CI); real: the paper's shapes (GPU machines only)")
    p.add_argument("--workloads", default="all", help="comma-separated: smollm2,smolvla,unet,resnet50,whisper")
    p.add_argument("--modes", default=modes_default, help="comma-separated: strict,accelerated")
    p.add_argument("--seed", type=int, default=0, help="seed of the inputs and weights")
    p.add_argument("--out", default="bench/results/latest", help="output folder")


def parser(prog="python -m meganeura.bench"):
    p = argparse.ArgumentParser(prog=prog, description=DESCRIPTION, formatter_class=HelpFormatter)
    sub = p.add_subparsers(dest="command")

    def command(name, help):
        return sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)

    r = command("run", "time the workloads against PyTorch")
    _common(r)
    r.add_argument("--phases", default="all", help="comma-separated: inference,minimal,flb,train_step,compile")
    r.add_argument("--quick", action="store_true", help="2 warm-ups and 5 samples instead of 5 and 20")
    r.add_argument("--device", default=None, help="torch device (default: cuda when available, else cpu)")
    r.add_argument("--no-torch-compile", action="store_true", help="time PyTorch eager only")
    r.add_argument("--torch-variants", default=None,
                   help="comma-separated PyTorch baselines beside eager (default all: torch_compile,torch_graph,"
                        "torch_compile_graphs,torch_bf16_graph)")
    r.add_argument("--no-progress", action="store_true", help="no progress bar")
    r.add_argument("--no-fresh-process", action="store_true",
                   help="compile phase: time in this process only (no cold / warm child processes)")
    r.add_argument("--debug", action="store_true", help="print tracebacks of failures")
    r.add_argument("--warmup", type=int, default=None,
                   help="untimed calls before the samples (default 5, 2 with --quick; the committed H200 tables used 3)")
    r.add_argument("--samples", type=int, default=None,
                   help="timed calls, of which the median is reported (default 20, 5 with --quick; the committed "
                        "H200 tables used 10)")
    g = command("gates", "accuracy gates against PyTorch")
    _common(g)
    g.add_argument("--backend", choices=("gpu", "numpy"), default="gpu", help="our backend to check")
    t = command("train", "N AdamW steps, ours vs torch's loss curve")
    _common(t, modes_default="strict")
    t.add_argument("--backend", choices=("gpu", "numpy"), default="gpu", help="our backend")
    t.add_argument("--steps", type=int, default=50, help="AdamW steps")
    t.add_argument("--lr", type=float, default=1e-4, help="learning rate")
    m = command("report", "merge bench JSON files and re-render the Markdown and chart")
    m.add_argument("files", nargs="+", help="bench JSON files to merge")
    m.add_argument("--out", required=True, help="output folder")
    return p


def main(argv=None, prog="python -m meganeura.bench") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in COMMANDS + ("-h", "--help"):
        argv = ["run"] + argv
    args = parser(prog).parse_args(argv)
    if args.command == "gates":
        from .gates import cmd_gates
        return cmd_gates(args)
    if args.command == "train":
        from .gates import cmd_train
        return cmd_train(args)
    if args.command == "report":
        from . import report
        return 0 if report.write_bench(report.merge(args.files), args.out) else 1
    from . import harness, report
    if args.warmup is None:
        args.warmup = 2 if args.quick else 5
    if args.samples is None:
        args.samples = 5 if args.quick else 20
    result = harness.run(args)
    report.write_bench(result, args.out)
    bad = [c for c in result["cells"] if not c.get("valid")]
    if bad:
        print(f"{len(bad)} cell(s) invalid (gate failed or error): "
              + ", ".join(f"{c['workload']}/{c['mode']}/{c['phase']}" for c in bad[:12]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
