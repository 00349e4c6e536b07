"""The gather kernels (``gather.py``) on the typed kernel AST: each lowering's body as a
tree (``Input`` reads its dense inputs, bound to buffers when the kernel is rendered), and
the whole kernel, whose only WGSL (and GLSL) is printed from this tree."""
from __future__ import annotations

from dataclasses import dataclass

from . import kernel_ast as K
from .common import WG, Bindings, grid, wgsl_type
from .kernel_ast_attn import (LID, Body, E, bitcast, buffers, conv, group_index, grp, land, lit, lor, name, node,
                              sel, substitute)
from .expr_ast import coords
from .store_ast import store_items


@dataclass(frozen=True)
class Input:
    """Element ``index`` of the gather's dense input ``k`` (``x{k}[...]`` in its body),
    of WGSL type ``ty``: a buffer load once the kernel binds its inputs."""
    k: int
    index: object
    ty: str


def _x(k, index, dtype):
    return E(Input(k, node(index), wgsl_type(dtype)))


def _idx(dt, e):
    return conv("i32", e) if dt.name != "i32" else e


I = name("i", "u32")


def one_hot(t):
    c = t.attrs["num_classes"]
    xo0 = name("xo0", "u32")
    ign = t.attrs.get("ignore_index")
    ign = int(ign) if ign is not None and -2**31 <= ign < 2**31 else None
    b = Body()
    lab = b.let("lab", _idx(t.inputs[0].dtype, _x(0, xo0 + I / c, t.inputs[0].dtype)))
    ok = grp(land(lab.ge(lit(0, "i32")), lab.lt(lit(c, "i32"))))
    if ign is not None:
        ok = lor(ok, lab.eq(lit(ign, "i32")))
    with b.if_(land((I % c).eq(0), ~grp(ok)), inline=True):
        b.call("report_err", lit(0), lab)
    hot = lab.eq(conv("i32", I % c))
    if ign is not None and 0 <= ign < c:
        hot = land(hot, lab.ne(lit(ign, "i32")))
    b.let("val", sel(lit(0, t.dtype.name), lit(1, t.dtype.name), hot))
    return b.stmts


def embedding(t):
    n, d = t.inputs[1].shape
    xo0, xo1 = name("xo0", "u32"), name("xo1", "u32")
    b = Body()
    i_d = b.let("id", _idx(t.inputs[0].dtype, _x(0, xo0 + I / d, t.inputs[0].dtype)))
    ok = b.let("ok", land(i_d.ge(lit(0, "i32")), i_d.lt(lit(n, "i32"))))
    with b.if_(land((I % d).eq(0), ~ok), inline=True):
        b.call("report_err", lit(0), i_d)
    row = b.let("row", sel(lit(0), conv("u32", i_d), ok))
    b.let("val", sel(lit(0, t.dtype.name), _x(1, xo1 + row * d + I % d, t.inputs[1].dtype), ok))
    return b.stmts


def im2col(t):
    from .gather import _out_len as out_len
    a = t.attrs
    n, c, h, w = t.inputs[0].shape
    kh, kw = a["kernel"]
    (top, _), (left, _) = a["padding"]
    wo = out_len(w, kw, a["stride"][1], a["padding"][1], a["dilation"][1])
    b = Body()
    if a.get("fold_batch"):
        L = t.shape[1] // n
        b.line(lambda b: (b.let("c1", I / t.shape[1]), b.let("c0", grp(I % t.shape[1]) / L), b.let("c2", I % L)))
    else:
        b.add(*coords(I.n, t.shape))
    c0, c1, c2 = (name(f"c{j}", "u32") for j in range(3))
    i32 = lambda n: lit(n, "i32")  # noqa: E731
    b.line(lambda b: (b.let("ch", c1 / (kh * kw)), b.let("ki", grp(c1 % (kh * kw)) / kw), b.let("kj", c1 % kw)))
    ch, ki, kj = name("ch", "u32"), name("ki", "u32"), name("kj", "u32")
    y = b.let("y", conv("i32", c2 / wo) * i32(a["stride"][0]) + conv("i32", ki) * i32(a["dilation"][0]) - i32(top))
    x = b.let("x", conv("i32", c2 % wo) * i32(a["stride"][1]) + conv("i32", kj) * i32(a["dilation"][1]) - i32(left))
    val = b.var("val", lit(a["fill"], t.dtype.name))
    with b.if_(land(y.ge(i32(0)), y.lt(i32(h)), x.ge(i32(0)), x.lt(i32(w)))):
        b.assign(val, _x(0, name("xo0", "u32") + grp(grp(c0 * c + ch) * h + conv("u32", y)) * w + conv("u32", x),
                         t.inputs[0].dtype))
    return b.stmts


def col2im(t):
    from .gather import _out_len as out_len
    a = t.attrs
    n, c, h, w = t.shape
    ck, L = t.inputs[0].shape[1:]
    kh, kw = a["kernel"]
    sh, sw = a["stride"]
    dh, dw = a["dilation"]
    (top, _), (left, _) = a["padding"]
    ho = out_len(h, kh, sh, a["padding"][0], dh)
    wo = out_len(w, kw, sw, a["padding"][1], dw)
    i32 = lambda n: lit(n, "i32")  # noqa: E731
    c0, c1, c2, c3 = (name(f"c{j}", "u32") for j in range(4))
    b = Body()
    b.add(*coords(I.n, t.shape))
    val = b.var("val", lit(0, t.dtype.name))
    with b.for_("ki", lit(0), lambda v: v.lt(kh), lambda v: v + 1) as ki:
        ty = b.let("ty", conv("i32", c2) + i32(top) - conv("i32", ki) * i32(dh))
        with b.if_(lor(ty.lt(i32(0)), (ty % i32(sh)).ne(i32(0)), (ty / i32(sh)).ge(i32(ho))), inline=True):
            b.cont()
        with b.for_("kj", lit(0), lambda v: v.lt(kw), lambda v: v + 1) as kj:
            tx = b.let("tx", conv("i32", c3) + i32(left) - conv("i32", kj) * i32(dw))
            with b.if_(lor(tx.lt(i32(0)), (tx % i32(sw)).ne(i32(0)), (tx / i32(sw)).ge(i32(wo))), inline=True):
                b.cont()
            row = b.let("row", grp(c1 * kh + ki) * kw + kj)
            b.assign(val, val + _x(0, name("xo0", "u32") + grp(c0 * ck + row) * L + conv("u32", ty / i32(sh)) * wo
                                   + conv("u32", tx / i32(sw)), t.inputs[0].dtype))
    return b.stmts


def embedding_grad(t):
    d, p = t.inputs[1].shape[-1], t.inputs[0].size
    xo0, xo1 = name("xo0", "u32"), name("xo1", "u32")
    idv = lambda q: _idx(t.inputs[0].dtype, _x(0, xo0 + q, t.inputs[0].dtype))   # noqa: E731
    b = Body()
    b.line(lambda b: (b.let("q0", I / d), b.let("j", I % d)))
    q0, j = name("q0", "u32"), name("j", "u32")
    v = b.let("v", idv(q0))
    with b.if_(lor(v.lt(lit(0, "i32")), v.ge(lit(t.shape[0], "i32"))), inline=True):
        b.ret()
    with b.for_("q", lit(0), lambda q: q.lt(q0), lambda q: q + 1, inline=True) as q:
        with b.if_(idv(q).eq(v), inline=True):
            b.ret()
    val = b.var("val", lit(0, t.dtype.name))
    with b.for_("q", q0, lambda q: q.lt(p), lambda q: q + 1) as q:
        with b.if_(idv(q).eq(v), inline=True):
            b.assign(val, val + _x(1, xo1 + q * d + j, t.inputs[1].dtype))
    b.let("oi", conv("u32", v) * d + j)
    return b.stmts


FORMS = {"one_hot": one_hot, "embedding": embedding, "im2col": im2col, "col2im": col2im,
         "embedding_grad": embedding_grad}


def body_tree(spec):
    """The statements of a gather's value (``spec["form"]``: the builder's name and the
    node it lowers), built when the kernel is rendered."""
    kind, t = spec["form"]
    return FORMS[kind](t)


def kernel_tree(kernel, errors=None):
    """(``ComputeKernel``, bound buffers, workgroups) of a gather kernel whose body is a tree
    (``spec["form"]``) (``errors``: checked mode's
    error buffer, as there); None where its output store is not on the AST yet."""
    if "form" not in kernel.spec:
        return None
    n = kernel.spec.get("threads", kernel.out.size)
    b = Bindings()
    fns = store_items(kernel, b, kernel.dtype)
    if fns is None:
        return None
    k_, v_ = name("k", "u32"), name("v", "i32")
    report = Body()
    if errors is not None:
        from ..graph import u32
        eb = b.index(errors[0], u32, write=True)
        report.store(eb, lit(2 * errors[1]) + lit(2) * k_, lit(1))
        report.store(eb, lit(2 * errors[1] + 1) + lit(2) * k_, bitcast("u32", v_))
    fns.append(K.Function("report_err", (k_.n, v_.n), report.stmts, inline=True))
    body = Body()
    i = body.let("i", grp(group_index()) * WG + LID)
    with body.if_(i.ge(n), inline=True):
        body.ret()
    bound = {}
    for k, v in enumerate(kernel.reads):
        bound[k] = b.index(v.buf, v.dtype)
        body.let(f"xo{k}", lit(v.offset), comment=f"  // x{k} is b{bound[k]}")
    body.add(*substitute(body_tree(kernel.spec), lambda e: K.Load(bound[e.k], e.index, e.ty)
                         if isinstance(e, Input) else None))
    body.call("store_out", name(kernel.spec.get("index", "i"), "u32"), name("val", wgsl_type(kernel.dtype)))
    return (K.ComputeKernel(buffers(b), WG, body.stmts, module=(*fns, K.Blank())), b.bufs, grid(-(-n // WG)))


def function_tree(gather_spec, reads, bind, name):
    """A ``kernel_ast.Function`` ``fn name(i0: u32) -> f32``: the
    value a gather would have stored at flat index ``i`` of its output, for a consumer that
    computes it in its loads), from the gather's tree (``body_tree``); its reads
    bound on ``bind`` (scalar bindings)."""
    from ..graph import dtype_of
    i0 = K.Name("i0", "u32")
    body = [K.Let("i", K.Call("min", (i0, K.u32(gather_spec["size"] - 1)), "u32"))]
    bound = {}
    for k, v in enumerate(reads):
        bound[k] = bind.index(v.buf, v.dtype)
        bind.scalar.add(bound[k])
        body.append(K.Let(f"xo{k}", K.u32(v.offset)))
    tree = body_tree(gather_spec)
    body += substitute(tree, lambda e: K.Load(bound[e.k], e.index, e.ty) if isinstance(e, Input) else None)
    dt = gather_spec.get("dtype", "f32")
    val = _value_of(tree)
    if dt != "f32":
        val = K.Convert(wgsl_type(dtype_of(dt)), val)
        bind.enable_f16 |= dt == "f16"
    return K.Function(name, (i0,), tuple(body) + (K.Return(K.Convert("f32", val)),), "f32")


def _value_of(stmts):
    """The name ``val`` as the gather's statements declare it."""
    for s in stmts:
        if isinstance(s, (K.Let, K.Var)) and s.name == "val":
            return K.Name("val", s.e.ty)
    raise ValueError("a gather's tree declares no val")
