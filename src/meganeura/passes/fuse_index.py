"""What every fusion pass shares: the index of which kernels write and read each buffer
(``_Uses``, kept up to date by the in-place passes, ``_in_place``) and helpers over epilogue
expressions (leaves relabelled or spliced) and output views."""
from __future__ import annotations

import functools
from collections import defaultdict


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
