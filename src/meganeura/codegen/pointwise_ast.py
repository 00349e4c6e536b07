"""The pointwise kernels built on the typed kernel AST (``kernel_ast``): ``ast_kernel`` says
which (a literal, casts, f32 arithmetic over the operands as the ops' records spell it, with
second stores and further outputs) and builds them, line for line as ``pointwise._body``
and ``expr.ExprWriter`` write their WGSL, so that ``pointwise.render`` prints their WGSL
from the tree and the Vulkan compile stage their GLSL."""
from __future__ import annotations

import functools
import re

from ..ops.registry import OPS
from .common import WG, Bindings, broadcast_view_strides, coalesce
from .expr import ieee_guard
from .kernel_ast import (LID, NWG, WID, Assign, Bin, Buffer, Call, CallIf, ComputeKernel, Convert, Field, Function,
                         Group, Let, Line, Lit, Load, Name, Neg, ReturnIf, Store, Var, WgslPrinter, add, clear_printed,
                         printed, tree_of, u32)

# (the registry of printed trees moved to ``kernel_ast``; its names stay importable from here)
__all__ = ["ast_kernel", "ast_multi", "printed", "tree_of", "clear_printed"]

# element types a kernel of the typed kernel AST stores and reads so far
AST_TYPES = frozenset({"f32", "f16", "i32", "u32"})
# ops whose f32 WGSL ``expr.op_text`` writes as its record's template (``wgsl``) alone, and
# the builtins such a template may call (the same function in both languages, or renamed by
# ``kernel_ast.GLSL_NAMES``); the other ops (helpers, select, comparisons) stay on the template
AST_SPECIAL = frozenset({"cast", "pow", "gelu", "gelu_grad", "where", "tanh", "erf", "relu", "maximum", "minimum",
                         "rotate_half"})
AST_BUILTINS = frozenset({"exp", "log", "sqrt", "inverseSqrt", "abs", "sin", "cos", "floor", "ceil", "trunc", "round",
                          "sign"})
_TOKEN = re.compile(r"\s*(\{\d+\}|\d+\.\d*(?:e[-+]?\d+)?|[A-Za-z_]\w*|[-+*/(),])")


class _NotOnAst(Exception):
    """The kernel has something the AST does not build yet (its template writes it)."""


@functools.lru_cache(maxsize=256)
def _template(text: str):
    """``_parse_template`` of ``text``, or None where it holds something else (both kept)."""
    try:
        return _parse_template(text)
    except _NotOnAst:
        return None


def _parse_template(text: str):
    """An op record's WGSL template parsed into a builder of its tree from the argument trees
    (precedence as WGSL's, a written pair of parentheses a ``Group``); raises ``_NotOnAst``
    on anything but arguments, float literals, + - * /, unary minus and ``AST_BUILTINS``."""
    toks = _TOKEN.findall(text)
    if "".join(toks) != text.replace(" ", ""):
        raise _NotOnAst(text)
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else None

    def take():
        pos[0] += 1
        return toks[pos[0] - 1]

    def binary(ops, sub):
        def parse():
            left = sub()
            while peek() in ops:
                op, right = take(), sub()
                left = (lambda op, a, b: lambda args: Bin(op, a(args), b(args)))(op, left, right)
            return left
        return parse

    def unary():
        if peek() == "-":
            take()
            inner = unary()
            return lambda args: Neg(inner(args))
        return primary()

    def primary():
        tok = take()
        if tok.startswith("{"):
            k = int(tok[1:-1])
            return lambda args: args[k]
        if tok[0].isdigit():
            from ..graph import f32
            return lambda args: Lit(float(tok), f32, tok)
        if tok == "(":
            inner = expr()
            if take() != ")":
                raise _NotOnAst(text)
            return lambda args: Group(inner(args))
        if tok in AST_BUILTINS and take() == "(":
            params = [expr()]
            while peek() == ",":
                take()
                params.append(expr())
            if take() != ")":
                raise _NotOnAst(text)
            return lambda args: Call(tok, tuple(p(args) for p in params), "f32")
        raise _NotOnAst(text)
    expr = binary(("+", "-"), binary(("*", "/"), unary))
    tree = expr()
    if pos[0] != len(toks):
        raise _NotOnAst(text)
    return tree


def _ast_value(e, leaves, body, done):
    """The AST name of expression ``e``'s value, its ``let`` lines appended to ``body`` as
    ``expr.ExprWriter`` writes them (one ``t{n}`` per distinct node, in evaluation order)."""
    if e[0] == "leaf":
        return leaves[e[1]]
    if e[0] == "lit" and e[2].name == "f32":
        return Lit(e[1], e[2])
    if e[0] == "const" and e[1].dtype.name == "f32":
        return Lit(e[1].attrs["value"].reshape(-1)[0], e[1].dtype)
    if e[0] != "op":
        raise _NotOnAst(e[0])
    t, kids = e[1], e[2]
    args = [_ast_value(k, leaves, body, done) for k in kids]
    texts = [WgslPrinter().expr(a) for a in args]
    key = (id(t), tuple(texts))
    if key in done:
        return done[key]
    if ieee_guard(t, kids, texts, set()) is not None or all(isinstance(a, Lit) for a in args):
        raise _NotOnAst(t.op)       # a helper call or a folded value; WGSL's abstract-typed literals
    if t.op == "cast" and t.dtype.name in AST_TYPES:
        node = Convert(t.dtype.name, args[0])
    elif t.dtype.name != "f32" or any(a.ty != "f32" for a in args) or t.op in AST_SPECIAL \
            or not isinstance(OPS[t.op].extra.get("wgsl"), str):
        raise _NotOnAst(t.op)
    elif (build := _template(OPS[t.op].extra["wgsl"])) is None:
        raise _NotOnAst(t.op)
    else:
        node = build(args)
    name = f"t{len(done) + 1}"
    body.append(Let(name, node))
    done[key] = Name(name, node.ty)
    return done[key]


def ast_kernel(kernel):
    """(``kernel_ast.ComputeKernel``, bound logical buffers) of a pointwise kernel whose
    values are a literal, casts, or f32 arithmetic and builtins over its operands (concat's
    copies, slice_grad's zero fill, f16 copies, residual adds, gradient sums), with its
    second stores and further outputs, else None: the kernels whose WGSL and GLSL both come
    from the typed kernel AST. The WGSL is the text ``pointwise.render`` writes for them."""
    b = Bindings()
    body = _part(kernel, b)
    if body is None:
        return None
    i = Name("i", "u32")
    group = Group(add(Field(WID, "x"), Bin("*", Field(WID, "y"), Field(NWG, "x"))))     # ``common.GROUP_INDEX``
    head = [Let("i", add(Bin("*", group, u32(WG)), LID)), ReturnIf(Bin(">=", i, u32(kernel.out.size)))]
    return ComputeKernel(_buffers(b), WG, tuple(head + body)), b.bufs


def ast_multi(kernel):
    """(``kernel_ast.ComputeKernel``, bound logical buffers, workgroups) of a merged launch
    of pointwise kernels that are each on the AST (``ast_kernel``), each part a function
    owning a range of workgroups, as ``pointwise.render_multi`` writes it; else None."""
    parts = kernel.spec["parts"]
    if any(p.archetype != "pointwise" for p in parts):
        return None
    b, fns, branches, g0 = Bindings(), [], [], 0
    i, g = Name("i", "u32"), Name("g", "u32")
    for j, part in enumerate(parts):
        body = _part(part, b)
        if body is None:
            return None
        n = part.out.size
        fns.append(Function(f"part{j}", (i,), (ReturnIf(Bin(">=", i, u32(n))), *body)))
        g1 = g0 + -(-n // WG)
        branches.append(CallIf(Bin("<", g, u32(g1)), f"part{j}",
                               (add(Bin("*", Group(Bin("-", g, u32(g0))), u32(WG)), LID),)))
        g0 = g1
    body = [Let("g", add(Field(WID, "x"), Bin("*", Field(WID, "y"), Field(NWG, "x")))), *branches]
    return ComputeKernel(_buffers(b), WG, tuple(body), tuple(fns)), b.bufs, g0


def _buffers(b: Bindings) -> tuple:
    return tuple(Buffer(t, id(x) in b.written) for x, t in zip(b.bufs, b.types))


def _part(kernel, b: Bindings):
    """The statements of ``pointwise._body`` for ``kernel`` (its buffers registered on
    ``b``), or None where the kernel is not on the AST."""
    spec, out = kernel.spec, kernel.out
    stores, out_exprs = list(spec.get("stores", ())), list(spec.get("out_exprs", ()))
    if kernel.archetype != "pointwise" or spec.get("flat_leaf") or len(kernel.outs) != len(out_exprs) \
            or any(v.dtype.name not in AST_TYPES for v in [out, *kernel.reads, *stores, *kernel.outs]):
        return None
    e = spec["expr"]
    if e[0] == "lit" and (kernel.reads or kernel.outs):
        return None
    ob = b.index(out.buf, out.dtype, write=True)
    # per view, the strides it is indexed by (as ``_body``: coalesced where all have the rank)
    views = [[out.strides], [broadcast_view_strides(v, out.shape) for v in kernel.reads],
             [v.strides for v in stores], [v.strides for v in kernel.outs]]
    shape = out.shape
    if all(len(st) == len(shape) for group in views for st in group):
        shape, merged = coalesce(out.shape, [st for group in views for st in group])
        it = iter(merged)
        views = [[next(it) for _ in group] for group in views]
    (out_st,), read_st, store_st, outs_st = views

    def coord(d):
        return Name(f"c{d}", "u32")

    def at(offset, strides):       # ``common.offset_expr``
        terms = ([u32(offset)] if offset else []) + [coord(d) if st == 1 else Bin("*", coord(d), u32(st))
                                                     for d, st in enumerate(strides) if st != 0]
        return add(*terms) if terms else u32(0)
    i, cr = Name("i", "u32"), Name("cr", "u32")
    body = []
    if shape:       # ``common.coords``
        body.append(Var("cr", i))
        body += [Line((Let(f"c{d}", Bin("%", cr, u32(shape[d]))), Assign("cr", Bin("/", cr, u32(shape[d])))))
                 for d in range(len(shape) - 1, 0, -1)]
        body.append(Let("c0", cr))
    leaves = []
    for k, v in enumerate(kernel.reads):
        body.append(Let(f"v{k}", Load(b.index(v.buf, v.dtype), at(v.offset, read_st[k]), v.dtype.name)))
        leaves.append(Name(f"v{k}", v.dtype.name))
    done, stored = {}, []
    try:
        val = Lit(e[1], e[2]) if e[0] == "lit" else _ast_value(e, leaves, body, done)
        if val.ty != out.dtype.name:
            val = Convert(out.dtype.name, val)
        if stores:          # ``expr.store_lines``
            stored.append(Let("stored", val))
            val = Name("stored", val.ty)
        stored.append(Store(ob, at(out.offset, out_st), val))
        for s, st in zip(stores, store_st):
            sv = val if s.dtype.name == out.dtype.name else Convert(s.dtype.name, val)
            stored.append(Store(b.index(s.buf, s.dtype, write=True), at(s.offset, st), sv))
        # further outputs: each the value of its own expression over the same leaves
        for view, oe, st in zip(kernel.outs, out_exprs, outs_st):
            v = _ast_value(oe, leaves, body, done)
            if v.ty != view.dtype.name:
                v = Convert(view.dtype.name, v)
            stored.append(Store(b.index(view.buf, view.dtype, write=True), at(view.offset, st), v))
    except _NotOnAst:
        return None
    return body + stored
