"""Fusion passes over the kernel IR (lists of ``schedule.Kernel`` in launch order).

Each pass is a function ``(kernels, max_bindings) -> kernels`` registered in
``FUSION_PASSES`` by name; ``MEGANEURA_NO_FUSE=name,...`` (or ``all``) switches passes off
for debugging. Passes only move work between kernels: every buffer keeps its meaning, so
the memory planner and the runtime need no knowledge of them.

- ``epilogue``: a pointwise kernel that is the only reader of another kernel's output
  becomes that kernel's epilogue (matmul + bias/activation/residual, reductions + scale,
  softmax/norm + mul, ...), so the intermediate is never stored.
- ``prologue``: a norm read only by GEMVs is computed inside them.
- ``horizontal``: independent pointwise kernels close together run as one launch.
"""
from __future__ import annotations

from collections import defaultdict

from ..codegen.common import broadcast_view_strides
from ..schedule import Kernel, View

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
            if k.archetype not in EPILOGUE_ARCHETYPES or k.out.buf.kind != "temp" or leaf.shape != p.out.shape \
                    or "index" in k.spec:      # a scatter stores where its data says
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


def _is_gemv_tb(k):
    return k.archetype == "matmul" and k.spec.get("gemv") and k.spec["tb"] and not k.spec["ta"] \
        and "parts" not in k.spec and "prologue" not in k.spec


def fuse_norm_prologue(kernels, max_bindings):
    """A layer/RMS norm whose every reader is a GEMV (decoding: the norm before the q/k/v
    or gate/up projections) moves into those GEMVs: each workgroup computes the row
    statistics of its few rows itself and normalises A as it streams it."""
    kernels = list(kernels)
    uses = _Uses(kernels)
    for ni, nk in enumerate(kernels):
        if nk is None or nk.archetype != "norm" or nk.epilogue is not None or nk.out.buf.kind != "temp":
            continue
        readers = sorted(set(uses.readers[id(nk.out.buf)]))
        if not readers or len(uses.writers[id(nk.out.buf)]) != 1:
            continue
        gs = [kernels[i] for i in readers]
        row = nk.spec["row"]
        if not all(_is_gemv_tb(g) and g.reads[0].buf is nk.out.buf and _same_elements(nk, g.reads[0])
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
    return [k for k in kernels if k is not None]


def _bindings(kernels) -> int:
    return len({(id(v.buf), v.dtype.name) for k in kernels for v in k.read_views()}
               | {(id(b), None) for k in kernels for b in k.written_bufs()})


MAX_FLOAT = 8           # kernels a horizontal group may be moved past
MAX_GROUPS = 65535      # workgroups of one merged launch


def _group_key(k):
    """Kernels with equal keys can share a launch: pointwise ones, and GEMVs (B transposed)
    that read the same A (sibling projections such as q, k and v)."""
    if k.archetype == "pointwise":
        return ("pointwise",)
    if k.archetype == "matmul" and k.spec.get("gemv") and k.spec["tb"] and "parts" not in k.spec:
        a = k.reads[0]
        pro = k.spec.get("prologue")
        pro = pro and (tuple(sorted(pro.items())), tuple(id(v.buf) for v in k.reads[2:]))
        return ("gemv", id(a.buf), a.offset, a.shape, a.strides, k.spec["ta"], k.shape[:-1], pro)
    return None


def _groups_of(k):
    from ..codegen.common import WG
    if k.archetype == "pointwise":
        return -(-k.out.size // WG)
    return -(-k.shape[-1] // 8)


def merge_horizontal(kernels, max_bindings):
    """Independent kernels of one kind that sit close together become one launch: RoPE of
    q and k, optimizer updates of many parameters, the q/k/v projections of one input.
    A group is emitted where a later kernel first touches what it writes (or writes what
    it reads); kernels that do neither may run before it."""
    out, group = [], []
    state = {"writes": set(), "reads": set(), "passed": 0, "groups": 0, "key": None}

    def close():
        if len(group) > 1 and state["key"][0] == "pointwise":
            out.append(Kernel("|".join(k.name for k in group), "multi", {"parts": list(group)}, group[0].out))
        elif len(group) > 1:
            out.append(Kernel("|".join(k.name for k in group), "matmul", {"gemv": True, "tb": True, "parts": list(group)},
                              group[0].out))
        elif group:
            out.append(group[0])
        group.clear()
        state.update(writes=set(), reads=set(), passed=0, groups=0, key=None)

    for k in kernels:
        kw = {id(b) for b in k.written_bufs()}
        kr = {id(v.buf) for v in k.read_views()}
        key = _group_key(k)
        conflict = bool((kw | kr) & state["writes"] or kw & state["reads"])
        groups = _groups_of(k) if key else 0
        joinable = (key is not None and key == state["key"] and not conflict
                    and state["groups"] + groups <= MAX_GROUPS and _bindings(group + [k]) <= max_bindings)
        if joinable:
            group.append(k)
            state["writes"] |= kw
            state["reads"] |= kr
            state["groups"] += groups
            continue
        if conflict or key is not None or state["passed"] >= MAX_FLOAT:
            close()
        if key is not None:
            group.append(k)
            state.update(writes=kw, reads=kr, groups=groups, key=key)
            continue
        out.append(k)
        if group:
            state["passed"] += 1
    close()
    return out


FUSION_PASSES = {"epilogue": fuse_epilogues, "prologue": fuse_norm_prologue, "horizontal": merge_horizontal}


def run_fusion(kernels, disabled=frozenset(), max_bindings=8):
    for name, fn in FUSION_PASSES.items():
        if name not in disabled:
            kernels = fn(kernels, max_bindings)
    return kernels
