"""The device-free compile stage: ``compile_plan(targets, limits, options) -> KernelPlan``.

The passes, in order: decomposition to primitives (``passes.lower``), scheduling into
kernel IR (``schedule``: views, pointwise fusion), the kernel-IR fusion passes
(``passes.fuse``), WGSL rendering per archetype (``codegen``) and the memory plan. The
result names buffers logically; the runtime only allocates them and records dispatches, so
everything here is testable (kernel counts, WGSL validity) without a GPU.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import os
import threading
import time
from dataclasses import dataclass, field

from . import codegen
from .codegen.fingerprint import RenderCache
from .memplan import (MemoryPlan, move_value, plan_memory, reads_only_own_element, touching_units,
                      write_over_dying_operands)
from .passes import lower_to_primitives
from .passes.remat import rematerialize
from .passes.fuse import FUSION_PASSES, run_fusion

# switches MEGANEURA_NO_FUSE also accepts besides the fusion passes
OTHER_PASSES = ("inplace", "remat")
from .schedule import Buf, Kernel, build_schedule


@dataclass
class CompileOptions:
    precision: str = "strict"            # "accelerated": forward matmuls read f16 operands
    max_bindings: int = 8                # storage buffers per shader stage on the adapter
    disabled: frozenset = frozenset()    # fusion passes switched off (MEGANEURA_NO_FUSE)
    workgroup_storage: int = 0           # bytes of workgroup memory a kernel may use (0: a portable 32 KiB)
    f16_weights: frozenset = frozenset() # accelerated: parameters read through persistent f16 copies
    binding_arrays: bool = False         # the runtime binds arrays of buffers: merged parts share bodies

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

    @property
    def names(self):
        return [d.kernel.name for d in self.dispatches]

    @property
    def n_dispatches(self):
        return len(self.dispatches)


F16_COPY = "@f16"      # name suffix of a parameter's persistent f16 copy (never a user name: no '@' in module paths)


def f16_copy_name(name: str) -> str:
    return name + F16_COPY


def _accelerated(t, forward) -> bool:
    """``t`` is a forward f32 matmul that accelerated precision gives f16 operands."""
    return t.op == "matmul" and t.id in forward and t.dtype.name == "f32" and not t.attrs.get("out_dtype")


CONV_OPS = ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")


def _accelerated_conv(t, forward) -> bool:
    """``t`` is a forward f32 convolution: its matmul takes f16 operands (the columns rounded
    in the implicit GEMM's loads)."""
    return t.op == "conv2d" and t.id in forward and t.dtype.name == "f32"


def _conv_macs(t) -> int:
    """Multiply-adds of a convolution op's matmul (forward, input or weight gradient)."""
    if t.op == "conv2d_weight_grad":
        ct = t.inputs[1]
        return t.size * ct.shape[0] * ct.shape[2] * ct.shape[3]
    ct, w = t.inputs[0], t.inputs[1]
    return (t if t.op == "conv2d" else ct).size * w.shape[1] * w.shape[2] * w.shape[3]


def _layout_chain(x):
    """(the tensor that layout ops (reshape, permute, ...) make ``x`` a view of, those ops from
    it to ``x``, outermost first)."""
    from .schedule import VIEW_OPS
    chain = []
    while x.op in VIEW_OPS:
        chain.append(x)
        x = x.inputs[0]
    return x, chain


def _viewed_parameter(x):
    """(parameter, layout ops from it to ``x``, outermost first) when ``x`` is an f32
    parameter or a layout view of one, else (None, [])."""
    x, chain = _layout_chain(x)
    if x.op == "parameter" and x.dtype.name == "f32":
        return x, chain
    return None, []


def f16_weights(forward_targets) -> frozenset:
    """Names of the parameters that accelerated forward matmuls read as operands (directly
    or through layout views). Each gets a persistent f16 copy on the device, written when
    the weight is set or updated instead of cast by every call."""
    from .reference import needed_nodes
    nodes = needed_nodes(forward_targets)
    forward = {t.id for t in nodes}
    names = set()
    for t in nodes:
        if _accelerated(t, forward) or _accelerated_conv(t, forward):
            names.update(p.name for p in (_viewed_parameter(x)[0] for x in t.inputs) if p is not None)
    return frozenset(names)


# A gradient operand of an accelerated backward matmul is scaled so that its largest
# magnitude is this before it is rounded to f16: gradients are often far below f16's
# smallest normal (6e-5; a token-mean loss over 512 tokens gives logit gradients near 1e-8),
# and 2^14 leaves room below f16's largest (65504) while keeping small elements normal.
GRAD_SCALE_TARGET = 2.0 ** 14
# A backward matmul takes f16 operands from this many multiply-adds on: scaling a gradient
# costs a max reduction and a cast (three launches, shared by the matmuls reading it), which
# smaller products do not win back. H200: SmolLM2 (128 tokens) with every backward matmul
# in f16 launched 1401 -> 1855 kernels per forward+backward and gained only 11.2 -> 10.0 ms;
# after the outputs fusion (2^20 here) 1259 -> 1734 launches lost, 8.85 -> 9.49 ms, although
# its matmuls' GPU time fell 5.32 -> 3.91 ms.
BACKWARD_F16_MIN_MACS = 2 ** 28
# A backward matmul or convolution takes its gradient operands in f32 and rounds them
# to f16 precision in its loads (``codegen.matmul.ROUND_F16``: the tensor-core kernel scales
# its share of each into f16's range by a power of two), so it needs no launch of its own to
# scale them: from this many multiply-adds on it runs on f16 operands.
BACKWARD_MATMUL_F16_MIN_MACS = 2 ** 20
# ... up to this depth (K): deeper, the scaled cast. The tensor-core kernel
# keeps a K split of up to coopmat.RAW_CHUNKS chunks in registers to take the rounded
# operand's peak, and reads a longer one twice (a pre-pass), which a deep product pays more
# than the two launches of the cast.
BACKWARD_ROUND_MAX_K = 4096
# ... and a convolution's product up to this depth: its weight gradient's K (an image's
# positions, or the batch's) is split few ways, and a long split reads the rounded operand
# twice (a pre-pass for its peak). H200, accelerated train steps at 4096 / 1024 / 512:
# ResNet-50 7.09 / 7.16 / 7.44 ms, U-Net 4.04 / 3.99 / 4.07, Whisper 4.49 / 4.46 / 4.44
# (its 1500-deep weight gradient took 124.7 us rounded, 59.4 cast; the cast's launches
# about 92 more); with the scaled cast for every convolution 7.48-7.55 / 4.27-4.29 / 4.43-4.48.
BACKWARD_CONV_ROUND_MAX_K = 1024


def precision_constants() -> tuple:
    """The module constants that decide accelerated precision's rewrite: part of the plan
    cache's key (a test or benchmark that changes one never reads another's plan)."""
    return (GRAD_SCALE_TARGET, BACKWARD_F16_MIN_MACS, BACKWARD_MATMUL_F16_MIN_MACS, BACKWARD_ROUND_MAX_K,
            BACKWARD_CONV_ROUND_MAX_K)


def _backward_f16(t, forward) -> str | None:
    """How accelerated precision gives backward f32 matmul or convolution ``t`` (one the
    autodiff added) f16 operands: "round" (its gradient operands read in f32 and rounded in
    its product's loads, ``_rounds_in_loads``: from BACKWARD_MATMUL_F16_MIN_MACS on), "scale"
    (scaled and cast before it: from BACKWARD_F16_MIN_MACS on), or None where it stays f32
    (too small, or not such a product). Matmuls that only a state update or the optimizer
    reads stay f32."""
    if t.op not in ("matmul",) + CONV_OPS or t.id in forward or t.id not in t.graph.backward_ids \
            or t.dtype.name != "f32" or t.attrs.get("out_dtype"):
        return None
    rounds = _rounds_in_loads(t, forward)
    macs = t.size * _depth(t) if t.op == "matmul" else _conv_macs(t)
    if macs < (BACKWARD_MATMUL_F16_MIN_MACS if rounds else BACKWARD_F16_MIN_MACS):
        return None
    return "round" if rounds else "scale"


def _depth(t) -> int:
    """K of matmul ``t``."""
    a = t.inputs[0]
    return a.shape[-2] if t.attrs["ta"] else a.shape[-1]


# the operand of a convolution gradient that is the cotangent (the other is a forward value)
_COTANGENT = {"conv2d_input_grad": 0, "conv2d_weight_grad": 1}


def _rounds_in_loads(t, forward) -> bool:
    """Backward matmul or convolution ``t`` reads its gradient operands in f32, rounded to f16
    by its product's loads (``f16_round``), rather than scaled and cast before it: up to
    BACKWARD_ROUND_MAX_K deep (a convolution's product: BACKWARD_CONV_ROUND_MAX_K), and for a
    convolution only where its one gradient operand is the cotangent, which reaches the
    product through views alone (the other operand, the weight or the im2col of the input,
    is a forward value)."""
    if t.op == "matmul":
        return _depth(t) <= BACKWARD_ROUND_MAX_K
    from .ops.conv import gradient_product_depth
    at = _COTANGENT.get(t.op)
    return at is not None and gradient_product_depth(t) <= BACKWARD_CONV_ROUND_MAX_K and \
        [x.id in forward for x in t.inputs] == [i != at for i in range(len(t.inputs))]


def _accelerated_attention_grad(t) -> bool:
    """``t`` is an attention gradient that the flash backward takes, with head dims the
    tensor-core kernels take (``codegen.flash_grad_coop``): its dO gets scaled. Elsewhere
    (short rows: decomposed, f32) scaling would only add launches."""
    if t.op != "attention_grad" or t.id not in t.graph.backward_ids or t.dtype.name != "f32":
        return False
    from .codegen import attention, flash_coop
    q, v = t.inputs[0], t.inputs[2]
    return attention.grad_supported(t) and max(q.shape[-1], v.shape[-1]) <= flash_coop.MAX_DIM


def accelerated_rewrite(forward_targets, f16_weights=frozenset()):
    """Accelerated precision: matmuls read f16 operands and accumulate in f32, and so do
    the matmuls of convolutions (decomposed here around them: the im2col columns are cast,
    which the implicit GEMM does in its loads). Forward matmuls (those the fetched outputs
    and loss depend on) cast theirs; a parameter named in
    ``f16_weights`` is read from its persistent f16 copy (a state of the lowered graph,
    ``f16_copy_name``) rather than cast on every call. Backward matmuls cast forward values
    alike and read gradient operands in f32, rounded to f16 precision as the kernel loads
    them (``f16_round``: the tensor-core kernel scales each workgroup's share into f16's
    range by a power of two and unscales its product); so do backward convolutions, whose
    cotangent reaches the product through views (``_rounds_in_loads``). Deeper products
    scale each gradient operand by GRAD_SCALE_TARGET over its
    largest magnitude before the cast (one max reduction per gradient, shared by the
    matmuls that read it), dividing the product by the scales after. A gradient holding an
    inf or NaN makes the product NaN where it reaches (a convolution's whole product; strict
    poisons only the rows and columns that touch it): either way the step is lost.

    An attention gradient that the flash backward takes reads dO, and D = rowsum(dO * O),
    divided by dO's largest magnitude, and its gradient is multiplied back: the flash backward on
    tensor cores (``codegen.flash_grad_coop``) rounds dO and dS to f16, which would flush a
    small loss's cotangents to zero."""
    from .ops import cast, emit
    from .ops.elementwise import maximum
    from .ops.registry import OPS
    from .ops.reduce import amax
    from .reference import needed_nodes
    forward = {t.id for t in needed_nodes(forward_targets)}
    scaled = {}       # original gradient tensor id -> (its scaled f16 copy, its peak magnitude)
    unit = {}         # dO's id -> (dO / its peak, the peak); D's id -> D / dO's peak

    def operand(x, new):
        p, chain = _viewed_parameter(x)
        if p is None or p.name not in f16_weights:
            return new
        g, name = new.graph, f16_copy_name(p.name)
        v = g.states.get(name) or g.state(name, p.shape, "f16")
        for view in reversed(chain):
            v = emit(view.op, [v], **view.attrs)
        return v

    def gradient_operand(x, new):
        # the peak is read by the cast and by the product's epilogue as it is (a scalar
        # computed from it, scale or inverse, would be a launch of its own between them);
        # scaling by the power of two GRAD_SCALE_TARGET is exact, and comes after the division
        # so that no finite gradient overflows on the way
        if x.id not in scaled:
            peak = maximum(amax(emit("abs", [new])), 1e-30)     # all zeros: any finite scale
            scaled[x.id] = (cast(new / peak * GRAD_SCALE_TARGET, "f16"), peak)
        return scaled[x.id]

    def attention_grad(t, ins):
        do, delta = t.inputs[3], t.inputs[5]
        if do.id not in unit:
            peak = maximum(amax(emit("abs", [ins[3]])), 1e-30)     # all zeros: any finite scale
            unit[do.id] = (ins[3] / peak, peak)
        do_unit, peak = unit[do.id]
        if delta.id not in unit:
            unit[delta.id] = ins[5] / peak
        return emit(t.op, ins[:3] + [do_unit, ins[4], unit[delta.id]] + ins[6:], **t.attrs) * peak

    def product(a, b, ta=False, tb=False):
        return codegen.matmul.accelerate(a, b, ta, tb)

    def apply(t, ops):
        """``t`` over ``ops`` with its matmul on f16 operands: a matmul, or a convolution
        decomposed around one (its im2col, col2im and batch sum stay f32)."""
        if t.op == "matmul":
            return product(*ops, t.attrs["ta"], t.attrs["tb"])
        return OPS[t.op].extra["decompose"](*ops, **t.attrs, product=product)

    def rw(t, ins):
        if _accelerated(t, forward) or _accelerated_conv(t, forward):
            return apply(t, [operand(x, n) for x, n in zip(t.inputs, ins)])
        if _accelerated_attention_grad(t):
            return attention_grad(t, ins)
        path = _backward_f16(t, forward)
        if path == "round":
            # gradient operands stay f32, rounded to f16 by the product's loads
            rounded = tuple(x.id not in forward for x in t.inputs)
            ops = [n if r else operand(x, n) for x, n, r in zip(t.inputs, ins, rounded)]
            if t.op == "matmul":
                return codegen.matmul.accelerate(*ops, t.attrs["ta"], t.attrs["tb"], f16_round=rounded)
            # the cotangent by the tensor it views: layout ops fold (a reshape of a reshape
            # is one), so the product's operand may view it through another chain
            grads = {_layout_chain(n)[0].id for n, r in zip(ops, rounded) if r}

            def rounding_product(a, b, ta=False, tb=False):
                flags = tuple(_layout_chain(v)[0].id in grads for v in (a, b))
                if flags.count(True) != 1:      # an unscaled cast would flush small gradients
                    raise RuntimeError(f"{t.op}: the product's operands {a.op} and {b.op} do not view the "
                                       "cotangent once")
                return codegen.matmul.accelerate(a, b, ta, tb, f16_round=flags)
            return OPS[t.op].extra["decompose"](*ops, **t.attrs, product=rounding_product)
        if path == "scale":
            ops, unscale = [], []
            for x, n in zip(t.inputs, ins):
                if x.id in forward:
                    ops.append(operand(x, n))
                else:
                    v, peak = gradient_operand(x, n)
                    ops.append(v)
                    unscale.append(peak)
            y = apply(t, ops)
            for peak in unscale:     # one factor at a time: their product could underflow
                y = y * (1.0 / GRAD_SCALE_TARGET) * peak
            return y
        return None
    return rw


def refresh_f16_copies(targets, updates, f16_weights) -> dict:
    """The f16 copy of every updated parameter that has one, computed from its new value:
    appended to ``targets`` (a list of the lowered graph) with its copy's name added to
    ``updates``, so an optimizer step writes the master weight and its copy in one pass."""
    from .ops import cast
    updates = dict(updates or {})
    for i, name in list(updates.items()):
        if name in f16_weights:
            updates[len(targets)] = f16_copy_name(name)
            targets.append(cast(targets[i], "f16"))
    return updates


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
                 cache=False, adapter=None, on_compile=None, on_render=None) -> KernelPlan:
    """Kernels computing ``targets`` (tensors of one graph). ``n_forward``: how many leading
    targets are forward outputs (accelerated precision applies to what they depend on).
    ``updates``: {target index: parameter/state name} for targets that become that
    tensor's new value after the call; where it is safe they are written in place.
    ``cache``: read and write the on-disk plan cache (``plan_cache``; the runtime turns it
    on, keyed with ``adapter``, the device's description); a plan read from it carries
    each kernel's name, archetype and output but not its IR. ``on_compile()`` is called
    before the compiler passes run (not for a plan from the cache): a runtime starts there
    what compiling the new kernels will need. ``on_render(kernel, text)`` is called for each
    text as it is rendered (each distinct text once; merged launches and matmuls first): a
    runtime may start making those kernels while the rest of the plan is rendered."""
    opts = options or CompileOptions()
    with gc_paused():
        key = None
        if cache:
            from . import plan_cache
            key = plan_cache.plan_key(targets, n_forward, opts, updates, adapter)
            plan = plan_cache.load(key) if key is not None else None
            if plan is not None:
                return plan
        if on_compile is not None:
            on_compile()
        # attention routes by precision (``attention.ACCELERATED_MAX_ROW_WORK``)
        accelerated = codegen.attention.ACCELERATED.set(opts.precision == "accelerated")
        try:
            plan = _compile_plan(targets, n_forward, opts, updates, on_render)
        finally:
            codegen.attention.ACCELERATED.reset(accelerated)
        if key is not None:
            plan.stats["key"] = key
            plan_cache.store(key, plan)
            plan.stats["cache"] = "stored"
        return plan


def _compile_plan(targets, n_forward, opts, updates, on_render=None) -> KernelPlan:
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
    # launches, matmuls) render first, for ``on_render`` to start them first
    array_limit = opts.max_bindings if opts.binding_arrays else 0
    render, sent = RenderCache(functools.partial(codegen.render, array_limit=array_limit,
                                                 tiled_arrays=opts.precision == "strict")), set()
    for i in sorted(range(len(kernels)), key=lambda i: _render_rank(kernels[i])):
        k = kernels[i]
        wgsl, bufs, groups = render(k)
        dispatches[i] = Dispatch(k, wgsl, bufs, groups)
        if on_render is not None and wgsl not in sent:
            sent.add(wgsl)
            on_render(k, wgsl)
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
                      kp_copies)


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


def update_in_place(kernels, sched, targets, updates) -> int:
    """A new value of a parameter or state computed elementwise from the old one (an
    optimizer update, a KV-cache blend) is written straight into the tensor's buffer, when
    nothing after its writer reads the old value: no copy after the step and no second
    buffer of that size. Returns how many updates became in place."""
    named = {b.name: b for b in sched.bufs if b.kind in ("parameter", "state")}
    touching = touching_units(kernels)
    values: dict = {}            # buffer id -> the schedule's value views on it (target locations)
    for x in sched.values.values():
        values.setdefault(id(x.buf), []).append(x)
    done = 0
    for ti, name in updates.items():
        v = sched.values.get(targets[ti].id)
        dst = named.get(name)
        if v is None or dst is None or v.buf.kind != "target" or v.offset or not v.is_contiguous() \
                or v.buf.nbytes != dst.nbytes or v.dtype is not dst.dtype:
            continue
        # each writer with the view it writes this value by (a further output may be a transpose)
        writers = [(i, u, wv) for i, u in touching.get(id(v.buf), [])
                   if (wv := next((o for o in [u.out, *u.outs] if o.buf is v.buf), None)) is not None]
        if len(writers) != 1:
            continue
        wi, w, written = writers[0]
        # the writer reads the old value only at the element it writes, and nothing else
        # touches the old value from the writer's launch on
        if not reads_only_own_element(w, dst, written) \
                or any(i >= wi and u is not w for i, u in touching.get(id(dst), [])):
            continue
        move_value(touching, v.buf, dst)
        for x in values.pop(id(v.buf), []):
            x.buf = dst
        done += 1
    return done


def _is_copy_cast(k, copies) -> bool:
    """``k`` casts one whole value into an f16 copy named in ``copies``."""
    e = k.spec.get("expr")
    return k.archetype == "pointwise" and k.out.buf.name in copies and len(k.reads) == 1 and not k.epi_reads \
        and e is not None and e[0] == "op" and e[1].op == "cast" and e[2] == [("leaf", 0)] \
        and k.out.is_contiguous() and k.reads[0].is_contiguous() and k.epilogue is None


def _n_bindings(k) -> int:
    return len({id(v.buf) for v in k.read_views()} | {id(b) for b in k.written_bufs()})


def store_copies_with_writers(kernels, copies, max_bindings=8) -> list:
    """An f16 copy computed from a value that a pointwise kernel (or part) wrote earlier
    becomes a second store of that writer (``spec["stores"]``): the optimizer's update
    writes the master weight and its f16 copy in one pass, and the cast's launch goes.
    Only when nothing touches the value or the copy between the two, and the writer's
    launch has a binding left."""
    writer: dict = {}        # id(buf) -> (launch position, its kernel, pointwise unit that last wrote it whole)
    last: dict = {}          # id(buf) -> last launch position that read or wrote it
    out = []
    for i, k in enumerate(kernels):
        units = k.spec.get("parts", [k]) if k.archetype == "multi" else [k]
        kept = []
        for u in units:
            src = u.reads[0] if _is_copy_cast(u, copies) else None
            w = writer.get(id(src.buf)) if src is not None else None
            if w is not None and w[2].out.offset == src.offset and w[2].out.shape == src.shape \
                    and last.get(id(src.buf)) == w[0] and last.get(id(u.out.buf), -1) < w[0] \
                    and _n_bindings(w[1]) < max_bindings:
                w[2].spec = {**w[2].spec, "stores": [*w[2].spec.get("stores", []), u.out]}
                last[id(u.out.buf)] = w[0]
                continue
            kept.append(u)
        for u in kept:
            for v in list(u.reads) + list(u.epi_reads):
                last[id(v.buf)] = i
            for b in u.written_bufs():
                last[id(b)] = i
                writer.pop(id(b), None)
            if u.archetype == "pointwise" and u.epilogue is None and u.out.is_contiguous() \
                    and u.out.size * u.out.dtype.np.itemsize == u.out.buf.nbytes:
                writer[id(u.out.buf)] = (i, k, u)
        if not kept:
            continue
        if k.archetype == "multi" and len(kept) != len(units):
            k.spec = {**k.spec, "parts": kept}
            k.name = "|".join(u.name for u in kept)
        out.append(k)
    return out


def count_dispatches(targets, **kw) -> int:
    """Dispatches the GPU backend records for ``targets`` (no device needed)."""
    return compile_plan(targets, **kw).n_dispatches


__all__ = ["Buf", "CompileOptions", "KernelPlan", "compile_plan", "count_dispatches"]
