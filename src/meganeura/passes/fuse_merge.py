"""The ``horizontal`` fusion pass: independent kernels close together share one launch
(pointwise kernels and mergeable reductions as ``multi`` launches, sibling GEMVs reading the
same A, tiled matmuls of the same tile), with GEMVs paired and cheap producers inlined into
their readers first."""
from __future__ import annotations

import itertools

import numpy as np

from ..codegen.matmul_tiles import block_of
from ..schedule import Kernel
from ..ops.registry import OPS
from .fuse_index import _Uses, _has_rleaf, _relabel, _same_elements, _splice


def _binding_keys(k) -> set:
    """What a kernel binds in a merged launch: each buffer read per dtype, each written."""
    return {(id(v.buf), v.dtype.name) for v in k.read_views()} | {(id(b), None) for b in k.written_bufs()}


MAX_FLOAT = 8           # kernels a group that reads intermediates may be moved past
MAX_GROUPS = 1 << 22    # workgroups of one merged launch
MAX_PARTS = 64          # kernels in one merged launch (its WGSL grows with each)
# tiled matmuls in one merged launch: each part carries a whole unrolled tiled body, and the
# driver's compile time grows with the kernel (H200: SmolVLA's 14 hoisted projections in one
# launch, 336 KiB of SPIR-V, took 1.7 s alone, the floor of its cold compile); the launches
# of the pieces are independent, so the Vulkan backend puts no barrier between them
MAX_TILED_PARTS = 4


def _group_key(k):
    """Kernels with equal keys can share a launch: pointwise ones, and GEMVs (B transposed)
    that read the same A (sibling projections such as q, k and v)."""
    from ..codegen.reduce import mergeable
    if k.archetype == "pointwise" or k.archetype == "reduce" and mergeable(k):
        return ("pointwise",)          # reductions share "multi" launches with pointwise kernels
    if k.archetype == "matmul" and k.spec.get("gemv") and k.spec["tb"] and "parts" not in k.spec:
        a = k.reads[0]
        pro = k.spec.get("prologue")
        pro = pro and (tuple(sorted(pro.items())), tuple(id(v.buf) for v in k.reads[2:]))
        return ("gemv", id(a.buf), a.offset, a.shape, a.strides, k.spec["ta"], k.shape[:-1], pro)
    if k.archetype == "matmul" and not k.spec.get("gemv") and "parts" not in k.spec and "tile" in k.spec:
        # each part of a merged tiled launch loads its own operands: any independent
        # matmuls with the same tile and the same y/z workgroup counts can share one
        # (sibling projections, and the backward's input and weight gradients)
        block, m = block_of(k.spec), k.shape[-2]
        nb = int(np.prod(k.spec.get("batch") or (1,))) * k.spec.get("split", 1)
        return ("tiled", block, -(-m // block[0]), nb)
    return None


def _groups_of(k):
    from ..codegen.common import WG
    if k.archetype == "pointwise":
        return -(-k.out.size // WG)
    if k.archetype == "reduce":
        from ..codegen import reduce
        return reduce.groups(k)
    if k.spec.get("gemv"):
        return -(-k.shape[-1] // 2)       # at most (codegen.matmul.gemv_columns)
    TM, TN = block_of(k.spec)[:2]
    return -(-k.shape[-1] // TN) * -(-k.shape[-2] // TM) * int(np.prod(k.spec.get("batch") or (1,))) * k.spec.get("split", 1)


class _Group:
    def __init__(self, key, seq):
        self.key, self.seq, self.kernels, self.deps = key, seq, [], set()
        self.writes, self.reads = set(), set()
        self.bindings = set()       # what _bindings counts, kept as kernels join
        self.passed = self.groups = 0
        # persistent buffers that a kernel writing a new value (a target) reads: the old
        # value of a parameter or moment, replaced in place after fusion when no launch reads
        # it later, so the groups whose kernels read it are emitted first
        self.replaced = set()
        # a group that reads only persistent buffers (an optimizer update reads gradients,
        # parameters and moments) extends no intermediate's life, so it may float any distance
        self.temps = False

    def conflicts(self, kw, kr) -> bool:
        return bool((kw | kr) & self.writes or kw & self.reads)

    def fits(self, k, groups, max_bindings) -> bool:
        parts = MAX_TILED_PARTS if self.key[0] == "tiled" else MAX_PARTS
        return (len(self.kernels) < parts and self.groups + groups <= MAX_GROUPS
                and len(self.bindings | _binding_keys(k)) <= max_bindings)

    def add(self, k, kw, kr, groups):
        self.kernels.append(k)
        self.writes |= kw
        self.reads |= kr
        self.groups += groups
        self.bindings |= _binding_keys(k)
        self.temps |= any(v.buf.kind == "temp" for v in k.read_views())
        if any(b.kind == "target" for b in k.written_bufs()):
            self.replaced |= {id(v.buf) for v in k.read_views() if v.buf.kind in ("parameter", "state")}

    def kernel(self):
        ks = self.kernels
        if len(ks) == 1:
            return ks[0]
        name = "|".join(k.name for k in ks)
        if self.key[0] == "pointwise":
            return Kernel(name, "multi", {"parts": list(ks)}, ks[0].out)
        if self.key[0] == "tiled":
            return Kernel(name, "matmul", {"parts": list(ks)}, ks[0].out)
        return Kernel(name, "matmul", {"gemv": True, "tb": True, "parts": list(ks)}, ks[0].out)


def _reaches(a, b) -> bool:
    """Group ``a`` is emitted after group ``b`` (depends on it, through its dependencies)."""
    seen, stack = set(), [a]
    while stack:
        g = stack.pop()
        if g is b:
            return True
        if id(g) not in seen:
            seen.add(id(g))
            stack.extend(g.deps)
    return False


def _pair_gemvs(kernels, max_bindings):
    """A GEMV whose epilogue alone reads another GEMV's output over the same A (SwiGLU:
    up * silu(gate) while decoding) computes both products in the same workgroups: the
    other product's value reaches the epilogue as ``acc2`` and is never stored."""
    kernels = list(kernels)
    uses = _Uses(kernels)

    def plain(k):
        return k is not None and k.archetype == "matmul" and k.spec.get("gemv") and k.spec["tb"] \
            and not k.spec["ta"] and "parts" not in k.spec and "pair" not in k.spec and k.spec.get("split", 1) == 1
    for ui, u in enumerate(kernels):
        if not plain(u):
            continue
        for li, lv in enumerate(u.epi_reads):
            gi = uses.producer(lv.buf, ui)
            if gi is None:
                continue
            g = kernels[gi]
            if not plain(g) or g.epilogue is not None or g.out.buf.kind != "temp" or g.shape != u.shape \
                    or _group_key(g) != _group_key(u):
                continue
            if not uses.read_only_by(g.out.buf, ui, u.epi_reads) or not _same_elements(g, lv):
                continue
            if any(uses.touched_between(v.buf, gi, ui, writes_only=True) for v in g.reads):
                continue
            if len({id(v.buf) for v in u.read_views() + [g.reads[1]]} | {id(u.out.buf)}) > max_bindings:
                continue
            uses.remove(ui, u)
            uses.remove(gi, g)
            leaf_map = {j: ("acc2",) if j == li else ("leaf", j - (j > li)) for j in range(len(u.epi_reads))}
            u.epilogue = _relabel(u.epilogue, leaf_map)
            u.epi_reads = [v for j, v in enumerate(u.epi_reads) if j != li]
            u.reads = list(u.reads) + [g.reads[1]]
            u.spec = {**u.spec, "pair": {"b_index": len(u.reads) - 1}}
            u.name = f"{g.name}&{u.name}"
            kernels[gi] = None
            uses.add(ui, u)
            break
    return [k for k in kernels if k is not None]


MAX_INLINE_OPS = 3     # a producer this small is recomputed rather than waited for


def _ops(e) -> int:
    """Elementwise ops in expression ``e`` (an op that stands for several counts as many)."""
    if e[0] != "op":
        return 0
    od = OPS.get(e[1].op)
    return (od.extra.get("ops", 1) if od is not None else 1) + sum(_ops(k) for k in e[2])


def _inline_cheap_producers(kernels, max_bindings):
    """A small pointwise kernel that the next kernel (pointwise) reads while others read it
    too (SwiGLU's silu(gate), kept for the backward) is recomputed inside that reader, so
    the two no longer depend on each other and can share a launch."""
    kernels = list(kernels)
    for ki in range(len(kernels) - 1):
        k, p = kernels[ki], kernels[ki + 1]
        if k.archetype != "pointwise" or p.archetype != "pointwise" or p.epilogue is not None or p.outs \
                or k.spec.get("flat_leaf") or p.spec.get("flat_leaf") or _has_rleaf(k.spec["expr"]) \
                or _has_rleaf(p.spec["expr"]) or _ops(k.spec["expr"]) > MAX_INLINE_OPS \
                or k.out.shape != p.out.shape or k.out.dtype.name != "f32":   # f16 stores round
            continue
        li = [j for j, v in enumerate(p.reads) if v.buf is k.out.buf]
        if len(li) != 1 or not _same_elements(k, p.reads[li[0]]) or any(v.buf is p.out.buf for v in k.reads):
            continue
        others = [v for j, v in enumerate(p.reads) if j != li[0]]
        if any(v.buf is k.out.buf for v in others) \
                or len({id(v.buf) for v in list(k.reads) + others} | {id(p.out.buf)}) > max_bindings:
            continue
        leaf_map = _splice(len(p.reads), li[0], k.spec["expr"], len(k.reads))
        p.spec = {**p.spec, "expr": _relabel(p.spec["expr"], leaf_map)}
        p.reads = list(k.reads) + others
        p.name = f"{k.name}+{p.name}"
    return kernels


def merge_horizontal(kernels, max_bindings):
    """Independent kernels of one kind become one launch: RoPE of q and k, optimizer
    updates of many parameters, the q/k/v projections of one input.

    Groups stay open while later kernels do not touch what they write (nor write what they
    read); those kernels run first. A kernel that depends on open groups may still join a
    group created after them (groups are emitted in creation order, each after the groups
    it depends on), so chains such as moment update -> parameter update become two wide
    launches, not one narrow launch per parameter."""
    kernels = _inline_cheap_producers(_pair_gemvs(kernels, max_bindings), max_bindings)
    out, open_ = [], []
    seq = itertools.count()

    def close(g):
        if g not in open_:
            return
        for d in sorted(g.deps, key=lambda d: d.seq):     # creation order: deterministic
            close(d)
        open_.remove(g)
        out.append(g.kernel())

    for k in kernels:
        kw = {id(b) for b in k.written_bufs()}
        kr = {id(v.buf) for v in k.read_views()}
        hits = [g for g in open_ if g.conflicts(kw, kr)]
        key = _group_key(k)
        if key is None:
            for g in hits:
                close(g)
            out.append(k)
            for g in list(open_):
                g.passed += 1
                if g.temps and g.passed >= MAX_FLOAT:
                    close(g)
            continue
        groups = _groups_of(k)
        last_hit = max((open_.index(g) for g in hits), default=-1)
        hit = set(hits)
        g = next((g for g in open_[last_hit + 1:]                      # the earliest it may join
                  if g.key == key and not any(_reaches(h, g) for h in hit)), None)
        if g is not None and not g.fits(k, groups, max_bindings):
            close(g)
            g = None
        if g is None:
            g = _Group(key, next(seq))
            open_.append(g)
        g.deps |= hit
        g.add(k, kw, kr, groups)
        for o in open_:
            if o is g:
                continue
            # a group replacing what k reads comes after k's; one reading what k replaces, before
            if o.replaced & kr and not _reaches(g, o):
                o.deps.add(g)
            if g.replaced & o.reads and not _reaches(o, g):
                g.deps.add(o)
    while open_:
        close(open_[0])
    del close               # it holds itself through its cell: a cycle holding every group
    return out
