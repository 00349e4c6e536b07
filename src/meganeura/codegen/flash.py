"""Flash attention forward: scaled dot-product attention for sequences too long for the
one-row kernel (``attention.py``), without materialising the Lq x Lk scores.

A workgroup owns BQ query rows of one (batch, head) and walks the keys in tiles of
``BK`` = 64: each tile's scores S = Q K^T live in registers, an online softmax keeps each
row's running max and sum, and O += P V accumulates in registers; O is divided by the row
sum once, at the end, and stored through ``store_out`` (fused epilogues work).

Threads: ``TY = BQ / 4`` row groups x ``TX`` = 16 lanes. A thread owns 4 consecutive
query rows and, per key tile, the 4 keys ``tx + 16c`` (a 4x4 block of S: 8 vec4 loads
from workgroup memory per 64 FMAs) and the 4 value columns ``4tx..4tx+3`` of every
64-column chunk of the output (one vec4 of P and one of V per 16 FMAs). A row's 16 lanes
share its max through workgroup memory; row sums stay per lane and combine once, at the end.

Workgroup memory (f32): Q (BQ x D, staged once), one 64x64 area that holds a chunk of K
(64 keys x 64 dims; D > 64 runs several chunks) and then a chunk of V (64 keys x 64
columns), and P (64 keys x BQ rows, also the lanes' max/sum exchange). Bank conflicts: K
rows are XOR-swizzled by key so 8 consecutive keys read one dim from 8 different banks;
P's rows (vec4 over 4 query rows) are swizzled by key the same way for the P writes.

Masks: a float mask is added to the scaled scores, an integer mask keeps non-zero
positions, ``is_causal`` keeps j <= i and skips the key tiles entirely above the
diagonal; grouped heads read kv head h // G; a fully masked row gives zeros. q, k, v and
the mask are read through their strided views (head splits and transposes cost nothing).

With a second output (``kernel.outs``, the ``attention_lse`` node scheduled with the
output's) the kernel also stores each row's log-sum-exp, max + log(sum), for the backward
pass (``flash_grad.py``).

Split over keys (``spec["split"]`` = S > 1, flash-decoding): S workgroups share a query
tile, split s walking key tiles [s * nt / S, (s + 1) * nt / S) of the nt that tile needs;
``out`` is then (S, *batch, Hq, Lq, Dv) of partial outputs, each normalised by its own row
sum, and the second output (S, *batch, Hq, Lq) their log-sum-exps (-inf where a split saw
no unmasked key). ``flash_split.py`` combines them.
"""
from __future__ import annotations

import contextvars
import os

import numpy as np

from .common import ENTRY, GROUP_INDEX, LOOP_BOUND, Bindings, broadcast_view_strides, coords, grid, literal
from .expr import OutputStore

BK = 64              # keys per tile
TX = 16              # lanes per row group (4 keys each: 64)
CH = 64              # columns of a K (dims) or V chunk in workgroup memory
MAX_DIM = 256
NEG_INF = "bitcast<f32>(0xff800000u)"


DEFAULT_SMEM = 32768     # bytes: lavapipe, Apple GPUs and most desktop GPUs offer it

# The adapter's workgroup memory for the compile under way (the compiler sets it around
# scheduling): lowering fixes the split over keys (its buffers' sizes depend on it) by the
# query rows per workgroup the kernel will render with, before the tiles are sized.
ADAPTER_SMEM = contextvars.ContextVar("flash_adapter_smem", default=0)


def smem_floats(budget=None) -> int:
    """Workgroup memory the tiles may use, in f32s: MEGANEURA_FLASH_SMEM, else ``budget``
    (the adapter's limit, which the compile stage records in the kernel's spec), else 32
    KiB. Larger tiles pay: Whisper-tiny inference 4.17 -> 3.77 ms with an H200's 48 KiB."""
    return int(os.environ.get("MEGANEURA_FLASH_SMEM", budget or DEFAULT_SMEM)) // 4


def _pad4(n):
    return -(-n // 4) * 4


def rows_per_group(d, budget=None) -> int | None:
    """BQ, query rows per workgroup: the largest that fits Q, the K/V chunk and P."""
    for bq in (64, 32, 16, 8):
        if bq * _pad4(d) + BK * CH + BK * bq <= smem_floats(budget):
            return bq
    return None


def _chunks(n):
    """(start, width) of the 64-wide chunks of ``n`` (padded to 4) columns."""
    n = _pad4(n)
    return [(c, min(CH, n - c)) for c in range(0, n, CH)]


def _stage_trips(total, threads):
    """(loop trips, copies per trip) to stage ``total`` elements with ``threads``."""
    per = -(-total // threads)
    unroll = min(per, 8)
    return -(-per // unroll), unroll


def loop_trips(lk, d, dv) -> int:
    """Loop back-edges one invocation takes (software drivers stop after 65535 in all)."""
    bq = rows_per_group(d)
    th = 4 * bq
    per_tile = 1
    for _, w in _chunks(d):
        per_tile += _stage_trips(BK * w, th)[0] + w // 4
    for _, w in _chunks(dv):
        per_tile += _stage_trips(BK * w, th)[0] + BK // 4
    return -(-lk // BK) * per_tile + _stage_trips(bq * _pad4(d), th)[0]


def supported(t) -> bool:
    """Shapes this kernel takes: f32, head dims up to 256, same batch dims for q, k and v,
    and at most LOOP_BOUND loop back-edges per invocation (Lk up to about 40k at D = 64);
    others decompose."""
    q, k, v = t.inputs[:3]
    return shapes_ok(q, k, v, t.shape[:-2]) and rows_per_group(q.shape[-1]) is not None \
        and loop_trips(k.shape[-2], q.shape[-1], v.shape[-1]) <= LOOP_BOUND


def shapes_ok(q, k, v, lead) -> bool:
    """q, k and v are f32 with head dims up to 256 and one set of batch dims, which the
    output's leading dims ``lead`` (*batch, Hq) are too."""
    if q.ndim < 3 or q.dtype.name != "f32" or k.dtype is not q.dtype or v.dtype is not q.dtype:
        return False
    lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if not (0 < lq and 0 < lk and 0 < d <= MAX_DIM and 0 < dv <= MAX_DIM):
        return False
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3] and k.shape[-3] == v.shape[-3]
            and q.shape[-3] % k.shape[-3] == 0 and tuple(lead) == tuple(q.shape[:-2])):
        return False
    return True


def render(kernel):
    """(WGSL, bound buffers, workgroups), printed from the kernel's tree (``flash_ast``); the
    template (``_render_template``) stays for the tests that compare the two."""
    from .flash_ast import tree
    from .kernel_ast import printed
    got = tree(kernel)
    if got is None:
        return _render_template(kernel)
    return printed(got[0]), got[1], got[2]


def _render_template(kernel):
    q, k, v = kernel.reads[:3]
    spec = kernel.spec
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    nb = int(np.prod(batch, dtype=np.int64))
    BQ = rows_per_group(d, kernel.spec.get("smem"))
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
    store = OutputStore(kernel, b)
    qb, kb, vb = (b.index(x.buf, x.dtype) for x in (q, k, v))
    nbd = len(batch)
    f = lambda x: literal(x, q.dtype)  # noqa: E731

    def base(x, head):
        st = x.strides
        terms = [f"{x.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nbd) if st[n]]
        return " + ".join(terms + ([f"{head} * {st[nbd]}u"] if st[nbd] else []))

    def stage(total, width, dst, src, ok):
        """Copy ``total`` elements (e -> row = e / width, col = e % width) into workgroup
        memory: ``dst(row, col)`` a WGSL lvalue, ``src`` the clamped read, ``ok`` in range."""
        trips, unroll = _stage_trips(total, TH)
        body = []
        for u in range(unroll):
            guard = (total % (TH * unroll * trips) != 0) or (trips * unroll * TH > total)
            inner = (f"let row = e / {width}u; let col = e % {width}u; "
                     f"{dst} = select(0.0, {src}, {ok});")
            body.append(f"        {{ let e = lid + (it * {unroll}u + {u}u) * {TH}u; "
                        + (f"if (e < {total}u) {{ {inner} }}" if guard else inner) + " }")
        return [f"    for (var it = 0u; it < {trips}u; it = it + 1u) {{"] + body + ["    }"]

    def by_register(total, width, reg, body):
        """One statement per register ``reg[u]`` of a thread's share of ``total`` elements
        (e -> row = e / width, col = e % width): ``stage`` split in two for software
        pipelining, the loads issued a phase ahead so their latency hides behind arithmetic."""
        def one(u):
            e = f"let e = lid + {u * TH}u; let row = e / {width}u; let col = e % {width}u;"
            st = body(f"{reg}[{u}]")
            return f"        {{ {e} " + (f"if (e < {total}u) {{ {st} }}" if (u + 1) * TH > total else st) + " }"
        return [one(u) for u in range(-(-total // TH))]

    qs, ks, vs = q.strides, k.strides, v.strides
    # one K chunk and one V chunk per tile and few elements per thread: the next tile's K
    # loads while P V is computed and the tile's V while Q K^T is (Whisper-tiny's encoder
    # attention 268 -> see bench/attention.py on an H200)
    piped = len(_chunks(d)) == 1 and len(VCH) == 1 and BK * max(_pad4(d), _pad4(dv)) <= 32 * TH
    L = [f"    let gi = {GROUP_INDEX};",
         f"    if (gi >= {NBH * NQT * S}u) {{ return; }}",
         # the query tile varies fastest: neighbouring workgroups read the same K/V tiles
         f"    let qt = gi % {NQT}u; let bh = (gi / {NQT}u) % {NBH}u; let h = bh % {hq}u; let bz = bh / {hq}u;"]
    if S > 1:
        L.append(f"    let sp = gi / {NQT * NBH}u;     // this workgroup's split of the keys")
    L += coords("bz", batch, prefix="z") if batch else []
    L += [f"    let hk = h / {group}u;",
          f"    let q0 = qt * {BQ}u;",
          f"    let qoff = {base(q, 'h')};",
          f"    let koff = {base(k, 'hk')};",
          f"    let voff = {base(v, 'hk')};",
          f"    let ty = lid / {TX}u; let tx = lid % {TX}u;"]
    # Q tile, once: Qs[row * DQ4 + d4] (vec4 over dims)
    L += stage(BQ * DQ4 * 4, DQ4 * 4, "Qs[row * {0}u + col / 4u][col % 4u]".format(DQ4),
               f"b{qb}[qoff + min(q0 + row, {lq - 1}u) * {qs[-2]}u + min(col, {d - 1}u) * {qs[-1]}u]",
               f"q0 + row < {lq}u && col < {d}u")
    L += ["    workgroupBarrier();",
          f"    var mrow = vec4<f32>({NEG_INF});   // running row max",
          "    var lrow = vec4<f32>(0.0);         // this lane's running row sum",
          f"    var o: array<vec4<f32>, {4 * NG}>;  // o[r * {NG} + g]: rows r, columns 64g + 4tx.."]
    if spec["causal"]:
        # top-left aligned: row i sees keys j <= i, so tiles past the tile's last row are skipped
        L.append(f"    let nt = min({NT}u, (q0 + {BQ - 1}u) / {BK}u + 1u);")
    else:
        L.append(f"    let nt = {NT}u;")
    # key tiles [t0, t1): all of them, or this split's share
    L += ([f"    let t0 = sp * nt / {S}u; let t1 = (sp + 1u) * nt / {S}u;"] if S > 1
          else ["    let t0 = 0u; let t1 = nt;"])
    k_src = lambda k0, c0: (f"b{kb}[koff + min({k0} + row, {lk - 1}u) * {ks[-2]}u + "  # noqa: E731
                            f"min({c0}u + col, {d - 1}u) * {ks[-1]}u]")
    k_ok = lambda k0, c0: f"{k0} + row < {lk}u && {c0}u + col < {d}u"  # noqa: E731
    v_src = lambda k0, c0: (f"b{vb}[voff + min({k0} + row, {lk - 1}u) * {vs[-2]}u + "  # noqa: E731
                            f"min({c0}u + col, {dv - 1}u) * {vs[-1]}u]")
    v_ok = lambda k0, c0: f"{k0} + row < {lk}u && {c0}u + col < {dv}u"  # noqa: E731
    if piped:
        wk, wv = _pad4(d), _pad4(dv)
        load_k = lambda k0: by_register(BK * wk, wk, "kr", lambda r: f"{r} = select(0.0, {k_src(k0, 0)}, {k_ok(k0, 0)});")  # noqa: E731,E501
        load_v = lambda k0: by_register(BK * wv, wv, "vr", lambda r: f"{r} = select(0.0, {v_src(k0, 0)}, {v_ok(k0, 0)});")  # noqa: E731,E501
        put_k = lambda dst: by_register(BK * wk, wk, "kr", lambda r: f"{dst} = {r};")  # noqa: E731
        put_v = lambda dst: by_register(BK * wv, wv, "vr", lambda r: f"{dst} = {r};")  # noqa: E731
        L += [f"    var kr: array<f32, {-(-BK * wk // TH)}>;", f"    var vr: array<f32, {-(-BK * wv // TH)}>;"]
        L += load_k(f"t0 * {BK}u")
    L += ["    for (var t = t0; t < t1; t = t + 1u) {", f"    let kt0 = t * {BK}u;",
          # s[r][c]: row ty*4+r, key kt0 + tx + 16c; zeroed here (naga hoists a bare var's
          # zero initialisation to the function's entry, not to each iteration)
          "    var s = array<vec4<f32>, 4>(vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0), vec4<f32>(0.0));"]
    for n, (c0, w) in enumerate(_chunks(d)):
        R = 1 << max(0, (w // 4 - 1).bit_length())     # row width in vec4s (a power of two)
        if n:
            L.append("    workgroupBarrier();")
        # K chunk: row j holds dims c0.. of key kt0 + j, vec4 d4 stored at d4 ^ (j % R)
        kdst = f"KV[row * {R}u + ((col / 4u) ^ (row & {R - 1}u))][col % 4u]"
        if piped:
            L += put_k(kdst) + ["    workgroupBarrier();"] + load_v("kt0")
        else:
            L += stage(BK * w, w, kdst, k_src("kt0", c0), k_ok("kt0", c0)) + ["    workgroupBarrier();"]
        L += [f"    for (var d4 = 0u; d4 < {w // 4}u; d4 = d4 + 1u) {{"]
        L += [f"        let qa{r} = Qs[(ty * 4u + {r}u) * {DQ4}u + {c0 // 4}u + d4];" for r in range(4)]
        L += [f"        let kc{c} = KV[(tx + {16 * c}u) * {R}u + (d4 ^ ((tx + {16 * c}u) & {R - 1}u))];"
              for c in range(4)]
        L += [f"        s[{r}][{c}] = s[{r}][{c}] + dot(qa{r}, kc{c});" for r in range(4) for c in range(4)]
        L.append("    }")
    # scale, masks, the tile's bounds
    score = [f"        var x = s[r][c] * {f(spec['scale'])};"]
    if spec["masked"]:
        m = kernel.reads[3]
        mb = b.index(m.buf, m.dtype)
        st = broadcast_view_strides(m, tuple(batch) + (hq, lq, lk))
        terms = [f"{m.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nbd) if st[n]]
        terms += [f"h * {st[nbd]}u"] if st[nbd] else []
        L.insert(L.index("    for (var t = t0; t < t1; t = t + 1u) {"), f"    let moff = {' + '.join(terms)};")
        mv = (f"b{mb}[moff + min(i, {lq - 1}u) * {st[-2]}u + min(j, {lk - 1}u) * {st[-1]}u]")
        score.append(f"        x = select({NEG_INF}, x, {mv} != {literal(0, m.dtype)});" if spec["int_mask"]
                     else f"        x = x + {mv};")
    if spec["causal"]:
        score.append(f"        x = select({NEG_INF}, x, j <= i);")
    if lk % BK:
        score.append(f"        x = select({NEG_INF}, x, j < {lk}u);")
    if len(score) > 1:
        for r in range(4):
            for c in range(4):
                L += [f"    {{ let i = q0 + ty * 4u + {r}u; let j = kt0 + tx + {16 * c}u;"]
                L += [ln.replace("s[r][c]", f"s[{r}][{c}]") for ln in score]
                L += [f"        s[{r}][{c}] = x; }}"]
    else:
        L += [f"    s[{r}] = s[{r}] * {f(spec['scale'])};" for r in range(4)]
    # the tile's row max: each lane's over its 4 keys, then over the 16 lanes (through P's memory)
    L += [f"    Ps[(ty * 4u + {r}u) * 4u + tx / 4u][tx % 4u] = max(max(s[{r}].x, s[{r}].y), max(s[{r}].z, s[{r}].w));"
          for r in range(4)]
    L.append("    workgroupBarrier();")
    for r in range(4):
        L += [f"    let w{r}{u} = Ps[(ty * 4u + {r}u) * 4u + {u}u];" for u in range(4)]
        L.append(f"    let tm{r} = max(max(max(w{r}0.x, w{r}0.y), max(w{r}0.z, w{r}0.w)), max("
                 f"max(max(w{r}1.x, w{r}1.y), max(w{r}1.z, w{r}1.w)), max(max(max(w{r}2.x, w{r}2.y), max(w{r}2.z, w{r}2.w)), "
                 f"max(max(w{r}3.x, w{r}3.y), max(w{r}3.z, w{r}3.w)))));")
    L += ["    workgroupBarrier();",
          "    let mnew = max(mrow, vec4<f32>(tm0, tm1, tm2, tm3));",
          "    // a row masked so far keeps max -inf: exponents against 0 give zeros, not NaN",
          f"    let mref = select(mnew, vec4<f32>(0.0), mnew == vec4<f32>({NEG_INF}));",
          "    let alpha = exp(mrow - mref);",
          "    mrow = mnew;",
          "    var p: array<vec4<f32>, 4>;"]
    L += [f"    p[{r}] = exp(s[{r}] - vec4<f32>(mref[{r}]));" for r in range(4)]
    L += ["    lrow = lrow * alpha + vec4<f32>(dot(p[0], vec4<f32>(1.0)), dot(p[1], vec4<f32>(1.0)), "
          "dot(p[2], vec4<f32>(1.0)), dot(p[3], vec4<f32>(1.0)));"]
    L += [f"    o[{r * NG + g}] = o[{r * NG + g}] * alpha[{r}];" for r in range(4) for g in range(NG)]
    # P: row j (a key) holds vec4s over 4 query rows, row group ty stored at ty ^ (j % TY)
    L += [f"    Ps[(tx + {16 * c}u) * {TY}u + (ty ^ ((tx + {16 * c}u) & {TY - 1}u))] = "
          f"vec4<f32>(p[0][{c}], p[1][{c}], p[2][{c}], p[3][{c}]);" for c in range(4)]
    for g, (c0, w) in enumerate(VCH):
        if g:
            L.append("    workgroupBarrier();")
        vdst = f"KV[row * {CH // 4}u + col / 4u][col % 4u]"
        if piped:
            L += put_v(vdst) + ["    workgroupBarrier();",
                                "    if (t + 1u < t1) {"] + load_k(f"kt0 + {BK}u") + ["    }"]
        else:
            L += stage(BK * w, w, vdst, v_src("kt0", c0), v_ok("kt0", c0)) + ["    workgroupBarrier();"]
        L += [f"    for (var j4 = 0u; j4 < {BK // 4}u; j4 = j4 + 1u) {{"]
        for u in range(4):
            L += [f"        let j{u} = j4 * 4u + {u}u;",
                  f"        let pp{u} = Ps[j{u} * {TY}u + (ty ^ (j{u} & {TY - 1}u))];",
                  f"        let vv{u} = KV[j{u} * {CH // 4}u + tx];"]
            L += [f"        o[{r * NG + g}] = fma(vec4<f32>(pp{u}[{r}]), vv{u}, o[{r * NG + g}]);" for r in range(4)]
        L.append("    }")
    L += ["    workgroupBarrier();", "    }"]
    # the row sums over the 16 lanes, then the normalised output
    L += [f"    Ps[(ty * 4u + {r}u) * 4u + tx / 4u][tx % 4u] = lrow[{r}];" for r in range(4)]
    L.append("    workgroupBarrier();")
    for r in range(4):
        L.append(f"    let lsum{r} = dot(Ps[(ty * 4u + {r}u) * 4u] + Ps[(ty * 4u + {r}u) * 4u + 1u] + "
                 f"Ps[(ty * 4u + {r}u) * 4u + 2u] + Ps[(ty * 4u + {r}u) * 4u + 3u], vec4<f32>(1.0));")
        # a fully masked row has sum 0: zeros, as the op's safe softmax gives
        L.append(f"    let inv{r} = select(0.0, 1.0 / lsum{r}, lsum{r} != 0.0);")
    # a split's rows start past the earlier splits' (out and the LSE lead with the split)
    row0 = f"(sp * {NBH}u + bh) * {lq}u" if S > 1 else f"bh * {lq}u"
    if kernel.outs:
        # the second output: each row's log-sum-exp of its scaled, masked scores (+inf for a
        # fully masked row), which the backward pass recomputes the probabilities from; a
        # split's -inf where it saw no unmasked key gives it no weight in the combine
        lse = kernel.outs[0]
        assert lse.is_contiguous() and lse.shape == (S,) * (S > 1) + tuple(batch) + (hq, lq), lse.shape
        lb = b.index(lse.buf, lse.dtype, write=True)
        empty = NEG_INF if S > 1 else "bitcast<f32>(0x7f800000u)"
        for r in range(4):
            L.append(f"    {{ let i = q0 + ty * 4u + {r}u; if (tx == 0u && i < {lq}u) {{ b{lb}[{lse.offset}u + {row0} + i] = "
                     f"select({empty}, mrow[{r}] + log(lsum{r}), lsum{r} != 0.0); }} }}")
    for r in range(4):
        L.append(f"    {{ let i = q0 + ty * 4u + {r}u;")
        L.append(f"      if (i < {lq}u) {{")
        for g, (c0, w) in enumerate(VCH):
            for e in range(4):
                col = f"{c0}u + tx * 4u + {e}u"
                L.append(f"        if ({col} < {dv}u) {{ store_out(({row0} + i) * {dv}u + {col}, "
                         f"o[{r * NG + g}][{e}] * inv{r}); }}")
        L.append("      }")
        L.append("    }")
    src = (b.decls() + "\n" + store.module_text() +
           f"\nvar<workgroup> Qs: array<vec4<f32>, {BQ * DQ4}>;"
           f"\nvar<workgroup> KV: array<vec4<f32>, {BK * CH // 4}>;"
           f"\nvar<workgroup> Ps: array<vec4<f32>, {BK * TY}>;\n\n"
           + ENTRY.format(wg=TH) + "\n".join(L) + "\n}\n")
    return src, b.bufs, grid(NBH * NQT * S)

