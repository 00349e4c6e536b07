"""``matmul.render``'s tiled products (double-buffered K tiles in workgroup memory, the
peeled form, K splits, sibling parts, alike parts sharing one body over arrays of buffers,
a norm of A's rows, f16 rounding and pointwise operands computed in the loads, fused
epilogues) built on the typed kernel AST, the only source of their WGSL (and GLSL). An operand that a gather computes in the loads (implicit-GEMM
convolution) is on the tree where the gather's function is (``gather_tree``)."""
from __future__ import annotations

import numpy as np

from .kernel_ast import (WID, Barrier, Bitcast, Block, Call, Construct, Convert, ExprStmt, Field, For, Function, If,
                         Index, Let, Line, Load, Name, Return, Select, Var)
from .kernel_ast_matmul import (ENTRY_LOCAL_ID, LID3, F, FlatIf, Lines, OpenBlock, Product, U, VEC4, add, affine,
                                assign, assign_index, b_, batch_offsets, blank, call_if, g, inline, module, shared,
                                store_function, store_supported)
from .common import wgsl_type

U32, F32 = "u32", "f32"
VU = "vec4<u32>"


def _u(n):
    return Name(n, U32)


def idx(n):
    """An index the template writes as a bare number (``acc[5]``)."""
    return U(n, str(n))


def gather_tree():
    """The builder of a gather's function as a tree (``gather_ast.function_tree``), or None
    where the gather family has none yet."""
    try:
        from .gather_ast import function_tree
    except ImportError:
        return None
    return function_tree


def _operand_on_tree(gs) -> bool:
    return "expr" in gs or (gs.get("form") is not None and gather_tree() is not None)


def supported(kernel) -> bool:
    """Whether ``render_tree`` builds ``kernel``: every part's store, and every operand it
    computes in its loads."""
    parts = kernel.spec.get("parts", [kernel])
    return all(store_supported(p) and all(map(_operand_on_tree, p.spec.get("gathers", {}).values())) for p in parts)


def operand_functions(kernel, j, op, gs, bind):
    """(name, module items) of the function computing operand ``op`` of part ``j`` in its
    loads (a pointwise expression's or a gather's), its reads bound on ``bind`` now."""
    from .pointwise import operand_function
    fname = f"gat{j}_{op}"
    reads = kernel.reads[gs["first"]:gs["first"] + gs["n"]]
    if "expr" in gs:
        return fname, operand_function(gs, reads, bind, fname)
    return fname, [gather_tree()(gs, reads, bind, fname)]


# An operand flagged in ``spec["f16_round"]`` is f32 in memory and holds f16's precision in
# the product (11 significant bits, to nearest even) without f16's range: the tiled kernel
# rounds its bits as it loads it; the cooperative-matrix kernel (codegen.coopmat) scales the
# workgroup's share of it by a power of two into f16's range and converts, which rounds alike.
# So a gradient far below f16's smallest normal needs no max reduction and scaled cast of its
# own before a tensor-core product.
def round_f16_functions() -> list:
    """``round_f16`` (f32) and ``round_f16v`` (vec4): the bits of an f32 rounded to f16's
    precision, for the loads of an operand flagged in ``spec["f16_round"]``."""
    x, b = Name("x", F32), Name("b", U32)
    hexu = lambda v: U(v, f"{v:#x}u")        # noqa: E731
    one = Function("round_f16", (x,), (
        Let("b", Bitcast(U32, x)),
        Return(Bitcast(F32, b_("&", g(add(b, hexu(0xfff), g(b_("&", g(b_(">>", b, U(13))), U(1))))), hexu(0xffffe000))))),
        F32)
    xv, bv = Name("x", VEC4), Name("b", VU)
    vu = lambda lit: Construct(VU, (lit,))   # noqa: E731
    four = Function("round_f16v", (xv,), (
        Let("b", Bitcast(VU, xv)),
        Return(Bitcast(VEC4, b_("&", g(add(bv, vu(hexu(0xfff)), g(b_("&", g(b_(">>", bv, vu(U(13)))), vu(U(1)))))),
                                vu(hexu(0xffffe000)))))), VEC4)
    return [one, four]


def _operand(name, view, trans_contig_t, dim_t, K, T, V, tile0, binding, off, chk_t, chk_k, reg, allow_vec=True,
             threads=256, transform=None, load=None, *, TK, SV=None):
    """``matmul._operand`` as statements: (vec4?, register type, fetch, store); ``load(index)``
    the value of an operand computed in the loads (a call of its function)."""
    SV = V if SV is None else SV
    vec = (dim_t % 4 == 0) if trans_contig_t else (K % 4 == 0)
    vec = vec and allow_vec and load is None and view.offset % 4 == 0 and view.dtype.name == "f32"
    total = T * TK // 4 if vec else T * TK
    per = -(-total // threads)
    v, kk, tt, k0, kend, tid, l_ = (_u(x) for x in ("v", "kk", "tt", "k0", "kend", "tid", "l"))
    t0, off_ = _u(tile0), _u(off)
    ld = dim_t if trans_contig_t else K
    if trans_contig_t:
        w = V if vec else T
        coords = Line((Let("kk", b_("/", v, U(w))), Let("tt", b_("*", g(b_("%", v, U(w))), U(4)) if vec else
                                                        g(b_("%", v, U(w))))))
        at = add(off_, b_("*", g(add(k0, kk)), U(ld)), t0, tt)
    else:
        w = TK // 4 if vec else TK
        coords = Line((Let("tt", b_("/", v, U(w))), Let("kk", b_("*", g(b_("%", v, U(w))), U(4)) if vec else
                                                        g(b_("%", v, U(w))))))
        at = add(off_, b_("*", g(add(t0, tt)), U(K)), k0, kk)
    conds = [c for c, on in ((b_("<", add(t0, tt), U(dim_t)), chk_t), (b_("<", add(k0, kk), kend), chk_k)) if on]
    last = view.offset + view.size - 1
    if vec:
        i = b_("/", g(at), U(4))
        read = Load(binding, Call("min", (i, U(last // 4)), U32) if conds else i, VEC4)
        zero = Construct(VEC4, (F("0.0"),))
    else:
        read = Convert(F32, Load(binding, Call("min", (at, U(last)), U32) if conds else at, wgsl_type(view.dtype)))
        zero = F("0.0")
    if load is not None:
        read = load(at)
    if transform is not None:
        read = transform(read, vec)
    if conds:
        cond = conds[0] if len(conds) == 1 else b_("&&", *conds)
        read = Select(zero, read, cond)
    ty = VEC4 if vec else F32
    rreg = Name(reg, f"array<{ty}, {per}>")
    guarded = total % threads != 0
    guard = b_("<", v, U(total))

    def loop(stmts):
        inner = [coords] + stmts
        body = [Let("v", add(tid, b_("*", l_, U(threads))))] + ([FlatIf(guard, inner)] if guarded else inner)
        return For(Var("l", U(0)), b_("<", l_, U(per)), assign("l", add(l_, U(1))), tuple(body))
    fetch = loop([assign_index(rreg, l_, read)])
    base, sv = Name(name, VEC4), _u(f"{name}0")
    at_s = lambda k: add(sv, b_("*", k, U(SV)), b_("/", tt, U(4)))     # noqa: E731
    if vec and trans_contig_t:
        st = [assign_index(base, at_s(kk), Index(rreg, l_, ty))]
    elif vec:
        st = [assign_index(Index(base, at_s(g(add(kk, U(j)))), VEC4), b_("%", tt, U(4)),
                           Index(Index(rreg, l_, ty), idx(j), F32)) for j in range(4)]
    else:
        st = [assign_index(Index(base, at_s(kk), VEC4), b_("%", tt, U(4)), Index(rreg, l_, ty))]
    return vec, f"array<{ty}, {per}>", [fetch], [loop(st)]


def _main_loop(nk, TK, SA, VN, fetch, store, fma, peel):
    """``matmul._main_loop`` as statements."""
    t, kk, kbeg = _u("t"), _u("kk"), _u("kbeg")

    def halves(buf):
        return [Let("As0", b_("*", buf, U(TK * SA))), Let("Bs0", b_("*", buf, U(TK * VN)))]

    def product(buf):
        return Product(halves(buf), For(Var("kk", U(0)), b_("<", kk, U(TK)), assign("kk", add(kk, U(1))), tuple(fma)))
    prev, this = g(b_("%", g(b_("-", t, U(1))), U(2))), g(b_("%", t, U(2)))
    k0 = Let("k0", add(kbeg, b_("*", t, U(TK))))
    if not peel:
        return [For(Var("t", U(0)), b_("<=", t, U(nk)), assign("t", add(t, U(1))), (
            If(b_("<", t, U(nk)), tuple([k0] + fetch)),
            If(b_(">", t, U(0)), (product(prev),)),
            If(b_("<", t, U(nk)), tuple([Line(tuple(halves(this)))] + store)),
            Barrier("workgroup")))]
    first = OpenBlock([Let("k0", kbeg), Let("As0", U(0)), Let("Bs0", U(0))], fetch + store)
    loop = For(Var("t", U(1)), b_("<", t, U(nk)), assign("t", add(t, U(1))), (
        OpenBlock([k0], fetch), product(prev), OpenBlock(halves(this), store), Barrier("workgroup")))
    return [first, Barrier("workgroup"), loop, product(U((nk - 1) % 2))]


NORM_LOADS_IN_FLIGHT = 4


def _tiled_norm_prologue(kernel, bind, M, K, T, th, ab, a_vec):
    """``matmul._tiled_norm_prologue`` as statements, and the transform of A's loads."""
    pro = kernel.spec["prologue"]
    extra = kernel.reads[2:]
    w = extra[0] if pro["has_w"] else None
    bb_ = extra[-1] if pro["has_b"] else None
    wb = bind.index(w.buf, w.dtype) if w is not None else None
    bbi = bind.index(bb_.buf, bb_.dtype) if bb_ is not None else None
    center = pro["kind"] == "layer_norm"
    a = kernel.reads[0]
    aoff, gr, k, tid, rr, r, j = (_u(x) for x in ("aoff", "gr", "k", "tid", "rr", "r", "j"))
    q = Name("q", VEC4 if a_vec else F32)
    d = Name("d", q.ty)
    mean, tot = Name("mean", F32), Name("tot", F32)
    pm, pinv, pred = (Name(x, F32) for x in ("pm", "pinv", "pred"))
    if a_vec:
        def load(c):
            return Load(ab, add(b_("/", g(add(aoff, b_("*", gr, U(K)))), U(4)), k, U(c)), VEC4)
        n, total, sq = K // 4, Call("dot", (q, Construct(VEC4, (F("1.0"),))), F32), Call("dot", (d, d), F32)
        dev = Let("d", b_("-", q, Construct(VEC4, (mean,))))
    else:
        def load(c):
            return Convert(F32, Load(ab, add(aoff, b_("*", gr, U(K)), k, U(c)), wgsl_type(a.dtype)))
        n, total, sq = K, q, b_("*", d, d)
        dev = Let("d", b_("-", q, mean))
    P = max(1, th // T)
    rows = -(-T // (th // P))
    UF = NORM_LOADS_IN_FLIGHT
    Kf = F(repr(float(K)))

    def pass_(acc_value, fin, centred, deviation):
        def acc_line(jj):
            a_ = Name(f"acc{jj}", F32)
            line = [assign(a_.id, add(a_, acc_value))]
            return ([deviation] if deviation is not None else []) + line
        step = tuple(Block(tuple([Let("q", load(jj * P))] + acc_line(jj))) for jj in range(UF))
        inner = (Let("mean", Index(pm, rr, F32) if centred else F("0.0")), Var("k", b_("%", tid, U(P))),
                 inline(For(None, b_("<", add(k, U((UF - 1) * P)), U(n)), assign("k", add(k, U(UF * P))), step)),
                 inline(For(None, b_("<", k, U(n)), assign("k", add(k, U(P))),
                            tuple([Let("q", load(0))] + acc_line(0)))))
        body = (Line((Let("rr", add(b_("*", r, U(th // P)), b_("/", tid, U(P)))), Let("gr", add(_u("row0"), rr)))),
                Line(tuple(Var(f"acc{jj}", F("0.0")) for jj in range(UF))),
                If(b_("&&", b_("<", rr, U(T)), b_("<", gr, U(M))), inner),
                Let("acc", add(*(Name(f"acc{jj}", F32) for jj in range(UF)))),
                assign_index(pred, tid, Name("acc", F32)),
                Barrier("workgroup"),
                If(b_("&&", b_("==", b_("%", tid, U(P)), U(0)), b_("<", rr, U(T))), (
                    Var("tot", F("0.0")),
                    inline(For(Var("j", U(0)), b_("<", j, U(P)), assign("j", add(j, U(1))),
                               (assign("tot", add(tot, Index(pred, add(tid, j), F32))),))),
                    fin)),
                Barrier("workgroup"))
        return [For(Var("r", U(0)), b_("<", r, U(rows)), assign("r", add(r, U(1))), body)]
    lines = []
    if center:
        lines += pass_(total, assign_index(pm, rr, b_("/", tot, Kf)), False, None)
    else:
        lines.append(inline(For(Var("rr", tid), b_("<", rr, U(T)), assign("rr", add(rr, U(th))),
                                (assign_index(pm, rr, F("0.0")),))))
    fin = assign_index(pinv, rr, Call("inverseSqrt", (add(b_("/", tot, Kf), F(repr(pro["eps"]))),), F32))
    lines += pass_(sq, fin, center, dev)
    lines.append(Barrier("workgroup"))
    tt = _u("tt")

    def transform(x, vec):
        k0kk = add(_u("k0"), _u("kk"))
        ks = [add(k0kk, U(c)) for c in range(4)] if vec else [k0kk]
        ty = VEC4 if vec else F32
        e = b_("*", g(b_("-", g(x), Convert(ty, Index(pm, tt, F32)))), Index(pinv, tt, F32))
        return affine(e, ks, K, (wb, w), (bbi, bb_), ty)
    return lines, transform


def _round_f16_load(value, vec):
    return Call("round_f16v" if vec else "round_f16", (value,), VEC4 if vec else F32)


def tiled_part(kernel, bind, j, block, peel):
    """``matmul._tiled_part`` as a tree: (module items of one part: its store and ``mm{j}``,
    its workgroup counts, its K step)."""
    from .matmul import a_padding
    from .matmul_tiles import k_step, rounded_operands, split_k
    a, bv = kernel.reads[:2]
    ta, tb = kernel.spec["ta"], kernel.spec["tb"]
    M, N = kernel.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    batch = kernel.spec.get("batch", kernel.shape[:-2])
    nb = int(np.prod(batch, dtype=np.int64))
    S = kernel.spec.get("split", 1)
    TM, TN, WY, WX = block
    GM, GN = TM // (4 * WY), TN // (4 * WX)
    VM, VN = TM // 4, TN // 4
    SA = VM + a_padding(peel)
    TK = kernel.spec.get("tk") or k_step(TM)
    KC = split_k(K, S, TK)
    chk_m, chk_n, chk_k = M % TM != 0, N % TN != 0, K % KC != 0 or KC % TK != 0
    wz = Field(WID, "z")
    bl, aoff, boff = batch_offsets(a, bv, batch, b_("/", wz, U(S)))
    split, kbeg = _u("split"), _u("kbeg")
    bl = [Let("split", b_("%", wz, U(S))),
          Line((Let("kbeg", b_("*", split, U(KC))), Let("kend", Call("min", (add(kbeg, U(KC)), U(K)), U32))))] + bl
    loads, fns = {}, []
    for op, gs in kernel.spec.get("gathers", {}).items():
        fname, items = operand_functions(kernel, j, op, gs, bind)
        fns += items + [blank()]      # (each function's text ends in a newline)
        loads[op] = (lambda at, f=fname, o=gs["offset"]: Call(f, (b_("-", g(at), U(o)),), F32))
    ab = None if 0 in loads else bind.index(a.buf, a.dtype)
    bb = None if 1 in loads else bind.index(bv.buf, bv.dtype)
    th = WX * WY
    pro_lines, transform, a_vec0 = [blank()], None, True
    if "prologue" in kernel.spec:
        a_vec0 = K % 4 == 0 and a.offset % 4 == 0 and a.dtype.name == "f32" and ab != bb
        pro_lines, transform = _tiled_norm_prologue(kernel, bind, M, K, TM, th, ab, a_vec0)
    round_a, round_b = rounded_operands(kernel.spec)
    b_transform = _round_f16_load if round_b else None
    if round_a:
        assert transform is None, f"{kernel.name}: a norm prologue on an operand rounded to f16"
        transform = _round_f16_load
    a_vec, a_reg, a_fetch, a_store = _operand("As", a, ta, M, K, TM, VM, "row0", ab, "aoff", chk_m, chk_k, "ra", SV=SA,
                                              threads=th, allow_vec=(transform is None or a_vec0) and ab not in bind.scalar,
                                              transform=transform, load=loads.get(0), TK=TK)
    b_vec, b_reg, b_fetch, b_store = _operand("Bs", bv, not tb, N, K, TN, VN, "col0", bb, "boff", chk_n, chk_k, "rb",
                                              threads=th, allow_vec=bb not in bind.scalar, load=loads.get(1), TK=TK,
                                              transform=b_transform)
    if ab == bb and ab is not None and a_vec != b_vec:   # one buffer, one declared type: scalars
        a_vec, a_reg, a_fetch, a_store = _operand("As", a, ta, M, K, TM, VM, "row0", ab, "aoff", chk_m, chk_k, "ra",
                                                  False, threads=th, transform=transform, TK=TK, SV=SA)
        b_vec, b_reg, b_fetch, b_store = _operand("Bs", bv, not tb, N, K, TN, VN, "col0", bb, "boff", chk_n, chk_k,
                                                  "rb", False, threads=th, TK=TK, transform=b_transform)
    if a_vec:
        bind.types[ab] = VEC4
    if b_vec:
        bind.types[bb] = VEC4
    store = store_function(kernel, bind, name=f"store_out{j}")   # after the operand types are fixed
    acc = Name("acc", f"array<vec4<f32>, {4 * GM * GN}>")
    As, Bs, As0, Bs0, kk, ty, tx = Name("As", VEC4), Name("Bs", VEC4), _u("As0"), _u("Bs0"), _u("kk"), _u("ty"), _u("tx")
    fma = [Let(f"a{q}", Index(As, add(As0, b_("*", kk, U(SA)), U(WY * q), ty), VEC4)) for q in range(GM)]
    fma += [Let(f"b{q}", Index(Bs, add(Bs0, b_("*", kk, U(VN)), U(WX * q), tx), VEC4)) for q in range(GN)]
    for gr in range(GM):
        for r in range(4):
            for gc in range(GN):
                i = (gr * 4 + r) * GN + gc
                fma.append(assign_index(acc, idx(i), Call("fma", (
                    Construct(VEC4, (Index(Name(f"a{gr}", VEC4), idx(r), F32),)), Name(f"b{gc}", VEC4),
                    Index(acc, idx(i), VEC4)), VEC4)))
    writes = []
    gm, gn, row0, col0, coff = _u("gm"), _u("gn"), _u("row0"), _u("col0"), _u("coff")
    for gr in range(GM):
        for r in range(4):
            row = add(row0, U(4 * WY * gr + r), b_("*", ty, U(4)))
            for gc in range(GN):
                col = add(col0, U(4 * WX * gc), b_("*", tx, U(4)))
                v = Index(acc, idx((gr * 4 + r) * GN + gc), VEC4)
                for c in range(4):
                    conds = [x for x, on in ((b_("<", gm, U(M)), chk_m), (b_("<", add(gn, U(c)), U(N)), chk_n)) if on]
                    st = ExprStmt(Call(f"store_out{j}", (add(coff, b_("*", gm, U(N)), gn, U(c)), Index(v, idx(c), F32)),
                                       "void"))
                    if conds:
                        st = If(conds[0] if len(conds) == 1 else b_("&&", *conds), (st,))
                    writes.append(Lines([(Block((Let("gm", row), Let("gn", col), st)),)], ["    "], block=False))
    nk = KC // TK
    lid3 = LID3
    body = [Line((Let("tx", Field(lid3, "x")), Let("ty", Field(lid3, "y")), Let("tid", add(b_("*", ty, U(WX)), tx)))),
            Line((Let("row0", b_("*", Field(WID, "y"), U(TM))), Let("col0", b_("*", Field(WID, "x"), U(TN)))))]
    body += bl + [Let("aoff", aoff), Let("boff", boff), Let("coff", b_("*", wz, U(M * N)))] + pro_lines
    body += [Var("acc", None, acc.ty), Var("ra", None, a_reg), Var("rb", None, b_reg)]
    body += _main_loop(nk, TK, SA, VN, a_fetch + b_fetch, a_store + b_store, fma, peel) + writes
    fn = Function(f"mm{j}", (Name("wid", "vec3<u32>"), lid3), tuple(body))
    return store + (fns or [blank()]) + [fn, blank()], (-(-N // TN), -(-M // TM), nb * S), TK


def render_tree(kernel, launch_form):
    """(tree, bound buffers, workgroups) of ``matmul.render``'s kernel (not the shared-body
    form), or None where a part is not on the tree (``supported``)."""
    from .common import Bindings
    if not supported(kernel):
        return None
    parts = kernel.spec.get("parts", [kernel])
    bind = Bindings()
    items, branches, x0, tks = [], [], 0, set()
    blocks, peel = launch_form(parts)
    for j, (part, block) in enumerate(zip(parts, blocks)):
        fns, (gx, gy, gz), TK = tiled_part(part, bind, j, block, peel)
        tks.add((block, TK))
        items += fns
        branches.append(call_if(b_("<", Field(WID, "x"), U(x0 + gx)), f"mm{j}", (
            Construct("vec3<u32>", (b_("-", Field(WID, "x"), U(x0)), Field(WID, "y"), Field(WID, "z"))), LID3)))
        x0 += gx
    assert len(tks) == 1, f"merged matmuls with different tiles or K steps: {tks}"
    (block, TK), = tks
    return (module(bind, _memory(parts, block, TK, peel) + items, (block[3], block[2]), branches, ENTRY_LOCAL_ID),
            bind.bufs, (x0, gy, gz))


def _memory(parts, block, TK, peel) -> list:
    """The workgroup memory items: the double-buffered A and B tiles, the norm prologue's
    statistics and the f16 rounding helpers where a part has them."""
    from .matmul import a_padding
    TM, TN, WY, WX = block
    out = [shared("As", VEC4, 2 * TK * (TM // 4 + a_padding(peel))), shared("Bs", VEC4, 2 * TK * TN // 4)]
    if any("prologue" in p.spec for p in parts):
        out += [shared("pm", F32, TM), shared("pinv", F32, TM), shared("pred", F32, WX * WY)]
    if any(p.spec.get("f16_round") for p in parts):
        out += round_f16_functions()
    return out


def render_shared_tree(kernel, launch_form):
    """A merged launch whose alike parts share one body
    ``mms{f}`` over arrays of buffers indexed by the private ``mp``; None where no two parts
    are alike, or a part is not on the tree."""
    from .common import NOWHERE, Bindings
    from .kernel_ast import WgslPrinter
    from .kernel_ast_matmul import private, rebind
    if not supported(kernel):
        return None
    parts = kernel.spec["parts"]
    blocks, peel = launch_form(parts)
    forms, where = {}, []
    printer = WgslPrinter()
    for part, block in zip(parts, blocks):
        pb = Bindings()
        fns, groups, TK = tiled_part(part, pb, "_", block, peel)
        text = "\n".join(printer.item(it) for it in fns)
        key = (text, tuple(pb.types), tuple(id(x) in pb.written for x in pb.bufs), pb.enable_f16, block, TK)
        members = forms.setdefault(key, [])
        where.append((key, len(members), groups))
        members.append(pb)
    if len(forms) == len(parts):
        return None
    b = Bindings()
    items, ids, ranges, x0 = [], {}, [], 0
    mp = Name("mp", U32)
    for (key, slot, (gx, gy, gz)), part, block in zip(where, parts, blocks):
        if key not in ids:
            f = ids[key] = len(ids)
            pb = Bindings()
            fns, _, _ = tiled_part(part, pb, f"s{f}", block, peel)
            # each helper once in the module (the store's helpers come first)
            helpers = {h for h in pb.helpers_done if h in b.helpers_done}
            fns = [it for it in fns if not (isinstance(it, Function) and it.name in helpers)]
            b.helpers_done |= pb.helpers_done
            b.enable_f16 |= pb.enable_f16
            items += rebind(b, [pb] + forms[key][1:], fns, mp)
        ranges.append((x0 + gx, ids[key], slot, x0))
        x0 += gx
    block, TK = key[-2:]
    x, at = _u("x"), Name("at", "vec3<u32>")
    v3 = lambda *a: Construct("vec3<u32>", a)     # noqa: E731
    locate = Function("locate", (x,), tuple(
        [inline(If(b_("<", x, U(end)), (Return(v3(U(f), U(slot), U(start))),))) for end, f, slot, start in ranges]
        + [Return(v3(U(NOWHERE), U(0), U(0)))]), "vec3<u32>")
    body = [Let("at", Call("locate", (Field(WID, "x"),), "vec3<u32>")), assign("mp", Field(at, "y"))]
    body += [call_if(b_("==", Field(at, "x"), U(f)), f"mms{f}", (
        v3(b_("-", Field(WID, "x"), Field(at, "z")), Field(WID, "y"), Field(WID, "z")), LID3)) for f in range(len(ids))]
    mem = _memory(parts, block, TK, peel)
    items = mem[:2] + [private("mp", U32)] + mem[2:] + items + [locate]
    return module(b, items, (block[3], block[2]), body, ENTRY_LOCAL_ID), b.flat(), (x0, gy, gz)
