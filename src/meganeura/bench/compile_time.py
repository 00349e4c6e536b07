"""Compile time of each workload's inference and training graphs.

    python bench/compile_time.py [--size real] [--workloads ...] [--out bench/results/compile_time.json]
    python bench/compile_time.py --gpu [--size real] [--out bench/results/compile_time_gpu.json]
    python bench/compile_time.py --scaling     (SmolLM2's training step at 8..64 layers: CPU s per layer)
    python bench/compile_time.py --spirv       (each graph's kernels as a driver compiles them: SPIR-V KiB)

Device-free (the default): per workload and graph, seconds to build the graph, to make the
session's program (autodiff, optimizer), and per executor phase (``run``; ``grads`` and
``step`` for training) to compile the plan, stage by stage (lower, schedule, fusion,
in-place, render, memory), then the same plan again from the on-disk plan cache. Options
are the H200's (bindings and workgroup memory), so the plans are the ones it runs.

``--gpu``: what a user waits for on the current device, ``mg.compile`` with its plans
built (pipelines included): ``cold`` in a fresh process with empty caches (ours, and the
driver's shader caches pointed at the same empty folder), ``warm`` in a fresh process
with those caches filled (the median of three such processes), and ``again`` the same
graph compiled a second time in the warm process. Each also counts the pipelines created and the seconds spent creating them.
``eager``: the part of the cold time until ``mg.compile`` returned, which builds the main
call's plan only (``step`` for training; ``grads`` is compiled on first use, as a trainer
that never calls ``compute_grads`` never waits for it).
The package's modules are compiled to bytecode first, as an install has them, and the host's
speed at a fixed compile job is recorded beside the rows (``host_reference``).
``--threads N`` sets MEGANEURA_COMPILE_THREADS for the child processes.

``--digests``: a digest of every plan (each workload's inference and training phases, strict
and accelerated, H200 options) and its compile CPU seconds; ``--against FILE`` names the plans
that differ from an earlier run's of the same size (``bench/results/plan_digests.json``: the
real size's, ``plan_digests_tiny.json``: the tiny size's). A change meant to make the compiler faster, not different,
shows no difference (the names of intermediates and constants are left out: they follow the
order in which nodes were made).

``--spirv``: what a cold compile hands the GPU driver, device-free: each graph's distinct
kernel texts (all its phases, as one session compiles them), finished by the Vulkan compile
stage as for the H200 (``stage_kernels``: GLSL printed from the kernel AST, compiled by
glslang), counted in kernels and KiB of SPIR-V by archetype. The NVIDIA
driver's pipeline creation on the H200 grew with that size (``DRIVER_MS_PER_KIB``), so the
column ``driver`` estimates its seconds summed over threads: a change meant to shorten cold
compiles can be judged before it reaches the device. The estimate holds for code that does
work, written out: bytes the driver's own optimizer drops do not count alike (SPIRV-Tools'
size passes halved the SPIR-V and cut the driver's time by a fifth), and a loop marked
``[[unroll]]`` is in the SPIR-V once, however many times the driver writes it out.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

from .workloads import WORKLOADS, make, parse_list

BINDINGS = 1 << 16      # as bench/dispatches.py: a large GPU's storage-buffer limit
# the H200's options: its Vulkan runtime binds arrays of buffers (``CompileOptions.binding_arrays``)
H200_WORKGROUP_STORAGE = 49152
GRAPHS = ("inference", "train")
# H200 (driver 580), pipeline creation on 16 threads against glslang's SPIR-V, ms per KiB:
# U-Net training 3.31 (422 kernels, correlation 0.95), ResNet-50 3.67 (231, 0.95)
# (bench/results/h200/vulkan/compile-ab-unroll-and-spirv-opt.json)
DRIVER_MS_PER_KIB = 3.3
PHASES = {"inference": ("run",), "train": ("grads", "step")}


def _session(w, graph, backend, precision="strict", **kw):
    import meganeura as mg
    b = w.build(graph)
    t0 = time.perf_counter()
    if graph == "train":
        s = mg.compile(b.graph, loss=b.loss, optimizer=mg.optim.AdamW(lr=1e-4), backend=backend,
                       precision=precision, **kw)
    else:
        s = mg.compile(b.graph, outputs=b.outputs, state_updates=b.state_updates or None, backend=backend,
                       precision=precision, **kw)
    return b, s, time.perf_counter() - t0


def _h200_options(**kw):
    """The H200's compile options (bindings, workgroup memory, arrays of buffers: its
    device-free ``Target.h200``), with ``kw``; no ``MEGANEURA_NO_FUSE``."""
    from ..compilation.target import Target
    from ..compiler import CompileOptions
    lim = Target.h200().limits
    assert lim["max-storage-buffers-per-shader-stage"] == BINDINGS and \
        lim["max-compute-workgroup-storage-size"] == H200_WORKGROUP_STORAGE
    return CompileOptions(max_bindings=BINDINGS, workgroup_storage=H200_WORKGROUP_STORAGE,
                          binding_arrays=lim["binding-arrays"], **kw)


def _plan_args(program, phase) -> tuple:
    """(targets, n_forward, updates) that ``compile_plan`` takes for a session program's phase."""
    fetches, grad_names, upd, targets = program.targets(phase)
    base = len(fetches) + len(grad_names)
    return targets, len(fetches), {base + j: n for j, (n, _) in enumerate(upd)}


# --------------------------------------------------------------------------- device-free
def device_free(name, size, graph, cache_dir) -> dict:
    """Seconds of each device-free compile step for one workload graph (see the module doc)."""
    from ..compiler import compile_plan
    w = make(name, size=size, device="cpu")
    c0, t0 = time.process_time(), time.perf_counter()
    w.build(graph)
    build_s = time.perf_counter() - t0
    _, s, session_s = _session(w, graph, "numpy")
    before_plans_cpu = time.process_time() - c0
    opts = _h200_options()
    row = {"workload": name, "graph": graph, "build_s": build_s, "session_s": session_s, "phases": {}}
    for phase in PHASES[graph]:
        targets, n_forward, updates = _plan_args(s.program, phase)
        c0, t0 = time.process_time(), time.perf_counter()
        kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
        p = {"plan_s": time.perf_counter() - t0, "plan_cpu_s": time.process_time() - c0, "dispatches": kp.n_dispatches,
             "unique_wgsl": len({d.wgsl for d in kp.dispatches}), "stages": kp.stats.get("seconds", {})}
        try:
            from .. import plan_cache  # noqa: F401  (absent in older versions)
        except ImportError:
            plan_cache = None
        if plan_cache is not None:
            os.environ["MEGANEURA_CACHE_DIR"] = cache_dir        # a folder of this run's own
            t0 = time.perf_counter()
            key = plan_cache.plan_key(targets, n_forward, opts, updates)
            p["key_s"] = time.perf_counter() - t0
            t0 = time.perf_counter()
            compile_plan(targets, n_forward=n_forward, options=opts, updates=updates, cache=True)
            p["miss_s"] = time.perf_counter() - t0          # compile and store
            t0 = time.perf_counter()
            hit = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates, cache=True)
            p["cached_s"] = time.perf_counter() - t0
            assert hit.stats.get("cache") == "hit" and hit.n_dispatches == kp.n_dispatches, key
            p["entry_bytes"] = (plan_cache.folder() / f"{key}.plan").stat().st_size
        row["phases"][phase] = p
    row["plans_s"] = sum(p["plan_s"] for p in row["phases"].values())
    row["total_s"] = build_s + session_s + row["plans_s"]
    # CPU seconds of the process: on a shared machine a steadier measure than wall time
    row["total_cpu_s"] = before_plans_cpu + sum(p["plan_cpu_s"] for p in row["phases"].values())
    if all("cached_s" in p for p in row["phases"].values()):
        row["total_cached_s"] = build_s + session_s + sum(p["cached_s"] for p in row["phases"].values())
    return row


def plan_digest(kp) -> str:
    """A digest of everything a plan runs: each dispatch's kernel name, program text, workgroup
    counts and buffers (by first appearance; kind, size, and the names of inputs, parameters and
    state; a constant's contents), the memory plan's slots, and where each target lies."""
    import hashlib
    h, ids = hashlib.sha256(), {}

    def buf(b):
        if id(b) not in ids:
            ids[id(b)] = len(ids)
        named = b.name if b.kind in ("input", "parameter", "state") else ""
        value = hashlib.sha256(b.value.tobytes()).hexdigest()[:16] if b.value is not None else ""
        return f"{ids[id(b)]}:{b.kind}:{named}:{b.nbytes}:{value}"
    for d in kp.dispatches:
        h.update(repr((d.kernel.name, d.wgsl, tuple(d.groups), [buf(b) for b in d.bufs])).encode())
    m = kp.memory
    h.update(repr(sorted((buf(b), slot) for b, slot in m.slot_of.items())).encode())
    h.update(repr((m.slot_sizes, m.bytes_without, m.bytes_with, m.persistent_bytes, m.live_peak)).encode())
    h.update(repr([(buf(b), off, n, str(dt), shape) for b, off, n, dt, shape in kp.target_locs]).encode())
    h.update(repr(kp.copy_updates).encode())
    return h.hexdigest()[:16]


def digests(names, size, precisions=("strict", "accelerated")) -> dict:
    """{"workload/graph/precision/phase": {"digest", "dispatches", "cpu_s"}} of every plan."""
    from ..compiler import compile_plan, f16_weights
    out = {}
    for name in names:
        w = make(name, size=size, device="cpu")
        for graph in GRAPHS:
            for precision in precisions:
                _, s, _ = _session(w, graph, "numpy")
                for phase in PHASES[graph]:
                    targets, n_forward, updates = _plan_args(s.program, phase)
                    copies = f16_weights(s.program.fetches) if precision == "accelerated" and s.program.fetches \
                        else frozenset()
                    opts = _h200_options(precision=precision, f16_weights=copies)
                    c0 = time.process_time()
                    kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
                    out[f"{name}/{graph}/{precision}/{phase}"] = {
                        "digest": plan_digest(kp), "dispatches": kp.n_dispatches, "cpu_s": time.process_time() - c0}
    return out


def stage_kernels(kernels_by_text, trees, threads=1) -> tuple:
    """The Vulkan compile stage's kernels of WGSL texts ``{text: kernel}`` for the H200
    (``Target.h200``: unrolled loops, IEEE float controls, Vulkan 1.3), as a plan's compile
    finishes them: GLSL printed from each text's kernel AST (``trees``, {text: tree}, as the
    plans hold them), compiled by glslang on ``threads`` threads, no disk caches. Returns
    ({text: FinalKernel}, the stage's stats)."""
    from ..compilation.target import Target
    from ..compilation.vulkan import VulkanKernels
    stage = VulkanKernels(Target.h200(), disk=False, threads=threads)
    try:
        for text, k in kernels_by_text.items():
            stage.start(k, text, trees.get(text))
        return stage.finish([(text, k.name) for text, k in kernels_by_text.items()]), stage.stats
    finally:
        stage.close()


def kernel_code(name, size, graph) -> dict:
    """The SPIR-V of one workload graph's distinct kernels (see ``--spirv`` in the module doc)."""
    from ..compiler import compile_plan
    w = make(name, size=size, device="cpu")
    _, s, _ = _session(w, graph, "numpy")
    opts = _h200_options()
    texts, trees = {}, {}
    for phase in PHASES[graph]:
        targets, n_forward, updates = _plan_args(s.program, phase)
        kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
        trees.update(kp.trees)
        for d in kp.dispatches:
            texts.setdefault(d.wgsl, d.kernel)
    done, stats = stage_kernels(texts, trees)
    families, largest = {}, (0, "")
    for text, k in texts.items():
        kib = len(done[text].spirv) / 1024
        fam = k.archetype + (" merged" if "|" in k.name else "")
        n, total = families.get(fam, (0, 0.0))
        families[fam] = (n + 1, total + kib)
        largest = max(largest, (kib, k.name))
    kib = sum(total for _, total in families.values())
    return {"workload": name, "graph": graph, "kernels": len(texts), "spirv_kib": kib,
            "driver_s": kib * DRIVER_MS_PER_KIB / 1e3,
            "translate_and_glslang_s": stats["glsl_seconds"] + stats["compile_seconds"],
            "printed_from_ast": stats["kernels_printed"],
            "largest": {"name": largest[1][:80], "spirv_kib": largest[0]},
            "families": {f: {"kernels": n, "spirv_kib": total}
                         for f, (n, total) in sorted(families.items(), key=lambda x: -x[1][1])}}


def print_kernel_code(rows):
    print(f"{'workload':9} {'graph':9} {'kernels':>7} {'SPIR-V KiB':>10} {'driver s':>8} {'largest KiB':>11}  "
          "top families (kernels, KiB)")
    for r in rows:
        top = ", ".join(f"{f} {v['kernels']} {v['spirv_kib']:.0f}" for f, v in list(r["families"].items())[:3])
        print(f"{r['workload']:9} {r['graph']:9} {r['kernels']:7d} {r['spirv_kib']:10.0f} {r['driver_s']:8.1f} "
              f"{r['largest']['spirv_kib']:11.0f}  {top}")


def print_device_free(rows, baseline=None):
    base = {(r["workload"], r["graph"]): r for r in (baseline or [])}
    print(f"{'workload':9} {'graph':9} {'build':>6} {'session':>7} {'plans':>6} {'total':>6} {'cpu':>6} "
          f"{'cached':>6} {'before':>7} {'b. cpu':>6}  stages (s, all phases)")
    for r in rows:
        stages = {}
        for p in r["phases"].values():
            for k, v in p["stages"].items():
                stages[k] = stages.get(k, 0.0) + v
        b = base.get((r["workload"], r["graph"]))
        nan = float("nan")
        print(f"{r['workload']:9} {r['graph']:9} {r['build_s']:6.2f} {r['session_s']:7.2f} {r['plans_s']:6.2f} "
              f"{r['total_s']:6.2f} {r.get('total_cpu_s', nan):6.2f} {r.get('total_cached_s', nan):6.2f} "
              f"{b['total_s'] if b else nan:7.2f} {b.get('total_cpu_s', nan) if b else nan:6.2f}  "
              + " ".join(f"{k} {v:.2f}" for k, v in stages.items()))


def scaling(layers=(8, 16, 32, 64)) -> list:
    """CPU seconds of compile_plan for SmolLM2's training step at several depths (best of
    two): a compiler linear in graph size spends the same per layer."""
    import dataclasses

    import meganeura as mg

    from ..compiler import compile_plan
    from ..models import llama
    cfg0 = make("smollm2", size="real", device="cpu").cfg
    opts = _h200_options()
    rows = []
    for n in layers:
        g, _, _, loss = llama.build_training(dataclasses.replace(cfg0, num_hidden_layers=n), 1, 128)
        s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-4), backend="numpy")
        targets, n_forward, updates = _plan_args(s.program, "step")
        best, kp = float("inf"), None
        for _ in range(2):
            c0 = time.process_time()
            kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
            best = min(best, time.process_time() - c0)
        rows.append({"layers": n, "nodes": len(g.nodes), "dispatches": kp.n_dispatches, "cpu_s": best,
                     "ms_per_layer": 1e3 * best / n, "stages": kp.stats.get("seconds", {})})
        print(f"{n:3d} layers {len(g.nodes):6d} nodes {kp.n_dispatches:5d} dispatches {best:6.3f} s "
              f"{1e3 * best / n:5.1f} ms/layer  " + " ".join(f"{k} {v:.3f}" for k, v in rows[-1]["stages"].items()))
    return rows


# ----------------------------------------------------------------------------------- GPU
def on_device(name, size, graph, mode="strict") -> dict:
    """``mg.compile`` of one workload graph with every plan built (pipelines included), twice
    in this process; device start-up is excluded."""
    from ..runtime.backends import gpu_device
    t0 = time.perf_counter()
    dev = gpu_device()
    startup_s = time.perf_counter() - t0
    w = make(name, size=size, device="cpu")      # graphs only: torch is not imported
    out = {"workload": name, "graph": graph, "mode": mode, "startup_s": startup_s, "adapter": dev.name}
    for run in ("first", "again"):
        st0 = dict(dev.stats)
        t0 = time.perf_counter()
        b, s, session_s = _session(w, graph, "gpu", mode)     # builds the graph once, then compiles it
        t1 = time.perf_counter()
        for k in PHASES[graph]:
            s.executor.plan(k)
        t2 = time.perf_counter()
        plans = {k: s.executor.plans[k] for k in PHASES[graph]}
        # eager_s: what a user waits for before the first call, the graph built and mg.compile
        # returned (its main call compiled: ``step`` for training, ``run`` for inference)
        out[run] = {"total_s": t2 - t0, "eager_s": t1 - t0, "build_s": t1 - t0 - session_s,
                    "compile_s": t2 - t1 + session_s,
                    "kernel_plan_s": sum(p.kernel_plan.compile_seconds for p in plans.values()),
                    "plan_cache": {k: p.kernel_plan.stats.get("cache") for k, p in plans.items()},
                    "dispatches": {k: p.n_dispatches for k, p in plans.items()},
                    "unique_pipelines": len({d.wgsl for p in plans.values() for d in p.kernel_plan.dispatches}),
                    "pipelines_created": dev.stats["pipelines_compiled"] - st0["pipelines_compiled"],
                    "pipeline_s": dev.stats["compile_seconds"] - st0["compile_seconds"],      # summed over threads
                    # Vulkan: the compile stage's kernels read compiled from disk (no GLSL, no
                    # glslang), seconds translating to GLSL and in glslang (summed over threads)
                    "kernels_from_disk": sum(p.executable.stats.get("kernel_cache_hits", 0) for p in plans.values()),
                    "glsl_s": sum(p.executable.stats.get("glsl_seconds", 0.0) for p in plans.values()),
                    "glslang_s": sum(p.executable.stats.get("compile_seconds", 0.0) for p in plans.values()),
                    "pipeline_wall_s": dev.stats.get("pipeline_wall_seconds", 0.0) - st0.get("pipeline_wall_seconds", 0.0)}
        out[run].update(_kernel_sizes(dev, plans.values()))
        s.close()
        del b, s
    return out


def _kernel_sizes(dev, plans, top=5) -> dict:
    """SPIR-V bytes of the plans' kernels, and the ``top`` slowest to create (Vulkan: the
    driver's compile time grows with a kernel's size); empty on other backends."""
    made = getattr(dev, "_pipelines", {})
    kernels = [made[t] for t in {k.key for p in plans for k in p.executable.kernels} if t in made]
    kernels = [k for k in kernels if hasattr(k, "spirv_bytes")]
    if not kernels:
        return {}
    slow = sorted(kernels, key=lambda k: -getattr(k, "create_seconds", 0.0))[:top]
    return {"spirv_bytes": sum(k.spirv_bytes for k in kernels),
            "slowest_kernels": [{"name": k.name[:80], "create_s": getattr(k, "create_seconds", 0.0),
                                 "spirv_bytes": k.spirv_bytes} for k in slow]}


def in_fresh_process(name, size, graph, mode, cache_dir, threads=None, timeout=1800) -> dict:
    """``on_device`` in a child process whose caches (ours and the drivers') live in ``cache_dir``."""
    env = dict(os.environ, MEGANEURA_CACHE_DIR=cache_dir,
               __GL_SHADER_DISK_CACHE_PATH=os.path.join(cache_dir, "nvidia"),
               __GL_SHADER_DISK_CACHE="1", MESA_SHADER_CACHE_DIR=os.path.join(cache_dir, "mesa"))
    env.pop("MEGANEURA_NO_DISK_CACHE", None)
    env.pop("MEGANEURA_NO_PLAN_CACHE", None)
    if threads:
        env["MEGANEURA_COMPILE_THREADS"] = str(threads)
    os.makedirs(env["__GL_SHADER_DISK_CACHE_PATH"], exist_ok=True)
    cmd = [sys.executable, "-m", "meganeura.bench.compile_time", "--one", name, graph, mode, "--size", size]
    t0 = time.perf_counter()
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    if r.returncode != 0:
        return {"error": (r.stderr.strip().splitlines() or ["failed"])[-1][:300]}
    res = json.loads(r.stdout.strip().splitlines()[-1])
    res["process_s"] = time.perf_counter() - t0
    return res


WARM_PROCESSES = 3


def cold_and_warm(name, size, graph, mode="strict", threads=None, warm_processes=WARM_PROCESSES) -> dict:
    """Cold (fresh process, empty caches), warm (fresh processes, caches filled: the median
    of ``warm_processes``, a single one moved by 50% between runs) and again (the same
    graph a second time in that warm process): seconds and pipelines."""
    with tempfile.TemporaryDirectory(prefix="meganeura-compile-") as d:
        cold = in_fresh_process(name, size, graph, mode, d, threads)
        warms = [in_fresh_process(name, size, graph, mode, d, threads) for _ in range(max(1, warm_processes))]
    bad = [r for r in [cold] + warms if "error" in r]
    if bad:
        return {"error": bad[0]["error"]}
    warms.sort(key=lambda r: r["first"]["total_s"])
    warm = warms[len(warms) // 2]
    return {"cold_s": cold["first"]["total_s"], "warm_s": warm["first"]["total_s"], "again_s": warm["again"]["total_s"],
            "cold_eager_s": cold["first"]["eager_s"],
            "warm_all_s": [r["first"]["total_s"] for r in warms],
            "cold": cold["first"], "warm": warm["first"], "again": warm["again"], "adapter": cold["adapter"]}


def _pipe(run):
    return f"{run.get('pipeline_wall_s', float('nan')):.2f}/{run['pipeline_s']:.2f}"


def print_gpu(rows):
    print(f"{'workload':9} {'graph':9} {'cold':>6} {'eager':>6} {'warm':>6} {'again':>6} {'pipelines':>9} "
          f"{'cold pipe s':>11} {'warm pipe s':>11} {'plan cache':>10} {'from disk':>9}   "
          "(cold: every plan; eager: mg.compile's main call alone, cold; pipe s: waited / summed "
          "over threads; from disk: warm kernels read compiled)")
    for r in rows:
        if "error" in r:
            print(f"{r['workload']:9} {r['graph']:9} error: {r['error']}")
            continue
        print(f"{r['workload']:9} {r['graph']:9} {r['cold_s']:6.2f} {r.get('cold_eager_s', float('nan')):6.2f} "
              f"{r['warm_s']:6.2f} {r['again_s']:6.2f} "
              f"{r['cold']['unique_pipelines']:9d} {_pipe(r['cold']):>11} {_pipe(r['warm']):>11} "
              f"{','.join(str(v) for v in r['warm']['plan_cache'].values()):>10} "
              f"{str(r['warm'].get('kernels_from_disk', '-')):>9}")
    for r in rows:
        slow = r.get("cold", {}).get("slowest_kernels")
        if slow:
            print(f"{r['workload']:9} {r['graph']:9} cold, {r['cold']['spirv_bytes'] >> 10} KiB of SPIR-V; slowest "
                  "to create: " + ", ".join(f"{k['name'][:40]} {k['create_s'] * 1e3:.0f} ms "
                                            f"({k['spirv_bytes'] >> 10} KiB)" for k in slow[:3]))


REFERENCE_COMPILES = 32


def host_reference(threads=None) -> dict:
    """The host's speed at a fixed compile job, so that runs on hosts of other speeds (cold
    times move by up to 2x between runs of the same code on one machine type) can be set side
    by side: seconds to compile the GLSL of a 256^3 matmul kernel (as the Vulkan compile stage
    makes it for the H200) with glslang ``REFERENCE_COMPILES`` times on one thread, and as
    many times on each of ``threads`` (``backends.compile_threads``) threads at once. Empty
    without glslang. The SPIR-V is validated, as every compile was before the runtime turned
    the validator off. (Until the kernels moved onto the kernel AST the job translated the
    WGSL to GLSL each time too: ``job`` tells the records apart.)"""
    from concurrent.futures import ThreadPoolExecutor

    import meganeura as mg
    from ..compiler import CompileOptions, compile_plan
    from ..runtime.backends import compile_threads
    from ..compilation.glslang import GlslangUnavailable, compile_glsl
    g = mg.Graph()
    y = mg.ops.matmul(g.input("a", (256, 256)), g.input("b", (256, 256)))
    kp = compile_plan([y], n_forward=1, options=CompileOptions(workgroup_storage=H200_WORKGROUP_STORAGE))
    d = kp.dispatches[0]
    n = compile_threads(threads)
    try:
        glsl = stage_kernels({d.wgsl: d.kernel}, kp.trees)[0][d.wgsl].text     # glslang's process set-up too
    except GlslangUnavailable:
        return {}

    def job(i):
        # the trailing comment makes each source new to glslang's in-memory cache
        compile_glsl(glsl + f"\n// {i}\n", name="reference", disk_cache=False, validate=True)
    t0 = time.perf_counter()
    for i in range(REFERENCE_COMPILES):
        job(i)
    one = time.perf_counter() - t0
    t0 = time.perf_counter()
    with ThreadPoolExecutor(n) as pool:
        list(pool.map(job, range(REFERENCE_COMPILES, REFERENCE_COMPILES * (n + 1))))
    return {"compiles": REFERENCE_COMPILES, "job": "glslang", "one_thread_s": one, "threads": n,
            "all_threads_s": time.perf_counter() - t0}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workloads", default=",".join(WORKLOADS))
    ap.add_argument("--graphs", default=",".join(GRAPHS))
    ap.add_argument("--size", default="real", choices=("tiny", "real"))
    ap.add_argument("--gpu", action="store_true", help="time mg.compile on the device, cold / warm / again")
    ap.add_argument("--mode", default="strict", choices=("strict", "accelerated"))
    ap.add_argument("--threads", type=int, default=None, help="MEGANEURA_COMPILE_THREADS for --gpu")
    ap.add_argument("--baseline", default=None, help="an earlier device-free JSON to print beside (column 'before')")
    ap.add_argument("--out", default=None)
    ap.add_argument("--scaling", action="store_true", help="SmolLM2 train step at 8..64 layers (CPU s per layer)")
    ap.add_argument("--one", nargs=3, metavar=("WORKLOAD", "GRAPH", "MODE"), help=argparse.SUPPRESS)
    ap.add_argument("--digests", action="store_true", help="a digest of every plan, to compare two versions")
    ap.add_argument("--against", default=None, help="with --digests: an earlier run's JSON, whose differing plans are named")
    ap.add_argument("--spirv", action="store_true", help="each graph's kernels as SPIR-V (device-free): "
                    "what a cold compile hands the driver")
    args = ap.parse_args(argv)
    if args.digests:
        got = digests(parse_list(args.workloads, WORKLOADS, "workloads"), args.size)
        ref = json.load(open(args.against)) if args.against else {}
        if ref and ref.get("size", args.size) != args.size:
            raise SystemExit(f"--against {args.against}: its plans are of size {ref['size']!r}, this run's of "
                             f"{args.size!r} (run --size {ref['size']}, or compare with a {args.size} run)")
        before = ref.get("plans", {})
        for key, p in got.items():
            was = before.get(key)
            mark = "" if was is None else " same" if was["digest"] == p["digest"] else \
                f" DIFFERS (was {was['digest']}, {was['dispatches']} dispatches)"
            print(f"{key:40} {p['digest']} {p['dispatches']:5d} dispatches {p['cpu_s']:6.2f} s{mark}")
        print(f"compile CPU seconds, all plans: {sum(p['cpu_s'] for p in got.values()):.2f}"
              + (f" (before: {sum(p['cpu_s'] for p in before.values()):.2f})" if before else ""))
        out = args.out or "bench/results/plan_digests.json"
        with open(out, "w") as f:
            json.dump({"size": args.size, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "plans": got}, f, indent=1)
        print(f"wrote {out}")
        return
    if args.one:
        print(json.dumps(on_device(args.one[0], args.size, args.one[1], args.one[2])))
        return
    if args.spirv:
        rows = []
        for name in parse_list(args.workloads, WORKLOADS, "workloads"):
            for g in parse_list(args.graphs, GRAPHS, "graphs"):
                rows.append(kernel_code(name, args.size, g))
                print_kernel_code(rows[-1:])
        print(f"\nsummary (driver: SPIR-V KiB x {DRIVER_MS_PER_KIB} ms, the H200's pipeline creation summed over threads)")
        print_kernel_code(rows)
        out = args.out or "bench/results/kernel_code.json"
        with open(out, "w") as f:
            json.dump({"size": args.size, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "driver_ms_per_kib": DRIVER_MS_PER_KIB, "rows": rows}, f, indent=1)
        print(f"wrote {out}")
        return
    if args.scaling:
        rows = scaling()
        out = args.out or "bench/results/compile_scaling.json"
        with open(out, "w") as f:
            json.dump({"workload": "smollm2 train step", "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                       "rows": rows}, f, indent=1)
        print(f"wrote {out}")
        return
    names = parse_list(args.workloads, WORKLOADS, "workloads")
    graphs = parse_list(args.graphs, GRAPHS, "graphs")
    rows = []
    if args.gpu:
        # the package's bytecode as an install has it: a checkout run with
        # PYTHONDONTWRITEBYTECODE compiles its modules in every child process (30 ms warm)
        import compileall
        compileall.compile_dir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), quiet=1)
        host = host_reference(args.threads)
        if host:
            print(f"host: {host['compiles']} reference compiles {host['one_thread_s']:.2f} s on one thread, "
                  f"{host['compiles']} on each of {host['threads']} threads {host['all_threads_s']:.2f} s")
        for name in names:
            for g in graphs:
                r = {"workload": name, "graph": g, **cold_and_warm(name, args.size, g, args.mode, args.threads)}
                rows.append(r)
                print_gpu([r])
        out = args.out or "bench/results/compile_time_gpu.json"
        print("\nsummary"), print_gpu(rows)
    else:
        with tempfile.TemporaryDirectory(prefix="meganeura-plans-") as d:
            for name in names:
                for g in graphs:
                    rows.append(device_free(name, args.size, g, d))
                    print_device_free(rows[-1:])
        baseline = json.load(open(args.baseline))["rows"] if args.baseline else None
        print("\nsummary (seconds; cached: the plans from the plan cache)")
        print_device_free(rows, baseline)
        out = args.out or "bench/results/compile_time.json"
    res = {"size": args.size, "gpu": args.gpu, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "rows": rows}
    if args.gpu and host:
        res["host_reference"] = host
    if args.baseline:
        res["baseline"] = {"file": os.path.basename(args.baseline), "rows": baseline}
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
