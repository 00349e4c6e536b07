"""The output store every archetype ends with (``expr.OutputStore``: ``fn store_out(f, acc)``,
where a fused epilogue runs) as a tree of the typed kernel AST, line for line as
``OutputStore`` writes it, for the families built on the AST (the epilogue's statements
from ``expr.ExprWriter`` on the AST, its helper functions from ``expr_ast``). A paired
product's second value gives None (no kernel is built)."""
from __future__ import annotations

from . import kernel_ast as K
from .common import broadcast_view_strides, wgsl_type
from .expr_ast import coords, offset_expr


def store_items(kernel, b, acc_dtype=None, require=(), name="store_out"):
    """The module items of ``kernel``'s output store: the helper functions (``require``: those
    the archetype's own body calls) and ``store_out``, its bindings registered on ``b``
    (``common.Bindings``) as ``OutputStore`` registers them; None for a paired product."""
    from ..graph import f32
    from .expr import HELPER_DEPS, ExprWriter
    spec, out = kernel.spec, kernel.out
    acc_dtype = acc_dtype or f32
    if "pair" in spec:
        return None
    ob = b.index(out.buf, out.dtype, write=True)
    leaves = [(b.index(v.buf, v.dtype), v) for v in kernel.epi_reads]
    b.scalar.update(bi for bi, _ in leaves)
    body = []
    smap = spec.get("store_map")
    if smap is not None:
        shape, strides = smap
        rm = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            rm[d] = rm[d + 1] * shape[d + 1]
        f = K.Name("f", "u32")
        terms = [K.Bin("*", K.Group(K.Bin("%", K.Group(K.Bin("/", f, K.u32(s))), K.u32(n))), K.u32(r))
                 for s, n, r in zip(strides, shape, rm) if n != 1]
        body.append(K.Let("fd", K.add(*terms) if terms else K.u32(0)))
    fd_from = spec.get("fd_from", len(leaves)) if smap is not None else len(leaves)
    dest = "fd" if smap is not None else "f"
    spaces = {(dest, out.shape): "e"}
    body += coords(K.Name(dest, "u32"), out.shape, "e")
    for k, (bi, v) in enumerate(leaves):
        key = ("fd" if k >= fd_from else "f", v.shape)
        if key not in spaces:
            spaces[key] = f"s{len(spaces)}_"
            body += coords(K.Name(key[0], "u32"), v.shape, spaces[key])
        at = offset_expr(v.offset, broadcast_view_strides(v, v.shape), spaces[key])
        body.append(K.Let(f"l{k}", K.Load(bi, at, wgsl_type(v.dtype))))

    def leaf(e):
        if e[0] == "acc":
            return K.Name("acc", wgsl_type(acc_dtype)), acc_dtype
        return K.Name(f"l{e[1]}", wgsl_type(leaves[e[1]][1].dtype)), leaves[e[1]][1].dtype
    w = ExprWriter(leaf, ast=True)
    val, dt = w.emit(kernel.epilogue or ("acc",))
    body += w.stmts
    if dt is not out.dtype:
        val = K.Convert(wgsl_type(out.dtype), val)
    idx = K.add(K.u32(out.offset), K.Name(dest, "u32")) if out.is_contiguous() else \
        offset_expr(out.offset, out.strides, "e")
    stores = spec.get("stores", ())
    if stores:
        body.append(K.Let("stored", val))
        val = K.Name("stored", val.ty)
    body.append(K.Store(ob, idx, val))
    for s in stores:
        sb = b.index(s.buf, s.dtype, write=True)
        body.append(K.Store(sb, offset_expr(s.offset, s.strides, "e"),
                            val if s.dtype is out.dtype else K.Convert(wgsl_type(s.dtype), val)))
    for r in require:       # helpers the archetype's own body calls (``OutputStore.require``)
        w.used.update([r] + HELPER_DEPS.get(r, []))
    return w.helper_functions(b) + [K.Function(name, (K.Name("f", "u32"), K.Name("acc", wgsl_type(acc_dtype))), tuple(body))]
