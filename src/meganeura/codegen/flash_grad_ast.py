"""The flash attention backward (``flash_grad.py``) on the typed kernel AST, line for line
and the only source of its WGSL (and GLSL)."""
from __future__ import annotations

import numpy as np

from . import kernel_ast as K
from .common import Bindings, broadcast_view_strides, grid, wgsl_type
from .kernel_ast_attn import (NEG_INF, Body, InlineBlock, SharedArray, buffers, call, construct, f32, group_index, grp,
                              land, lit, load, name, sel, sum_terms)
from .expr_ast import coords
from .store_ast import store_items

V4, V2 = "vec4<f32>", "vec2<f32>"


def tree(kernel):
    """(``ComputeKernel``, bound buffers, workgroups), or None where the output store is not
    on the AST yet (``store_ast``)."""
    from .flash import _chunks, _pad4, _stage_trips, smem_floats
    from .flash_grad import BX, BY, CHUNK_VEC4, PAD, RO, TH, TX, TY
    spec = kernel.spec
    kind = spec["grad"]
    q, k, v, do, lse, delta = kernel.reads[:6]
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    nb = int(np.prod(batch, dtype=np.int64))
    nbd = len(batch)
    b = Bindings()
    fns = store_items(kernel, b)
    if fns is None:
        return None
    qb, kb, vb, ob, lb, db = (b.index(x.buf, x.dtype) for x in (q, k, v, do, lse, delta))
    scale = f32(spec["scale"])
    dq = kind == "dq"
    NX = -(-(lq if dq else lk) // BX)
    NQT = -(-lq // BY)
    u = lambda nm: name(nm, "u32")  # noqa: E731
    lid, ty, tx = u("lid"), u("ty"), u("tx")
    XA, YS, YV, XV = (SharedArray(n, V4, CHUNK_VEC4) for n in ("XA", "YS", "YV", "XV"))
    PS = SharedArray("PS", V4, BX * BY // 4)

    def base(x, head):
        st = x.strides
        terms = [lit(x.offset)] + [u(f"z{n}") * st[n] for n in range(nbd) if st[n]]
        return sum_terms(terms + ([head * st[nbd]] if st[nbd] else []))

    e, row, col = u("e"), u("row"), u("col")

    def stage(B, area, row0, n_rows, c0, w, buf, off, view, width):
        """Rows row0.. (of n_rows) and columns c0..c0+w of ``view`` into ``area``:
        area[(col / 4) * PAD + row][col % 4], zeros past the ends. The statements after
        each copy's ``let e`` are the same nodes (built once)."""
        trips, unroll = _stage_trips(BY * w, TH)
        rs, cs = view.strides[-2], view.strides[-1]
        guard = trips * unroll * TH > BY * w
        src = load(buf, off + call("min", row0 + row, lit(n_rows - 1)) * rs
                   + call("min", lit(c0) + col, lit(width - 1)) * cs, "f32")
        ok = land((row0 + row).lt(n_rows), (lit(c0) + col).lt(width))
        inner = Body()
        inner.let("row", e / w)
        inner.let("col", e % w)
        inner.assign(area[grp(col / 4) * PAD + row][col % 4], sel(f32(0.0), src, ok))
        after = (K.If(e.lt(BY * w).n, inner.stmts, inline=True),) if guard else inner.stmts
        with B.for_("it", lit(0), lambda it: it.lt(trips), lambda it: it + 1) as it:
            for j in range(unroll):
                B.add(InlineBlock((K.Let("e", (lid + grp(it * unroll + j) * TH).n),) + after))

    def dots(B, acc, w, xa_area, y_area):
        with B.for_("c4", lit(0), lambda c4: c4.lt(w // 4), lambda c4: c4 + 1) as c4:
            xa = [B.let(f"xa{r}", xa_area[c4 * PAD + ty * RO + r]) for r in range(RO)]
            B.line(lambda B: (B.let("ya0", y_area[c4 * PAD + tx]), B.let("ya1", y_area[c4 * PAD + tx + 16])))
            for r in range(RO):
                for c in range(2):
                    B.assign(acc[r][c], acc[r][c] + call("dot", xa[r], name(f"ya{c}", V4)))

    def accumulate(B, acc, area, n_chunks, ci):
        with B.for_("y4", lit(0), lambda y4: y4.lt(BY // 4), lambda y4: y4 + 1) as y4:
            for j in range(4):
                y = u(f"y{j}")
                B.line(lambda B: (B.let(f"y{j}", y4 * 4 + j), B.let(f"w{j}", area[tx * PAD + y]),
                                  B.let(f"p{j}", PS[y * TY + grp(ty ^ grp(y & (TY - 1)))])))
                for r in range(RO):
                    at = r * n_chunks + ci
                    B.assign(acc[at], call("fma", construct(V4, name(f"p{j}", V4)[r]), name(f"w{j}", V4), acc[at]))

    S = spec.get("split", 1)
    G0 = nb * (hq if dq else hkv) * NX
    B = Body()
    gs = B.let("gs", group_index())
    with B.if_(gs.ge(S * G0), inline=True):
        B.ret()
    B.line(lambda B: (B.let("sp", gs / G0), B.let("gi", gs % G0)))
    sp, gi = u("sp"), u("gi")
    own_head = "h" if dq else "hk"
    B.line(lambda B: (B.let("xt", gi % NX), B.let("bh", gi / NX), B.let(own_head, u("bh") % (hq if dq else hkv)),
                      B.let("bz", u("bh") / (hq if dq else hkv))))
    xt, bh, bz = u("xt"), u("bh"), u("bz")
    if batch:
        B.add(*coords(bz.n, batch, "z"))
    x0 = B.let("x0", xt * BX)
    B.line(lambda B: (B.let("ty", lid / TX), B.let("tx", lid % TX)))
    h, hk = u("h"), u("hk")
    if dq:
        B.let("hk", h / group)
        B.let("qoff", base(q, h))
        B.let("dooff", base(do, h))
    B.let("koff", base(k, hk))
    B.let("voff", base(v, hk))
    qoff, dooff, koff, voff = u("qoff"), u("dooff"), u("koff"), u("voff")
    y0 = u("y0")
    dch, vch = _chunks(d), _chunks(dv)
    xs, ys = ((qb, qoff, q, lq), (kb, koff, k, lk)) if dq else ((kb, koff, k, lk), (qb, qoff, q, lq))
    xv, yv = ((ob, dooff, do, lq), (vb, voff, v, lk)) if dq else ((vb, voff, v, lk), (ob, dooff, do, lq))
    resident = len(dch) == len(vch) == 1 and 4 * CHUNK_VEC4 + BX * BY // 4 <= smem_floats(spec.get("smem")) // 4

    def own(B):
        if resident:
            stage(B, XA, x0, xs[3], 0, _pad4(d), xs[0], xs[1], xs[2], d)
            stage(B, XV, x0, xv[3], 0, _pad4(dv), xv[0], xv[1], xv[2], dv)
    t = u("t")
    if dq:
        aq = B.var("aq", ty=f"array<{V4}, {RO * len(dch)}>")
        lses, dds = [], []
        for r in range(RO):
            at = call("min", x0 + ty * RO + r, lit(lq - 1))
            lses.append(B.let(f"lse{r}", load(lb, base(lse, h) + at * lse.strides[-1], "f32")))
            dds.append(B.let(f"dd{r}", load(db, base(delta, h) + at * delta.strides[-1], "f32")))
        ntiles = -(-lk // BY)
        if spec["causal"]:
            nt = B.let("nt", call("min", lit(ntiles), grp(x0 + (BX - 1)) / BY + 1))
        else:
            nt = B.let("nt", lit(ntiles))
        per = -(-ntiles // S)
        own(B)
        loop = B.for_("t", sp * per, lambda t: t.lt(call("min", nt, sp * per + per)), lambda t: t + 1, indent="")
    else:
        ak = B.var("ak", ty=f"array<{V4}, {RO * len(dch)}>")
        av = B.var("av", ty=f"array<{V4}, {RO * len(vch)}>")
        qt0 = B.let("qt0", call("min", x0 / BY, lit(NQT)) if spec["causal"] else lit(0))
        nq = B.let("nq", lit(NQT) - qt0)
        per = -(-(group * NQT) // S)
        own(B)
        loop = B.for_("t", sp * per, lambda t: t.lt(call("min", lit(group) * nq, sp * per + per)),
                      lambda t: t + 1, indent="")
    with loop:
        if dq:
            B.let("y0", t * BY)
        else:
            B.let("h", hk * group + t / nq)
            B.let("y0", grp(qt0 + t % nq) * BY)
            B.let("qoff", base(q, h))
            B.let("dooff", base(do, h))
            lses, dds = [], []
            for c in range(2):
                at = call("min", y0 + tx + 16 * c, lit(lq - 1))
                lses.append(B.let(f"lse{c}", load(lb, base(lse, h) + at * lse.strides[-1], "f32")))
                dds.append(B.let(f"dd{c}", load(db, base(delta, h) + at * delta.strides[-1], "f32")))
        zeros = construct(f"array<{V2}, {RO}>", *[construct(V2, f32(0.0))] * RO)
        s = B.var("s", zeros)
        dp = B.var("dp", zeros)
        if resident:
            stage(B, YS, y0, ys[3], 0, _pad4(d), ys[0], ys[1], ys[2], d)
            stage(B, YV, y0, yv[3], 0, _pad4(dv), yv[0], yv[1], yv[2], dv)
            B.barrier()
            dots(B, s, _pad4(d), XA, YS)
            dots(B, dp, _pad4(dv), XV, YV)
        else:
            for c0, w in dch:
                stage(B, XA, x0, xs[3], c0, w, xs[0], xs[1], xs[2], d)
                stage(B, YS, y0, ys[3], c0, w, ys[0], ys[1], ys[2], d)
                B.barrier()
                dots(B, s, w, XA, YS)
                B.barrier()
            for n, (c0, w) in enumerate(vch):
                stage(B, XA, x0, xv[3], c0, w, xv[0], xv[1], xv[2], dv)
                stage(B, YV, y0, yv[3], c0, w, yv[0], yv[1], yv[2], dv)
                B.barrier()
                dots(B, dp, w, XA, YV)
                if n < len(vch) - 1:
                    B.barrier()
        if spec["masked"]:
            m = kernel.reads[6]
            mb = b.index(m.buf, m.dtype)
            st = broadcast_view_strides(m, tuple(batch) + (hq, lq, lk))
            terms = [lit(m.offset)] + [u(f"z{n}") * st[n] for n in range(nbd) if st[n]]
            terms += [h * st[nbd]] if st[nbd] else []
            B.let("moff", sum_terms(terms))
        i, j, x = u("i"), u("j"), name("x", "f32")
        for r in range(RO):
            for c in range(2):
                ie, je = x0 + ty * RO + r, y0 + tx + 16 * c
                if not dq:
                    ie, je = je, ie
                lse_i, d_i = (lses[r], dds[r]) if dq else (lses[c], dds[c])
                with B.block(head=2, tail=True):
                    B.let("i", ie)
                    B.let("j", je)
                    B.var("x", s[r][c] * scale)
                    if spec["masked"]:
                        mv = load(mb, u("moff") + call("min", i, lit(lq - 1)) * st[-2]
                                  + call("min", j, lit(lk - 1)) * st[-1], wgsl_type(m.dtype))
                        B.assign(x, sel(NEG_INF, x, mv.ne(lit(0, wgsl_type(m.dtype)))) if spec["int_mask"] else x + mv)
                    keep = [i.lt(lq), j.lt(lk)] + ([j.le(i)] if spec["causal"] else [])
                    p = B.let("p", sel(f32(0.0), call("exp", x - lse_i), land(*keep)))
                    B.assign(s[r][c], p)
                    B.assign(dp[r][c], p * grp(dp[r][c] - d_i))

        def writes(a):
            for c in range(2):
                B.assign(PS[grp(tx + 16 * c) * TY + grp(ty ^ grp(grp(tx + 16 * c) & (TY - 1)))],
                         construct(V4, *[a[r][c] for r in range(RO)]))
        if dq:
            writes(dp)
            B.barrier()
            for ci, (c0, w) in enumerate(dch):
                if len(dch) > 1:
                    stage(B, YS, y0, lk, c0, w, kb, koff, k, d)
                    B.barrier()
                accumulate(B, aq, YS, len(dch), ci)
                B.barrier()
        else:
            writes(s)
            B.barrier()
            for ci, (c0, w) in enumerate(vch):
                if len(vch) > 1:
                    stage(B, YV, y0, lq, c0, w, ob, dooff, do, dv)
                    B.barrier()
                accumulate(B, av, YV, len(vch), ci)
                B.barrier()
            writes(dp)
            B.barrier()
            for ci, (c0, w) in enumerate(dch):
                if len(dch) > 1:
                    stage(B, YS, y0, lq, c0, w, qb, qoff, q, d)
                    B.barrier()
                accumulate(B, ak, YS, len(dch), ci)
                B.barrier()
    n_own = lq if dq else lk
    main, width, chunks = (aq, d, dch) if dq else (ak, d, dch)
    heads = hq if dq else hkv
    own_size = nb * heads * n_own
    xx = u("x")
    for r in range(RO):
        with B.block(head=2, tail=True):
            B.let("x", x0 + ty * RO + r)
            with B.if_(xx.lt(n_own)):
                for ci, (c0, w) in enumerate(chunks):
                    for e in range(4):
                        col = [lit(c0), tx * 4, lit(e)]
                        with B.if_(sum_terms(col).lt(width), inline=True):
                            B.call("store_out", sum_terms([grp(sp * own_size + bh * n_own + xx) * width] + col),
                                   main[r * len(chunks) + ci][e] * scale)
                if not dq:
                    dvv = kernel.outs[0]
                    split_dims = () if S == 1 else (S,)
                    assert dvv.is_contiguous() and dvv.shape == split_dims + tuple(batch) + (heads, lk, dv), dvv.shape
                    vo = b.index(dvv.buf, dvv.dtype, write=True)
                    for ci, (c0, w) in enumerate(vch):
                        for e in range(4):
                            col = [lit(c0), tx * 4, lit(e)]
                            with B.if_(sum_terms(col).lt(dv), inline=True):
                                B.store(vo, sum_terms([lit(dvv.offset) + grp(sp * own_size + bh * lk + xx) * dv] + col),
                                        av[r * len(vch) + ci][e])
    areas = (XA, YS, YV) + ((XV,) if resident else ()) + (PS,)
    module = (*fns, *(a.decl for a in areas), K.Blank())
    return K.ComputeKernel(buffers(b), TH, B.stmts, module=module), b.bufs, grid(S * G0)
