"""Fusions of the quantized archetype's GEMVs (``codegen/quantized_gemv.py``), the
``quantized`` entry of ``fuse.FUSION_PASSES``: fewer launches per decoded token.

- pair: a GEMV whose epilogue alone reads another GEMV's output over the same x (SwiGLU's
  up * silu(gate)) computes both products in one loop; the other one's value reaches the
  epilogue as ``acc2`` and is never stored;
- merge: GEMVs next to each other over the same x that do not read each other (the q, k
  and v projections) run as the parts of one launch;
- norm: a layer / RMS norm read only by such GEMVs (as x) is computed in them: each
  workgroup takes its rows' statistics, and x is normalised as it is loaded.
"""
from __future__ import annotations

from ..schedule import Kernel, View
from .fuse_index import _relabel, _same_elements, _Uses

MAX_PARTS = 8


def _gemv(k) -> bool:
    return k is not None and k.archetype == "quantized" and k.spec["mode"] == "gemv" and "parts" not in k.spec


def _x_key(k):
    x = k.reads[0]
    return id(x.buf), x.offset, x.shape, x.strides, k.spec["m"], k.spec["k"]


def _bindings(ks) -> int:
    return len({(id(v.buf), v.dtype.name) for k in ks for v in k.read_views()} | {id(b) for k in ks for b in k.written_bufs()})


def _pair(kernels, max_bindings):
    uses = _Uses(kernels)
    for ui, u in enumerate(kernels):
        if not _gemv(u) or "pair" in u.spec:
            continue
        for li, lv in enumerate(u.epi_reads):
            gi = uses.producer(lv.buf, ui)
            g = kernels[gi] if gi is not None else None
            if not _gemv(g) or "pair" in g.spec or g.epilogue is not None or g.outs or "stores" in g.spec \
                    or g.out.buf.kind != "temp" or g.shape != u.shape or _x_key(g) != _x_key(u):
                continue
            if not _same_elements(g, lv) or not uses.read_only_by(g.out.buf, ui, u.epi_reads) \
                    or uses.touched_between(u.reads[0].buf, gi, ui, writes_only=True) \
                    or _bindings([u, g]) > max_bindings:
                continue
            uses.remove(ui, u)
            uses.remove(gi, g)
            u.epilogue = _relabel(u.epilogue, {j: ("acc2",) if j == li else ("leaf", j - (j > li))
                                               for j in range(len(u.epi_reads))})
            u.epi_reads = [v for j, v in enumerate(u.epi_reads) if j != li]
            u.reads = list(u.reads) + [g.reads[1]]
            u.spec = {**u.spec, "pair": {"b_index": len(u.reads) - 1, "qtype": g.spec["qtype"]}}
            u.name = f"{g.name}&{u.name}"
            kernels[gi] = None
            uses.add(ui, u)
            break
    return [k for k in kernels if k is not None]


def _merge(kernels, max_bindings):
    out, run = [], []

    def flush():
        if len(run) > 1:
            out.append(Kernel("|".join(k.name for k in run), "quantized", {"mode": "gemv", "parts": list(run)},
                              run[0].out))
        else:
            out.extend(run)
        run.clear()
    for k in kernels:
        if run and _gemv(k) and _x_key(k) == _x_key(run[0]) and len(run) < MAX_PARTS \
                and _bindings(run + [k]) <= max_bindings:
            kw, kr = {id(b) for b in k.written_bufs()}, {id(v.buf) for v in k.read_views()}
            rw = {id(b) for r in run for b in r.written_bufs()}
            rr = {id(v.buf) for r in run for v in r.read_views()}
            if not (rw & (kr | kw) or kw & rr):          # independent of the run
                run.append(k)
                continue
        flush()
        if _gemv(k):
            run.append(k)
        else:
            out.append(k)
    flush()
    return out


MAX_NORM_ROW = 16384      # the statistics loop over a row stays short


def _norm(kernels, max_bindings):
    uses = _Uses(kernels)
    for ni, nk in enumerate(kernels):
        if nk is None or nk.archetype != "norm" or nk.epilogue is not None or nk.outs or nk.out.buf.kind != "temp" \
                or "stats_only" in nk.spec or "prologue" in nk.spec or "stores" in nk.spec \
                or not nk.reads[0].is_contiguous() or nk.spec["row"] > MAX_NORM_ROW \
                or any(v.dtype.name != "f32" for v in nk.reads) or len(uses.writers[id(nk.out.buf)]) != 1:
            continue
        readers = sorted(set(uses.readers[id(nk.out.buf)]))
        gs = [kernels[i] for i in readers]
        if not gs or not all(_gemv(g) and "prologue" not in g.spec and g.reads[0].buf is nk.out.buf
                             and _same_elements(nk, g.reads[0]) and g.spec["k"] == nk.spec["row"]
                             and not any(v.buf is nk.out.buf for v in g.read_views()[1:]) for g in gs):
            continue
        if any(uses.touched_between(v.buf, ni, max(readers), writes_only=True) for v in nk.reads) \
                or any(_bindings([g, nk]) - 1 > max_bindings for g in gs):
            continue
        x = nk.reads[0]
        for i, g in zip(readers, gs):
            uses.remove(i, g)
            a = g.reads[0]
            g.reads = [View(x.buf, a.shape, a.strides, x.offset, x.dtype), *g.reads[1:], *nk.reads[1:]]
            g.spec = {**g.spec, "prologue": {"kind": nk.spec["kind"], "eps": nk.spec["eps"], "w": nk.spec["weight"],
                                             "b": nk.spec["bias"], "at": len(g.reads) - len(nk.reads) + 1}}
            g.name = f"{nk.spec['kind']}>{g.name}"
            uses.add(i, g)
        uses.remove(ni, nk)
        kernels[ni] = None
    return [k for k in kernels if k is not None]


def fuse_quantized(kernels, max_bindings):
    if not any(_gemv(k) for k in kernels):
        return kernels            # (a graph without quantized weights pays no index)
    return _merge(_pair(_norm(list(kernels), max_bindings), max_bindings), max_bindings)
