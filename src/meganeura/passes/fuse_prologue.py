"""The ``prologue`` and ``rows`` fusion passes: work evaluated in a kernel's loads instead
of stored before it (norms computed inside the GEMVs and tiled matmuls that read them, the
pointwise kernel before a norm or a reduction, gathers such as im2col and small pointwise
operands in matmul loads), and reductions read only by a pointwise kernel that broadcasts
them back run with it as one row kernel (``rowfuse``)."""
from __future__ import annotations

import os

import numpy as np

from ..codegen.matmul_tiles import block_of, rounded_operands
from ..schedule import Kernel, View
from .fuse_index import _has_rleaf, _in_place, _relabel, _same_elements


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
                                                            "im2col": gk.spec.get("im2col"),
                                                            "form": gk.spec.get("form")})


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
