"""``gemv.render_gemv`` (the matmul archetype's few-row products: B transposed or plain,
sibling parts, a paired weight, a norm of A's rows in the loads) built on the typed kernel
AST: its only WGSL (and GLSL) is printed from this tree."""
from __future__ import annotations

import numpy as np

from .kernel_ast import LID, WID, Barrier, Call, Convert, ExprStmt, Field, For, Function, If, Index, Let, Line, Load
from .kernel_ast import Name, ReturnIf, Var
from .kernel_ast_matmul import (ENTRY_LOCAL_INDEX, F, U, Lines, Text, add, affine, assign, assign_index, b_,
                                batch_offsets, blank, call_if, g, inline, module, shared, store_function,
                                store_supported)
from .common import wgsl_type

U32, F32 = "u32", "f32"


def _u(n):
    return Name(n, U32)


def gemv_kernel(kernel):
    """(tree, bound buffers, workgroups) of ``render_gemv``'s kernel, or None where an
    output store is not on the tree (an epilogue)."""
    from .common import Bindings
    parts = kernel.spec.get("parts", [kernel])
    if not all(map(store_supported, parts)):
        return None
    bind = Bindings()
    items, branches, g0 = [], [], 0
    tb = parts[0].spec["tb"]
    M = parts[0].shape[-2]
    paired = 2 if any("pair" in p.spec for p in parts) else 1
    part = Name("part", f"array<f32, {256 * M * paired}>")
    for j, p in enumerate(parts):
        fns, gx, nb = _gemv_part(p, bind, j, part)
        items += fns
        branches.append(call_if(b_("<", Field(WID, "x"), U(g0 + gx)), f"gemv{j}",
                                (b_("-", Field(WID, "x"), U(g0)), Field(WID, "z"), LID)))
        g0 += gx
    items = ([shared("part", F32, 256 * M * paired)] if tb else []) + items
    return module(bind, items, 256, branches, ENTRY_LOCAL_INDEX), bind.bufs, (g0, 1, nb)


def _reduce(part, R, lid, s, stop, step_s):
    """``for (var s = ...; s > 0u; s = s >> 1u) { if (lid < s) { part[..] += part[.. + s]; } barrier }``."""
    rows = tuple(assign_index(part, add(U(r * 256), lid), add(Index(part, add(U(r * 256), lid), F32),
                                                              Index(part, add(U(r * 256), lid, s), F32)))
                 for r in R)
    return For(Var("s", U(step_s)), b_(">", s, U(0)), assign("s", b_(">>", s, U(1))),
               (If(b_("<", stop, s), rows), Barrier("workgroup")))


def _norm_prologue(kernel, bind, M, K, a_at, ab, part):
    """``gemv._norm_prologue`` as statements, and the normalised A element of (m, k)."""
    pro = kernel.spec["prologue"]
    extra = kernel.reads[2:kernel.spec.get("pair", {}).get("b_index", len(kernel.reads))]
    w = extra[0] if pro["has_w"] else None
    b = extra[-1] if pro["has_b"] else None
    wb = bind.index(w.buf, w.dtype) if w is not None else None
    bb = bind.index(b.buf, b.dtype) if b is not None else None
    a = kernel.reads[0]
    center = pro["kind"] == "layer_norm"
    lid, k, s, x = _u("lid"), _u("k"), Name("s", F32), Name("x", F32)

    def load(m, kk):
        return Convert(F32, Load(ab, a_at(U(m), kk), wgsl_type(a.dtype)))

    def tree(expr, m):
        loop = inline(For(Var("k", lid), b_("<", k, U(K)), assign("k", add(k, U(256))),
                          (Let("x", load(m, k)), assign("s", add(s, expr)))))
        return [Lines([(Text("{"), Var("s", F("0.0"))), (loop,), (assign_index(part, add(U(m * 256), lid), s),
                                                                   Text("}"))], ["", "  ", "  "])]
    lines = []
    for m in range(M):
        lines += tree(x, m) if center else [Let(f"mean{m}", F("0.0"))]
    red = [Barrier("workgroup"), _reduce(part, range(M), lid, _u("s"), lid, 128)]
    Kf = F(repr(float(K)))
    if center:
        lines += red + [Let(f"mean{m}", b_("/", Index(part, U(m * 256), F32), Kf)) for m in range(M)]
        lines.append(Barrier("workgroup"))
    for m in range(M):
        d = g(b_("-", x, Name(f"mean{m}", F32)))
        lines += tree(b_("*", d, d), m)
    lines += red + [Let(f"inv{m}", Call("inverseSqrt", (add(b_("/", Index(part, U(m * 256), F32), Kf),
                                                            F(repr(pro["eps"]))),), F32)) for m in range(M)]
    lines.append(Barrier("workgroup"))

    def elem(m, kk):
        e = b_("*", g(b_("-", load(m, kk), Name(f"mean{m}", F32))), Name(f"inv{m}", F32))
        return affine(e, [kk], K, (wb, w), (bb, b))
    return lines, elem


def _gemv_part(kernel, bind, j, part):
    """(module items of one GEMV: its store and ``gemv{j}``, its x workgroups, its batch workgroups)."""
    from .matmul_tiles import gemv_columns
    a, bv = kernel.reads[:2]
    ta, tb = kernel.spec["ta"], kernel.spec["tb"]
    M, N = kernel.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    S = kernel.spec.get("split", 1)
    batch = kernel.spec["batch"] if S > 1 else kernel.shape[:-2]
    nb = int(np.prod(batch, dtype=np.int64))
    KC = -(-K // S)
    store = store_function(kernel, bind, name=f"store_out{j}")
    ab, bb = bind.index(a.buf, a.dtype), bind.index(bv.buf, bv.dtype)
    wz, wx, lid, kbeg, kend, k, n = (_u(x) for x in ("wz", "wx", "lid", "kbeg", "kend", "k", "n"))
    aoff_, boff_, coff_ = _u("aoff"), _u("boff"), _u("coff")
    bl, aoff, boff = batch_offsets(a, bv, batch, b_("/", wz, U(S)) if S > 1 else wz)
    bl.append(Line((Let("kbeg", b_("*", g(b_("%", wz, U(S))), U(KC))),
                    Let("kend", Call("min", (add(kbeg, U(KC)), U(K)), U32)))))
    if ta:
        def a_at(m, kk):
            return add(aoff_, b_("*", kk, U(M)), m)
    else:
        def a_at(m, kk):
            return add(aoff_, b_("*", m, U(K)), kk)
    head = bl + [Let("aoff", aoff), Let("boff", boff), Let("coff", b_("*", wz, U(M * N)))]
    acc = lambda r: Name(f"acc{r}", F32)      # noqa: E731
    slot = lambda r: Index(part, add(U(r * 256), lid), F32)      # noqa: E731
    w_ = Name("w", F32)
    fn = f"store_out{j}"
    if tb:
        pro_lines = [blank()]
        elem = (lambda m, kk: Convert(F32, Load(ab, a_at(U(m), kk), wgsl_type(a.dtype))))     # noqa: E731
        if "prologue" in kernel.spec:
            pro_lines, elem = _norm_prologue(kernel, bind, M, K, a_at, ab, part)
        head += pro_lines
        pair = kernel.spec.get("pair")
        R = 2 * M if pair else M
        if pair:
            pv = kernel.reads[pair["b_index"]]
            pbb = bind.index(pv.buf, pv.dtype)
            boff2 = batch_offsets(a, pv, batch, wz)[2]
            head.append(Let("boff2", boff2))
            fmas = [Let("w2", Convert(F32, Load(pbb, add(_u("boff2"), b_("*", n, U(K)), k), wgsl_type(pv.dtype))))]
            for m in range(M):
                am = Name(f"a{m}", F32)
                fmas += [Let(f"a{m}", elem(m, k)), assign(f"acc{m}", Call("fma", (am, w_, acc(m)), F32)),
                         assign(f"acc{M + m}", Call("fma", (am, Name("w2", F32), acc(M + m)), F32))]
        else:
            fmas = [assign(f"acc{m}", Call("fma", (elem(m, k), w_, acc(m)), F32)) for m in range(M)]
        C = gemv_columns(N)
        L = 256 // C
        lane = _u("lane")
        second = (lambda m: (slot(M + m),)) if pair else (lambda m: ())      # noqa: E731
        writes = tuple(ExprStmt(Call(fn, (add(coff_, U(m * N), n), slot(m)) + second(m), "void")) for m in range(M))
        loop = For(Var("k", add(kbeg, lane)), b_("<", k, kend), assign("k", add(k, U(L))), tuple(
            [Let("w", Convert(F32, Load(bb, add(boff_, b_("*", n, U(K)), k), wgsl_type(bv.dtype))))] + fmas))
        body = [Let("lane", b_("%", lid, U(L))), Let("n", add(b_("*", wx, U(C)), b_("/", lid, U(L))))]
        body += [Var(f"acc{r}", F("0.0")) for r in range(R)] + [If(b_("<", n, U(N)), (loop,))]
        body += [assign_index(part, add(U(r * 256), lid), acc(r)) for r in range(R)]
        body += [Barrier("workgroup"), _reduce(part, range(R), lid, _u("s"), lane, L // 2),
                 If(b_("&&", b_("==", lane, U(0)), b_("<", n, U(N))), writes)]
        groups = -(-N // C)
    else:
        fmas = [assign(f"acc{m}", Call("fma", (Convert(F32, Load(ab, a_at(U(m), k), wgsl_type(a.dtype))), w_, acc(m)), F32))
                for m in range(M)]
        body = [Let("n", add(b_("*", wx, U(256)), lid)), ReturnIf(b_(">=", n, U(N)))]
        body += [Var(f"acc{m}", F("0.0")) for m in range(M)]
        body.append(For(Var("k", kbeg), b_("<", k, kend), assign("k", add(k, U(1))), tuple(
            [Let("w", Convert(F32, Load(bb, add(boff_, b_("*", k, U(N)), n), wgsl_type(bv.dtype))))] + fmas)))
        body += [ExprStmt(Call(fn, (add(coff_, U(m * N), n), acc(m)), "void")) for m in range(M)]
        groups = -(-N // 256)
    return store + [Function(f"gemv{j}", (wx, wz, lid), tuple(head + body)), blank()], groups, nb * S
