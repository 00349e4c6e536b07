"""Benchmark outputs: the environment record, the JSON file, the Markdown tables (as in the
paper: ms ours / ms PyTorch and the ratio per cell, compile seconds, memory, gates, top
kernels) and a chart of the ratios (PNG through matplotlib when importable, else SVG)."""
from __future__ import annotations

import json
import os
import pathlib
import platform
import subprocess
import sys

from .baselines import COMPILE, EAGER, SHORT, VARIANTS, graph_variants

PHASE_ORDER = ("inference", "minimal", "flb", "train_step")


def _version(mod):
    try:
        from importlib.metadata import version
        return version(mod)
    except Exception:
        return None


def _nvidia_smi():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        return out.stdout.strip() or None
    except Exception:
        return None


def environment(backend="gpu") -> dict:
    """Machine, adapter, driver and package versions."""
    env = {"machine": {"host": platform.node(), "platform": platform.platform(), "processor": platform.processor(),
                       "cpus": os.cpu_count(), "python": sys.version.split()[0]},
           "versions": {m: _version(m) for m in ("meganeura", "numpy", "wgpu", "torch", "transformers", "diffusers",
                                                  "safetensors", "tqdm", "matplotlib")}}
    try:
        import torch
        env["torch"] = {"cuda_available": torch.cuda.is_available(), "cuda": torch.version.cuda,
                        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
                        "threads": torch.get_num_threads()}
    except Exception as e:
        env["torch"] = {"error": str(e)}
    env["nvidia_smi"] = _nvidia_smi()
    if backend != "numpy":
        try:
            from ..runtime.backends import get_runtime_device, resolve
            env["runtime"] = resolve(backend)        # the GPU runtime that ran: vulkan or wgpu
            dev = get_runtime_device(env["runtime"])
            env["adapter"] = {**{k: v for k, v in dev.adapter_info.items() if isinstance(v, (str, int, float))},
                              "driver": dev.adapter_info.get("description"), "is_software": dev.is_software,
                              "trusted_shaders": getattr(dev, "trusted", True), "features": sorted(dev.features),
                              "max_buffer_size": dev.limits.get("max-buffer-size")}
        except Exception as e:
            env["adapter"] = {"error": str(e)}
    return env


def write_outputs(out, stem: str, result: dict, markdown: str) -> dict:
    """Write ``stem``.json and ``stem``.md under ``out``; returns their paths."""
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / f"{stem}.json", "md": out / f"{stem}.md"}
    with open(paths["json"], "w") as f:
        json.dump(result, f, indent=1, default=_json_default)
    paths["md"].write_text(markdown)
    print(f"wrote {paths['json']} and {paths['md']}")
    return paths


def _json_default(o):
    import numpy as np
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    return str(o)


# ------------------------------------------------------------------ Markdown
def _ms(x):
    if x is None:
        return "-"
    return f"{x:.3f}" if x < 10 else f"{x:.1f}"


def _mib(b):
    return "-" if b is None else f"{b / 2**20:.1f}"


def _ref_cell(c, ref):
    r = c.get(ref, {})
    if "skipped" in r:
        return "skipped"
    if "error" in r:
        return "error"
    return _ms(r.get("median_ms"))


def _time_cell(c, ref):
    if c is None:
        return ""
    ours = c.get("ours", {})
    if "error" in ours:
        return "error"
    theirs = c.get(ref, {})
    ratio = c.get(f"ratio_{ref.split('_')[1]}")
    text = f"{_ms(ours.get('median_ms'))} / {_ref_cell(c, ref)}"
    if ratio is not None:
        text += f" ({ratio:.2f}x)"
    if not c.get("valid"):
        text = f"~~{text}~~ invalid" if "skipped" not in theirs else f"{text} invalid"
    return text


def _best_cell(c):
    """``ours / strongest (ratio) winner``; the winner is the fastest valid baseline."""
    if c is None:
        return ""
    if "error" in c.get("ours", {}):
        return "error"
    best = c.get("best_baseline")
    if best is None or c.get("ratio_best") is None:
        return f"{_ms(c.get('ours', {}).get('median_ms'))} / - (no valid baseline)"
    text = (f"{_ms(c['ours'].get('median_ms'))} / {_ms(c[best]['median_ms'])} "
            f"({c['ratio_best']:.2f}x, {SHORT[best]})")
    if c["ratio_best"] > 1:
        text = f"**{text}**"
    failed = [SHORT[v] for v in VARIANTS if "error" in c.get(v, {}) or c.get(v, {}).get("valid") is False]
    if failed:      # the strongest may be among these: the reader should know
        text += f" ({', '.join(failed)}: failed)"
    return text if c.get("valid") else f"~~{text}~~ invalid"


def _median(vals):
    vals = sorted(v for v in vals if v)
    if not vals:
        return None
    n = len(vals)
    return vals[n // 2] if n % 2 else 0.5 * (vals[n // 2 - 1] + vals[n // 2])


def best_section(result, cells, phases) -> list:
    """Per mode: ours against the fastest valid PyTorch variant of each cell, the winner
    named, and the median ratio per phase. Empty for results without the variants."""
    if not any("best_baseline" in c for c in cells.values()):
        return []
    o, lines = result["options"], []
    for mode in o["modes"]:
        names = ", ".join(SHORT[v] for v in VARIANTS if v in (EAGER, COMPILE) or v in graph_variants(mode))
        lines += [f"## {mode}: ours vs the strongest PyTorch (ms)", "",
                  f"Per cell, the fastest valid of: {names} (CUDA graphs and reduce-overhead on CUDA only). "
                  "Bold: we are slower. A baseline whose output or loss departs from eager's beyond the gate "
                  "tolerance, or that could not be captured or compiled, does not count and is named "
                  "after the cell (the JSON keeps its error).", "",
                  "| workload | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
        for name in o["workloads"]:
            lines.append(f"| {name} | " + " | ".join(_best_cell(cells.get((name, mode, p))) for p in phases) + " |")
        meds = [_median(c.get("ratio_best") for (n, m, ph), c in cells.items() if m == mode and ph == p
                        and c.get("valid")) for p in phases]
        lines.append("| median | " + " | ".join("-" if v is None else f"{v:.2f}x" for v in meds) + " |")
        lines.append("")
    return lines


def _cells(result):
    return {(c["workload"], c["mode"], c["phase"]): c for c in result.get("cells", [])}


def bench_markdown(result: dict) -> str:
    o = result["options"]
    env = result["environment"]
    ad = env.get("adapter", {})
    cells = _cells(result)
    lines = [f"# meganeura vs PyTorch ({o['size']} size)", "",
             f"Adapter: {ad.get('name', '?')} ({ad.get('backend', '?')}, driver {ad.get('driver', '?')}); "
             f"torch {env['versions'].get('torch')} on {env.get('torch', {}).get('device')}; "
             f"{o['warmup']} warm-ups, {o['samples']} samples, median ms (submit to result ready). "
             "Cells read `ours / PyTorch (ratio ours/PyTorch)`: below 1x we are faster. A struck-out cell "
             "failed its accuracy gate and does not count.", ""]
    if result.get("note"):
        lines += [f"**Note:** {result['note']}.", ""]
    phases = [p for p in PHASE_ORDER if p in o["phases"]]
    lines += best_section(result, cells, phases)
    for mode in o["modes"]:
        for ref, label in (("torch_eager", "PyTorch eager"), ("torch_compile", "torch.compile")):
            if ref == "torch_compile" and all("skipped" in c.get(ref, {}) for c in cells.values()
                                              if c["phase"] != "compile"):
                lines += [f"torch.compile was not timed: "
                          f"{next((c[ref]['skipped'] for c in cells.values() if ref in c), 'skipped')}.", ""]
                continue
            if not phases:
                continue
            lines += [f"## {mode}: ours vs {label} (ms)", "",
                      "| workload | " + " | ".join(phases) + " |", "|---|" + "---|" * len(phases)]
            for name in o["workloads"]:
                lines.append(f"| {name} | " + " | ".join(_time_cell(cells.get((name, mode, p)), ref)
                                                         for p in phases) + " |")
            lines.append("")
    if "compile" in o["phases"]:
        lines += ["## Compile seconds", "",
                  "Ours: build the graph, `mg.compile` and every plan of it (pipelines included; weights upload "
                  "excluded). Cold: a fresh process with empty caches (our plan cache and the driver's shader "
                  "cache); warm: a fresh process with them filled; in-process: first in the benchmark process "
                  "/ the same graph again there. Pipelines: unique pipelines and the seconds a cold process spends "
                  "creating them. torch.compile: first call, cold and after a dynamo reset.", "",
                  "| workload | mode | ours inference cold / warm / in-process | ours train cold / warm / in-process | "
                  "pipelines inference / train (cold s) | torch.compile inference cold / warm | "
                  "torch.compile train cold / warm |", "|---|---|---|---|---|---|---|"]
        for name in o["workloads"]:
            for mode in o["modes"]:
                c = cells.get((name, mode, "compile"))
                if c is None:
                    continue

                def f(x):
                    return "-" if x is None else f"{x:.2f}"

                def ours(d):
                    if not d:
                        return "-"
                    if "error" in d:
                        return "error"
                    if "in_process_first_s" not in d:      # older runs timed in the process only
                        return f"- / - / {f(d.get('cold_s'))} first, {f(d.get('warm_s'))} again"
                    return (f"{f(d.get('cold_s'))} / {f(d.get('warm_s'))} / "
                            f"{f(d['in_process_first_s'])} first, {f(d.get('in_process_again_s'))} again")

                def pipes(d):
                    if not d or "pipelines" not in d:
                        return "-"
                    return f"{d['pipelines']} ({d['cold_pipeline_s']:.2f} s)"

                def cw(d):
                    if not d:
                        return "-"
                    if "error" in d and "cold_s" not in d:
                        return "error"
                    return f"{d.get('cold_s', float('nan')):.2f} / {d.get('warm_s', float('nan')):.2f}"
                tc = c.get("torch_compile", {})
                tci = "skipped" if "skipped" in tc else cw(tc.get("inference"))
                tct = "skipped" if "skipped" in tc else cw(tc.get("train"))
                oi, ot = c["ours"].get("inference"), c["ours"].get("train")
                lines.append(f"| {name} | {mode} | {ours(oi)} | {ours(ot)} | {pipes(oi)} / {pipes(ot)} "
                             f"| {tci} | {tct} |")
        lines.append("")
    if phases:
        lines += ["## Memory (MiB) and dispatches", "",
                  "Ours: planner bytes (persistent + intermediates) with / without aliasing; PyTorch: "
                  "`torch.cuda.max_memory_allocated` over the phase (CUDA only).", "",
                  "| workload | mode | phase | ours with aliasing | ours without | PyTorch eager peak | "
                  "dispatches (barriers) per call | GPU time (us) |", "|---|---|---|---|---|---|---|---|"]
        for name in o["workloads"]:
            for mode in o["modes"]:
                for p in phases:
                    c = cells.get((name, mode, p))
                    if c is None or "error" in c.get("ours", {}):
                        continue
                    ours, mem = c["ours"], c["ours"].get("memory", {})
                    gpu = ours.get("gpu_us")
                    bar = "" if ours.get("barriers") is None else f" ({ours['barriers']})"
                    lines.append(f"| {name} | {mode} | {p} | {_mib(mem.get('peak_with_aliasing'))} | "
                                 f"{_mib(mem.get('peak_without_aliasing'))} | "
                                 f"{_mib(c.get('torch_eager', {}).get('max_memory_allocated'))} | "
                                 f"{ours.get('dispatches', '-')}{bar} | {'-' if gpu is None else f'{gpu:.1f}'} |")
        lines.append("")
    lines += gates_section(result)
    lines += kernels_section(result)
    return "\n".join(lines) + "\n"


def _e(x):
    return "-" if x is None else f"{x:.2e}"


def gates_section(result):
    lines = ["## Accuracy gates", "",
             "Forward rel L2 over 256 evenly spaced outputs (< 1%), loss error (< 1%), total gradient norm "
             "error and rel L2 of per-parameter gradient norms (< 5%), against torch f32.", "",
             "| workload | mode | inference | minimal | loss err | grad total-norm err | grad norms rel L2 | pass |",
             "|---|---|---|---|---|---|---|---|"]
    for name, wr in result["workloads"].items():
        for mode, g in wr.get("gates", {}).items():
            inf, mini, tr = g.get("inference", {}), g.get("minimal", {}), g.get("train", {})
            bw = tr.get("backward", {})
            ok = all(v.get("pass") for v in g.values()) if g else False
            errs = "; ".join(f"{k}: {v['error']}" for k, v in g.items() if "error" in v)
            lines.append(f"| {name} | {mode} | {_e(inf.get('rel_l2_sampled'))} | {_e(mini.get('rel_l2_sampled'))} | "
                         f"{_e(tr.get('loss', {}).get('rel_err'))} | {_e(bw.get('total_norm_err'))} | "
                         f"{_e(bw.get('norms_rel_l2'))} | {'pass' if ok else 'FAIL ' + errs} |")
    return lines + [""]


def kernels_section(result):
    lines = []
    for name, wr in result["workloads"].items():
        for mode, per_phase in wr.get("kernels", {}).items():
            for phase, rows in per_phase.items():
                if not rows or phase not in ("inference", "train_step", "flb", "minimal"):
                    continue
                lines += [f"### Top kernels: {name}, {mode}, {phase}", "",
                          "| kernel | total us | count | mean us | % |", "|---|---|---|---|---|"]
                lines += [f"| `{r['kernel']}` | {r['total_us']:.1f} | {r['count']} | {r['mean_us']:.2f} | "
                          f"{r['percent']:.1f} |" for r in rows]
                lines.append("")
    return (["## Top-10 kernels by GPU time", ""] + lines) if lines else []


# ------------------------------------------------------------------ chart
def chart(result: dict, out) -> str | None:
    """Ratio chart (ours / PyTorch eager, and / torch.compile when timed) per workload and
    phase. PNG through matplotlib if importable; otherwise an SVG written by hand."""
    series = []
    for c in result.get("cells", []):
        if c["phase"] == "compile":
            continue
        for ref in ("best", "eager", "compile"):
            r = c.get(f"ratio_{ref}")
            if r:
                series.append((f"{c['workload']} {c['phase']} ({c['mode'][:3]}, {ref})", r, bool(c.get("valid"))))
    if not series:
        return None
    out = pathlib.Path(out)
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        path = out / "ratios.svg"
        path.write_text(_svg(series))
        print(f"matplotlib is not importable: wrote {path} instead of a PNG")
        return str(path)
    fig, ax = plt.subplots(figsize=(9, 0.28 * len(series) + 1.5))
    labels = [s[0] for s in series]
    vals = [s[1] for s in series]
    colors = [("#2a7" if v < 1 else "#c44") if ok else "#999" for _, v, ok in series]
    ax.barh(range(len(series)), vals, color=colors)
    ax.set_yticks(range(len(series)), labels, fontsize=7)
    ax.invert_yaxis()
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_xlabel("time ours / PyTorch (log scale; < 1 = faster; grey = gate failed)")
    ax.set_title(f"meganeura vs PyTorch, {result['options']['size']} size")
    fig.tight_layout()
    path = out / "ratios.png"
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return str(path)


def _svg(series) -> str:
    import math
    w, lab, row = 900, 330, 16
    h = row * len(series) + 50
    vals = [math.log10(max(v, 1e-3)) for _, v, _ in series]
    lo, hi = min(min(vals), -0.1), max(max(vals), 0.1)
    scale = (w - lab - 20) / (hi - lo)
    x0 = lab + (0 - lo) * scale
    parts = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" font-family="sans-serif" '
             f'font-size="10"><rect width="100%" height="100%" fill="white"/>',
             f'<text x="{lab}" y="14">time ours / PyTorch (log scale; left of the line = faster; grey = gate '
             'failed)</text>']
    for i, ((label, v, ok), lv) in enumerate(zip(series, vals)):
        y = 24 + i * row
        a, b = sorted((x0, lab + (lv - lo) * scale))
        color = ("#2a7" if v < 1 else "#c44") if ok else "#999"
        parts.append(f'<text x="{lab - 4}" y="{y + 11}" text-anchor="end">{_xml(label)}</text>')
        parts.append(f'<rect x="{a:.1f}" y="{y + 2}" width="{max(b - a, 1):.1f}" height="{row - 4}" fill="{color}"/>')
        parts.append(f'<text x="{max(a, b) + 3:.1f}" y="{y + 11}">{v:.2f}x</text>')
    parts.append(f'<line x1="{x0:.1f}" y1="20" x2="{x0:.1f}" y2="{h - 10}" stroke="black"/>')
    return "\n".join(parts + ["</svg>"]) + "\n"


def _xml(s):
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def write_bench(result: dict, out) -> dict:
    paths = write_outputs(out, "bench", result, bench_markdown(result))
    c = chart(result, out)
    if c:
        paths["chart"] = pathlib.Path(c)
    return paths


def merge(files) -> dict:
    """One result from several bench JSON files (e.g. one workload per run): cells and
    workloads are concatenated; options take the union of workloads, phases and modes."""
    results = [json.loads(pathlib.Path(f).read_text()) for f in files]
    base = dict(results[0])
    base["cells"] = [c for r in results for c in r.get("cells", [])]
    base["workloads"] = {k: v for r in results for k, v in r.get("workloads", {}).items()}
    opts = dict(base["options"])
    for key in ("workloads", "phases", "modes"):
        seen = []
        for r in results:
            seen += [v for v in r["options"][key] if v not in seen]
        opts[key] = seen
    base["options"] = opts
    base["merged_from"] = [str(f) for f in files]
    return base
