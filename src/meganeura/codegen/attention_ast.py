"""The one-row attention kernel (``attention.py``) on the typed kernel AST: its only WGSL
(and GLSL) is printed from this tree."""
from __future__ import annotations

import numpy as np

from . import kernel_ast as K
from .common import WG, Bindings, broadcast_view_strides, grid, wgsl_type
from .kernel_ast_attn import (NEG_INF, Body, SharedArray, bitcast, buffers, call, f32, group_index, grp, land,
                              lit, load, name, sel, sum_terms)
from .expr_ast import coords
from .store_ast import store_items


def base(x, head, nbd):
    """Element offset of row 0 of view ``x`` at batch ``z..`` and head ``head`` (a name)."""
    st = x.strides
    terms = [lit(x.offset)] + [name(f"z{n}", "u32") * st[n] for n in range(nbd) if st[n]]
    return sum_terms(terms + ([head * st[nbd]] if st[nbd] else []))


def tree(kernel):
    """(``ComputeKernel``, bound buffers, workgroups), or None where the output store is not
    on the AST yet (``store_ast``)."""
    q, k, v = kernel.reads[:3]
    spec = kernel.spec
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    rows = int(np.prod(batch, dtype=np.int64)) * hq * lq
    b = Bindings()
    fns = store_items(kernel, b, require=("fmax_f32",))        # a NaN score gives a NaN row
    if fns is None:
        return None
    qb, kb, vb = (b.index(x.buf, x.dtype) for x in (q, k, v))
    DV = 1 << max(0, (dv - 1).bit_length())
    slices = WG // DV
    nbd = len(batch)
    lid = name("lid", "u32")
    sc, red, qv = (SharedArray("sc", "f32", lk), SharedArray("red", "f32", WG),
                   SharedArray("qv", "f32", d))
    qs, ks, vs = q.strides, k.strides, v.strides
    B = Body()
    row = B.let("row", group_index())
    with B.if_(row.ge(rows), inline=True):
        B.ret()
    B.line(lambda B: (B.let("i", row % lq), B.let("h", grp(row / lq) % hq), B.let("bz", row / (lq * hq))))
    i, h, bz = name("i", "u32"), name("h", "u32"), name("bz", "u32")
    if batch:
        B.add(*coords(bz.n, batch, "z"))
    hk = B.let("hk", h / group)
    qoff = B.let("qoff", base(q, h, nbd) + i * qs[-2])
    koff = B.let("koff", base(k, hk, nbd))
    voff = B.let("voff", base(v, hk, nbd))
    P = 8 if d >= 8 else 1
    KPP = WG // P
    j = name("j", "u32")
    s = name("s", "f32")

    def score(B):
        with B.extra("    "):         # (the first score line is indented further)
            B.var("s", red[lid] * f32(spec["scale"]))
        if spec["masked"]:
            m = kernel.reads[3]
            mb = b.index(m.buf, m.dtype)
            mv = load(mb, name("moff", "u32") + j * st[-1], wgsl_type(m.dtype))
            if spec["int_mask"]:
                B.assign(s, sel(NEG_INF, s, mv.ne(lit(0, wgsl_type(m.dtype)))))
            else:
                B.assign(s, s + mv)
        if spec["causal"]:
            B.assign(s, sel(NEG_INF, s, j.le(i)))
    if spec["masked"]:
        m = kernel.reads[3]
        b.index(m.buf, m.dtype)
        st = broadcast_view_strides(m, tuple(batch) + (hq, lq, lk))
        terms = [lit(m.offset)] + [name(f"z{n}", "u32") * st[n] for n in range(nbd) if st[n]]
        terms += [c * s_ for c, s_ in zip((h, i), st[nbd:nbd + 2]) if s_]
        B.let("moff", sum_terms(terms))
    with B.for_("c", lid, lambda c: c.lt(d), lambda c: c + WG, inline=True) as c:
        B.assign(qv[c], load(qb, qoff + c * qs[-1], "f32"))
    B.barrier()
    B.line(lambda B: (B.let("p", lid % P), B.let("kl", lid / P)))
    p, kl = name("p", "u32"), name("kl", "u32")
    mx = B.var("mx", NEG_INF)
    with B.for_("j0", lit(0), lambda j0: j0.lt(lk), lambda j0: j0 + KPP) as j0:
        B.let("j", j0 + kl)
        part = B.var("part_s", f32(0.0))
        with B.if_(j.lt(lk)):
            with B.for_("c", p, lambda c: c.lt(d), lambda c: c + P, inline=True) as c:
                B.assign(part, call("fma", qv[c], load(kb, koff + j * ks[-2] + c * ks[-1], "f32"), part))
        B.assign(red[lid], part)
        B.barrier()
        _tree(B, P // 2, p, lambda t: red[lid] + red[lid + t])
        with B.if_(land(p.eq(0), j.lt(lk))):
            score(B)
            B.assign(sc[j], s)
            B.assign(mx, call("fmax_f32", mx, s))
        B.barrier()
    B.assign(red[lid], mx)
    B.barrier()
    _tree(B, WG // 2, lid, lambda t: call("fmax_f32", red[lid], red[lid + t]))
    m_ = B.let("m", red[0])
    live = B.let("live", bitcast("u32", m_).ne(lit(0xff800000, "u32", "0xff800000u")),
                 comment="   // a fully masked row gives zeros (a NaN row stays NaN)")
    B.barrier()
    tot = B.var("tot", f32(0.0))
    with B.for_("j", lid, lambda j: j.lt(lk), lambda j: j + WG) as jj:
        e = B.let("e", sel(f32(0.0), call("exp", sc[jj] - m_), live))
        B.assign(sc[jj], e)
        B.assign(tot, tot + e)
    B.assign(red[lid], tot)
    B.barrier()
    _tree(B, WG // 2, lid, lambda t: red[lid] + red[lid + t])
    inv = B.let("inv", sel(f32(0.0), f32(1.0) / red[0], live))
    B.barrier()
    B.line(lambda B: (B.let("col", lid % DV), B.let("sl", lid / DV)))
    col, sl = name("col", "u32"), name("sl", "u32")
    acc = B.var("acc", f32(0.0))
    with B.if_(col.lt(dv)):
        with B.for_("j", sl, lambda j: j.lt(lk), lambda j: j + slices, inline=True) as jj:
            B.assign(acc, call("fma", sc[jj], load(vb, voff + jj * vs[-2] + col * vs[-1], "f32"), acc))
    B.assign(red[lid], acc)
    B.barrier()
    _tree(B, slices // 2, sl, lambda t: red[lid] + red[lid + t * DV])
    with B.if_(land(sl.eq(0), col.lt(dv)), inline=True):
        B.call("store_out", row * dv + col, red[lid] * inv)
    module = (*fns, *(x.decl for x in (sc, red, qv)), K.Blank())
    return K.ComputeKernel(buffers(b), WG, B.stmts, module=module), b.bufs, grid(rows)


def _tree(B, half, who, op):
    """A halving reduction of ``red`` over lanes ``who < t``."""
    red = name("red", f"array<f32, {WG}>")
    lid = name("lid", "u32")
    with B.for_("t", lit(half), lambda t: t.gt(0), lambda t: t >> lit(1)) as t:
        with B.if_(who.lt(t), inline=True):
            B.assign(red[lid], op(t))
        B.barrier()
