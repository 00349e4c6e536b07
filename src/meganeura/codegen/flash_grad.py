"""Flash attention backward: dQ, dK and dV from Q, K, V, dO, the forward's log-sum-exp
(LSE) and D = rowsum(dO * O), without materialising the Lq x Lk matrices.

The probabilities are recomputed tile by tile, P = exp(scale * Q K^T + mask - LSE), and
with dP = dO V^T and dS = P * (dP - D):

- ``dq``: a workgroup owns BX = 32 query rows of one (batch, head) and walks the key
  tiles: dQ = scale * dS K, accumulated in registers;
- ``dkv``: a workgroup owns BX = 32 keys of one (batch, kv head) and walks the query
  tiles of every query head of its group: dV = P^T dO and dK = scale * dS^T Q, so grouped
  heads are summed inside the kernel. It writes two outputs (dK through ``store_out``,
  where a fused epilogue runs; dV as ``kernel.outs[0]``).

Both are one template over "own" rows X (queries for dq, keys for dkv) and "walked" rows
Y of BY = 32 per tile. Threads: 8 x 16; thread (ty, tx) owns the 4 x 2 block of the
32 x 32 score tile at own rows 4ty..4ty+3 and walked rows tx + 16c, and the output columns
4tx..4tx+3 of every 64-column chunk of its four rows: a walked row's P or dS for those four
rows is one vec4 (PS holds each walked row's 32 values as 8 vec4s, the thread's swizzled to
ty ^ (y % 8)), so the accumulation reads 2 vec4s per 16 FMAs. (With 16 x 16 threads of 2 x
2 it read 3 values per 8, and Whisper-tiny's backward was bound by workgroup memory.)
Operands reach workgroup memory in
chunks of 64 columns as vec4s over 4 columns, column-group-major with a row stride of 33
vec4s, so the score loop reads 8 different banks per quarter warp and the accumulation
(over Y rows, lanes along columns) too. With D <= 64 the K (dq) or Q and dO (dkv) chunks
staged for the scores are reused by the accumulation; wider heads stage them again.

Masks as in the forward (a float mask added, an integer mask keeping non-zero positions,
``is_causal`` keeping j <= i, whose tiles entirely above the diagonal are skipped). Rows
and keys past the ends read zeros and their probabilities are zero; a fully masked row
has LSE +inf, so its probabilities and gradients are zeros.
"""
from __future__ import annotations

import numpy as np

from .common import ENTRY, GROUP_INDEX, LOOP_BOUND, Bindings, broadcast_view_strides, coords, grid, literal
from .expr import OutputStore
from . import flash_split
from .flash import MAX_DIM, NEG_INF, _chunks, _pad4, _stage_trips, shapes_ok, smem_floats

BX = BY = 32         # own rows per workgroup, walked rows per tile
TX = 16              # lanes per row group
RO = 4               # own rows per thread: 4ty..4ty+3
TY = BX // RO        # row groups
TH = TY * TX         # threads (128)
PAD = 33             # vec4 stride between column groups of a staged chunk
CHUNK_VEC4 = 16 * PAD


def loop_trips(kind, lq, lk, d, dv, group) -> int:
    """Loop back-edges one invocation takes (LOOP_BOUND keeps software drivers exact)."""
    st = _stage_trips(BY * 64, TH)[0]
    per_tile = 1
    for _, w in _chunks(d):
        per_tile += 2 * st + w // 4
    for _, w in _chunks(dv):
        per_tile += 2 * st + w // 4
    acc = [d] if kind == "dq" else [d, dv]
    per_tile += sum(len(_chunks(n)) * (BY // 4 + (st if len(_chunks(n)) > 1 else 0)) for n in acc)
    tiles = -(-lk // BY) if kind == "dq" else group * -(-lq // BY)
    return tiles * per_tile


def supported(t) -> bool:
    """An ``attention_grad`` node this kernel takes: f32, head dims up to 256, one set of
    batch dims, within LOOP_BOUND (Whisper and SmolLM2 shapes are far inside)."""
    q, k, v, do = t.inputs[:4]
    if not shapes_ok(q, k, v, do.shape[:-2]) or max(q.shape[-1], v.shape[-1]) > MAX_DIM:
        return False
    lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    group = q.shape[-3] // k.shape[-3]
    return max(loop_trips(kind, lq, lk, d, dv, group) for kind in ("dq", "dkv")) <= LOOP_BOUND


def splits(kind, q_shape, k_shape) -> int:
    """S workgroups per own tile, each walking 1/S of the walked tiles into a partial
    gradient (``flash_split.splits``'s rule: about its TARGET_GROUPS workgroups, at least
    MIN_TILES tiles each; MEGANEURA_FLASH_SPLIT forces it). Whisper-tiny's encoder has
    6 heads x 47 tiles of 32 rows: 282 workgroups of 128 threads, two an SM of an H200."""
    *batch, hq, lq, _ = q_shape
    hkv, lk = k_shape[-3], k_shape[-2]
    nb = int(np.prod(batch, dtype=np.int64))
    if kind == "dq":
        groups, walked = nb * hq * -(-lq // BX), -(-lk // BY)
    else:
        groups, walked = nb * hkv * -(-lk // BX), (hq // hkv) * -(-lq // BY)
    return max(1, min(flash_split.splits(groups, walked), walked))


def render(kernel):
    """(WGSL, bound buffers, workgroups), printed from the kernel's tree (``flash_grad_ast``);
    the template (``_render_template``) stays for the tests that compare the two."""
    from .flash_grad_ast import tree
    from .kernel_ast import printed
    got = tree(kernel)
    if got is None:
        return _render_template(kernel)
    return printed(got[0]), got[1], got[2]


def _render_template(kernel):
    spec = kernel.spec
    kind = spec["grad"]
    q, k, v, do, lse, delta = kernel.reads[:6]
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    nb = int(np.prod(batch, dtype=np.int64))
    nbd = len(batch)
    b = Bindings()
    store = OutputStore(kernel, b)
    qb, kb, vb, ob, lb, db = (b.index(x.buf, x.dtype) for x in (q, k, v, do, lse, delta))
    f = lambda x: literal(x, q.dtype)  # noqa: E731
    dq = kind == "dq"
    NX = -(-(lq if dq else lk) // BX)           # own tiles per head
    NQT = -(-lq // BY)

    def base(x, head, nd=nbd):
        st = x.strides
        terms = [f"{x.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nd) if st[n]]
        return " + ".join(terms + ([f"{head} * {st[nd]}u"] if st[nd] else []))

    def stage(area, row0, n_rows, c0, w, buf, off, view, width):
        """Rows row0.. (of n_rows) and columns c0..c0+w of ``view`` into ``area``:
        area[(col / 4) * PAD + row][col % 4], zeros past the ends."""
        trips, unroll = _stage_trips(BY * w, TH)
        rs, cs = view.strides[-2], view.strides[-1]
        src = (f"b{buf}[{off} + min({row0} + row, {n_rows - 1}u) * {rs}u + "
               f"min({c0}u + col, {width - 1}u) * {cs}u]")
        ok = f"{row0} + row < {n_rows}u && {c0}u + col < {width}u"
        lines = [f"    for (var it = 0u; it < {trips}u; it = it + 1u) {{"]
        for u in range(unroll):
            inner = (f"let row = e / {w}u; let col = e % {w}u; "
                     f"{area}[(col / 4u) * {PAD}u + row][col % 4u] = select(0.0, {src}, {ok});")
            guard = trips * unroll * TH > BY * w
            lines.append(f"        {{ let e = lid + (it * {unroll}u + {u}u) * {TH}u; "
                         + (f"if (e < {BY * w}u) {{ {inner} }}" if guard else inner) + " }")
        return lines + ["    }"]

    def dots(acc, w):
        """acc[r][c] += XA row (4ty + r) . YS row (tx + 16c) over a chunk of w columns."""
        lines = [f"    for (var c4 = 0u; c4 < {w // 4}u; c4 = c4 + 1u) {{"]
        lines += [f"        let xa{r} = XA[c4 * {PAD}u + ty * {RO}u + {r}u];" for r in range(RO)]
        lines += [f"        let ya0 = YS[c4 * {PAD}u + tx]; let ya1 = YS[c4 * {PAD}u + tx + 16u];"]
        lines += [f"        {acc}[{r}][{c}] = {acc}[{r}][{c}] + dot(xa{r}, ya{c});" for r in range(RO) for c in range(2)]
        return lines + ["    }"]

    def accumulate(acc, area, n_chunks, ci):
        """acc[r * n_chunks + ci] += sum over the tile's Y rows y of P(own row 4ty + r, y) *
        area[y][4tx..]: PS[y] holds the own rows' values as vec4s over 4 rows, the thread's
        at ty ^ (y % TY) (swizzled: the writes of 16 lanes spread over the banks)."""
        lines = [f"    for (var y4 = 0u; y4 < {BY // 4}u; y4 = y4 + 1u) {{"]
        for u in range(4):
            lines.append(f"        let y{u} = y4 * 4u + {u}u; let w{u} = {area}[tx * {PAD}u + y{u}];"
                         f" let p{u} = PS[y{u} * {TY}u + (ty ^ (y{u} & {TY - 1}u))];")
            lines += [f"        {acc}[{r * n_chunks + ci}] = fma(vec4<f32>(p{u}[{r}]), w{u}, "
                      f"{acc}[{r * n_chunks + ci}]);" for r in range(RO)]
        return lines + ["    }"]

    S = spec.get("split", 1)       # workgroup sp walks tiles [sp * per, (sp + 1) * per)
    G0 = nb * (hq if dq else hkv) * NX
    L = [f"    let gs = {GROUP_INDEX};", f"    if (gs >= {S * G0}u) {{ return; }}",
         f"    let sp = gs / {G0}u; let gi = gs % {G0}u;"]
    if dq:      # own: query rows of head h; walked: keys of kv head h / G
        L += [f"    let xt = gi % {NX}u; let bh = gi / {NX}u; let h = bh % {hq}u; let bz = bh / {hq}u;"]
    else:       # own: keys of kv head hk; walked: query rows of its group's heads
        L += [f"    let xt = gi % {NX}u; let bh = gi / {NX}u; let hk = bh % {hkv}u; let bz = bh / {hkv}u;"]
    L += coords("bz", batch, prefix="z") if batch else []
    L += [f"    let x0 = xt * {BX}u;", f"    let ty = lid / {TX}u; let tx = lid % {TX}u;"]
    if dq:
        L += [f"    let hk = h / {group}u;",
              f"    let qoff = {base(q, 'h')};", f"    let dooff = {base(do, 'h')};"]
    L += [f"    let koff = {base(k, 'hk')};", f"    let voff = {base(v, 'hk')};"]
    dch, vch = _chunks(d), _chunks(dv)
    # (own, walked) operands of the scores and of dP
    xs, ys = ((qb, "qoff", q, lq), (kb, "koff", k, lk)) if dq else ((kb, "koff", k, lk), (qb, "qoff", q, lq))
    xv, yv = ((ob, "dooff", do, lq), (vb, "voff", v, lk)) if dq else ((vb, "voff", v, lk), (ob, "dooff", do, lq))
    # the own rows' two operands stay in workgroup memory for the whole walk where they fit:
    # each tile then stages only the walked rows' two (half the copies, 3 barriers a tile
    # instead of 5); they are staged before the walk
    resident = len(dch) == len(vch) == 1 and 4 * CHUNK_VEC4 + BX * BY // 4 <= smem_floats(spec.get("smem")) // 4
    own = (stage("XA", "x0", xs[3], 0, _pad4(d), xs[0], xs[1], xs[2], d)
           + stage("XV", "x0", xv[3], 0, _pad4(dv), xv[0], xv[1], xv[2], dv)) if resident else []
    if dq:
        L.append(f"    var aq: array<vec4<f32>, {RO * len(dch)}>;")
        # this thread's own rows' LSE and D, once
        for r in range(RO):
            L += [f"    let lse{r} = b{lb}[{base(lse, 'h')} + min(x0 + ty * {RO}u + {r}u, {lq - 1}u) * {lse.strides[-1]}u];",
                  f"    let dd{r} = b{db}[{base(delta, 'h')} + min(x0 + ty * {RO}u + {r}u, {lq - 1}u) * {delta.strides[-1]}u];"]
        if spec["causal"]:
            L.append(f"    let nt = min({-(-lk // BY)}u, (x0 + {BX - 1}u) / {BY}u + 1u);")
        else:
            L.append(f"    let nt = {-(-lk // BY)}u;")
        per = -(-(-(-lk // BY)) // S)
        L += own + [f"    for (var t = sp * {per}u; t < min(nt, sp * {per}u + {per}u); t = t + 1u) {{",
                    f"    let y0 = t * {BY}u;"]
    else:
        L += [f"    var ak: array<vec4<f32>, {RO * len(dch)}>;", f"    var av: array<vec4<f32>, {RO * len(vch)}>;"]
        # causal: query rows i >= j only, so the tiles before the key tile's own are skipped
        L.append(f"    let qt0 = {f'min(x0 / {BY}u, {NQT}u)' if spec['causal'] else '0u'};")
        L.append(f"    let nq = {NQT}u - qt0;")
        per = -(-(group * NQT) // S)
        L += own + [f"    for (var t = sp * {per}u; t < min({group}u * nq, sp * {per}u + {per}u); t = t + 1u) {{",
              "    let h = hk * " + f"{group}u + t / nq;",
              f"    let y0 = (qt0 + t % nq) * {BY}u;",
              f"    let qoff = {base(q, 'h')};", f"    let dooff = {base(do, 'h')};"]
        for c in range(2):
            L += [f"    let lse{c} = b{lb}[{base(lse, 'h')} + min(y0 + tx + {16 * c}u, {lq - 1}u) * {lse.strides[-1]}u];",
                  f"    let dd{c} = b{db}[{base(delta, 'h')} + min(y0 + tx + {16 * c}u, {lq - 1}u) * {delta.strides[-1]}u];"]
    # zeroed here, not by a bare ``var`` (naga hoists that to the function's entry)
    zeros = ", ".join(["vec2<f32>(0.0)"] * RO)
    L += [f"    var s = array<vec2<f32>, {RO}>({zeros});", f"    var dp = array<vec2<f32>, {RO}>({zeros});"]
    if resident:
        L += stage("YS", "y0", ys[3], 0, _pad4(d), ys[0], ys[1], ys[2], d)
        L += stage("YV", "y0", yv[3], 0, _pad4(dv), yv[0], yv[1], yv[2], dv)
        L += ["    workgroupBarrier();"] + dots("s", _pad4(d))
        L += [ln.replace("XA[", "XV[").replace("YS[", "YV[") for ln in dots("dp", _pad4(dv))]
    else:       # X holds one own chunk at a time, staged again for each
        for c0, w in dch:
            L += stage("XA", "x0", xs[3], c0, w, xs[0], xs[1], xs[2], d)
            L += stage("YS", "y0", ys[3], c0, w, ys[0], ys[1], ys[2], d)
            L += ["    workgroupBarrier();"] + dots("s", w) + ["    workgroupBarrier();"]
        for n, (c0, w) in enumerate(vch):
            L += stage("XA", "x0", xv[3], c0, w, xv[0], xv[1], xv[2], dv)
            L += stage("YV", "y0", yv[3], c0, w, yv[0], yv[1], yv[2], dv)
            L += ["    workgroupBarrier();"] + [ln.replace("YS[", "YV[") for ln in dots("dp", w)]
            if n < len(vch) - 1:
                L.append("    workgroupBarrier();")
    # probabilities and dS of the thread's block: query i, key j
    if spec["masked"]:
        m = kernel.reads[6]
        mb = b.index(m.buf, m.dtype)
        st = broadcast_view_strides(m, tuple(batch) + (hq, lq, lk))
        terms = [f"{m.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nbd) if st[n]]
        terms += [f"h * {st[nbd]}u"] if st[nbd] else []
        L.append(f"    let moff = {' + '.join(terms)};")
    for r in range(RO):
        for c in range(2):
            i, j = (f"x0 + ty * {RO}u + {r}u", f"y0 + tx + {16 * c}u")
            if not dq:
                i, j = j, i
            lse_i, d_i = (f"lse{r}", f"dd{r}") if dq else (f"lse{c}", f"dd{c}")
            L += [f"    {{ let i = {i}; let j = {j};", f"        var x = s[{r}][{c}] * {f(spec['scale'])};"]
            if spec["masked"]:
                mv = f"b{mb}[moff + min(i, {lq - 1}u) * {st[-2]}u + min(j, {lk - 1}u) * {st[-1]}u]"
                L.append(f"        x = select({NEG_INF}, x, {mv} != {literal(0, m.dtype)});" if spec["int_mask"]
                         else f"        x = x + {mv};")
            keep = [f"i < {lq}u", f"j < {lk}u"] + (["j <= i"] if spec["causal"] else [])
            L += [f"        let p = select(0.0, exp(x - {lse_i}), {' && '.join(keep)});",
                  f"        s[{r}][{c}] = p;",
                  f"        dp[{r}][{c}] = p * (dp[{r}][{c}] - {d_i}); }}"]
    # s now holds P and dp holds dS; PS[walked row] (vec4s over own rows) feeds the accumulation
    writes = lambda a: [f"    PS[(tx + {16 * c}u) * {TY}u + (ty ^ ((tx + {16 * c}u) & {TY - 1}u))] = "  # noqa: E731
                        f"vec4<f32>({', '.join(f'{a}[{r}][{c}]' for r in range(RO))});" for c in range(2)]
    if dq:
        L += writes("dp") + ["    workgroupBarrier();"]
        for ci, (c0, w) in enumerate(dch):
            if len(dch) > 1:
                L += stage("YS", "y0", lk, c0, w, kb, "koff", k, d) + ["    workgroupBarrier();"]
            L += accumulate("aq", "YS", len(dch), ci) + ["    workgroupBarrier();"]
    else:
        L += writes("s") + ["    workgroupBarrier();"]
        for ci, (c0, w) in enumerate(vch):
            if len(vch) > 1:
                L += stage("YV", "y0", lq, c0, w, ob, "dooff", do, dv) + ["    workgroupBarrier();"]
            L += accumulate("av", "YV", len(vch), ci) + ["    workgroupBarrier();"]
        L += writes("dp") + ["    workgroupBarrier();"]
        for ci, (c0, w) in enumerate(dch):
            if len(dch) > 1:
                L += stage("YS", "y0", lq, c0, w, qb, "qoff", q, d) + ["    workgroupBarrier();"]
            L += accumulate("ak", "YS", len(dch), ci) + ["    workgroupBarrier();"]
    L.append("    }")
    # stores: the thread's own rows, 4 columns per chunk
    n_own = lq if dq else lk
    main, width, chunks = ("aq", d, dch) if dq else ("ak", d, dch)
    heads = hq if dq else hkv
    scale = f(spec["scale"])
    own_size = nb * heads * n_own      # rows of one split's partial gradient
    for r in range(RO):
        L.append(f"    {{ let x = x0 + ty * {RO}u + {r}u; if (x < {n_own}u) {{")
        for ci, (c0, w) in enumerate(chunks):
            for e in range(4):
                col = f"{c0}u + tx * 4u + {e}u"
                L.append(f"        if ({col} < {width}u) {{ "
                         f"store_out((sp * {own_size}u + bh * {n_own}u + x) * {width}u + {col}, "
                         f"{main}[{r * len(chunks) + ci}][{e}] * {scale}); }}")
        if not dq:
            dvv = kernel.outs[0]
            split_dims = () if S == 1 else (S,)
            assert dvv.is_contiguous() and dvv.shape == split_dims + tuple(batch) + (heads, lk, dv), dvv.shape
            vo = b.index(dvv.buf, dvv.dtype, write=True)
            for ci, (c0, w) in enumerate(vch):
                for e in range(4):
                    col = f"{c0}u + tx * 4u + {e}u"
                    L.append(f"        if ({col} < {dv}u) {{ "
                             f"b{vo}[{dvv.offset}u + (sp * {own_size}u + bh * {lk}u + x) * {dv}u + {col}] = "
                             f"av[{r * len(vch) + ci}][{e}]; }}")
        L.append("    } }")
    src = (b.decls() + "\n" + store.module_text() +
           f"\nvar<workgroup> XA: array<vec4<f32>, {CHUNK_VEC4}>;"
           f"\nvar<workgroup> YS: array<vec4<f32>, {CHUNK_VEC4}>;"
           f"\nvar<workgroup> YV: array<vec4<f32>, {CHUNK_VEC4}>;"
           + (f"\nvar<workgroup> XV: array<vec4<f32>, {CHUNK_VEC4}>;" if resident else "") +
           f"\nvar<workgroup> PS: array<vec4<f32>, {BX * BY // 4}>;\n\n"
           + ENTRY.format(wg=TH) + "\n".join(L) + "\n}\n")
    return src, b.bufs, grid(S * G0)
