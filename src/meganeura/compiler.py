"""The device-free compile stage: ``compile_plan(targets, ..., options, target) -> Executable``.

The passes, in order: decomposition to primitives (``passes.lower``, with accelerated
precision's rewrite: ``compilation.precision``), scheduling into kernel IR (``schedule``:
views, pointwise fusion), the kernel-IR fusion passes (``passes.fuse``), the in-place passes
(``compilation.inplace``), WGSL rendering per archetype (``codegen``) and the memory plan:
a ``KernelPlan`` over logical buffers. Given a ``Target`` (``compilation.target``), each
dispatch's kernel is then finished for it (``compilation.vulkan`` for Vulkan: tensor-core
variants, GLSL, SPIR-V) into an ``Executable`` (``compilation.executable``) that a runtime
only allocates, binds and records. Everything here runs without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
from dataclasses import dataclass, field, replace

from . import codegen
from .codegen.fingerprint import RenderCache
from .codegen.kernel_ast import collected_trees
from .compilation.inplace import store_copies_with_writers, update_in_place
from .compilation.precision import (BACKWARD_CONV_ROUND_MAX_K, BACKWARD_F16_MIN_MACS,  # noqa: F401 (the
                                    BACKWARD_MATMUL_F16_MIN_MACS, BACKWARD_ROUND_MAX_K, F16_COPY,  # names
                                    GRAD_SCALE_TARGET, _accelerated_attention_grad,  # callers import
                                    accelerated_rewrite, f16_copy_name, f16_weights,  # from here)
                                    precision_constants, refresh_f16_copies)
from .memplan import MemoryPlan, plan_memory, write_over_dying_operands
from .passes import lower_to_primitives
from .passes.order import early_update_order, reorder
from .passes.remat import rematerialize
from .passes.fuse import FUSION_PASSES, run_fusion

# switches MEGANEURA_NO_FUSE also accepts besides the fusion passes
OTHER_PASSES = ("inplace", "remat", "early_updates")
from .schedule import Buf, Kernel, build_schedule


@dataclass
class CompileOptions:
    precision: str = "strict"            # "accelerated": forward matmuls read f16 operands
    max_bindings: int = 8                # storage buffers per shader stage on the adapter
    disabled: frozenset = frozenset()    # fusion passes switched off (MEGANEURA_NO_FUSE)
    workgroup_storage: int = 0           # bytes of workgroup memory a kernel may use (0: a portable 32 KiB)
    f16_weights: frozenset = frozenset() # accelerated: parameters read through persistent f16 copies
    binding_arrays: bool = False         # the runtime binds arrays of buffers: merged parts share bodies
    checked: bool = False                # kernels that index with data report bad indices (MEGANEURA_CHECKED)

    @staticmethod
    def for_target(target, precision="strict", checked=False):
        """``from_env`` for a ``Target``'s limits."""
        opts = CompileOptions.from_env(precision, target.limits)
        opts.checked = bool(checked)
        return opts

    @staticmethod
    def from_env(precision="strict", limits=None):
        """Options for an adapter's ``limits``; ``MEGANEURA_NO_FUSE`` names passes to turn
        off (comma-separated, or ``all``)."""
        raw = os.environ.get("MEGANEURA_NO_FUSE", "")
        names = {s.strip() for s in raw.split(",") if s.strip()}
        known = list(FUSION_PASSES) + list(OTHER_PASSES)
        if "all" in names:
            names = set(known)
        unknown = names - set(known)
        if unknown:
            raise ValueError(f"MEGANEURA_NO_FUSE: unknown pass(es) {sorted(unknown)}; "
                             f"known: {', '.join(known)} or 'all'")
        mb = int((limits or {}).get("max-storage-buffers-per-shader-stage", 8))
        return CompileOptions(precision, mb, frozenset(names),
                              int((limits or {}).get("max-compute-workgroup-storage-size", 0)),
                              binding_arrays=bool((limits or {}).get("binding-arrays", False)))


@dataclass
class Dispatch:
    kernel: Kernel
    wgsl: str
    bufs: list           # logical Bufs in binding order
    groups: tuple        # workgroup counts


@dataclass
class KernelPlan:
    """What one kind of call runs: dispatches in launch order over logical buffers."""
    dispatches: list
    bufs: list                       # every logical Buf
    memory: MemoryPlan
    target_locs: list                # per target: (Buf, byte offset, nbytes, np dtype, shape)
    compile_seconds: float = 0.0
    stats: dict = field(default_factory=dict)
    copy_updates: list = field(default_factory=list)   # f16 copies written by the targets after the given ones
    # {WGSL text: kernel AST} of the dispatches' texts (``kernel_ast.collected_trees``): what the
    # Vulkan compile stage prints their GLSL from; a plan read from the plan cache brings them
    # packed (``packed_trees``: {text: compressed pickle}, ``plan_cache.unpacked_tree``)
    trees: dict = field(default_factory=dict, repr=False, compare=False)
    packed_trees: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def names(self):
        return [d.kernel.name for d in self.dispatches]

    @property
    def n_dispatches(self):
        return len(self.dispatches)


_gc_lock = threading.Lock()
_gc_users = 0                 # compiles under way (gc_paused nests and runs on several threads)
_gc_was_enabled = False


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector held off while a graph is differentiated or
    compiled: those passes allocate hundreds of thousands of small objects, and the
    collector's repeated scans of them took about half of the compile time. Whatever
    became garbage is collected as usual afterwards. Nests, and is safe across threads."""
    global _gc_users, _gc_was_enabled
    with _gc_lock:
        if _gc_users == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_users += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_users -= 1
            if _gc_users == 0 and _gc_was_enabled:
                gc.enable()


def compile_plan(targets, n_forward=None, options: CompileOptions | None = None, updates=None,
                 cache=False, adapter=None, target=None, stream=None):
    """Kernels computing ``targets`` (tensors of one graph). ``n_forward``: how many leading
    targets are forward outputs (accelerated precision applies to what they depend on).
    ``updates``: {target index: parameter/state name} for targets that become that
    tensor's new value after the call; where it is safe they are written in place.
    ``cache``: read and write the on-disk plan cache (``plan_cache``, keyed with ``adapter``,
    the device's description); a plan read from it carries each kernel's name, archetype and
    output but not its IR (never in checked mode, whose kernels are rendered with index reports).

    ``target`` None: the ``KernelPlan`` (device-free counts and digests read it). A ``Target``:
    the ``Executable`` for it, every dispatch's kernel finished (checked mode's index reports,
    and for Vulkan the cooperative-matrix variants, GLSL and SPIR-V). ``stream``: a
    ``KernelStream`` that each finished kernel is put on as soon as it is made (closed when
    this returns or raises), so that a runtime creates pipelines while the rest compiles;
    kernels start finishing as they are rendered (``early_kernels``)."""
    opts = options or CompileOptions()
    finisher = storing = None    # storing: the plan cache's write, beside the Vulkan stage
    try:            # the stream is closed whatever raises, the finisher's set-up too
        finisher = _finisher(target, opts, stream)
        with gc_paused():
            plan = key = None
            if cache and not opts.checked:
                from . import plan_cache
                key = plan_cache.plan_key(targets, n_forward, opts, updates, adapter)
                plan = plan_cache.load(key) if key is not None else None
            if plan is None:
                if finisher is not None:
                    finisher.prepare()
                early = finisher.start if finisher is not None and not opts.checked and early_kernels() else None
                # attention routes by precision (``attention.ACCELERATED_MAX_ROW_WORK``)
                accelerated = codegen.attention.ACCELERATED.set(opts.precision == "accelerated")
                try:
                    plan = _compile_plan(targets, n_forward, opts, updates, early)
                finally:
                    codegen.attention.ACCELERATED.reset(accelerated)
                if key is not None:
                    plan.stats["key"] = key
                    if target is None:
                        plan_cache.store(key, plan)
                    else:
                        storing = plan_cache.store_beside(key, plan)
                    plan.stats["cache"] = "stored"
            return plan if target is None else _finish(plan, target, opts, finisher)
    finally:
        if storing is not None:     # written before this returns or raises: nothing is lost
            storing.join()
        if finisher is not None:
            finisher.close()
        if stream is not None:
            stream.close()


def early_kernels() -> bool:
    """Whether kernels start finishing (GLSL, SPIR-V) as they are rendered, beside the rest of
    the plan; ``MEGANEURA_EARLY_KERNELS=0`` waits for the whole plan (to compare)."""
    from .runtime.backends import env_flag
    return env_flag("MEGANEURA_EARLY_KERNELS", default=True)


def _finisher(target, opts, stream):
    """What finishes kernels for ``target`` (None: the WGSL is final, or no target)."""
    if target is None or target.api != "vulkan":
        return None
    from .compilation.vulkan import VulkanKernels
    return VulkanKernels(target, opts.precision, stream)


def _finish(plan, target, opts, finisher):
    """The ``Executable`` of ``plan`` for ``target``: checked mode's kernels rendered again
    with their index reports into one error buffer, then (Vulkan) each kernel finished."""
    from .compilation.executable import Executable, FinalKernel, Step
    shaders = [(d.wgsl, d.kernel.name, d.bufs, d.groups) for d in plan.dispatches]
    checks, err = [], None
    checked = [i for i, d in enumerate(plan.dispatches) if d.kernel.spec.get("checks")] if opts.checked else []
    trees = dict(plan.trees)
    if checked:
        n = sum(len(plan.dispatches[i].kernel.spec["checks"]) for i in checked)
        err = Buf(8 * n, "temp", "index_errors")
        with collected_trees(trees):
            for i in checked:
                k = plan.dispatches[i].kernel
                wgsl, bufs, _ = codegen.render(k, errors=(err, len(checks)))
                checks += [(c, k.name) for c in k.spec["checks"]]
                shaders[i] = (wgsl, k.name, bufs, plan.dispatches[i].groups)
    if finisher is None:
        steps = [Step(FinalKernel(label, text, text), bufs, groups) for text, label, bufs, groups in shaders]
        stats = {}
    else:
        finisher.take_trees(trees, plan.packed_trees)
        shaders = finisher.variants([d.kernel for d in plan.dispatches], shaders)
        done = finisher.finish([(text, label) for text, label, _, _ in shaders])
        steps = [Step(done[text], bufs, groups) for text, _, bufs, groups in shaders]
        stats = dict(finisher.stats)
    # the trees are spent: the executable holds each kernel finished
    return Executable(replace(plan, trees={}, packed_trees={}), target, steps, opts.precision, checks, err, stats)


def _compile_plan(targets, n_forward, opts, updates, on_render=None) -> KernelPlan:
    """The passes; ``on_render(kernel, text, tree)`` takes each distinct text as it is
    rendered, with its kernel AST."""
    clock = _StageClock()
    fwd = targets[:len(targets) if n_forward is None else n_forward]
    accelerated = opts.precision == "accelerated"
    rewrite = accelerated_rewrite(fwd, opts.f16_weights) if accelerated and fwd else None
    g2, new_targets = lower_to_primitives(targets, keep=codegen.has_kernel, rewrite=rewrite)
    n_given = len(new_targets)
    if accelerated and opts.f16_weights and updates:
        updates = refresh_f16_copies(new_targets, updates, opts.f16_weights)
    if "remat" not in opts.disabled and fwd:
        g3, new_targets = rematerialize(new_targets, len(fwd))
        if g3 is not None:
            g2._drop_nodes()       # the lowered copy, replaced
            g2 = g3
    if updates and "early_updates" not in opts.disabled:
        order = early_update_order(new_targets, updates.keys(), updates.values())
        if order is not None:
            g3, new_targets = reorder(new_targets, order)
            g2._drop_nodes()
            g2 = g3
    clock.lap("lower")
    smem = codegen.flash.ADAPTER_SMEM.set(opts.workgroup_storage)
    try:
        sched = build_schedule(g2, new_targets, max_bindings=opts.max_bindings)
    finally:
        codegen.flash.ADAPTER_SMEM.reset(smem)
    # kernels that write nothing are dropped before fusion (a merged launch must not be
    # judged by an empty first part)
    kernels = [k for k in sched.kernels if k.out.size > 0]
    n_scheduled = len(kernels)
    clock.lap("schedule")
    kernels = run_fusion(kernels, disabled=opts.disabled, max_bindings=opts.max_bindings)
    clock.lap("fusion")
    n_in_place = n_over = 0
    if updates and "inplace" not in opts.disabled:
        n_in_place = update_in_place(kernels, sched, new_targets, updates)
    if "inplace" not in opts.disabled:
        n_over = write_over_dying_operands(kernels)
    if opts.workgroup_storage:
        _size_tiles(kernels, opts.workgroup_storage)
    if kp_copies := [updates[i] for i in range(n_given, len(new_targets))]:
        kernels = store_copies_with_writers(kernels, set(kp_copies), opts.max_bindings)
    clock.lap("in_place")
    dispatches = [None] * len(kernels)
    # a repeated layer's kernels render once (``codegen.fingerprint``); the text does not
    # depend on the order, so the kernels whose driver compiles take longest (merged
    # launches, matmuls) render first, for ``on_render`` to start finishing them first
    array_limit = opts.max_bindings if opts.binding_arrays else 0
    render, sent = RenderCache(functools.partial(codegen.render, array_limit=array_limit,
                                                 tiled_arrays=opts.precision == "strict")), set()
    with collected_trees() as trees:
        for i in sorted(range(len(kernels)), key=lambda i: _render_rank(kernels[i])):
            k = kernels[i]
            wgsl, bufs, groups = render(k)
            dispatches[i] = Dispatch(k, wgsl, bufs, groups)
            if on_render is not None and wgsl not in sent:
                sent.add(wgsl)
                on_render(k, wgsl, trees.get(wgsl))
    clock.lap("render")
    used = {id(b) for d in dispatches for b in d.bufs}
    locs = []
    for t in new_targets:
        v = sched.values.get(t.id)
        if v is None:
            raise RuntimeError(f"target {t.name!r} has no value")
        if not v.is_contiguous():
            raise RuntimeError(f"target {t.name!r} is a strided view")
        locs.append((v.buf, v.offset * t.dtype.np.itemsize, t.size * t.dtype.np.itemsize, t.dtype.np, t.shape))
    used |= {id(loc[0]) for loc in locs}
    bufs = [b for b in sched.bufs if id(b) in used]     # buffers a fusion made unnecessary are never allocated
    memory = plan_memory([(k.written_bufs(), d.bufs) for d in dispatches for k in [d.kernel]], bufs)
    clock.lap("memory")
    return KernelPlan(dispatches, bufs, memory, locs, clock.total(),
                      {"scheduled": n_scheduled, "fused": n_scheduled - len(kernels), "in_place": n_in_place,
                       "written_over_operands": n_over, "rendered_once": render.hits, "seconds": clock.laps},
                      kp_copies, trees={d.wgsl: trees[d.wgsl] for d in dispatches if d.wgsl in trees})


def _render_rank(k) -> int:
    """Render order: merged launches, then matmuls and attention, then the rest."""
    return 0 if "parts" in k.spec else 1 if k.archetype in ("matmul", "attention") else 2


class _StageClock:
    """Seconds per compile stage (``KernelPlan.stats["seconds"]``), to see where time goes."""

    def __init__(self):
        self.start = self.last = time.perf_counter()
        self.laps = {}

    def lap(self, stage):
        now = time.perf_counter()
        self.laps[stage] = self.laps.get(stage, 0.0) + now - self.last
        self.last = now

    def total(self):
        return time.perf_counter() - self.start


def _size_tiles(kernels, storage):
    """Tiles chosen for the adapter's workgroup memory: the flash kernel's query rows per
    workgroup, and whether its backward keeps the own rows' operands resident (the only
    kernels whose tiles depend on it)."""
    from .codegen import flash
    for k in kernels:
        if k.archetype == "attention" and (k.spec.get("grad") or k.spec.get("flash")
                                           and flash.rows_per_group(k.reads[0].shape[-1], storage) is not None):
            k.spec["smem"] = storage


def count_dispatches(targets, **kw) -> int:
    """Dispatches the GPU backend records for ``targets`` (no device needed)."""
    return compile_plan(targets, **kw).n_dispatches


__all__ = ["Buf", "CompileOptions", "KernelPlan", "compile_plan", "count_dispatches", "early_kernels"]
