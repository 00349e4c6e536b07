"""The output store every archetype ends with (``expr.OutputStore``: ``fn store_out(f, acc)``,
where a fused epilogue runs) as a tree of the typed kernel AST, line for line as
``OutputStore`` writes it, for the families built on the AST. The epilogue's arithmetic is
built as the pointwise kernels' (``pointwise_ast``); an epilogue it does not build yet (a
helper call, a folded IEEE case), a paired product's second value, or a helper function the
kernel needs that the AST cannot print on one line yet, gives None: the kernel keeps its
template."""
from __future__ import annotations

from . import kernel_ast as K
from .common import broadcast_view_strides
from .kernel_ast_attn import coords


def offset_tree(offset, strides, prefix="c"):
    """``common.offset_expr`` as a tree."""
    terms = [K.u32(offset)] if offset else []
    terms += [K.Name(f"{prefix}{d}", "u32") if st == 1 else K.Bin("*", K.Name(f"{prefix}{d}", "u32"), K.u32(st))
              for d, st in enumerate(strides) if st != 0]
    return K.add(*terms) if terms else K.u32(0)


def _with_acc(e, k):
    """Expression ``e`` with ("acc",) read as leaf ``k``."""
    if e[0] == "acc":
        return ("leaf", k)
    if e[0] == "op":
        return ("op", e[1], [_with_acc(c, k) for c in e[2]])
    return e


# the helper functions (``expr.HELPERS``) the attention kernels call, as trees
def _isnan_f():
    x = K.Name("x", "f32")
    return K.Function("isnan_f", (x,), (K.Return(K.Bin(">", K.Group(K.Bin("&", K.Bitcast("u32", x),
                                                                              K.u32(0x7fffffff, "0x7fffffffu"))),
                                                       K.u32(0x7f800000, "0x7f800000u"))),), "bool", **INLINE)


def _fmax_f32():
    a, b = K.Name("a", "f32"), K.Name("b", "f32")

    def isnan(x):
        return K.Call("isnan_f", (x,), "bool")
    inner = K.Select(K.Call("max", (a, b), "f32"), b, isnan(b))
    return K.Function("fmax_f32", (a, b), (K.Return(K.Select(inner, a, isnan(a))),), "f32", **INLINE)


# a function the WGSL writes on one line (the helpers), where the AST has the form
INLINE = {"inline": True} if "inline" in K.Function.__dataclass_fields__ else {}
HELPER_TREES = {"isnan_f": _isnan_f, "fmax_f32": _fmax_f32}
HELPER_DEPS = {"fmax_f32": ["isnan_f"]}


def store_items(kernel, b, acc_dtype=None, require=(), name="store_out"):
    """The module items of ``kernel``'s output store: the helper functions (``require``: those
    the archetype's own body calls) and ``store_out``, its bindings registered on ``b``
    (``common.Bindings``) as ``OutputStore`` registers them; None where the store is not
    built on the AST yet (see the module docstring)."""
    from ..graph import f32
    from .expr import HELPERS
    from .pointwise_ast import _NotOnAst, _ast_value
    spec, out = kernel.spec, kernel.out
    acc_dtype = acc_dtype or f32
    used = set(require) | {d for r in require for d in HELPER_DEPS.get(r, ())}
    if "pair" in spec or (used and not INLINE) or not used <= set(HELPER_TREES):
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
    names = []
    for k, (bi, v) in enumerate(leaves):
        key = ("fd" if k >= fd_from else "f", v.shape)
        if key not in spaces:
            spaces[key] = f"s{len(spaces)}_"
            body += coords(K.Name(key[0], "u32"), v.shape, spaces[key])
        at = offset_tree(v.offset, broadcast_view_strides(v, v.shape), spaces[key])
        body.append(K.Let(f"l{k}", K.Load(bi, at, v.dtype.wgsl)))
        names.append(K.Name(f"l{k}", v.dtype.wgsl))
    acc = K.Name("acc", acc_dtype.wgsl)
    if kernel.epilogue is None:
        val = acc
    else:
        try:
            val = _ast_value(_with_acc(kernel.epilogue, len(names)), names + [acc], body, {})
        except _NotOnAst:
            return None
    if val.ty != out.dtype.wgsl:
        val = K.Convert(out.dtype.wgsl, val)
    idx = K.add(K.u32(out.offset), K.Name(dest, "u32")) if out.is_contiguous() else \
        offset_tree(out.offset, out.strides, "e")
    stores = spec.get("stores", ())
    if stores:
        body.append(K.Let("stored", val))
        val = K.Name("stored", val.ty)
    body.append(K.Store(ob, idx, val))
    for s in stores:
        sb = b.index(s.buf, s.dtype, write=True)
        body.append(K.Store(sb, offset_tree(s.offset, s.strides, "e"),
                            val if s.dtype is out.dtype else K.Convert(s.dtype.wgsl, val)))
    new = [h for h in HELPERS if h in used and h not in b.helpers_done]
    b.helpers_done.update(new)
    return [HELPER_TREES[h]() for h in new] + [K.Function(name, (K.Name("f", "u32"), acc), tuple(body))]
