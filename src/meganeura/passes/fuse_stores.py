"""The fusion passes that give a kernel more stores (``normstats``, ``stores``,
``outputs``) and the ``hoist`` pass: a norm statistic the backward reads stored by the
forward norm, a copy into a slice (a concat) as a second store, a pointwise kernel storing
the values of its pointwise producers too, and input-only kernels moved to the front."""
from __future__ import annotations

import numpy as np

from ..codegen.common import broadcast_view_strides
from ..schedule import MAX_INLINE_DEPTH, View, contiguous_strides, expr_depth
from .fuse_index import EPILOGUE_ARCHETYPES, _has_rleaf, _in_place, _permutes, _relabel, _same_elements, _splice
from .fuse_merge import MAX_INLINE_OPS, _ops
from .fuse_prologue import norm_input


def _norm_rows_key(k):
    """What decides a norm kernel's row statistics: the rows it reads and how it reduces them."""
    x = norm_input(k)
    return (id(x.buf), x.offset, tuple(x.shape), tuple(x.strides), x.dtype.name, k.spec["kind"], k.spec["eps"],
            k.spec["row"])


@_in_place
def fuse_norm_stats(kernels, uses, max_bindings):
    """A norm statistic the backward reads (``ops.normalization.norm_stat``: a stats-only norm kernel)
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
