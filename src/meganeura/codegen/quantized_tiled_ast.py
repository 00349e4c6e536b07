"""``quantized_tiled.render_tiled`` (the quantized archetype's tiled product) built on the
typed kernel AST: its only WGSL (and GLSL) is printed from this tree."""
from __future__ import annotations

from .kernel_ast import WID, AssignIndex, Barrier, Block, Call, ExprStmt, Field, For, If, Index, Let, Name, Var
from .kernel_ast_matmul import (ENTRY_LOCAL_INDEX, F, U, VEC4, add, assign, b_, blank, g, inline, module, shared,
                                store_function, store_supported, v4)
from .quantized import TK
from .quantized_ast import half_functions, weight_functions, x_loads

T = 64


def tiled_kernel(kernel):
    """(tree, bound buffers, workgroups) of ``render_tiled``'s kernel, or None where its
    output store is not on the tree."""
    from .common import Bindings
    s = kernel.spec
    qtype, M, N, K = s["qtype"], s["m"], s["n"], s["k"]
    if not store_supported(kernel):
        return None
    b = Bindings()
    store = store_function(kernel, b)
    wv = kernel.reads[1]
    if wv.offset:
        raise NotImplementedError("quantized kernels read their weight from the start of its buffer")
    wfns = weight_functions(qtype, K, b.index(wv.buf, wv.dtype), wv.size)
    xvec = x_loads(b, kernel.reads[0], K)
    V = T // 4
    u = lambda n: Name(n, "u32")          # noqa: E731
    lid, kk, kb, c, c8, tx, ty, r, e, kq, m0, n0, n, j = map(u, "lid kk kb c c8 tx ty r e kq m0 n0 n j".split())
    lo, hi, v, wv_, xv = (Name(x, VEC4) for x in ("lo", "hi", "v", "wv", "xv"))
    ws, xs = Name("ws", f"array<vec4<f32>, {TK * V}>"), Name("xs", f"array<vec4<f32>, {TK * V}>")
    wstores = [AssignIndex(Index(ws, add(b_("*", g(add(c8, U(i))), U(V)), b_("/", c, U(4))), VEC4),
                           b_("%", c, U(4)), Field(vv, f, "f32"))
               for i, (vv, f) in enumerate([(lo, f) for f in "xyzw"] + [(hi, f) for f in "xyzw"])]
    xloads = []
    for q in range(T * TK // 4 // 256):
        row = add(m0, r)
        st = [Let("e", add(lid, U(256 * q))),
              Let("r", b_("/", e, U(TK // 4))),
              Let("kq", b_("*", g(b_("%", e, U(TK // 4))), U(4))),
              Var("v", v4(F("0.0"))),
              inline(If(b_("<", row, U(M)), (assign("v", xvec(g(row), add(Name("k0", "u32"), kq))),)))]
        for i, f in enumerate("xyzw"):
            at = kq if i == 0 else g(add(kq, U(i)))
            st.append(AssignIndex(Index(xs, add(b_("*", at, U(V)), b_("/", r, U(4))), VEC4), b_("%", r, U(4)),
                                  Field(v, f, "f32")))
        xloads.append(Block(tuple(st)))
    fmas = [assign(f"acc{i}", Call("fma", (v4(Field(xv, f, "f32")), wv_, Name(f"acc{i}", VEC4)), VEC4))
            for i, f in enumerate("xyzw")]
    inner = For(Var("kk", U(0)), b_("<", kk, U(TK)), assign("kk", add(kk, U(1))),
                tuple([Let("wv", Index(ws, add(b_("*", kk, U(V)), tx), VEC4)),
                       Let("xv", Index(xs, add(b_("*", kk, U(V)), ty), VEC4))] + fmas))
    loop = For(Var("kb", U(0)), b_("<", kb, U(K // TK)), assign("kb", add(kb, U(1))), tuple(
        [Let("k0", b_("*", kb, U(TK))), Var("lo", v4(F("0.0"))), Var("hi", v4(F("0.0"))),
         If(b_("<", add(n0, c), U(N)), (
             ExprStmt(Call("qgroup", (add(n0, c), add(b_("*", kb, U(TK // 8)), b_("%", lid, U(4)))), "void")),
             assign("lo", Name("qlo", VEC4)), assign("hi", Name("qhi", VEC4))))]
        + wstores + xloads + [Barrier("workgroup"), inner, Barrier("workgroup")]))
    writes = []
    for i in range(4):
        rowi = add(m0, b_("*", ty, U(4)), U(i))
        fv = Name("f", "u32")
        store_j = inline(For(Var("j", U(0)), b_("<", j, U(4)), assign("j", add(j, U(1))), (
            If(b_("<", add(n, j), U(N)), (ExprStmt(Call("store_out", (add(fv, j), Index(Name(f"acc{i}", VEC4), j, "f32")),
                                                        "void")),)),)))
        writes.append(If(b_("<", rowi, U(M)), (Let("f", add(b_("*", g(rowi), U(N)), n)), store_j)))
    body = [Let("n0", b_("*", Field(WID, "x"), U(T))), Let("m0", b_("*", Field(WID, "y"), U(T))),
            Let("tx", b_("%", lid, U(V))), Let("ty", b_("/", lid, U(V))), Let("c", b_("/", lid, U(4))),
            Let("c8", b_("*", g(b_("%", lid, U(4))), U(8)))]
    body += [Var(f"acc{i}", v4(F("0.0"))) for i in range(4)] + [loop, Let("n", add(n0, b_("*", tx, U(4))))] + writes
    items = store + half_functions() + wfns + [blank(), shared("ws", VEC4, TK * V), shared("xs", VEC4, TK * V)]
    return module(b, items, 256, body, ENTRY_LOCAL_INDEX), b.bufs, (-(-N // T), -(-M // T), 1)
