"""The module part of the cooperative-matrix kernels (``coopmat``, ``flash_coop``,
``flash_grad_coop``), whose ``main`` is written in GLSL directly: the storage buffers, the
output stores (``store_out``, where a fused epilogue runs) and the helper functions their
epilogues call, built as trees of the typed kernel AST and printed by its GLSL printer.

``StoreTree`` is ``expr.OutputStore`` as a tree: the same bindings registered in the same
order and the same statements (so its WGSL, ``WgslPrinter().function(tree)``, is the
OutputStore's text, and its GLSL what the translator wrote for that text).
"""
from __future__ import annotations

from . import kernel_ast as K
from .common import broadcast_view_strides
from .expr import ExprWriter
from .expr_ast import HELPER_FUNCTIONS, coords, offset_expr
from .kernel_ast_print import GlslPrinter


class StoreTree:
    """``fn {name}(f: u32, acc: f32)``: stores an archetype's value for the output element of
    flat (row-major, logical) index ``f`` through the kernel's epilogue, as ``OutputStore``
    does; registers the output, epilogue and second-store bindings on ``bind``. ``function``:
    the tree; ``used``: the helpers it calls; ``items()``: the module items it adds."""

    def __init__(self, kernel, bind, acc_dtype=None, name="store_out"):
        from ..graph import f32
        out, spec = kernel.out, kernel.spec
        self.acc_dtype, self.bind = acc_dtype or f32, bind
        self.ob = bind.index(out.buf, out.dtype, write=True)
        leaves = [(bind.index(v.buf, v.dtype), v) for v in kernel.epi_reads]
        bind.scalar.update(bi for bi, _ in leaves)     # read element by element: never vec4
        body = []
        smap = spec.get("store_map")
        if smap is not None:
            # a transposed store: element f goes where the copy fused away put it
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
            body.append(K.Let(f"l{k}", K.Load(bi, at, v.dtype.wgsl)))
        acc = K.Name("acc", self.acc_dtype.wgsl)
        acc2 = K.Name("acc2", self.acc_dtype.wgsl)

        def leaf(e):
            if e[0] in ("acc", "acc2"):        # acc2: a paired product's value (spec["pair"])
                return (acc if e[0] == "acc" else acc2), self.acc_dtype
            v = leaves[e[1]][1]
            return K.Name(f"l{e[1]}", v.dtype.wgsl), v.dtype
        w = ExprWriter(leaf, ast=True)
        val, dt = w.emit(kernel.epilogue or ("acc",))
        body += w.stmts
        if dt is not out.dtype:
            val = K.Convert(out.dtype.wgsl, val)
        idx = K.add(K.u32(out.offset), K.Name(dest, "u32")) if out.is_contiguous() else \
            offset_expr(out.offset, out.strides, "e")
        stores = spec.get("stores", ())
        if stores:
            body.append(K.Let("stored", val))
            val = K.Name("stored", val.ty)
        body.append(K.Store(self.ob, idx, val))
        for s in stores:        # second stores of the value (a concat's slice, an f16 copy)
            sb = bind.index(s.buf, s.dtype, write=True)
            body.append(K.Store(sb, offset_expr(s.offset, s.strides, "e"),
                                val if s.dtype is out.dtype else K.Convert(s.dtype.wgsl, val)))
        self.used = w.used
        params = (K.Name("f", "u32"), acc) + ((acc2,) if "pair" in spec else ())
        self.function = K.Function(name, params, tuple(body))

    def items(self) -> list:
        """The helpers not yet in the module (which then records them) and ``function``."""
        new = [h for h in HELPER_FUNCTIONS if h in self.used and h not in self.bind.helpers_done]
        self.bind.helpers_done.update(new)
        return [HELPER_FUNCTIONS[h] for h in new] + [self.function]


def buffers(bind) -> tuple:
    """The storage buffers of ``bind`` (``common.Bindings``) as module items of the AST."""
    return tuple(K.Buffer(t, id(b) in bind.written, len(b) if isinstance(b, tuple) else None)
                 for b, t in zip(bind.bufs, bind.types))


def glsl_library(bind, items) -> str:
    """GLSL of the buffers of ``bind`` and the module ``items`` (functions, workgroup
    arrays): declarations, prototypes and function bodies, without a header or an entry
    point (the kernel that includes it writes those; its header enables 16-bit types)."""
    tree = K.ComputeKernel(buffers(bind), 1, (), module=tuple(items), builtins=(), enable_f16=bind.enable_f16)
    lines = GlslPrinter(unroll=False, preserve_ieee=False).kernel(tree).splitlines()
    assert lines[-2:] == ["void main() {", "}"], lines[-2:]
    code = [ln for ln in lines[:-2] if not ln.startswith(("#version", "#extension", "layout(local_size"))]
    return "\n".join(code) + "\n"
