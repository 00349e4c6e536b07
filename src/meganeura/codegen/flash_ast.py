"""The flash attention forward (``flash.py``) on the typed kernel AST, line for line as
the only source of its WGSL (and GLSL)."""
from __future__ import annotations

import numpy as np

from . import kernel_ast as K
from .common import Bindings, broadcast_view_strides, grid, wgsl_type
from .kernel_ast_attn import (NEG_INF, POS_INF, Body, InlineBlock, SharedArray, buffers, call, construct, f32,
                              group_index, grp, land, lit, load, name, sel, sum_terms)
from .expr_ast import coords
from .store_ast import store_items

V4 = "vec4<f32>"


def _m4(w):
    return call("max", call("max", w.x, w.y), call("max", w.z, w.w))


def tree(kernel):
    """(``ComputeKernel``, bound buffers, workgroups), or None where the output store is not
    on the AST yet (``store_ast``)."""
    from .flash import BK, CH, TX, _chunks, _pad4, _stage_trips, rows_per_group
    q, k, v = kernel.reads[:3]
    spec = kernel.spec
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    nb = int(np.prod(batch, dtype=np.int64))
    BQ = rows_per_group(d, spec.get("smem"))
    TY = BQ // 4
    TH = TY * TX
    DQ4 = _pad4(d) // 4
    NQT = -(-lq // BQ)
    NT = -(-lk // BK)
    S = spec.get("split", 1)
    NBH = nb * hq
    VCH = _chunks(dv)
    NG = len(VCH)
    b = Bindings()
    fns = store_items(kernel, b)
    if fns is None:
        return None
    qb, kb, vb = (b.index(x.buf, x.dtype) for x in (q, k, v))
    nbd = len(batch)
    lid = name("lid", "u32")
    Qs, KV, Ps = (SharedArray("Qs", V4, BQ * DQ4), SharedArray("KV", V4, BK * CH // 4),
                  SharedArray("Ps", V4, BK * TY))
    u = lambda nm: name(nm, "u32")  # noqa: E731

    def base(x, head):
        st = x.strides
        terms = [lit(x.offset)] + [u(f"z{n}") * st[n] for n in range(nbd) if st[n]]
        return sum_terms(terms + ([head * st[nbd]] if st[nbd] else []))

    e, row, col = u("e"), u("row"), u("col")

    def stage(B, total, width, dst, src, ok):
        """Copy ``total`` elements (e -> row = e / width, col = e % width) into workgroup
        memory: ``dst(row, col)`` the element, ``src`` its clamped read, ``ok`` in range. The
        statements after each copy's ``let e`` are the same nodes (built once)."""
        trips, unroll = _stage_trips(total, TH)
        guard = (total % (TH * unroll * trips) != 0) or (trips * unroll * TH > total)
        inner = Body()
        inner.let("row", e / width)
        inner.let("col", e % width)
        inner.assign(dst(row, col), sel(f32(0.0), src(row, col), ok(row, col)))
        after = (K.If(e.lt(total).n, inner.stmts, inline=True),) if guard else inner.stmts
        with B.for_("it", lit(0), lambda it: it.lt(trips), lambda it: it + 1) as it:
            for j in range(unroll):
                B.add(InlineBlock((K.Let("e", (lid + grp(it * unroll + j) * TH).n),) + after))

    def by_register(B, total, width, reg, body):
        """One statement per register ``reg[j]`` of a thread's share of ``total`` elements:
        ``body(reg[j])`` (of the names ``row`` and ``col``), loads issued a phase ahead."""
        rc = (K.Let("row", (e / width).n), K.Let("col", (e % width).n))
        for j in range(-(-total // TH)):
            s = Body()
            body(s, reg[j])
            stmt = s.stmts
            if (j + 1) * TH > total:
                stmt = (K.If(e.lt(total).n, stmt, inline=True),)
            B.add(InlineBlock((K.Let("e", (lid + j * TH).n),) + rc + stmt))

    qs, ks, vs = q.strides, k.strides, v.strides
    piped = len(_chunks(d)) == 1 and len(VCH) == 1 and BK * max(_pad4(d), _pad4(dv)) <= 32 * TH
    B = Body()
    gi = B.let("gi", group_index())
    with B.if_(gi.ge(NBH * NQT * S), inline=True):
        B.ret()
    B.line(lambda B: (B.let("qt", gi % NQT), B.let("bh", grp(gi / NQT) % NBH), B.let("h", u("bh") % hq),
                      B.let("bz", u("bh") / hq)))
    qt, bh, h, bz = u("qt"), u("bh"), u("h"), u("bz")
    sp = None
    if S > 1:
        sp = B.let("sp", gi / (NQT * NBH), comment="     // this workgroup's split of the keys")
    if batch:
        B.add(*coords(bz.n, batch, "z"))
    hk = B.let("hk", h / group)
    q0 = B.let("q0", qt * BQ)
    qoff = B.let("qoff", base(q, h))
    koff = B.let("koff", base(k, hk))
    voff = B.let("voff", base(v, hk))
    B.line(lambda B: (B.let("ty", lid / TX), B.let("tx", lid % TX)))
    ty, tx = u("ty"), u("tx")
    stage(B, BQ * DQ4 * 4, DQ4 * 4, lambda row, col: Qs[row * DQ4 + col / 4][col % 4],
          lambda row, col: load(qb, qoff + call("min", q0 + row, lit(lq - 1)) * qs[-2]
                                + call("min", col, lit(d - 1)) * qs[-1], "f32"),
          lambda row, col: land((q0 + row).lt(lq), col.lt(d)))
    B.barrier()
    mrow = B.var("mrow", construct(V4, NEG_INF), comment="   // running row max")
    lrow = B.var("lrow", construct(V4, f32(0.0)), comment="         // this lane's running row sum")
    o = B.var("o", ty=f"array<{V4}, {4 * NG}>", comment=f"  // o[r * {NG} + g]: rows r, columns 64g + 4tx..")
    if spec["causal"]:
        nt = B.let("nt", call("min", lit(NT), grp(q0 + (BQ - 1)) / BK + 1))
    else:
        nt = B.let("nt", lit(NT))
    if S > 1:
        B.line(lambda B: (B.let("t0", sp * nt / S), B.let("t1", grp(sp + 1) * nt / S)))
    else:
        B.line(lambda B: (B.let("t0", lit(0)), B.let("t1", nt)))
    t0, t1 = u("t0"), u("t1")

    def k_src(k0, c0, row, col):
        return load(kb, koff + call("min", k0 + row, lit(lk - 1)) * ks[-2]
                    + call("min", lit(c0) + col, lit(d - 1)) * ks[-1], "f32")

    def k_ok(k0, c0, row, col):
        return land((k0 + row).lt(lk), (lit(c0) + col).lt(d))

    def v_src(k0, c0, row, col):
        return load(vb, voff + call("min", k0 + row, lit(lk - 1)) * vs[-2]
                    + call("min", lit(c0) + col, lit(dv - 1)) * vs[-1], "f32")

    def v_ok(k0, c0, row, col):
        return land((k0 + row).lt(lk), (lit(c0) + col).lt(dv))
    if piped:
        wk, wv = _pad4(d), _pad4(dv)
        kr = B.var("kr", ty=f"array<f32, {-(-BK * wk // TH)}>")
        vr = B.var("vr", ty=f"array<f32, {-(-BK * wv // TH)}>")

        def load_k(B, k0):
            value = sel(f32(0.0), k_src(k0, 0, row, col), k_ok(k0, 0, row, col))
            by_register(B, BK * wk, wk, kr, lambda B, r: B.assign(r, value))

        def load_v(B, k0):
            value = sel(f32(0.0), v_src(k0, 0, row, col), v_ok(k0, 0, row, col))
            by_register(B, BK * wv, wv, vr, lambda B, r: B.assign(r, value))

        def put(B, total, width, reg, dst):
            at = dst(row, col)
            by_register(B, total, width, reg, lambda B, r: B.assign(at, r))
        with B.extra("    "):
            load_k(B, t0 * BK)
    if spec["masked"]:
        m = kernel.reads[3]
        mb = b.index(m.buf, m.dtype)
        st = broadcast_view_strides(m, tuple(batch) + (hq, lq, lk))
        terms = [lit(m.offset)] + [u(f"z{n}") * st[n] for n in range(nbd) if st[n]]
        terms += [h * st[nbd]] if st[nbd] else []
        B.let("moff", sum_terms(terms))
    s = name("s", f"array<{V4}, 4>")
    with B.for_("t", t0, lambda t: t.lt(t1), lambda t: t + 1, indent="") as t:
        kt0 = B.let("kt0", t * BK)
        B.var("s", construct(f"array<{V4}, 4>", *[construct(V4, f32(0.0))] * 4))
        for n, (c0, w) in enumerate(_chunks(d)):
            R = 1 << max(0, (w // 4 - 1).bit_length())
            if n:
                B.barrier()

            def kdst(row, col, R=R):
                return KV[row * R + grp(grp(col / 4) ^ grp(row & (R - 1)))][col % 4]
            if piped:
                with B.extra("    "):
                    put(B, BK * wk, wk, kr, kdst)
                B.barrier()
                with B.extra("    "):
                    load_v(B, kt0)
            else:
                stage(B, BK * w, w, kdst, lambda row, col, c0=c0: k_src(kt0, c0, row, col),
                      lambda row, col, c0=c0: k_ok(kt0, c0, row, col))
                B.barrier()
            with B.for_("d4", lit(0), lambda d4: d4.lt(w // 4), lambda d4: d4 + 1) as d4:
                qa = [B.let(f"qa{r}", Qs[grp(ty * 4 + r) * DQ4 + c0 // 4 + d4]) for r in range(4)]
                kc = [B.let(f"kc{c}", KV[grp(tx + 16 * c) * R + grp(d4 ^ grp(grp(tx + 16 * c) & (R - 1)))])
                      for c in range(4)]
                for r in range(4):
                    for c in range(4):
                        B.assign(s[r][c], s[r][c] + call("dot", qa[r], kc[c]))
        _scores(B, kernel, spec, s, q0, ty, tx, kt0, lq, lk, BK, mb if spec["masked"] else None,
                st if spec["masked"] else None)
        for r in range(4):
            B.assign(Ps[grp(ty * 4 + r) * 4 + tx / 4][tx % 4], call("max", call("max", s[r].x, s[r].y),
                                                                     call("max", s[r].z, s[r].w)))
        B.barrier()
        tms = []
        for r in range(4):
            ws = [B.let(f"w{r}{j}", Ps[grp(ty * 4 + r) * 4 + j]) for j in range(4)]
            tms.append(B.let(f"tm{r}", call("max", _m4(ws[0]), call("max", _m4(ws[1]), call("max", _m4(ws[2]),
                                                                                            _m4(ws[3]))))))
        B.barrier()
        mnew = B.let("mnew", call("max", mrow, construct(V4, *tms)))
        B.comment("// a row masked so far keeps max -inf: exponents against 0 give zeros, not NaN")
        mref = B.let("mref", sel(mnew, construct(V4, f32(0.0)), mnew.eq(construct(V4, NEG_INF))))
        alpha = B.let("alpha", call("exp", mrow - mref))
        B.assign(mrow, mnew)
        p = B.var("p", ty=f"array<{V4}, 4>")
        for r in range(4):
            B.assign(p[r], call("exp", s[r] - construct(V4, mref[r])))
        one = construct(V4, f32(1.0))
        B.assign(lrow, lrow * alpha + construct(V4, *[call("dot", p[r], one) for r in range(4)]))
        for r in range(4):
            for g in range(NG):
                B.assign(o[r * NG + g], o[r * NG + g] * alpha[r])
        for c in range(4):
            B.assign(Ps[grp(tx + 16 * c) * TY + grp(ty ^ grp(grp(tx + 16 * c) & (TY - 1)))],
                     construct(V4, *[p[r][c] for r in range(4)]))
        for g, (c0, w) in enumerate(VCH):
            if g:
                B.barrier()

            def vdst(row, col):
                return KV[row * (CH // 4) + col / 4][col % 4]
            if piped:
                with B.extra("    "):
                    put(B, BK * wv, wv, vr, vdst)
                B.barrier()
                with B.if_((t + 1).lt(t1)):
                    load_k(B, kt0 + BK)
            else:
                stage(B, BK * w, w, vdst, lambda row, col, c0=c0: v_src(kt0, c0, row, col),
                      lambda row, col, c0=c0: v_ok(kt0, c0, row, col))
                B.barrier()
            with B.for_("j4", lit(0), lambda j4: j4.lt(BK // 4), lambda j4: j4 + 1) as j4:
                for j in range(4):
                    jj = B.let(f"j{j}", j4 * 4 + j)
                    pp = B.let(f"pp{j}", Ps[jj * TY + grp(ty ^ grp(jj & (TY - 1)))])
                    vv = B.let(f"vv{j}", KV[jj * (CH // 4) + tx])
                    for r in range(4):
                        B.assign(o[r * NG + g], call("fma", construct(V4, pp[r]), vv, o[r * NG + g]))
        B.barrier()
    for r in range(4):
        B.assign(Ps[grp(ty * 4 + r) * 4 + tx / 4][tx % 4], lrow[r])
    B.barrier()
    lsums, invs = [], []
    for r in range(4):
        at = grp(ty * 4 + r) * 4
        ls = B.let(f"lsum{r}", call("dot", Ps[at] + Ps[at + 1] + Ps[at + 2] + Ps[at + 3], construct(V4, f32(1.0))))
        lsums.append(ls)
        invs.append(B.let(f"inv{r}", sel(f32(0.0), f32(1.0) / ls, ls.ne(f32(0.0)))))
    row0 = grp(sp * NBH + bh) * lq if S > 1 else bh * lq
    i = u("i")
    if kernel.outs:
        lse = kernel.outs[0]
        assert lse.is_contiguous() and lse.shape == (S,) * (S > 1) + tuple(batch) + (hq, lq), lse.shape
        lb = b.index(lse.buf, lse.dtype, write=True)
        empty = NEG_INF if S > 1 else POS_INF
        for r in range(4):
            with B.block(inline=True):
                B.let("i", q0 + ty * 4 + r)
                with B.if_(land(tx.eq(0), i.lt(lq)), inline=True):
                    B.store(lb, lit(lse.offset) + row0 + i,
                            sel(empty, mrow[r] + call("log", lsums[r]), lsums[r].ne(f32(0.0))))
    for r in range(4):
        with B.block(head=1, indent="  "):
            B.let("i", q0 + ty * 4 + r)
            with B.if_(i.lt(lq), indent="  "):
                for g, (c0, w) in enumerate(VCH):
                    for e in range(4):
                        col = [lit(c0), tx * 4, lit(e)]
                        with B.if_(sum_terms(col).lt(dv), inline=True):
                            B.call("store_out", sum_terms([grp(row0 + i) * dv] + col), o[r * NG + g][e] * invs[r])
    module = (*fns, *(x.decl for x in (Qs, KV, Ps)), K.Blank())
    return K.ComputeKernel(buffers(b), TH, B.stmts, module=module), b.bufs, grid(NBH * NQT * S)


def _scores(B, kernel, spec, s, q0, ty, tx, kt0, lq, lk, BK, mb, st):
    """Scale, masks and the tile's bounds on each score of the thread's 4 x 4 block."""
    m = kernel.reads[3] if spec["masked"] else None
    scale = f32(spec["scale"])
    if not (spec["masked"] or spec["causal"] or lk % BK):
        for r in range(4):
            B.assign(s[r], s[r] * scale)
        return
    i, j, x = name("i", "u32"), name("j", "u32"), name("x", "f32")
    for r in range(4):
        for c in range(4):
            with B.block(head=2, tail=True):
                B.let("i", q0 + ty * 4 + r)
                B.let("j", kt0 + tx + 16 * c)
                B.var("x", s[r][c] * scale)
                if m is not None:
                    mv = load(mb, name("moff", "u32") + call("min", i, lit(lq - 1)) * st[-2]
                              + call("min", j, lit(lk - 1)) * st[-1], wgsl_type(m.dtype))
                    B.assign(x, sel(NEG_INF, x, mv.ne(lit(0, wgsl_type(m.dtype)))) if spec["int_mask"] else x + mv)
                if spec["causal"]:
                    B.assign(x, sel(NEG_INF, x, j.le(i)))
                if lk % BK:
                    B.assign(x, sel(NEG_INF, x, j.lt(lk)))
                B.assign(s[r][c], x)
