"""Imported models timed against the strongest PyTorch: torchvision's ResNet-18 and
transformers' BERT (bert-base-uncased's configuration), random-initialised and seeded,
imported with ``mg.from_torch`` and compiled on our GPU backend.

    python bench/imported.py [--size tiny|real] [--models resnet18,bert] [--batches 1,32]
                             [--modes strict,accelerated] [--out DIR] [--max-seconds S]

Per model, batch and precision mode one inference cell, built from the harness
(``meganeura.bench``): ours is ``Session.run(feeds, fetch=False)`` (outputs left on the
device, as torch's are), PyTorch on the same weights and inputs is timed eager,
``torch.compile``, eager captured whole in a CUDA graph, ``reduce-overhead`` and, in
accelerated mode, bf16 autocast captured; each variant's output is checked against eager's
(a failing one is kept with its reason and does not count), and ``ratio_best`` is ours over
the fastest valid one, named in ``best_baseline``. Warm-ups, then the samples (median kept).
Without CUDA (the tiny size on a laptop) PyTorch CPU eager is the only baseline.

Gate: our output against PyTorch eager in f32 with TF32 off (in both modes), relative L2
over evenly spaced samples below the harness's ``FORWARD_TOL``. A cell whose gate fails is
invalid.

Sizes: ``real``: ResNet-18 at 224x224 (batches 1 and 32), BERT-base at sequence 128
(batches 1 and 8). ``tiny``: the same ResNet-18 on 32x32 images with 10 classes (batches
1 and 2) and a two-layer BERT (sequence 8, batches 1 and 2). Without torchvision the
ResNet is skipped and the reason recorded. ``--compile-only`` imports and compiles each
model (any ``--backend``; ``numpy`` needs no device) and times nothing; the interpreter's
compile is nearly free, so the GPU backend's on lavapipe is the better estimate.
``--max-seconds``: cells not begun by then are recorded as skipped; the JSON is rewritten
after every cell, so a run cut short keeps what finished.
"""
from __future__ import annotations

import argparse
import copy
import gc
import sys
import time
import traceback

import numpy as np

from meganeura.bench import baselines as B
from meganeura.bench import gates as G
from meganeura.bench import harness as H
from meganeura.bench import report
from meganeura.bench.workloads import Workload, default_device, parse_list

MODELS = ("resnet18", "bert")
BATCHES = {"real": {"resnet18": (1, 32), "bert": (1, 8)}, "tiny": {"resnet18": (1, 2), "bert": (1, 2)}}


class Imported(Workload):
    """One imported model at one batch, behind the harness's workload interface (torch side:
    ``reference``, ``torch_fn``; ours: ``session``). The torch module is built once on the
    CPU, imported from there, and copied to ``device`` for the baselines."""
    model = ""

    def __init__(self, size, batch, seed=0, device=None, backend="gpu"):
        self.b, self.backend = batch, backend
        super().__init__(size, seed, device)
        self.name = f"{self.model}_b{batch}"
        self.cpu_module = None
        self.imported, self.import_s = None, None
        self.timings = {}

    def batch(self, graph):
        return self.b

    def describe(self):
        return {"name": self.name, "model": self.model, "size": self.size, "batch": self.b,
                "device": self.device, "config": self.cfg, "input_shapes": self.input_shapes(),
                "parameters": int(sum(p.numel() for p in self.module().parameters()))}

    def input_shapes(self):
        return {k: list(v.shape) for k, v in self.inputs("inference").items()}

    def module(self):
        if self.cpu_module is None:
            self.cpu_module = self.make_reference().float().eval()
        return self.cpu_module

    @property
    def reference(self):
        if self._ref is None:
            self._ref = copy.deepcopy(self.module()).to(self.device).eval()
        return self._ref

    def import_model(self):
        """(``mg.from_torch`` of the CPU module at this batch's shapes, seconds it took now:
        0 when imported before)."""
        if self.imported is None:
            import torch

            import meganeura as mg
            args = tuple(torch.as_tensor(v) for v in self.inputs("inference").values())
            t0 = time.perf_counter()
            self.imported = mg.from_torch(self.module(), args)
            self.import_s = time.perf_counter() - t0
            return self.imported, self.import_s
        return self.imported, 0.0

    def session(self, graph="inference", backend=None, precision="strict", optimizer=None, timings=None):
        """(session, feeds) of the imported graph compiled on this workload's backend."""
        m, import_s = self.import_model()       # the second mode reuses the first's import
        t0 = time.perf_counter()
        s = m.compile(backend=backend or self.backend, precision=precision, seed=self.seed)
        t = {"import_s": import_s, "compile_s": time.perf_counter() - t0,
             "nodes": len(m.graph.nodes), "parameters": len(m.graph.parameters)}
        self.timings[precision] = t
        if timings is not None:
            timings.update(t)
        return s, m.feeds(*self.inputs("inference").values())


class ResNet18(Imported):
    """torchvision's ``resnet18`` (``weights=None``: its own initialisation, seeded). Tiny:
    the same network on 32x32 images with 10 classes."""
    model = "resnet18"

    def config(self):
        real = self.size == "real"
        self.image = 224 if real else 32
        return {"image": self.image, "num_classes": 1000 if real else 10}

    def make_reference(self):
        import torch
        from torchvision.models import resnet18
        torch.manual_seed(self.seed)
        return resnet18(weights=None, num_classes=self.cfg["num_classes"])

    def make_inputs(self, batch):
        rng = np.random.default_rng(self.seed)
        return {"x": rng.standard_normal((batch, 3, self.image, self.image)).astype(np.float32)}

    def torch_output(self, model, graph, tin):
        return model(tin["x"])


class Bert(Imported):
    """transformers' ``BertModel`` from ``BertConfig()`` (bert-base-uncased's configuration:
    12 layers, hidden 768, 12 heads, vocabulary 30522), random-initialised and seeded;
    output ``last_hidden_state``. Tiny: 2 layers, hidden 32, 4 heads, vocabulary 64.
    Dropout is off in eval mode. Attention is transformers' ``sdpa`` path (its default): torch
    runs its fused attention kernels; ``torch.export`` decomposes it to matmuls and a softmax
    for our import."""
    model = "bert"

    def config(self):
        self.seq = 128 if self.size == "real" else 8
        if self.size == "real":
            return {"seq": self.seq}
        return {"seq": self.seq, "hidden_size": 32, "intermediate_size": 64, "num_attention_heads": 4,
                "num_hidden_layers": 2, "vocab_size": 64, "max_position_embeddings": 32}

    def make_reference(self):
        import torch
        import transformers
        config = transformers.BertConfig(**{k: v for k, v in self.cfg.items() if k != "seq"})
        config._attn_implementation = "sdpa"
        torch.manual_seed(self.seed)
        return transformers.BertModel(config, add_pooling_layer=False)

    def make_inputs(self, batch):
        rng = np.random.default_rng(self.seed)
        vocab = self.module().config.vocab_size
        return {"input_ids": rng.integers(0, vocab, (batch, self.seq)).astype(np.int64)}

    def torch_output(self, model, graph, tin):
        return model(input_ids=tin["input_ids"]).last_hidden_state


CLASSES = {"resnet18": ResNet18, "bert": Bert}


def missing_dependency(model):
    """Why ``model`` cannot run here (a package missing), or None."""
    import importlib.util
    pkg = {"resnet18": "torchvision", "bert": "transformers"}[model]
    return None if importlib.util.find_spec(pkg) else f"{pkg} is not installed: {model} skipped"


# ------------------------------------------------------------------ one cell
def time_cell(runner, w, mode, backend) -> dict:
    """Our side and every PyTorch variant for one inference cell (harness helpers)."""
    o = runner.o
    cell = {"workload": w.name, "model": w.model, "batch": w.b, "mode": mode, "phase": "inference"}
    try:
        sess, feeds = w.session("inference", backend, mode)
        cell["compile"] = w.timings[mode]
    except Exception as e:
        cell.update(ours={"error": H._short_error(e)}, valid=False)
        if o.debug:
            traceback.print_exc()
        return cell
    try:
        cell["gate"] = G.gate(w, "inference", sess, feeds, "strict")     # eager f32, TF32 off
    except Exception as e:
        cell["gate"] = {"error": H._short_error(e), "pass": False}
    cell["valid"] = bool(cell["gate"].get("pass"))
    try:
        cell["ours"] = H.measure(H._ours_call(sess, "inference", feeds), o.warmup, o.samples)
        if backend != "numpy":
            cell["ours"].update(H._plan_info(sess, "run"))
    except Exception as e:
        cell["ours"] = {"error": H._short_error(e)}
        cell["valid"] = False
    sess.close()
    torch = runner.t.torch
    with G.torch_precision(mode):
        model = w.reference
        try:
            cell[B.EAGER] = runner._time_torch(w.torch_fn("inference", model))
        except Exception as e:
            cell[B.EAGER] = {"error": H._short_error(e)}
        if runner.t.compile_reason or not runner._wanted(B.COMPILE):
            cell[B.COMPILE] = {"skipped": runner.t.compile_reason or "not asked for (--torch-variants)"}
        else:
            try:
                fn = w.torch_fn("inference", torch.compile(model))
                t0 = time.perf_counter()
                fn()
                runner.t.sync()
                first = time.perf_counter() - t0
                cell[B.COMPILE] = runner._time_torch(fn)
                cell[B.COMPILE]["first_call_s"] = first
                runner._check(w, "inference", model, fn, cell[B.COMPILE])
            except Exception as e:
                cell[B.COMPILE] = {"error": H._short_error(e)}
        for v in B.graph_variants(mode):
            cell[v] = runner._time_variant(w, "inference", model, v)
    if runner.t.compile_reason is None:
        torch._dynamo.reset()
    a = cell["ours"].get("median_ms")
    for ref in (B.EAGER, B.COMPILE):
        b = cell[ref].get("median_ms")
        cell[f"ratio_{ref.split('_')[1]}"] = a / b if a and b else None
    best, best_ms = B.best(cell)
    cell["best_baseline"] = best
    cell["ratio_best"] = a / best_ms if a and best_ms else None
    return cell


# ------------------------------------------------------------------ report
def markdown(result) -> str:
    o = result["options"]
    lines = [f"# Imported models vs the strongest PyTorch ({o['size']} size)", "",
             f"Ours: `mg.from_torch`, backend {o['backend']} ({_adapter(result)}); "
             f"PyTorch on {o['device']}. Inference ms, median of {o['samples']} after {o['warmup']} warm-ups; "
             "best = the fastest valid PyTorch variant (bold: we are slower). Gate: rel L2 against PyTorch "
             f"eager f32 (TF32 off) < {G.FORWARD_TOL:g}.", "",
             "| model | batch | mode | ours | eager | compile | graph | reduce-overhead | bf16 graph "
             "| ours / best | gate rel L2 | our compile s |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in result["cells"]:
        if "skipped" in c:
            lines.append(f"| {c['model']} | {c.get('batch', '-')} | {c.get('mode', '-')} | skipped: {c['skipped']} "
                         "| | | | | | | | |")
            continue
        g = c.get("gate", {})
        ge = "-" if "rel_l2_sampled" not in g else f"{g['rel_l2_sampled']:.1e} {'pass' if g['pass'] else 'FAIL'}"
        comp = c.get("compile", {})
        cs = "-" if "compile_s" not in comp else f"{comp['compile_s']:.1f}" + (
            f" (+{comp['import_s']:.1f} import)" if comp["import_s"] else "")
        ours = "error: " + c["ours"]["error"] if "error" in c.get("ours", {}) else report._ms(c["ours"].get("median_ms"))
        refs = " | ".join(report._ref_cell(c, v) if v in c else "-" for v in B.VARIANTS)
        lines.append(f"| {c['model']} | {c['batch']} | {c['mode']} | {ours} | {refs} | {report._best_cell(c)} "
                     f"| {ge} | {cs} |")
    return "\n".join(lines) + "\n"


def _adapter(result) -> str:
    if result["options"]["backend"] == "numpy":
        return "the NumPy interpreter"
    a = result["environment"].get("adapter", {})
    return a.get("name") or a.get("error") or "?"


def compile_only(args, models, result):
    for name in models:
        for b in args.batches.get(name, ()):
            w = CLASSES[name](args.size, b, args.seed, "cpu", args.backend)
            for mode in args.modes:
                row = {"workload": w.name, "model": name, "batch": b, "mode": mode}
                try:
                    s, _ = w.session("inference", args.backend, mode)
                    row.update(w.timings[mode])
                    s.close()
                except Exception as e:
                    row["error"] = H._short_error(e)
                result["compile"].append(row)
                print(f"{w.name} [{mode}] on {args.backend}: " + (row.get("error") or
                      f"import {row['import_s']:.1f} s, compile {row['compile_s']:.1f} s, {row['nodes']} nodes"),
                      flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("tiny", "real"), default="real")
    p.add_argument("--models", default=",".join(MODELS))
    p.add_argument("--batches", default=None,
                   help="comma-separated batches for every model, or model=1:32,bert=1:8 (default: the size's)")
    p.add_argument("--modes", default="strict,accelerated")
    p.add_argument("--backend", default="gpu", help="ours: gpu (default), vulkan, wgpu or numpy")
    p.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--samples", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--torch-variants", default=None,
                   help=f"only these of {','.join(B.VARIANTS[1:])} beside eager (default: all)")
    p.add_argument("--no-torch-compile", action="store_true")
    p.add_argument("--max-seconds", type=float, default=None, help="begin no cell after this many seconds")
    p.add_argument("--compile-only", action="store_true", help="import and compile only; time nothing")
    p.add_argument("--out", default="bench/results/imported")
    p.add_argument("--debug", action="store_true")
    args = p.parse_args(argv)
    t_start = time.perf_counter()
    models = parse_list(args.models, MODELS, "models")
    args.modes = parse_list(args.modes, H.MODES, "modes")
    args.batches = _batches(args.batches, args.size, models)
    args.torch_variants = parse_list(args.torch_variants, B.VARIANTS[1:], "torch variants") \
        if args.torch_variants else None
    args.device = args.device or default_device()
    result = {"kind": "imported", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "options": {"size": args.size, "models": models, "batches": args.batches, "modes": args.modes,
                          "backend": args.backend, "device": args.device, "warmup": args.warmup,
                          "samples": args.samples, "seed": args.seed, "compile_only": args.compile_only},
              "environment": report.environment("gpu" if args.backend != "numpy" else "numpy"),
              "torch_variants": args.torch_variants or list(B.VARIANTS), "skipped_models": {},
              "cells": [], "compile": []}
    if not args.device.startswith("cuda"):
        result["note"] = "torch ran on the CPU: eager is the only baseline and ratios are not GPU performance"
    for name in list(models):
        why = missing_dependency(name)
        if why:
            print(why, file=sys.stderr, flush=True)
            result["skipped_models"][name] = why
            result["cells"].append({"model": name, "skipped": why})
            models.remove(name)
    if args.compile_only:
        compile_only(args, models, result)
        report.write_outputs(args.out, "imported_compile", result, markdown(result))
        return 0 if all("error" not in r for r in result["compile"]) else 1
    if args.backend != "numpy":
        from meganeura.runtime.backends import gpu_device
        gpu_device()                     # device start-up is no part of a cell
    runner = H.Runner(args, log=print)
    workloads = {}
    try:
        for mode in args.modes:          # every strict cell before the accelerated ones
            for name in models:
                for b in args.batches[name]:
                    if args.max_seconds is not None and time.perf_counter() - t_start > args.max_seconds:
                        result["cells"].append({"model": name, "batch": b, "mode": mode,
                                                "skipped": f"not begun within --max-seconds {args.max_seconds:g}"})
                        continue
                    key = (name, b)
                    if key not in workloads:
                        workloads[key] = CLASSES[name](args.size, b, args.seed, args.device, args.backend)
                    w = workloads[key]
                    t_cell = time.perf_counter()
                    try:
                        cell = time_cell(runner, w, mode, args.backend)
                        cell["config"] = w.describe()
                    except Exception as e:
                        cell = {"workload": w.name, "model": name, "batch": b, "mode": mode, "valid": False,
                                "ours": {"error": H._short_error(e)}}
                        if args.debug:
                            traceback.print_exc()
                    cell["cell_s"] = time.perf_counter() - t_cell     # wall seconds, torch compiles included
                    result["cells"].append(cell)
                    print(f"{_line(cell)} [{cell['cell_s']:.0f} s]", flush=True)
                    report.write_outputs(args.out, "imported", result, markdown(result))
                    gc.collect()
    except KeyboardInterrupt:
        result["interrupted"] = True
        print("interrupted; writing the cells timed so far", flush=True)
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["wall_s"] = time.perf_counter() - t_start
    report.write_outputs(args.out, "imported", result, markdown(result))
    print(markdown(result))
    timed = [c for c in result["cells"] if "skipped" not in c]
    return 0 if timed and all(c.get("valid") for c in timed) else 1


def _batches(spec, size, models) -> dict:
    if not spec:
        return {m: list(BATCHES[size][m]) for m in models}
    if "=" not in spec:
        return {m: [int(v) for v in spec.split(",")] for m in models}
    out = {m: list(BATCHES[size][m]) for m in models}
    for part in spec.split(","):
        m, _, bs = part.partition("=")
        if m not in MODELS:
            raise SystemExit(f"--batches: unknown model {m!r}; choose from {', '.join(MODELS)}")
        out[m] = [int(v) for v in bs.split(":")]
    return out


def _line(c) -> str:
    if "error" in c.get("ours", {}):
        return f"{c['workload']} [{c['mode']}]: error {c['ours']['error']}"
    g = c.get("gate", {})
    best = c.get("best_baseline")
    return (f"{c['workload']} [{c['mode']}]: ours {report._ms(c['ours'].get('median_ms'))} ms, best "
            f"{B.SHORT.get(best, '-')} {report._ms(c[best]['median_ms']) if best else '-'} ms, ratio_best "
            f"{'-' if c.get('ratio_best') is None else format(c['ratio_best'], '.2f')}, gate rel L2 "
            f"{g.get('rel_l2_sampled', float('nan')):.1e} ({'pass' if g.get('pass') else 'FAIL'})")


if __name__ == "__main__":
    sys.exit(main())
