"""Fusion passes over the kernel IR (lists of ``schedule.Kernel`` in launch order).

Each pass is a function ``(kernels, max_bindings) -> kernels`` registered in
``FUSION_PASSES`` by name; ``MEGANEURA_NO_FUSE=name,...`` (or ``all``) switches passes off
for debugging. Passes only move work between kernels: every buffer keeps its meaning, so
the memory planner and the runtime need no knowledge of them.

- ``epilogue``: a pointwise kernel that is the only reader of another kernel's output
  becomes that kernel's epilogue (matmul + bias/activation/residual, reductions + scale,
  softmax/norm + mul, ...), so the intermediate is never stored.
"""
from __future__ import annotations

from collections import defaultdict

from ..codegen.common import broadcast_view_strides
from ..schedule import View

# archetypes whose renderers end in ``store_out`` (codegen.expr.OutputStore)
EPILOGUE_ARCHETYPES = frozenset({"matmul", "reduce", "rows", "norm", "gather"})


class _Uses:
    """Which kernels (by position) write and read each logical buffer."""

    def __init__(self, kernels):
        self.writers, self.readers = defaultdict(list), defaultdict(list)
        for i, k in enumerate(kernels):
            self.add(i, k)

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


def _relabel(e, leaf_map):
    """``e`` with ("leaf", i) replaced by ``leaf_map[i]`` (an expression)."""
    if e[0] == "leaf":
        return leaf_map[e[1]]
    if e[0] == "op":
        return ("op", e[1], [_relabel(k, leaf_map) for k in e[2]])
    return e


def _has_rleaf(e) -> bool:
    return e[0] == "rleaf" or (e[0] == "op" and any(_has_rleaf(k) for k in e[2]))


def _same_elements(k, view) -> bool:
    """``view`` reads exactly what ``k`` wrote, element for element in row-major order."""
    o = k.out
    return (o.is_contiguous() and view.is_contiguous() and view.buf is o.buf and view.offset == o.offset
            and view.size == o.size)


def fuse_epilogues(kernels, max_bindings):
    kernels = list(kernels)
    uses = _Uses(kernels)
    for pi, p in enumerate(kernels):
        if p is None or p.archetype != "pointwise" or p.spec.get("flat_leaf") or p.epilogue is not None:
            continue
        if _has_rleaf(p.spec["expr"]):
            continue            # indexed reads need the pointwise kernel's own coordinates
        for li, leaf in enumerate(p.reads):
            ws = uses.writers[id(leaf.buf)]
            if len(ws) != 1 or ws[0] >= pi:
                continue
            ki = ws[0]
            k = kernels[ki]
            if k.archetype not in EPILOGUE_ARCHETYPES or k.out.buf.kind != "temp" or leaf.shape != p.out.shape:
                continue
            if set(uses.readers[id(leaf.buf)]) != {pi} or sum(v.buf is leaf.buf for v in p.reads) != 1:
                continue
            if not _same_elements(k, leaf):
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
            bufs = {id(v.buf) for v in k.read_views() + others} | {id(p.out.buf)}
            if len(bufs) > max_bindings:
                continue
            base = len(k.epi_reads)
            leaf_map, n = {}, 0
            for j in range(len(p.reads)):
                if j == li:
                    leaf_map[j] = k.epilogue or ("acc",)
                else:
                    leaf_map[j] = ("leaf", base + n)
                    n += 1
            uses.remove(ki, k)
            uses.remove(pi, p)
            k.epilogue = _relabel(p.spec["expr"], leaf_map)
            k.epi_reads = list(k.epi_reads) + others
            k.spec = {**k.spec, "shape": k.shape, "out_dtype": k.dtype}
            k.out = p.out
            k.name = f"{k.name}+{p.name}"
            kernels[pi] = None
            uses.add(ki, k)
            break
    return [k for k in kernels if k is not None]


FUSION_PASSES = {"epilogue": fuse_epilogues}


def run_fusion(kernels, disabled=frozenset(), max_bindings=8):
    for name, fn in FUSION_PASSES.items():
        if name not in disabled:
            kernels = fn(kernels, max_bindings)
    return kernels
