"""``quantized_gemv.render_gemv`` (the quantized archetype's GEMV: sibling parts, paired
weights, a norm prologue) built on the typed kernel AST: its only WGSL (and GLSL) is
printed from this tree."""
from __future__ import annotations

from .kernel_ast import Barrier, Call, ExprStmt, Field, For, Function, If, Index, Let, Name, Var
from .kernel_ast_matmul import (GROUP_INDEX, F, U, VEC4, add, assign, assign_index, b_, blank, call_if, g, inline, module,
                                shared, store_function, store_supported, terms, v4)
from .quantized_ast import half_functions, weight_functions, x_loads

U32, F32 = "u32", "f32"


def _u(n):
    return Name(n, U32)


def gemv_kernel(kernel):
    """(tree, bound buffers, workgroups) of ``render_gemv``'s kernel, or None where an
    output store is not on the tree."""
    from .common import Bindings, grid
    from .matmul_tiles import gemv_columns
    parts = kernel.spec.get("parts", [kernel])
    if not all(map(store_supported, parts)):
        return None
    b = Bindings()
    M, K = parts[0].spec["m"], parts[0].spec["k"]
    xvec = x_loads(b, parts[0].reads[0], K)
    R = max(2 if "pair" in p.spec else 1 for p in parts) * M
    items, branches, g0 = half_functions() + [blank()], [], 0
    gi, lid = _u("gi"), _u("lid")
    for j, p in enumerate(parts):
        fns, gx = _part(p, b, j, xvec, gemv_columns)
        items += fns
        branches.append(call_if(b_("<", gi, U(g0 + gx)), f"gemv{j}", (b_("-", gi, U(g0)), lid)))
        g0 += gx
    items.append(shared("part", F32, 256 * R))
    body = [Let("gi", GROUP_INDEX)] + branches
    return module(b, items, 256, body), b.bufs, grid(g0)


def _part(kernel, b, j, xvec, gemv_columns):
    s = kernel.spec
    M, N, K = s["m"], s["n"], s["k"]
    G = K // 8
    store = store_function(kernel, b, name=f"store_out{j}")
    weights = [(kernel.reads[1], s["qtype"])]
    if "pair" in s:
        weights.append((kernel.reads[s["pair"]["b_index"]], s["pair"]["qtype"]))
    items = list(store)
    for w, (wv, qtype) in enumerate(weights):
        if wv.offset:
            raise NotImplementedError("quantized kernels read their weight from the start of its buffer")
        items += weight_functions(qtype, K, b.index(wv.buf, wv.dtype), wv.size, f"_{j}_{w}") + [blank()]
    R = len(weights) * M
    C = gemv_columns(N)
    L = 256 // C
    lid, lane, n, gg, k, sv = (_u(x) for x in ("lid", "lane", "n", "g", "k", "s"))
    part = Name("part", f"array<f32, {256 * R}>")
    pro, load = _prologue(kernel, b, xvec, M, K, part, lid)
    slot = lambda r: Index(part, add(U(r * 256), lid), F32)      # noqa: E731
    acc = lambda r: Name(f"acc{r}", F32)                          # noqa: E731
    xs = [st for m in range(M) for st in (Let(f"xa{m}", load(m, k)), Let(f"xb{m}", load(m, add(k, U(4)))))]
    qlo, qhi = Name("qlo", VEC4), Name("qhi", VEC4)
    fmas = []
    for w in range(len(weights)):
        fmas.append(ExprStmt(Call(f"qgroup_{j}_{w}", (n, gg), "void")))
        fmas += [assign(f"acc{w * M + m}", add(acc(w * M + m), Call("dot", (qlo, Name(f"xa{m}", VEC4)), F32),
                                               Call("dot", (qhi, Name(f"xb{m}", VEC4)), F32))) for m in range(M)]
    loop = For(Var("g", lane), b_("<", gg, U(G)), assign("g", add(gg, U(L))),
               tuple([Let("k", b_("*", gg, U(8)))] + xs + fmas))
    red = For(Var("s", U(L // 2)), b_(">", sv, U(0)), assign("s", b_(">>", sv, U(1))), (
        If(b_("<", lane, sv), tuple(assign_index(part, add(U(r * 256), lid),
                                                 add(slot(r), Index(part, add(U(r * 256), lid, sv), F32)))
                                    for r in range(R))),
        Barrier("workgroup")))
    stores = [ExprStmt(Call(f"store_out{j}", (add(U(m * N), n), slot(m)) + ((slot(M + m),) if "pair" in s else ()),
                            "void")) for m in range(M)]
    body = [Let("lane", b_("%", lid, U(L))), Let("n", add(b_("*", _u("wx"), U(C)), b_("/", lid, U(L))))]
    body += pro + [Var(f"acc{r}", F("0.0")) for r in range(R)]
    body += [If(b_("<", n, U(N)), (loop,))] + [assign_index(part, add(U(r * 256), lid), acc(r)) for r in range(R)]
    body += [Barrier("workgroup"), red, If(b_("&&", b_("==", lane, U(0)), b_("<", n, U(N))), tuple(stores))]
    items.append(Function(f"gemv{j}", (_u("wx"), lid), tuple(body)))
    items.append(blank())
    return items, -(-N // C)


def _prologue(kernel, b, xvec, M, K, part, lid):
    """(statements of the rows' norm statistics, ``load(m, col)``), as ``quantized_gemv._prologue``."""
    pro = kernel.spec.get("prologue")
    if pro is None:
        return [blank()], lambda m, col: xvec(U(m), col)
    at = pro["at"]
    w = x_loads(b, kernel.reads[at], K) if pro["w"] else None
    bias = x_loads(b, kernel.reads[at + pro["w"]], K) if pro["b"] else None
    center = pro["kind"] == "layer_norm"
    v, k4, sv = Name("v", VEC4), _u("k4"), _u("s")
    slot0 = lambda m: Index(part, add(U(m * 256), lid), F32)     # noqa: E731

    def tree(term, name, m):
        t = Name(f"t{name}{m}", F32)
        return [Var(t.id, F("0.0")),
                inline(For(Var("k4", lid), b_("<", k4, U(K // 4)), assign("k4", add(k4, U(256))), (
                    Let("v", xvec(U(m), b_("*", k4, U(4)))), assign(t.id, add(t, *terms(term)))))),
                assign_index(part, add(U(m * 256), lid), t)]
    reduce = [Barrier("workgroup"), For(Var("s", U(128)), b_(">", sv, U(0)), assign("s", b_(">>", sv, U(1))), (
        If(b_("<", lid, sv), tuple(assign_index(part, add(U(m * 256), lid),
                                                add(slot0(m), Index(part, add(U(m * 256), lid, sv), F32)))
                                   for m in range(M))),
        Barrier("workgroup")))]
    lines = []
    comp = lambda c: Field(v, c, F32)        # noqa: E731
    if center:
        lines = [x for m in range(M) for x in tree(add(*map(comp, "xyzw")), "s", m)] + reduce
        lines += [Let(f"mean{m}", b_("/", Index(part, U(m * 256), F32), F(repr(float(K))))) for m in range(M)]
        lines.append(Barrier("workgroup"))
    dev = (lambda m: g(b_("-", v, v4(Name(f"mean{m}", F32))))) if center else (lambda m: v)    # noqa: E731
    lines += [x for m in range(M) for x in tree(Call("dot", (dev(m), dev(m)), F32), "q", m)] + reduce
    lines += [Let(f"inv{m}", Call("inverseSqrt", (add(b_("/", Index(part, U(m * 256), F32), F(repr(float(K)))),
                                                      F(repr(pro["eps"]))),), F32)) for m in range(M)]
    lines.append(Barrier("workgroup"))

    def load(m, col):
        e = g(b_("-", xvec(U(m), col), v4(Name(f"mean{m}", F32)))) if center else xvec(U(m), col)
        e = b_("*", e, Name(f"inv{m}", F32))
        if w is not None:
            e = b_("*", e, w(U(0), col))
        if bias is not None:
            e = b_("+", e, bias(U(0), col))
        return e
    return lines, load
