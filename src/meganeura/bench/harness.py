"""The timing harness: our GPU backend side by side with PyTorch on the same weights and
inputs, in one process: eager, torch.compile and, on CUDA, the CUDA-graph variants of
``baselines`` (eager captured whole, reduce-overhead, and bf16 autocast captured in
accelerated mode). ``ratio_best`` is ours over the fastest valid one, named per cell in
``best_baseline``.

Per workload and precision mode, phases:
  inference   full-shape forward            ours: Session.run (outputs kept on the device)   torch: no_grad forward
  minimal     one token / batch 1           ours: Session.run (outputs kept on the device)   torch: no_grad forward
  flb         forward + loss + backward     ours: compute_grads      torch: zero grads, loss.backward()
  train_step  flb + AdamW update            ours: Session.step       torch: flb + optimizer.step()
  compile     seconds to build the graph, compile it and build every plan (pipelines
              included): cold (a fresh process with empty caches: ours and the driver's),
              warm (a fresh process, caches filled) and in-process (first, and the same
              graph again); torch.compile's first-call seconds, cold and after a dynamo reset.

Each timed sample runs from submit to result ready: inference leaves the outputs on the
device on both sides (ours: ``run(feeds, fetch=False)`` waits for the GPU; torch is
synchronised); training calls return the loss to the host on both sides. Warm-ups first, then the samples; median,
IQR, min, max and the raw samples are kept, with our GPU timestamps (``Session.profile``)
beside. Every cell carries its gate result and is invalid when the gate fails.
"""
from __future__ import annotations

import copy
import gc
import platform
import time
import traceback

import numpy as np

from . import baselines as B
from . import gates as G
from .workloads import WORKLOADS, make, parse_list

PHASES = ("inference", "minimal", "flb", "train_step", "compile")
MODES = ("strict", "accelerated")
# phase -> (our graph, our executor phase)
OURS = {"inference": ("inference", "run"), "minimal": ("minimal", "run"),
        "flb": ("train", "grads"), "train_step": ("train", "step")}
TRAIN_LR = 1e-4


def stats(samples_s) -> dict:
    """Summary in milliseconds."""
    ms = np.asarray(samples_s, np.float64) * 1e3
    q1, med, q3 = np.percentile(ms, [25, 50, 75])
    return {"median_ms": float(med), "iqr_ms": float(q3 - q1), "q1_ms": float(q1), "q3_ms": float(q3),
            "min_ms": float(ms.min()), "max_ms": float(ms.max()), "n": int(ms.size),
            "samples_ms": [round(float(v), 6) for v in ms]}


def measure(fn, warmup: int, samples: int, sync=None) -> dict:
    """Time ``fn`` (``fn.prepare``, if set, runs untimed before every call)."""
    prepare = getattr(fn, "prepare", None)
    for _ in range(warmup):
        if prepare:
            prepare()
        fn()
        if sync:
            sync()
    ts = []
    for _ in range(samples):
        if prepare:
            prepare()
            if sync:
                sync()
        t0 = time.perf_counter()
        fn()
        if sync:
            sync()
        ts.append(time.perf_counter() - t0)
    return stats(ts)


def replay_seconds(sess, samples: int, warmup: int, reps: int = 1, phase: str = "run", gpu: bool = True,
                   back_to_back: bool = False, busy_s: float = 0.0):
    """(seconds per call for each sample, GPU seconds of one call or None): ``sess``'s compiled
    ``phase`` replayed on the device as it was prepared, no uploads or readbacks; ``reps``
    replays per sample, then a sync, so launch cost is amortised. ``back_to_back``: the
    ``reps`` replays go in one submit where the runtime can (the direct Vulkan backend), as
    a CUDA stream queues launches, instead of a submit and a wait each. The GPU time comes
    from timestamps around every dispatch (None where the device has none, or ``gpu=False``).
    ``busy_s``: seconds of replays after the warm-up, for a GPU whose clocks fell while the
    host was busy (an H200's SM clock went 1980 -> 345 MHz between the sessions of a sweep)."""
    ex = sess.executor
    plan, dev = ex.plan(phase), ex.dev
    for _ in range(warmup):
        ex.recorder.run(plan.step)
    t_end = time.perf_counter() + busy_s
    while time.perf_counter() < t_end:
        ex.recorder.run(plan.step)
    dev.sync()
    gpu_s = None
    if gpu and dev.has_timestamps:
        ts = ex.recorder.run(plan.step, timestamps=True)
        gpu_s = float((ts[:, 1] - ts[:, 0]).sum()) / 1e9
    # queued back to back where the runtime can (one submit of ``reps`` steps, as torch
    # queues its launches), else one submit and wait each
    repeated = getattr(ex.recorder, "run_repeated", None) if back_to_back and reps > 1 else None
    if repeated is not None:
        repeated(plan.step, reps)       # records its command buffer before the timing
    times = []
    for _ in range(samples):
        t0 = time.perf_counter()
        if repeated is not None:
            repeated(plan.step, reps)
        else:
            for _ in range(reps):
                ex.recorder.run(plan.step)
        dev.sync()
        times.append((time.perf_counter() - t0) / reps)
    return times, gpu_s


class _Torch:
    """Torch-side helpers: device sync, memory peaks and torch.compile availability."""

    def __init__(self, device, use_compile=True):
        import torch
        self.torch, self.device = torch, device
        self.cuda = device.startswith("cuda")
        self.compile_reason = None
        if not use_compile:
            self.compile_reason = "disabled (--no-torch-compile)"
        elif not self.cuda:
            self.compile_reason = "no CUDA device: torch.compile is only timed on GPUs"

    def sync(self):
        if self.cuda:
            self.torch.cuda.synchronize()

    def reset_peak(self):
        if self.cuda:
            self.sync()
            self.torch.cuda.reset_peak_memory_stats()

    def peak(self):
        return int(self.torch.cuda.max_memory_allocated()) if self.cuda else None


def _plan_info(sess, key) -> dict:
    plan = sess.executor.plans.get(key)
    if plan is None:
        return {}
    m = plan.memory
    sync = getattr(plan.step, "sync_stats", None)     # the Vulkan backend: barriers between levels
    return {"dispatches": plan.n_dispatches, "plan_compile_s": plan.compile_seconds,
            **({"barriers": sync()["barriers"]} if sync is not None and sync() else {}),
            "memory": {"intermediates_with_aliasing": m.bytes_with, "intermediates_without_aliasing": m.bytes_without,
                       "persistent": m.persistent_bytes, "peak_with_aliasing": m.persistent_bytes + m.bytes_with,
                       "peak_without_aliasing": m.persistent_bytes + m.bytes_without}}


def _ours_call(sess, phase, feeds):
    if phase in ("inference", "minimal"):
        return lambda: sess.run(feeds, fetch=False)      # outputs stay on the device, as torch's do
    if phase == "flb":
        return lambda: sess.compute_grads(feeds)
    return lambda: sess.step(feeds)


def _short_error(e: BaseException) -> str:
    return f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}"


class Runner:
    def __init__(self, opts, progress=None, log=print):
        self.o, self.log = opts, log
        self.progress = progress
        self.t = _Torch(opts.device, use_compile=not opts.no_torch_compile)

    # ------------------------------------------------------------------ sessions
    def _sessions(self, w, mode, phases, compile_cell):
        """Our sessions for the phases, compiled now (first in the process = cold) with
        their plans built; compile times go to ``compile_cell``."""
        import meganeura as mg
        keys = {}      # graph -> executor phases to plan
        for p in phases:
            if p in OURS:
                keys.setdefault(OURS[p][0], []).append(OURS[p][1])
        if "compile" in phases:
            keys.setdefault("inference", ["run"])
            tk = keys.setdefault("train", [])
            tk += [k for k in ("grads", "step") if k not in tk]
        graphs = list(keys)
        sessions = {}
        for g in graphs:
            t = {}
            try:
                sess, feeds = w.session(g, "gpu", mode, mg.optim.AdamW(lr=TRAIN_LR) if g == "train" else None, t)
                t0 = time.perf_counter()
                for k in keys[g]:
                    sess.executor.plan(k)          # the phases mg.compile did not build eagerly
                extra_s = time.perf_counter() - t0
                plans = {k: sess.executor.plans[k].compile_seconds for k in keys[g]}
                sessions[g] = (sess, feeds)
                compile_cell["ours"][g] = {"in_process_first_s": t["build_s"] + t["compile_s"] + extra_s,
                                           "build_s": t["build_s"], "session_s": t["compile_s"],
                                           "plans_s": plans, "load_weights_s": t["load_s"]}
            except Exception as e:
                compile_cell["ours"][g] = {"error": _short_error(e)}
                self.log(f"  {w.name} [{mode}] {g}: compile failed: {_short_error(e)}")
                if self.o.debug:
                    traceback.print_exc()
        if "compile" in phases:
            from .compile_time import cold_and_warm
            for g in ("inference", "train"):
                if g not in sessions:
                    continue
                cell = compile_cell["ours"][g]
                t = {}
                try:
                    # the same graph again in this process: plan cache and pipelines already here
                    t0 = time.perf_counter()
                    s2, _ = w.session(g, "gpu", mode, mg.optim.AdamW(lr=TRAIN_LR) if g == "train" else None, t)
                    t1 = time.perf_counter()
                    for k in keys[g]:
                        s2.executor.plan(k)
                    cell["in_process_again_s"] = t["build_s"] + t["compile_s"] + time.perf_counter() - t1
                    s2.close()
                    del s2
                except Exception as e:
                    cell["again_error"] = _short_error(e)
                if getattr(self.o, "no_fresh_process", False):
                    continue
                # fresh processes: empty caches (cold), then filled (warm)
                cw = cold_and_warm(w.name, self.o.size, g, mode)
                if "error" in cw:
                    cell["process_error"] = cw["error"]
                else:
                    cell.update(cold_s=cw["cold_s"], warm_s=cw["warm_s"], pipelines=cw["cold"]["unique_pipelines"],
                                cold_pipeline_s=cw["cold"]["pipeline_wall_s"], warm_pipeline_s=cw["warm"]["pipeline_wall_s"],
                                processes=cw)
            gc.collect()
        return sessions

    # ------------------------------------------------------------------ torch side
    def _torch_compile_times(self, w, mode, train_model, cell):
        """torch.compile first-call seconds: cold, then after a dynamo reset (warm caches)."""
        tc = cell["torch_compile"] = {}
        if self.t.compile_reason:
            tc["skipped"] = self.t.compile_reason
            return
        torch = self.t.torch
        for g, model, phase in (("inference", w.reference, "inference"), ("train", train_model, "flb")):
            res = {}
            for kind in ("cold_s", "warm_s"):
                try:
                    torch._dynamo.reset()
                    fn = w.torch_fn(phase, torch.compile(model))
                    t0 = time.perf_counter()
                    fn()
                    self.t.sync()
                    res[kind] = time.perf_counter() - t0
                except Exception as e:
                    res["error"] = _short_error(e)
                    break
            tc[g] = res
        torch._dynamo.reset()

    def _wanted(self, variant) -> bool:
        only = getattr(self.o, "torch_variants", None)
        return not only or variant in only

    def _check(self, w, phase, model, fn, timed):
        """Mark ``timed`` (a variant's stats) valid or not by ``baselines.check``."""
        try:
            timed["check"] = B.check(w, phase, model, fn)
            timed["valid"] = bool(timed["check"]["pass"])
        except Exception as e:
            timed["check"] = {"error": _short_error(e)}
            timed["valid"] = False

    def _time_variant(self, w, phase, model, variant) -> dict:
        """One CUDA-graph variant of ``baselines``: built, first call timed apart (capture or
        compile), then timed as the others and checked against eager."""
        if not self.t.cuda:
            return {"skipped": "no CUDA device: CUDA graphs are only timed on GPUs"}
        if not self._wanted(variant):
            return {"skipped": "not asked for (--torch-variants)"}
        if variant == B.COMPILE_GRAPHS and self.t.compile_reason:
            return {"skipped": self.t.compile_reason}
        torch, fn = self.t.torch, None
        if phase in ("flb", "train_step"):
            # a copy with fresh leaves: the originals' gradient accumulators were made on the
            # default stream by the variants before (and cudagraph trees keep them alive),
            # which breaks a capture on another stream
            model = copy.deepcopy(model)
        try:
            t0 = time.perf_counter()
            if variant == B.COMPILE_GRAPHS:
                fn = B.reduce_overhead(w, phase, model, lr=TRAIN_LR)
                if getattr(fn, "prepare", None):
                    fn.prepare()
                fn()
            else:
                fn = B.captured(w, phase, model, bf16=variant == B.BF16_GRAPH, lr=TRAIN_LR)
            self.t.sync()
            first = time.perf_counter() - t0
            st = self._time_torch(fn)
            st["first_call_s"] = first
            self._check(w, phase, model, fn, st)
            return st
        except Exception as e:
            if self.o.debug:
                traceback.print_exc()
            return {"error": _short_error(e), "traceback": traceback.format_exc()[-2000:]}
        finally:
            del fn, model
            gc.collect()
            if self.t.cuda:
                torch.cuda.empty_cache()

    def _time_torch(self, fn):
        self.t.reset_peak()
        st = measure(fn, self.o.warmup, self.o.samples, self.t.sync)
        st["max_memory_allocated"] = self.t.peak()
        return st

    # ------------------------------------------------------------------ one workload
    def run_workload(self, name, result):
        o = self.o
        w = make(name, o.size, o.seed, o.device)
        wres = result["workloads"][name] = {**w.describe(), "gates": {}, "kernels": {}}
        torch = self.t.torch
        for mode in o.modes:
            with G.torch_precision(mode):
                self._run_mode(w, mode, wres, result)
            gc.collect()
            if self.t.cuda:
                torch.cuda.empty_cache()

    def _tick(self, label):
        if self.progress is not None:
            self.progress.set_description(label)
            self.progress.update()

    def _run_mode(self, w, mode, wres, result):
        o, torch = self.o, self.t.torch
        phases = o.phases
        compile_cell = {"workload": w.name, "mode": mode, "phase": "compile", "ours": {}}
        sessions = self._sessions(w, mode, phases, compile_cell)
        gates = wres["gates"][mode] = {}
        for g, sf in sessions.items():
            if g in ("inference", "minimal", "train"):
                try:
                    gates[g] = G.gate(w, g, sf[0], sf[1], mode)
                except Exception as e:
                    gates[g] = {"error": _short_error(e), "pass": False}
                self.log(f"  {w.name} [{mode}] gate {g}: {_gate_summary(gates[g])}")
        needs_train = any(p in phases for p in ("flb", "train_step", "compile"))
        train_model = w.train_copy() if needs_train else None
        opt = (torch.optim.AdamW(list(w.trainable(train_model).values()), lr=TRAIN_LR)
               if "train_step" in phases else None)
        compiled = {}
        if "compile" in phases:
            self._torch_compile_times(w, mode, train_model, compile_cell)
        kernels = wres["kernels"].setdefault(mode, {})
        for phase in phases:
            if phase == "compile":
                continue
            graph, key = OURS[phase]
            gate = gates.get(graph, {"pass": False, "error": "not compiled"})
            cell = {"workload": w.name, "mode": mode, "phase": phase, "gate": gate, "valid": bool(gate.get("pass"))}
            result["cells"].append(cell)       # now: a process that dies later keeps what this cell has
            if graph in sessions:
                sess, feeds = sessions[graph]
                try:
                    cell["ours"] = measure(_ours_call(sess, phase, feeds), o.warmup, o.samples)
                    cell["ours"].update(_plan_info(sess, key))
                except Exception as e:
                    cell["ours"] = {"error": _short_error(e)}
                    cell["valid"] = False
                if "error" not in cell["ours"]:
                    try:
                        rows = sess.profile(feeds, phase=key)
                        cell["ours"]["gpu_us"] = float(sum(r[1] for r in rows))
                        kernels[phase] = [{"kernel": r[0], "total_us": r[1], "count": r[2], "mean_us": r[3],
                                           "percent": r[4]} for r in rows[:10]]
                    except Exception as e:
                        cell["ours"]["gpu_us_error"] = _short_error(e)
            else:
                cell["ours"] = {"error": compile_cell["ours"].get(graph, {}).get("error", "not compiled")}
                cell["valid"] = False
            # torch eager
            model = w.reference if phase in ("inference", "minimal") else train_model
            try:
                cell["torch_eager"] = self._time_torch(w.torch_fn(phase, model, opt))
            except Exception as e:
                cell["torch_eager"] = {"error": _short_error(e)}
            # torch.compile
            fn = None
            if self.t.compile_reason or not self._wanted("torch_compile"):
                cell["torch_compile"] = {"skipped": self.t.compile_reason or "not asked for (--torch-variants)"}
            else:
                try:
                    if id(model) not in compiled:
                        compiled[id(model)] = torch.compile(model)
                    fn = w.torch_fn(phase, compiled[id(model)], opt)
                    if getattr(fn, "prepare", None):
                        fn.prepare()
                    t0 = time.perf_counter()
                    fn()
                    self.t.sync()
                    first = time.perf_counter() - t0
                    cell["torch_compile"] = self._time_torch(fn)
                    cell["torch_compile"]["first_call_s"] = first
                except Exception as e:
                    cell["torch_compile"] = {"error": _short_error(e)}
            if "median_ms" in cell["torch_compile"]:
                self._check(w, phase, model, fn, cell["torch_compile"])
            for v in B.graph_variants(mode):
                cell[v] = self._time_variant(w, phase, model, v)
            for ref in ("torch_eager", "torch_compile"):
                a, b = cell["ours"].get("median_ms"), cell[ref].get("median_ms")
                cell[f"ratio_{ref.split('_')[1]}"] = a / b if a and b else None
            best, best_ms = B.best(cell)
            a = cell["ours"].get("median_ms")
            cell["best_baseline"] = best
            cell["ratio_best"] = a / best_ms if a and best_ms else None
            self._tick(f"{w.name} {mode} {phase}")
        if "compile" in phases:
            compile_cell["gate"] = {g: v.get("pass", False) for g, v in gates.items()}
            compile_cell["valid"] = all(compile_cell["gate"].values()) and bool(compile_cell["gate"])
            result["cells"].append(compile_cell)
            self._tick(f"{w.name} {mode} compile")
        if self.t.compile_reason is None:
            torch._dynamo.reset()
        sessions.clear()


def _gate_summary(g):
    if "error" in g:
        return f"error {g['error']}"
    if "rel_l2_sampled" in g:
        return f"rel L2 {g['rel_l2_sampled']:.2e} ({'pass' if g['pass'] else 'FAIL'})"
    return (f"loss err {g['loss']['rel_err']:.2e}, grad total-norm err {g['backward']['total_norm_err']:.2e}, "
            f"grad norms rel L2 {g['backward']['norms_rel_l2']:.2e} ({'pass' if g['pass'] else 'FAIL'})")


def run(opts, log=print) -> dict:
    """Run the benchmark described by ``opts`` (see ``__main__``); returns the result dict."""
    from . import report
    opts.workloads = parse_list(opts.workloads, WORKLOADS, "workloads") if isinstance(opts.workloads, str) \
        else list(opts.workloads)
    opts.phases = parse_list(opts.phases, PHASES, "phases") if isinstance(opts.phases, str) else list(opts.phases)
    opts.modes = parse_list(opts.modes, MODES, "modes") if isinstance(opts.modes, str) else list(opts.modes)
    tv = getattr(opts, "torch_variants", None)
    if isinstance(tv, str):
        opts.torch_variants = parse_list(tv, B.VARIANTS[1:], "torch variants")
    if opts.device is None:
        from .workloads import default_device
        opts.device = default_device()
    from ..runtime.backends import gpu_device
    gpu_device()      # device start-up is not part of any compile time
    result = {"kind": "bench", "schema": 1,
              "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "options": {k: getattr(opts, k) for k in ("size", "workloads", "phases", "modes", "warmup", "samples",
                                                        "seed", "device", "quick")},
              "torch_variants": getattr(opts, "torch_variants", None) or list(B.VARIANTS),
              "environment": report.environment("gpu"), "workloads": {}, "cells": []}
    if not opts.device.startswith("cuda"):
        result["note"] = ("torch ran on the CPU: ratios are not GPU performance"
                          + (" and our adapter is a software driver" if result["environment"]["adapter"].get("is_software")
                             else ""))
    total = len(opts.workloads) * len(opts.modes) * len(opts.phases)
    bar = None
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, unit="cell", disable=opts.no_progress, leave=True)
    except ImportError:
        pass
    runner = Runner(opts, bar, log=(bar.write if bar is not None and not opts.no_progress else log))
    for name in opts.workloads:
        try:
            runner.run_workload(name, result)
        except KeyboardInterrupt:
            # Ctrl-C (or a time limit's SIGINT): the cells timed so far are still written
            result["interrupted"] = f"during {name}"
            runner.log(f"{name}: interrupted; writing the cells timed so far")
            break
        except Exception as e:
            result["workloads"].setdefault(name, {})["error"] = _short_error(e)
            runner.log(f"{name}: failed: {_short_error(e)}")
            if opts.debug:
                traceback.print_exc()
    if bar is not None:
        bar.close()
    result["finished"] = time.strftime("%Y-%m-%dT%H:%M:%S%z")
    result["host"] = platform.node()
    return result
