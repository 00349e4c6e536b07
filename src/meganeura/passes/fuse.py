"""Fusion passes over the kernel IR (lists of ``schedule.Kernel`` in launch order).

Each pass is a function ``(kernels, max_bindings) -> kernels`` registered in
``FUSION_PASSES`` by name; ``MEGANEURA_NO_FUSE=name,...`` (or ``all``) switches passes off
for debugging. Passes only move work between kernels: every buffer keeps its meaning, so
the memory planner and the runtime need no knowledge of them.

- ``epilogue``: a pointwise kernel that is the only reader of another kernel's output
  becomes that kernel's epilogue (matmul + bias/activation/residual, reductions + scale,
  softmax/norm + mul, ...), so the intermediate is never stored.
- ``prologue``: a pointwise kernel read only by a reduction is evaluated in its loads; a
  norm read only by GEMVs is computed inside them.
- ``rows``: reductions read only by a pointwise kernel that broadcasts them back over the
  reduced axes run with it as one row kernel.
- ``normstats``: a norm statistic the backward reads is stored by the forward norm kernel
  over the same rows.
- ``stores``: a copy of a kernel's whole output into a slice of another buffer (a
  concat) becomes a second store of that kernel.
- ``outputs``: a pointwise kernel computes the pointwise kernels that write its operands
  and stores their values too (AdamW's moments with its parameter update).
- ``hoist``: kernels that read only inputs and parameters move to the front, so that
  ``horizontal`` can merge the same work of every layer.
- ``quantized``: GEMVs on quantized weights take the norm they read, pair (gate and up)
  and merge (q, k, v) as matmul GEMVs do (``fuse_quantized.py``).
- ``horizontal``: independent pointwise kernels close together run as one launch.
"""
from __future__ import annotations

import functools
import itertools
import os
from collections import defaultdict

import numpy as np

from ..codegen.common import broadcast_view_strides
from ..codegen.matmul import block_of, rounded_operands
from ..schedule import MAX_INLINE_DEPTH, Kernel, View, contiguous_strides, expr_depth, reshape_view
from ..ops.registry import OPS
from .fuse_quantized import fuse_quantized

# archetypes whose renderers end in ``store_out`` (codegen.expr.OutputStore)
EPILOGUE_ARCHETYPES = frozenset({"matmul", "reduce", "rows", "norm", "gather", "attention", "quantized"})


class _Uses:
    """Which kernels (by position) write and read each logical buffer."""

    def __init__(self, kernels):
        self.writers, self.readers = writers, readers = defaultdict(list), defaultdict(list)
        for i, k in enumerate(kernels):
            if k is None:           # fused away by an in-place pass (``_in_place``)
                continue
            spec = k.spec
            if k.outs or "parts" in spec or "stores" in spec or "gathers" in spec:
                self.add(i, k)
                continue
            # one output, every read stored: written_bufs and read_views spelled out (each
            # fusion pass indexes the whole plan: SmolLM2's train step 48 times)
            writers[id(k.out.buf)].append(i)
            for v in k.reads:
                readers[id(v.buf)].append(i)
            for v in k.epi_reads:
                readers[id(v.buf)].append(i)

    def add(self, i, k):
        for b in k.written_bufs():
            self.writers[id(b)].append(i)
        for v in k.read_views():
            self.readers[id(v.buf)].append(i)

    def remove(self, i, k):
        for b in k.written_bufs():
            self.writers[id(b)].remove(i)
        for v in k.read_views():
            self.readers[id(v.buf)].remove(i)

    def touched_between(self, buf, lo, hi, writes_only=False) -> bool:
        uses = self.writers[id(buf)] + ([] if writes_only else self.readers[id(buf)])
        return any(lo <= u < hi for u in uses)

    def producer(self, buf, pos):
        """The position of ``buf``'s only writer when it runs before ``pos``, else None."""
        ws = self.writers[id(buf)]
        return ws[0] if len(ws) == 1 and ws[0] < pos else None

    def read_only_by(self, buf, pos, views) -> bool:
        """``buf`` is read by the kernel at ``pos`` alone, through exactly one of ``views``."""
        return set(self.readers[id(buf)]) == {pos} and sum(v.buf is buf for v in views) == 1


def _in_place(fuse):
    """A pass that fuses in place, ``fuse(kernels, uses, max_bindings)``: kernels keep their
    positions (None where one was fused away) and ``uses`` is kept up to date, so a run of
    such passes shares one index (``run_fusion``) instead of each building its own (12 a
    plan were the largest self-time of SmolLM2's training-step compile). Called as
    ``fuse_x(kernels, max_bindings)`` it is a pass like the others."""
    @functools.wraps(fuse)
    def run(kernels, max_bindings):
        kernels = list(kernels)
        fuse(kernels, _Uses(kernels), max_bindings)
        return [k for k in kernels if k is not None]
    run.in_place = fuse
    return run


def _relabel(e, leaf_map, rleaf_map=None):
    """``e`` with ("leaf", i) replaced by ``leaf_map[i]`` (an expression), and ("rleaf", i)
    by ``rleaf_map[i]`` when given."""
    if e[0] == "leaf":
        return leaf_map[e[1]]
    if e[0] == "rleaf" and rleaf_map is not None:
        return rleaf_map[e[1]]
    if e[0] == "op":
        return ("op", e[1], [_relabel(k, leaf_map, rleaf_map) for k in e[2]])
    return e


def _splice(n_leaves, li, replacement, base):
    """A leaf map for an expression of ``n_leaves`` leaves: leaf ``li`` becomes
    ``replacement`` and the others become leaves ``base``, ``base + 1``, ... in order."""
    others = [j for j in range(n_leaves) if j != li]
    return {li: replacement, **{j: ("leaf", base + n) for n, j in enumerate(others)}}


def _has_rleaf(e) -> bool:
    return e[0] == "rleaf" or (e[0] == "op" and any(_has_rleaf(k) for k in e[2]))


def _covers(k, view) -> bool:
    """``view`` spans ``k``'s contiguous output: same buffer, start and size."""
    o = k.out
    return o.is_contiguous() and view.buf is o.buf and view.offset == o.offset and view.size == o.size


def _same_elements(k, view) -> bool:
    """``view`` reads exactly what ``k`` wrote, element for element in row-major order."""
    return _covers(k, view) and view.is_contiguous()


def _permutes(k, view) -> bool:
    """``view`` reads every element ``k`` wrote exactly once, in another order (a transpose
    of ``k``'s contiguous output)."""
    if not _covers(k, view):
        return False
    dims = sorted((s, n) for s, n in zip(view.strides, view.shape) if n != 1)
    expect = 1
    for s, n in dims:
        if s != expect:
            return False
        expect *= n
    return True


def _store_permuted(k, p, uses, ki, pi) -> bool:
    """``p`` only copies ``k``'s output into another layout: ``k`` stores there itself."""
    if p.spec["expr"] != ("leaf", 0) or len(p.reads) != 1 or not p.out.is_contiguous():
        return False
    leaf = p.reads[0]
    if not p.spec.get("flat_leaf") and leaf.shape != p.out.shape:
        return False
    if "store_map" in k.spec or not _permutes(k, leaf) or uses.touched_between(p.out.buf, ki, pi):
        return False
    uses.remove(ki, k)
    uses.remove(pi, p)
    k.spec = {**k.spec, "shape": k.shape, "out_dtype": k.dtype,
              "store_map": (leaf.shape, tuple(leaf.strides)), "fd_from": len(k.epi_reads)}
    k.out = p.out
    k.name = f"{k.name}+{p.name}"
    uses.add(ki, k)
    return True


def _pointwise_store_permuted(k, p, leaf, uses, ki, pi) -> bool:
    """``p`` only copies pointwise kernel ``k``'s output into another layout through a
    transpose of its dims: ``k`` writes that layout directly (its output becomes a strided
    view of ``p``'s). ``k`` first iterates the leaf's dims in its own memory order, so a
    dim that the leaf splits (a sequence read back as height x width) is split in ``k``."""
    o = k.out
    if p.spec["expr"] != ("leaf", 0) or len(p.reads) != 1 or not p.out.is_contiguous() \
            or k.out.buf.kind != "temp" or k.spec.get("flat_leaf") or _has_rleaf(k.spec["expr"]) \
            or not o.is_contiguous() or p.out.dtype is not o.dtype:
        return False
    if not p.spec.get("flat_leaf") and leaf.shape != p.out.shape:
        return False
    if not uses.read_only_by(leaf.buf, pi, p.reads) or not _permutes(k, leaf) \
            or uses.touched_between(p.out.buf, ki, pi):
        return False
    # k's elements in memory order are the leaf's dims (size > 1) by falling stride
    order = sorted((d for d, n in enumerate(leaf.shape) if n != 1), key=lambda d: -leaf.strides[d])
    shape = tuple(leaf.shape[d] for d in order) or (1,)
    reads = [reshape_view(View(v.buf, o.shape, tuple(broadcast_view_strides(v, o.shape)), v.offset, v.dtype), shape)
             for v in k.reads]
    if any(v is None for v in reads):
        return False
    dest = contiguous_strides(leaf.shape)
    uses.remove(ki, k)
    uses.remove(pi, p)
    k.reads = reads
    k.out = View(p.out.buf, shape, tuple(dest[d] for d in order) or (0,), p.out.offset, p.out.dtype)
    k.name = f"{k.name}+{p.name}"
    uses.add(ki, k)
    return True


def _compose_pointwise(k, p, li, leaf, uses, ki, pi, max_bindings, kernels):
    """``p`` reads pointwise kernel ``k``'s output at the same elements (possibly through a
    reshape): one kernel evaluates both (for kernels made by lowerings, such as the split-K
    sum, or after views the schedule could not see through). It runs where ``k`` ran when
    ``p``'s other operands are ready there, else where ``p`` ran when ``k``'s operands
    still hold their values there. Returns where it runs, or None."""
    if k.spec.get("flat_leaf") or _has_rleaf(k.spec["expr"]) or k.out.buf.kind != "temp" or k.dtype is not leaf.dtype:
        return None
    if not uses.read_only_by(leaf.buf, pi, p.reads) or not _same_elements(k, leaf):
        return None
    copies = (k.spec["expr"], p.spec["expr"]) == (("leaf", 0), ("leaf", 0)) and len(k.reads) == len(p.reads) == 1
    if p.spec.get("flat_leaf"):
        # a copy into a contiguous layout, then a reshape that reads it in logical order:
        # the reshape reads the copy's source in its logical order instead
        if not copies or leaf.shape != k.out.shape or k.reads[0].shape != k.out.shape \
                or k.reads[0].dtype is not p.out.dtype:
            return None
        k_reads, others = list(k.reads), []
    elif leaf.shape != p.out.shape:
        return None
    else:
        k_reads, others = list(k.reads), [v for j, v in enumerate(p.reads) if j != li]
    if k.out.shape != p.out.shape and not p.spec.get("flat_leaf"):
        # k's operands (broadcast to k's shape) re-viewed in p's
        k_reads = [reshape_view(View(v.buf, k.out.shape, tuple(broadcast_view_strides(v, k.out.shape)),
                                     v.offset, v.dtype), p.out.shape) for v in k.reads]
    if any(v is None for v in k_reads):
        return None
    if len({id(v.buf) for v in k_reads + others} | {id(p.out.buf)}) > max_bindings:
        return None
    at_k = not any(uses.touched_between(v.buf, ki, pi, writes_only=True) for v in others) \
        and not uses.touched_between(p.out.buf, ki, pi)
    if not at_k and any(uses.touched_between(v.buf, ki + 1, pi, writes_only=True) for v in k.reads):
        return None
    leaf_map = _splice(len(p.reads), li, k.spec["expr"], len(k_reads))
    uses.remove(ki, k)
    uses.remove(pi, p)
    spec = {**k.spec, "expr": _relabel(p.spec["expr"], leaf_map), "dtype": p.out.dtype}
    if p.spec.get("flat_leaf"):
        spec["flat_leaf"] = True
    fused = Kernel(f"{k.name}+{p.name}", "pointwise", spec, p.out, k_reads + others)
    at = ki if at_k else pi
    kernels[ki] = kernels[pi] = None
    kernels[at] = fused
    uses.add(at, fused)
    return at


@_in_place
def fuse_epilogues(kernels, uses, max_bindings):
    for start in range(len(kernels)):
        pi = start
        while pi is not None:       # a composed pointwise kernel may absorb more producers
            pi = _absorb_producer(kernels, pi, uses, max_bindings)


def _absorb_producer(kernels, pi, uses, max_bindings):
    """Pointwise kernel ``pi`` joins one producer (as its epilogue, or composed with a
    pointwise producer). Returns the composed kernel's position to try again, else None."""
    p = kernels[pi]
    if p is None or p.archetype != "pointwise" or p.epilogue is not None:
        return None
    if _has_rleaf(p.spec["expr"]):
        return None         # indexed reads need the pointwise kernel's own coordinates
    p_depth = expr_depth(p.spec["expr"])
    for li, leaf in enumerate(p.reads):
        ki = uses.producer(leaf.buf, pi)
        if ki is None:
            continue
        k = kernels[ki]
        # a long chain stays cut where the schedule cut it (shallow expressions)
        if p_depth + expr_depth(k.spec["expr"] if k.archetype == "pointwise" else k.epilogue) > MAX_INLINE_DEPTH:
            continue
        if k.archetype == "pointwise":
            at = _compose_pointwise(k, p, li, leaf, uses, ki, pi, max_bindings, kernels)
            if at is not None:
                return at
            if _pointwise_store_permuted(k, p, leaf, uses, ki, pi):
                kernels[pi] = None
                return None
            continue
        if k.archetype not in EPILOGUE_ARCHETYPES or k.out.buf.kind != "temp" \
                or "index" in k.spec:      # a scatter stores where its data says
            continue
        if not uses.read_only_by(leaf.buf, pi, p.reads):
            continue
        if not _same_elements(k, leaf) or leaf.shape != p.out.shape:
            if _store_permuted(k, p, uses, ki, pi):
                kernels[pi] = None
                return None
            continue
        if k.archetype in ("matmul", "rows", "norm") and k.dtype.name != "f32":
            continue            # the stored value would have been rounded first
        # each operand as a view of p's iteration shape (broadcasts as zero strides): a
        # later fusion may change the kernel's output shape, never its element order
        others = [View(v.buf, p.out.shape, tuple(broadcast_view_strides(v, p.out.shape)), v.offset, v.dtype)
                  for j, v in enumerate(p.reads) if j != li]
        # the other operands must hold their values already where k runs, and the
        # output must not be touched in between
        if any(uses.touched_between(v.buf, ki, pi, writes_only=True) for v in others):
            continue
        if uses.touched_between(p.out.buf, ki, pi):
            continue
        bufs = {id(v.buf) for v in k.read_views() + others + k.outs} | {id(p.out.buf)}
        if len(bufs) > max_bindings:
            continue
        leaf_map = _splice(len(p.reads), li, k.epilogue or ("acc",), len(k.epi_reads))
        uses.remove(ki, k)
        uses.remove(pi, p)
        k.epilogue = _relabel(p.spec["expr"], leaf_map)
        k.epi_reads = list(k.epi_reads) + others
        k.spec = {**k.spec, "shape": k.shape, "out_dtype": k.dtype}
        k.out = p.out
        k.name = f"{k.name}+{p.name}"
        kernels[pi] = None
        uses.add(ki, k)
        return None
    return None


def _is_gemv_tb(k):
    return k.archetype == "matmul" and k.spec.get("gemv") and k.spec["tb"] and not k.spec["ta"] \
        and "parts" not in k.spec and "prologue" not in k.spec


def _is_tiled_plain(k):
    return k.archetype == "matmul" and not k.spec.get("gemv") and "tile" in k.spec and not k.spec["ta"] \
        and "parts" not in k.spec and "prologue" not in k.spec and not k.spec.get("f16_round")


MAX_PROLOGUE_ROW = 16384    # a thread loops over one row for its statistics (loop bound)
# Each workgroup of a tiled matmul that reads a norm computes its rows' statistics again:
# (column tiles x K splits) x rows x row length elements read in all. Past
# TILED_PROLOGUE_READ_ELEMENTS the norm keeps its launch. H200 GPU time per launch:
# Whisper's feed-forward input (1500 rows of 384, 24 readers: 13.8M) 162 us fused -> 84
# with the norm apart; SmolVLA's gate/up (50 rows of 720, 256 readers: 9.2M) 30.2 -> 16.6
# + 5.4; SmolLM2's (128 of 576, 144 readers: 10.6M) 40.8 -> 26.9 + 5.4 (inference 4.0 ->
# 3.6 ms wall). SmolLM2's q/k/v (5.3M) broke even apart, and U-Net's (at most 1.2M) lost 4%.
TILED_PROLOGUE_READ_ELEMENTS = int(os.environ.get("MEGANEURA_TILED_PROLOGUE_READ_ELEMENTS", str(6 << 20)))


def _tiled_prologue_pays(g) -> bool:
    """Whether tiled matmul ``g`` computes its A rows' norm statistics itself (above)."""
    readers = -(-g.shape[-1] // block_of(g.spec)[1]) * g.spec.get("split", 1)
    rows = int(np.prod(g.reads[0].shape[:-1], dtype=np.int64))
    return readers * rows * g.reads[0].shape[-1] <= TILED_PROLOGUE_READ_ELEMENTS


def _stores_f16(k) -> bool:
    """``k``'s only epilogue converts its value to f16 (an accelerated matmul's operand)."""
    e = k.epilogue
    return e is not None and not k.epi_reads and e[0] == "op" and e[1].op == "cast" and e[2] == [("acc",)] \
        and k.out.dtype.name == "f16"


@_in_place
def fuse_norm_prologue(kernels, uses, max_bindings):
    """A layer/RMS norm whose every reader is a matmul reading it as A (the norm before
    the q/k/v or gate/up projections) moves into those matmuls: GEMV workgroups compute
    their few rows' statistics, tiled workgroups their tile's rows', and A is normalised
    as it is loaded. In accelerated precision a norm that stores f16 for GEMVs (decoding)
    moves too: the GEMV then reads the normalised value unrounded, and the launch goes;
    tiled readers keep their f16 operand (tensor-core kernels read f16 tiles)."""
    for ni, nk in enumerate(kernels):
        if nk is None or nk.archetype != "norm" or (nk.epilogue is not None and not _stores_f16(nk)) \
                or nk.out.buf.kind != "temp" or not nk.reads[0].is_contiguous() \
                or "stats_only" in nk.spec or "prologue" in nk.spec or nk.outs:
            continue
        readers = sorted(set(uses.readers[id(nk.out.buf)]))
        if not readers or len(uses.writers[id(nk.out.buf)]) != 1:
            continue
        gs = [kernels[i] for i in readers]
        if nk.epilogue is not None and not all(_is_gemv_tb(g) for g in gs):
            continue
        row = nk.spec["row"]
        if row > MAX_PROLOGUE_ROW:
            continue
        if not all((_is_gemv_tb(g) or _is_tiled_plain(g) and _tiled_prologue_pays(g))
                   and g.reads[0].buf is nk.out.buf
                   and _same_elements(nk, g.reads[0])
                   and g.reads[1].buf is not nk.out.buf and g.reads[0].shape[-1] == row
                   and not any(v.buf is nk.out.buf for v in g.epi_reads) for g in gs):
            continue
        if any(uses.touched_between(v.buf, ni, max(readers), writes_only=True) for v in nk.reads):
            continue
        if any(len({id(v.buf) for v in g.read_views() + nk.reads} | {id(g.out.buf)}) > max_bindings for g in gs):
            continue
        x = nk.reads[0]
        for i, g in zip(readers, gs):
            uses.remove(i, g)
            a = g.reads[0]
            g.reads = [View(x.buf, a.shape, a.strides, x.offset, x.dtype), g.reads[1]] + list(nk.reads[1:])
            g.spec = {**g.spec, "prologue": {"kind": nk.spec["kind"], "eps": nk.spec["eps"],
                                             "has_w": nk.spec["weight"], "has_b": nk.spec["bias"]}}
            g.name = f"{nk.spec['kind']}>{g.name}"
            uses.add(i, g)
        uses.remove(ni, nk)
        kernels[ni] = None


# elements of a row a norm keeps in workgroup memory: 12 KiB, beside the 3 KiB of its
# reduction, within WebGPU's default 16 KiB
NORM_STASH_ROW = 3072


def norm_input(k):
    """The view a norm kernel normalises: its first read, or the output of the pointwise
    kernel it computes in its loads (``fuse_norm_producer``)."""
    return k.spec["prologue"]["view"] if "prologue" in k.spec else k.reads[0]


@_in_place
def fuse_norm_producer(kernels, uses, max_bindings):
    """A norm (one workgroup per row) computes the pointwise kernel that writes its input
    (a residual add after a split-K sum) in its loads and stores that value itself, for
    the input's other readers (the residual stream): one launch instead of two. The row
    is kept in workgroup memory between the statistics and the normalised write, so the
    producer's expression is evaluated once per element."""
    for ni, nk in enumerate(kernels):
        if nk is None or nk.archetype != "norm" or "stats_only" in nk.spec or "prologue" in nk.spec or nk.outs:
            continue
        x = nk.reads[0]     # the row is read once, stored (when others read it) and kept
        if not 64 <= nk.spec["row"] <= NORM_STASH_ROW or not x.is_contiguous() or x.dtype.name != "f32" \
                or sum(v.buf is x.buf for v in nk.read_views()) != 1:
            continue
        pi = uses.producer(x.buf, ni)
        if pi is None:
            continue
        p = kernels[pi]
        if p.archetype != "pointwise" or p.epilogue is not None or p.spec.get("flat_leaf") or p.spec.get("stores") \
                or _has_rleaf(p.spec["expr"]) or p.out.buf.kind != "temp" or p.out.buf is not x.buf \
                or not p.out.is_contiguous() or p.out.offset != x.offset or p.out.size != x.size \
                or p.out.dtype.name != "f32":
            continue
        if uses.touched_between(x.buf, pi + 1, ni) \
                or any(uses.touched_between(v.buf, pi, ni, writes_only=True) for v in p.reads):
            continue
        if len({id(v.buf) for v in nk.read_views()[1:] + list(p.reads)} | {id(b) for b in nk.written_bufs()}
               | {id(x.buf)}) > max_bindings:
            continue
        kept = set(uses.readers[id(x.buf)]) != {ni}     # others read it: stored as well
        uses.remove(ni, nk)
        uses.remove(pi, p)
        rest = list(nk.reads[1:])
        nk.spec = {**nk.spec, "prologue": {"expr": p.spec["expr"], "out": p.out, "view": x,
                                           "first": len(rest), "n": len(p.reads)}}
        if kept:
            nk.spec["out_stats"] = ["x"]
            nk.outs = [p.out]
        nk.reads = rest + list(p.reads)
        nk.name = f"{p.name}>{nk.name}"
        kernels[pi] = None
        uses.add(ni, nk)


@_in_place
def fuse_reduce_prologue(kernels, uses, max_bindings):
    """A pointwise kernel whose only reader is a reduction (a weight gradient's sum of
    ct * x, a mean of squares) is evaluated inside the reduction's loads."""
    for ri, rk in enumerate(kernels):
        if rk is None or rk.archetype != "reduce" or "prologue" in rk.spec or len(rk.reads) != 1:
            continue
        v = rk.reads[0]
        pi = uses.producer(v.buf, ri)
        if pi is None:
            continue
        p = kernels[pi]
        if p.archetype != "pointwise" or p.spec.get("flat_leaf") or _has_rleaf(p.spec["expr"]) \
                or not p.out.is_contiguous() or p.out.buf.kind != "temp" or p.out.buf is not v.buf:
            continue
        if not uses.read_only_by(v.buf, ri, rk.reads):
            continue
        if any(uses.touched_between(x.buf, pi, ri, writes_only=True) for x in p.reads):
            continue
        if len({id(x.buf) for x in p.reads} | {id(b) for b in rk.written_bufs()}) > max_bindings:
            continue
        uses.remove(ri, rk)
        uses.remove(pi, p)
        rk.spec = {**rk.spec, "prologue": {"expr": p.spec["expr"], "out": p.out, "view": v}}
        rk.reads = list(p.reads)
        rk.name = f"{p.name}>{rk.name}"
        kernels[pi] = None
        uses.add(ri, rk)


def _load_operand(m, gk, max_bindings):
    """The operand (0 or 1) of tiled matmul ``m`` that is ``gk``'s output, when ``m`` can
    compute it in its loads from ``gk``'s reads instead (one operand, read once, no other
    prologue, bindings to spare), else None. An operand rounded to f16 in the loads
    (``f16_round``: the tensor-core kernel scales it by its stored share's peak) is not
    computed there; the other operand may be (a convolution's weight gradient: the columns)."""
    if m.archetype != "matmul" or m.spec.get("gemv") or "tile" not in m.spec \
            or any(key in m.spec for key in ("parts", "prologue", "gathers")):
        return None
    ops = [j for j in (0, 1) if m.reads[j].buf is gk.out.buf]
    if len(ops) != 1 or rounded_operands(m.spec)[ops[0]] \
            or sum(v.buf is gk.out.buf for v in m.read_views()) != 1 \
            or any(v.buf is m.reads[1 - ops[0]].buf for v in gk.reads) \
            or len({id(v.buf) for v in m.read_views() + gk.reads}
                   | {id(b) for b in m.written_bufs()}) > max_bindings:
        return None
    return ops[0]


def _compute_in_loads(kernels, gi, uses, max_bindings, operand_spec, accept=None):
    """Kernel ``gi`` (a gather or pointwise kernel whose output only tiled matmuls read) is
    evaluated in those matmuls' operand loads (``spec["gathers"]``), when every reader can
    (and ``accept(matmul, operand)`` agrees). Returns whether it was."""
    gk = kernels[gi]
    readers = sorted(set(uses.readers[id(gk.out.buf)]))
    if not readers or len(uses.writers[id(gk.out.buf)]) != 1 or readers[0] < gi:
        return False
    if any(uses.touched_between(v.buf, gi, readers[-1], writes_only=True) for v in gk.reads):
        return False
    ops = [_load_operand(kernels[mi], gk, max_bindings) for mi in readers]
    if None in ops or (accept is not None and not all(accept(kernels[mi], op) for mi, op in zip(readers, ops))):
        return False
    for mi, op in zip(readers, ops):
        m = kernels[mi]
        uses.remove(mi, m)
        m.spec = {**m.spec, "gathers": {op: {**operand_spec, "size": gk.out.size, "offset": gk.out.offset,
                                             "first": len(m.reads), "n": len(gk.reads)}}}
        m.reads = list(m.reads) + list(gk.reads)
        m.name = f"{gk.name}>{m.name}"
        uses.add(mi, m)
    uses.remove(gi, gk)
    kernels[gi] = None
    return True


@_in_place
def fuse_gather_operands(kernels, uses, max_bindings):
    """An im2col read only by tiled matmuls (a convolution's forward and its weight
    gradient) is computed in their operand loads (implicit-GEMM convolution): the column
    matrix is never stored (nor rounded to f16 in memory, where accelerated precision casts
    it: the loads round it)."""
    from ..codegen.gather import inlinable
    for gi, gk in enumerate(kernels):
        if gk is None or not inlinable(gk) or gk.out.buf.kind != "temp" or not gk.out.is_contiguous():
            continue
        _compute_in_loads(kernels, gi, uses, max_bindings, {"body": gk.spec["body"], "dtype": gk.out.dtype.name,
                                                            "im2col": gk.spec.get("im2col")})


MAX_LOAD_RECOMPUTE = 4      # a pointwise operand is evaluated once per output tile across it
MAX_LOAD_LEAVES = 2


@_in_place
def fuse_pointwise_operands(kernels, uses, max_bindings):
    """A small pointwise kernel read only by tiled matmuls (GEGLU's gelu(gate) * value
    before the feed-forward's output projection) is evaluated in their operand loads, when
    each value is recomputed by at most MAX_LOAD_RECOMPUTE output tiles: its launch and
    its stored intermediate go."""

    def accept(m, op):
        M, N = m.shape[-2:]
        TM, TN = block_of(m.spec)[:2]
        return (-(-N // TN) if op == 0 else -(-M // TM)) <= MAX_LOAD_RECOMPUTE

    for gi, gk in enumerate(kernels):
        if gk is None or gk.archetype != "pointwise" or gk.epilogue is not None or gk.spec.get("stores") \
                or gk.spec.get("flat_leaf") or _has_rleaf(gk.spec["expr"]) or gk.out.buf.kind != "temp" \
                or not gk.out.is_contiguous() or gk.out.dtype.name != "f32" or len(gk.reads) > MAX_LOAD_LEAVES \
                or any(v.dtype.name != "f32" for v in gk.reads) or gk.spec["expr"][0] != "op":
            continue
        _compute_in_loads(kernels, gi, uses, max_bindings,
                          {"expr": gk.spec["expr"], "shape": tuple(gk.out.shape)}, accept)


@_in_place
def fuse_prologues(kernels, uses, max_bindings):
    """Producers computed inside their consumer's loads: pointwise kernels into the
    reductions and norms that read them, norms into the matmuls that read them, im2col
    and small pointwise kernels into the tiled matmuls that read them."""
    # a norm that absorbs its producer keeps its launch and stores its rows: its readers
    # no longer recompute the statistics (fuse_norm_prologue leaves it alone)
    for fuse in (fuse_reduce_prologue, fuse_norm_producer, fuse_norm_prologue, fuse_gather_operands,
                 fuse_pointwise_operands):
        fuse.in_place(kernels, uses, max_bindings)


def _row_reduction(rk, p, leaf):
    """(dims, input expression, its reads) when reduction ``rk`` can run inside a row
    kernel with its reader ``p``: it reduces a tensor of ``p``'s shape, and ``p`` reads
    the result broadcast back over the reduced dims."""
    if rk is None or rk.archetype != "reduce" or rk.spec.get("kind") not in ("sum", "mean") \
            or rk.epilogue is not None or "chunks" in rk.spec \
            or "count" in rk.spec or rk.out.buf.kind != "temp" or not rk.out.is_contiguous():
        return None
    pro = rk.spec.get("prologue")
    view = pro["view"] if pro else rk.reads[0]
    if view.shape != p.out.shape:
        return None
    if pro and not (pro["out"].shape == view.shape and view.is_contiguous() and view.offset == pro["out"].offset):
        return None
    dims = tuple(rk.spec["dims"])
    keep = tuple(1 if d in dims else n for d, n in enumerate(view.shape))
    lead = len(keep) - len(leaf.shape)
    if lead < 0 or (1,) * lead + tuple(leaf.shape) != keep or not leaf.is_contiguous() \
            or leaf.offset != rk.out.offset or leaf.size != rk.out.size:
        return None
    return dims, (pro["expr"] if pro else ("leaf", 0)), list(rk.reads) if pro else [view]


@_in_place
def fuse_rows(kernels, uses, max_bindings):
    """Reductions whose only reader is a pointwise kernel that broadcasts their results back
    over the reduced axes (a norm's backward: mean(dn), mean(dn * n), then dx) become one
    row kernel: each kept position's workgroup reduces, then writes its row."""
    for pi, p in enumerate(kernels):
        if p is None or p.archetype != "pointwise" or p.spec.get("flat_leaf") or _has_rleaf(p.spec["expr"]):
            continue
        found = {}
        for li, leaf in enumerate(p.reads):
            ri = uses.producer(leaf.buf, pi)
            if ri is None or not uses.read_only_by(leaf.buf, pi, p.reads):
                continue
            got = _row_reduction(kernels[ri], p, leaf)
            if got is not None:
                found[li] = (ri, got)
        if not found or len({dims for _, (dims, _, _) in found.values()}) != 1:
            continue
        if any(uses.touched_between(v.buf, ri, pi, writes_only=True) for ri, (_, _, rr) in found.values() for v in rr):
            continue
        reads, reduces = [], []
        for li, (ri, (dims, expr, rr)) in sorted(found.items()):
            rk = kernels[ri]
            r = int(np.prod([p.out.shape[d] for d in dims], dtype=np.int64))
            reduces.append({"kind": rk.spec["kind"], "count": r, "expr": expr, "reads": (len(reads), len(reads) + len(rr))})
            reads += rr
        others = [j for j in range(len(p.reads)) if j not in found]
        leaf_map = {li: ("red", n) for n, li in enumerate(sorted(found))}
        leaf_map.update({j: ("leaf", n) for n, j in enumerate(others)})
        out_reads = (len(reads), len(reads) + len(others))
        reads += [p.reads[j] for j in others]
        if len({id(v.buf) for v in reads} | {id(p.out.buf)}) > max_bindings:
            continue
        spec = {"shape": tuple(p.out.shape), "dims": dims, "reduces": reduces, "out_reads": out_reads,
                "expr": _relabel(p.spec["expr"], leaf_map)}
        names = "&".join(kernels[ri].name for ri, _ in sorted(found.values()))
        fused = Kernel(f"{names}>{p.name}", "rowfuse", spec, p.out, reads)
        for ri, _ in found.values():
            uses.remove(ri, kernels[ri])
            kernels[ri] = None
        uses.remove(pi, p)
        kernels[pi] = fused
        uses.add(pi, fused)


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
        g = next((g for g in open_[last_hit + 1:] if g.key == key), None)   # the earliest it may join
        if g is not None and not g.fits(k, groups, max_bindings):
            close(g)
            g = None
        if g is None:
            g = _Group(key, next(seq))
            open_.append(g)
        g.deps |= set(hits)
        g.add(k, kw, kr, groups)
    while open_:
        close(open_[0])
    del close               # it holds itself through its cell: a cycle holding every group
    return out


def _norm_rows_key(k):
    """What decides a norm kernel's row statistics: the rows it reads and how it reduces them."""
    x = norm_input(k)
    return (id(x.buf), x.offset, tuple(x.shape), tuple(x.strides), x.dtype.name, k.spec["kind"], k.spec["eps"],
            k.spec["row"])


@_in_place
def fuse_norm_stats(kernels, uses, max_bindings):
    """A norm statistic the backward reads (``ops.nn.norm_stat``: a stats-only norm kernel)
    over the same rows as an earlier norm kernel is stored by that kernel (``outs``), which
    computes it anyway: the backward does not reduce the input again."""
    norms = {}          # rows key -> position of the first norm kernel over those rows
    for i, k in enumerate(kernels):
        if k is None or k.archetype != "norm":
            continue
        key = _norm_rows_key(k)
        j = norms.get(key)
        only = k.spec.get("stats_only")
        if j is None or not only or k.epilogue is not None or k.outs or not k.out.is_contiguous() \
                or k.out.dtype is not k.reads[0].dtype:
            norms.setdefault(key, i)
            continue
        n = kernels[j]
        if uses.touched_between(norm_input(n).buf, j + 1, i, writes_only=True) \
                or uses.touched_between(k.out.buf, j, i) \
                or len({id(v.buf) for v in n.read_views()} | {id(b) for b in n.written_bufs()} | {id(k.out.buf)}) \
                > max_bindings:
            continue
        uses.remove(j, n)
        uses.remove(i, k)
        n.outs = list(n.outs) + [k.out]
        n.spec = {**n.spec, "out_stats": [*n.spec.get("out_stats", []), only]}
        n.name = f"{n.name}&{k.name}"
        kernels[i] = None
        uses.add(j, n)


def _extent(v) -> tuple:
    """[first, last] element of buffer ``v.buf`` that view ``v`` can touch."""
    span = sum((n - 1) * s for n, s in zip(v.shape, v.strides) if n > 0)
    return v.offset, v.offset + span


def _write_views(k) -> list:
    if "parts" in k.spec:
        return [v for p in k.spec["parts"] for v in _write_views(p)]
    return [k.out] + list(k.outs) + list(k.spec.get("stores", ()))


def _elements(v) -> np.ndarray:
    idx = np.array([v.offset], dtype=np.int64)
    for n, s in zip(v.shape, v.strides):
        idx = np.add.outer(idx, np.arange(n, dtype=np.int64) * s).ravel()
    return idx


def _overlaps(a, b, exact_up_to=1 << 21) -> bool:
    """Views ``a`` and ``b`` may share an element (exact for views of up to
    ``exact_up_to`` elements; larger ones are compared by their extents)."""
    if a.buf is not b.buf:
        return False
    (a0, a1), (b0, b1) = _extent(a), _extent(b)
    if a1 < b0 or b1 < a0:
        return False
    if a.size > exact_up_to or b.size > exact_up_to:
        return True
    return np.intersect1d(_elements(a), _elements(b)).size > 0


def _copy_or_cast(expr) -> bool:
    """``expr`` is its one leaf, or that leaf converted to another type (a cast)."""
    if expr == ("leaf", 0):
        return True
    return expr[0] == "op" and getattr(expr[1], "op", None) == "cast" and list(expr[2]) == [("leaf", 0)]


@_in_place
def fuse_copy_stores(kernels, uses, max_bindings):
    """A kernel that only copies another kernel's whole output into part of a larger buffer
    (a concat's slice: a U-Net skip connection, stored long before the decoder reads it), or
    converts it (the f16 copy of an activation that accelerated matmuls read while the
    backward pass reads the f32 one), becomes a second store of that writer
    (``spec["stores"]``, converted as it is stored): the value is stored twice where it is
    computed, and the copy's launch goes."""
    for pi, p in enumerate(kernels):
        if p is None or p.archetype != "pointwise" or p.epilogue is not None or not _copy_or_cast(p.spec["expr"]) \
                or len(p.reads) != 1 or p.spec.get("flat_leaf") or p.spec.get("stores") or p.out.buf.kind != "temp":
            continue
        src = p.reads[0]
        ki = uses.producer(src.buf, pi)
        if ki is None:
            continue
        k = kernels[ki]
        o = k.out
        if (k.archetype not in EPILOGUE_ARCHETYPES and k.archetype != "pointwise") or "parts" in k.spec \
                or "index" in k.spec or (o.buf, o.offset, o.shape, tuple(o.strides)) != \
                (src.buf, src.offset, p.out.shape, tuple(src.strides)):
            continue
        # nothing reads the destination in between, and what writes it there writes elsewhere
        if any(ki <= j < pi for j in uses.readers[id(p.out.buf)]) \
                or any(_overlaps(w, p.out) for j in set(uses.writers[id(p.out.buf)]) if ki <= j < pi
                       for w in _write_views(kernels[j])):
            continue
        if len({id(v.buf) for v in k.read_views()} | {id(b) for b in k.written_bufs()} | {id(p.out.buf)}) \
                > max_bindings:
            continue
        uses.remove(ki, k)
        uses.remove(pi, p)
        k.spec = {**k.spec, "stores": [*k.spec.get("stores", []), p.out]}
        k.name = f"{k.name}+{p.name}"
        kernels[pi] = None
        uses.add(ki, k)


def _plain_pointwise(k) -> bool:
    """A pointwise kernel whose expression reads each leaf at its own output element."""
    return k is not None and k.archetype == "pointwise" and k.epilogue is None and not k.spec.get("flat_leaf") \
        and not _has_rleaf(k.spec["expr"]) and k.out.is_contiguous()


def _view_through(leaf, k, r):
    """The view of ``r`` (an operand of pointwise kernel ``k``, broadcast to its contiguous
    output) that gives, at each coordinate of ``leaf`` (a view of ``k``'s output: a
    transpose, a split of heads), what ``k`` read for the element ``leaf`` reads there; None
    unless each of ``leaf``'s strides is a multiple of one of the output's within its range."""
    o = k.out
    C, R = contiguous_strides(o.shape), broadcast_view_strides(r, o.shape)
    rel = leaf.offset - o.offset
    if rel < 0 or any(s < 0 for s in leaf.strides):
        return None
    top = []                            # the output coordinates of leaf's first element
    for c in C:
        q, rel = divmod(rel, c)
        top.append(q)
    offset = r.offset + sum(q * st for q, st in zip(top, R))
    strides = []
    for n, s in zip(leaf.shape, leaf.strides):
        if n == 1 or s == 0:
            strides.append(0)
            continue
        i = next((i for i, (c, m) in enumerate(zip(C, o.shape)) if s % c == 0 and s // c < m), None)
        if i is None:
            return None
        top[i] += (n - 1) * (s // C[i])
        strides.append(s // C[i] * R[i])
    if any(t >= m for t, m in zip(top, o.shape)):
        return None                     # the coordinates would carry into another dimension
    return View(r.buf, tuple(leaf.shape), tuple(strides), offset, r.dtype)


@_in_place
def fuse_producer_outputs(kernels, uses, max_bindings):
    """A pointwise kernel computes the pointwise kernels that write what it reads (the
    same elements, or a transpose or split of them) and stores their values as further
    outputs (``outs``, each with its expression in ``spec["out_exprs"]``) where something
    else reads them later: AdamW's parameter update computes both moment updates and stores
    the new moments, so an optimizer step is one pass over parameters, gradients and moments
    (7 accesses per element instead of 10) and one level of launches instead of two;
    SwiGLU's product sums the split-K partials of gate and up itself and stores them for the
    backward; RoPE sums those of q and k, read by heads. The values are stored where the
    reader runs: nothing else may read them in between, nor write what the producer reads.
    The last reader of a chain takes it."""
    for pi in range(len(kernels) - 1, -1, -1):
        p = kernels[pi]
        # (a copy or cast of one value is a second store of its writer: ``stores``, and the
        # f16 copies of updated weights after fusion)
        if p is None or p.archetype != "pointwise" or p.epilogue is not None or p.spec.get("flat_leaf") \
                or not p.out.is_contiguous() or _copy_or_cast(p.spec["expr"]):
            continue
        li = 0
        while li < len(p.reads):
            leaf = p.reads[li]
            ki = uses.producer(leaf.buf, pi)
            k = kernels[ki] if ki is not None else None
            if not _plain_pointwise(k) or k.outs or k.spec.get("stores") or leaf.shape != p.out.shape \
                    or k.dtype is not leaf.dtype or sum(v.buf is leaf.buf for v in p.reads) != 1 \
                    or any(ki < j < pi for j in uses.readers[id(leaf.buf)]) \
                    or any(uses.touched_between(v.buf, ki + 1, pi, writes_only=True) for v in k.reads) \
                    or any(v.buf is p.out.buf for v in k.reads) \
                    or expr_depth(p.spec["expr"]) + expr_depth(k.spec["expr"]) > MAX_INLINE_DEPTH:
                li += 1
                continue
            # ``leaf`` reads every element of k's output once (so nothing is computed twice,
            # and a stored value is written through ``leaf`` at this kernel's coordinates), or
            # k is a few ops read through a broadcast (a scale); an intermediate that only this
            # reader reads (now) is not stored at all
            store = k.out.buf.kind != "temp" or not uses.read_only_by(leaf.buf, pi, p.reads)
            cheap = not store and _ops(k.spec["expr"]) <= MAX_INLINE_OPS
            if not (_permutes(k, leaf) or cheap):
                li += 1
                continue
            same = k.out.shape == leaf.shape and _same_elements(k, leaf)
            k_reads = list(k.reads) if same else [_view_through(leaf, k, r) for r in k.reads]
            if any(v is None for v in k_reads):
                li += 1
                continue
            others = [v for j, v in enumerate(p.reads) if j != li]
            bufs = {id(v.buf) for v in k_reads + others} | {id(b) for b in p.written_bufs()} \
                | ({id(k.out.buf)} if store else set())
            if len(bufs) > max_bindings:
                li += 1
                continue
            uses.remove(ki, k)
            uses.remove(pi, p)
            leaf_map = _splice(len(p.reads), li, k.spec["expr"], len(k.reads))
            rleaf_map = {j: ("rleaf", v[1]) for j, v in leaf_map.items() if j != li}
            # (k's leaves keep their indices: its reads come first)
            rleaf_map[li] = _relabel(k.spec["expr"], {j: ("rleaf", j) for j in range(len(k.reads))})
            p.spec = {**p.spec, "expr": _relabel(p.spec["expr"], leaf_map, rleaf_map),
                      "out_exprs": [_relabel(e, leaf_map) for e in p.spec.get("out_exprs", [])]
                      + ([k.spec["expr"]] if store else [])}
            p.reads = k_reads + others
            p.outs = list(p.outs) + ([View(k.out.buf, leaf.shape, leaf.strides, leaf.offset, k.out.dtype)]
                                     if store else [])
            p.name = f"{k.name}{'&' if store else '+'}{p.name}"
            kernels[ki] = None
            uses.add(pi, p)
            li = 0              # the producer's own reads may come from kernels to compute too


HOIST_MAX_BYTES = 16 << 20     # what hoisted kernels write lives from the start of the call


def hoist_independent(kernels, max_bindings):
    """Kernels that read only inputs, parameters, state and constants and write only
    intermediates move to the front, in order, then the kernels that read only what those
    write (a split-K sum), while what they write stays under HOIST_MAX_BYTES. Every
    cross-attention layer of SmolVLA's expert projects keys and values of the same VLM
    features, and every cross-attention block of the U-Net those of the text context: at
    the front, ``horizontal`` makes each of those one launch instead of one (and one sum)
    per layer, off the critical path. Two levels only: the whole network depends on its
    inputs alone."""
    levels, rest = ([], []), []
    level_of = {}                  # buffer id -> level of the hoisted kernel that writes it
    rest_writes, written, read = set(), set(), set()      # buffer ids
    budget = HOIST_MAX_BYTES
    for k in kernels:
        views, outs = k.read_views(), k.written_bufs()
        nbytes = sum(b.nbytes for b in outs)
        level = 0
        for v in views:
            if id(v.buf) in rest_writes or v.buf.kind == "temp" and id(v.buf) not in level_of:
                level = len(levels)
                break
            level = max(level, level_of.get(id(v.buf), -1) + 1)
        if level < len(levels) and nbytes <= budget \
                and all(b.kind == "temp" and id(b) not in written and id(b) not in read for b in outs):
            levels[level].append(k)
            level_of.update((id(b), level) for b in outs)
            budget -= nbytes
        else:
            rest.append(k)
            rest_writes |= {id(b) for b in outs}
        written |= {id(b) for b in outs}
        read |= {id(v.buf) for v in views}
    return levels[0] + levels[1] + rest


FUSION_PASSES = {"epilogue": fuse_epilogues, "prologue": fuse_prologues, "rows": fuse_rows,
                 "normstats": fuse_norm_stats, "stores": fuse_copy_stores, "outputs": fuse_producer_outputs,
                 "hoist": hoist_independent, "quantized": fuse_quantized, "horizontal": merge_horizontal}


def run_fusion(kernels, disabled=frozenset(), max_bindings=8):
    held = uses = None      # while in-place passes run: the kernels with their holes, and one index
    for name, fn in FUSION_PASSES.items():
        if name in disabled:
            continue
        in_place = getattr(fn, "in_place", None)
        if in_place is not None:
            if held is None:
                held = list(kernels)
                uses = _Uses(held)
            in_place(held, uses, max_bindings)
            continue
        if held is not None:
            kernels, held = [k for k in held if k is not None], None
        kernels = fn(kernels, max_bindings)
    return kernels if held is None else [k for k in held if k is not None]
