"""Flash attention's backward on tensor cores: GLSL on ``GL_KHR_cooperative_matrix`` for the
direct Vulkan backend in accelerated precision, a drop-in for the f32 kernels of
``flash_grad.py`` (same bindings in the same order, same outputs: dQ, or dK through
``store_out`` and dV as ``kernel.outs[0]``, split partials included).

Both kernels are one template over "own" rows X (queries for ``dq``, keys for ``dkv``) and
"walked" rows Y, as in ``flash_grad.py``: with XA, XV the own rows' operands (Q and dO, or
K and V) and YS, YV the walked rows' (K and V, or Q and dO),

    T = XA YS^T (the scores, or their transpose), dT = XV YV^T (dP, or its transpose),
    P = exp(scale T + mask - LSE), dS = P (dT - D),
    dq:  dQ += dS YS (K);    dkv: dV += P YV (dO), dK += dS YS (Q),

LSE and D indexed by the query (an own row for ``dq``, a walked one for ``dkv``). A workgroup
owns 16 x NSG rows, subgroup ``sg`` 16 of them, whose XA and XV fragments it holds in
registers; the walked rows come in tiles of BY = 64, staged as f16 in workgroup memory (the
next tile fetched into registers meanwhile). Per tile each subgroup multiplies T into
accumulator fragments and stores them to its f32 scratch rows, reads them back two lanes a
row (as ``flash_coop`` does its scores), then dT likewise, forms P and dS in f32, writes them
as f16 and accumulates the products into its output fragments. The gradients leave through
the scratch at the end, dQ and dK times ``scale``.

The f16 operands need dO of moderate size: accelerated precision scales dO and D by dO's
largest magnitude before the attention gradient and the gradients back after it
(``compiler.accelerated_rewrite``), so dO is at most 1 here and dS stays within f16's range.
"""
from __future__ import annotations

import numpy as np

from .common import Bindings, grid
from .expr import OutputStore
from .flash_coop import NEG_INF, Frame, _pad16, _stage, check, fitting_subgroups

BY = 64               # walked rows per tile


def _layout(d, dv, nsg, emulate, kind):
    """Offsets (uvec4) of the f16 areas in H and the sizes of H and the scratch (vec4): the
    walked tile's YS and YV (also the own rows' staging on tensor cores, where those move
    to registers), each subgroup's dS (and P for ``dkv``); the own rows have areas of their
    own when emulated (their fragments stay in H)."""
    dp, dvp = _pad16(d), _pad16(dv)
    ss, vs, ps = dp // 8 + 1, dvp // 8 + 1, BY // 8 + 1
    bx = 16 * nsg
    own = bx * (ss + vs) if emulate else 0
    ys_at = own
    yv_at = ys_at + max(BY, 0 if emulate else bx) * ss
    ds_at = yv_at + max(BY, 0 if emulate else bx) * vs
    p_at = ds_at + bx * ps
    h_size = p_at + (bx * ps if kind == "dkv" else 0)
    cw = max(BY, dp, dvp) // 4 + 1
    return dict(dp=dp, dvp=dvp, ss=ss, vs=vs, ps=ps, xa_at=0 if emulate else ys_at,
                xv_at=bx * ss if emulate else yv_at, ys_at=ys_at, yv_at=yv_at, ds_at=ds_at, p_at=p_at,
                h_size=h_size, cw=cw, c_size=bx * cw)


def workgroup_bytes(d, dv, nsg, kind, emulate=False) -> int:
    lay = _layout(d, dv, nsg, emulate, kind)
    return 16 * (lay["h_size"] + lay["c_size"]) + 4 * 2 * BY


def subgroups(d, dv, kind, workgroup_storage, emulate=False) -> int | None:
    return fitting_subgroups(lambda n: workgroup_bytes(d, dv, n, kind, emulate), workgroup_storage)


def select(kernel, workgroup_storage=49152, emulate=False) -> str:
    """Why ``kernel`` cannot run here ('' when it can): a flash attention backward kernel
    (``flash_grad.py``'s dq or dkv) with head dims up to MAX_DIM whose tiles fit."""
    def need(n):
        q, v = kernel.reads[0], kernel.reads[2]
        return workgroup_bytes(q.shape[-1], v.shape[-1], n, kernel.spec["grad"], emulate)
    return check(kernel, lambda s: "" if s.get("grad") in ("dq", "dkv") else "not a flash attention backward",
                 need, workgroup_storage)


def render(kernel, workgroup_storage=49152, emulate=False):
    """(GLSL text, bound logical buffers in binding order, workgroup counts) of the flash
    attention backward ``kernel`` on cooperative matrices; raises ValueError when it cannot
    (see ``select``). ``emulate``: the fragment operations as plain loops."""
    why = select(kernel, workgroup_storage, emulate)
    if why:
        raise ValueError(f"kernel {kernel.name!r} cannot run the attention backward on cooperative matrices: {why}")
    emu = emulate
    spec = kernel.spec
    kind = spec["grad"]
    dq = kind == "dq"
    q, k, v, do, lse, delta = kernel.reads[:6]
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    nb = int(np.prod(batch, dtype=np.int64))
    nbd = len(batch)
    NSG = subgroups(d, dv, kind, workgroup_storage, emulate)
    BX, NT = 16 * NSG, 32 * NSG
    lay = _layout(d, dv, NSG, emulate, kind)
    DP, DVP, SS, VS, PS, CW = (lay[x] for x in ("dp", "dvp", "ss", "vs", "ps", "cw"))
    # bindings in the WGSL kernel's order: the store's, q, k, v, dO, LSE, D, the mask, dV
    b = Bindings()
    store = OutputStore(kernel, b)
    qb, kb, vb, ob, lb, db = (b.index(x.buf, x.dtype) for x in (q, k, v, do, lse, delta))
    mb = b.index(kernel.reads[6].buf, kernel.reads[6].dtype) if spec["masked"] else None
    dvv = None if dq else kernel.outs[0]
    S = spec.get("split", 1)
    n_own, heads = (lq, hq) if dq else (lk, hkv)
    own_size = nb * heads * n_own            # rows of one split's partial gradient
    if dvv is not None:
        assert dvv.is_contiguous() and dvv.shape == (S,) * (S > 1) + tuple(batch) + (heads, lk, dv), dvv.shape
    vo = b.index(dvv.buf, dvv.dtype, write=True) if dvv is not None else None
    others = {store.ob, lb, db, mb, vo} | {b.index(x.buf, x.dtype) for x in kernel.epi_reads}
    fr = Frame(kernel, b, store, ((qb, q), (kb, k), (vb, v), (ob, do)), others, nbd, emulate)
    ops, vec, base, acc_decl, sync = fr.ops, fr.vec, fr.base, fr.acc_decl, fr.ops.sync
    NX = -(-n_own // BX)
    G0 = nb * heads * NX
    L = ["uint t = gl_LocalInvocationIndex;", ops.ids,
         "uint r = lane % 16u, hh = lane / 16u;     // this lane's row of the subgroup's 16, and column parity",
         "uint gs = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;",
         f"if (gs >= {S * G0}u) return;",
         f"uint sp = gs / {G0}u, gi = gs % {G0}u;",
         f"uint xt = gi % {NX}u, bh = gi / {NX}u, bz = bh / {heads}u;",
         f"uint x0 = xt * {BX}u;"]
    L += fr.batch_coords("bz", batch)
    if dq:      # own: query rows of head h; walked: keys of kv head h / G
        L += [f"uint h = bh % {hq}u, hk = h / {group}u;",
              f"uint qoff = {base(q, 'h')}, dooff = {base(do, 'h')}, koff = {base(k, 'hk')}, voff = {base(v, 'hk')};"]
        xa, xv, ys, yv = (q, qb, "qoff"), (do, ob, "dooff"), (k, kb, "koff"), (v, vb, "voff")
    else:       # own: keys of kv head hk; walked: query rows of its group's heads
        L += [f"uint hk = bh % {hkv}u;", f"uint koff = {base(k, 'hk')}, voff = {base(v, 'hk')};"]
        xa, xv, ys, yv = (k, kb, "koff"), (v, vb, "voff"), (q, qb, "qoff"), (do, ob, "dooff")
    # the own rows, once: staged as f16, then (on tensor cores) into this subgroup's A fragments
    L += _stage(xa[0], xa[1], vec[xa[1]], xa[2], "x0", BX, DP, NT, dst=f"{lay['xa_at']}u")[0]
    L += _stage(xv[0], xv[1], vec[xv[1]], xv[2], "x0", BX, DVP, NT, dst=f"{lay['xv_at']}u")[0]
    L.append("barrier();")
    L += fr.held("fxa", lay["xa_at"], SS, DP) + fr.held("fxv", lay["xv_at"], VS, DVP)
    if not emu:
        L.append("barrier();      // the own rows' area becomes the walked tiles'")
    L.append(f"uint cs = sg * {16 * CW}u;     // this subgroup's scratch rows")
    L.append("uint i_own = x0 + sg * 16u + r;   // this lane's own row")
    accs = [("ga", DP)] if dq else [("gk", DP), ("gv", DVP)]
    for name, width in accs:
        L += acc_decl(name, width // 16)
    # the walked tiles [w0, w1): this split's share; dkv walks (head of the group, query tile)
    NY = -(-(lk if dq else lq) // BY)
    if dq:
        L.append(f"uint nt = min({NY}u, (x0 + {BX - 1}u) / {BY}u + 1u);" if spec["causal"] else f"uint nt = {NY}u;")
        L.append(f"uint lse_own = {base(lse, 'h')} + min(i_own, {lq - 1}u) * {lse.strides[-1]}u;")
        L.append(f"float lse_r = b{lb}[lse_own], d_r = b{db}[{base(delta, 'h')} + min(i_own, {lq - 1}u) * {delta.strides[-1]}u];")
    else:       # causal: query rows i >= j only, so the tiles before the own keys' first are skipped
        L.append(f"uint qt0 = {f'min(x0 / {BY}u, {NY}u)' if spec['causal'] else '0u'}, nq = {NY}u - qt0;")
        L.append(f"uint nt = {group}u * nq;")
    per = -(-(NY if dq else group * NY) // S)
    L.append(f"uint w0 = min(sp * {per}u, nt), w1 = min(nt, w0 + {per}u);")
    # the walked tile's rows and (dkv) its heads' offsets, LSE and D
    def locate(w):
        """The walked tile ``w``'s first row and (dkv) its head's offsets."""
        if dq:
            return [f"uint y0 = {w} * {BY}u;"]
        return [f"uint h = hk * {group}u + {w} / nq, y0 = (qt0 + {w} % nq) * {BY}u;",
                f"uint qoff = {base(q, 'h')}, dooff = {base(do, 'h')};"]
    fs, ns = _stage(ys[0], ys[1], vec[ys[1]], ys[2], "y0", BY, DP, NT, reg="rs")
    fv, nv = _stage(yv[0], yv[1], vec[yv[1]], yv[2], "y0", BY, DVP, NT, reg="rv")
    put = _stage(ys[0], ys[1], vec[ys[1]], "", "", BY, DP, NT, reg="rs", dst=f"{lay['ys_at']}u")[0] + \
        _stage(yv[0], yv[1], vec[yv[1]], "", "", BY, DVP, NT, reg="rv", dst=f"{lay['yv_at']}u")[0]
    fetch = ["    " + x for x in locate("wf") + fs + fv]
    NL = -(-BY // NT)       # the walked queries' LSE and D per thread (dkv), staged beside them
    if not dq:
        fetch += [f"    [[unroll]] for (uint l = 0u; l < {NL}u; ++l) {{",
                  f"        uint yq = min(y0 + t + l * {NT}u, {lq - 1}u);",
                  f"        rl[l] = b{lb}[{base(lse, 'h')} + yq * {lse.strides[-1]}u];",
                  f"        rd[l] = b{db}[{base(delta, 'h')} + yq * {delta.strides[-1]}u];", "    }"]
        put += [f"[[unroll]] for (uint l = 0u; l < {NL}u; ++l) if (t + l * {NT}u < {BY}u) "
                f"{{ LDs[t + l * {NT}u] = rl[l]; LDs[{BY}u + t + l * {NT}u] = rd[l]; }}"]
    L += [f"uvec4 rs[{ns}];", f"uvec4 rv[{nv}];"] + ([] if dq else [f"float rl[{NL}], rd[{NL}];"])
    L += ["if (w0 < w1) {", "    uint wf = w0;"] + fetch + ["}"]
    body = put + ["barrier();"]
    body += ["if (w + 1u < w1) {", "    uint wf = w + 1u;"] + ["    " + x for x in fetch] + ["}"]
    body += locate("w")
    # T = XA YS^T, then dT = XV YV^T: each through the scratch into this lane's 32 values
    for name, fx, at, stride, width in (("tv", "fxa", lay["ys_at"], SS, DP), ("dtv", "fxv", lay["yv_at"], VS, DVP)):
        body += ["{"] + ["    " + x for x in fr.scores(fx, at, stride, width, BY, CW) + sync]
        body += [f"    [[unroll]] for (uint j = 0u; j < {BY // 8}u; ++j) {name}[j] = Cs[cs + r * {CW}u + 2u * j + hh];"]
        body += ["    " + x for x in sync] + ["}"]
    # P and dS, elementwise: query i, key j
    i, j = ("i_own", "y") if dq else ("y", "i_own")
    lse_q, d_q = ("lse_r", "d_r") if dq else (f"LDs[y - y0]", f"LDs[{BY}u + y - y0]")
    elem = [f"uint y = y0 + (2u * jj + hh) * 4u + e;",
            f"float x = tv[jj][e] * {float(np.float32(spec['scale']))!r};"]
    if spec["masked"]:
        mterms, st = fr.mask_terms(kernel.reads[6], tuple(batch) + (hq, lq, lk), "h")
        mv = (f"b{mb}[{' + '.join(mterms)} + min({i}, {lq - 1}u) * {st[-2]}u + "
              f"min({j}, {lk - 1}u) * {st[-1]}u]")
        elem.append(f"x = ({mv} != 0) ? x : {NEG_INF};" if spec["int_mask"] else f"x += {mv};")
    keep = [f"{i} < {lq}u", f"{j} < {lk}u"] + ([f"{j} <= {i}"] if spec["causal"] else [])
    elem += [f"float p = ({' && '.join(keep)}) ? exp(x - {lse_q}) : 0.0;",
             "tv[jj][e] = p;",
             f"dtv[jj][e] = p * (dtv[jj][e] - {d_q});"]
    body += [f"[[unroll]] for (uint jj = 0u; jj < {BY // 8}u; ++jj) {{",
             "    [[unroll]] for (uint e = 0u; e < 4u; ++e) {"] + ["        " + x for x in elem] + ["    }", "}"]
    # dS (and P) as f16 A operands, then the products
    writes = [("dtv", lay["ds_at"])] + ([] if dq else [("tv", lay["p_at"])])
    for name, at in writes:
        body += fr.write_rows(name, at, PS, BY // 8)
    body += sync
    products = [("ga", lay["ds_at"], lay["ys_at"], SS, DP)] if dq else \
        [("gk", lay["ds_at"], lay["ys_at"], SS, DP), ("gv", lay["p_at"], lay["yv_at"], VS, DVP)]
    for acc, a_at, b_at, stride, width in products:
        body += fr.accumulate(acc, a_at, PS, b_at, stride, BY, width)
    body.append("barrier();      // the tile, dS, P and the scratch are read: the next tile may overwrite them")
    L += [f"vec4 tv[{BY // 8}], dtv[{BY // 8}];     // this lane's values of T (then P) and dT (then dS)"]
    L += ["for (uint w = w0; w < w1; ++w) {"] + ["    " + x for x in body] + ["}"]
    # the gradients through the scratch: this lane's row, columns 4 (2j + hh) ..
    scale = float(np.float32(spec["scale"]))
    outs = [("ga", DP, d, scale, None)] if dq else [("gk", DP, d, scale, None), ("gv", DVP, dv, None, vo)]
    for acc, width, n, mul, binding in outs:
        L += sync + [f"[[unroll]] for (uint jn = 0u; jn < {width // 16}u; ++jn) " + ops.store(f"{acc}[jn]", "Cs", "cs + jn * 4u", CW)]
        L += sync
        dest = f"(sp * {own_size}u + bh * {n_own}u + i_own) * {n}u + col"
        value = f"Cs[cs + r * {CW}u + 2u * j + hh][e]" + (f" * {mul!r}" if mul is not None else "")
        st_line = (f"store_out({dest}, {value});" if binding is None
                   else f"b{binding}[{dvv.offset}u + {dest}] = {value};")
        L += [f"if (i_own < {n_own}u) {{",
              f"    [[unroll]] for (uint j = 0u; j < {width // 8}u; ++j) {{",
              "        [[unroll]] for (uint e = 0u; e < 4u; ++e) {",
              "            uint col = (2u * j + hh) * 4u + e;",
              f"            if (col < {n}u) {st_line}",
              "        }", "    }", "}"]
    shared = [f"shared uvec4 H[{lay['h_size']}];", f"shared vec4 Cs[{lay['c_size']}];", f"shared float LDs[{2 * BY}];"]
    return fr.source(NT, shared, [], L), b.bufs, grid(S * G0)
