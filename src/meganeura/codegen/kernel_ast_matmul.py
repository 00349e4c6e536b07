"""Shorthands that the matmul, GEMV and quantized kernels build their trees with (on
``kernel_ast``'s nodes), the spellings of those templates that the core nodes do not have
(a block opened on a line of statements, an expression broken over two lines...), the
output store every one of them ends with (``expr.OutputStore``, fused epilogue included) as
a tree, and the rebinding of a shared body's buffers (``common.bind_roles``) on trees."""
from __future__ import annotations

import functools
from dataclasses import replace

from .kernel_ast import (LID, NWG, WID, Assign, AssignIndex, Bin, Blank, Buffer, Call, CallIf, ComputeKernel,
                         Construct, Convert, Field, Function, Group, Let, Line, Lit, Load, Name, Private, Shared, Store,
                         Var)
from .common import wgsl_type

U32, F32, VEC4 = "u32", "f32", "vec4<f32>"
LID3 = Name("lid3", "vec3<u32>")
# the entry's builtins: common.ENTRY's; workgroup id and local index; workgroup and local ids
ENTRY_1D = (("workgroup_id", WID), ("local_invocation_index", LID), ("num_workgroups", NWG))
ENTRY_LOCAL_INDEX = (("workgroup_id", WID), ("local_invocation_index", LID))
ENTRY_LOCAL_ID = (("workgroup_id", WID), ("local_invocation_id", LID3))
GROUP_INDEX = Bin("+", Field(WID, "x"), Bin("*", Field(WID, "y"), Field(NWG, "x")))    # common.GROUP_INDEX
GROUP = Group(GROUP_INDEX)


@functools.lru_cache(maxsize=4096)
def U(n: int, text: str = "") -> Lit:
    """A u32 literal (``4u``; ``text`` "4": an abstract one, an index). Spelled here, as
    ``common.literal`` spells it, so that the printers need not (a kernel has thousands)."""
    n = int(n)
    return Lit(n, U32, text or f"{n}u")


def I(n: int) -> Lit:      # noqa: E743
    """An i32 literal (``128i``)."""
    n = int(n)
    return Lit(n, "i32", f"{n}i")


def F(text: str) -> Lit:
    """An abstract float as the template writes it (``0.0``, ``1e-05``), an f32 where it stands."""
    from ..graph import f32
    return Lit(float(text), f32, text)


def b_(op, a, b):
    return Bin(op, a, b)


def g(e):
    """A pair of parentheses the template writes."""
    return Group(e)


def add(*terms):
    """``terms`` summed left to right."""
    e = terms[0]
    for t in terms[1:]:
        e = Bin("+", e, t)
    return e


def terms(e) -> list:
    """The terms of a sum ``add`` built (so that a sum goes on as one chain)."""
    if type(e) is Bin and e.op == "+":
        return terms(e.a) + [e.b]
    return [e]


def v4(*args):
    """``vec4<f32>(...)``."""
    return Construct(VEC4, tuple(args))


def assign(name, e):
    return Assign(name, e)


def assign_index(base, index, e):
    return AssignIndex(base, index, e)


def blank():
    return Blank()


def line(*stmts):
    return Line(tuple(stmts))


def inline(stmt):
    """An ``If`` / ``For`` the template writes on one line."""
    return replace(stmt, inline=True)


def call_if(cond, fn, args):
    return CallIf(cond, fn, tuple(args))


def shared(name, ty, count):
    return Shared(name, ty, count)


def private(name, ty):
    return Private(name, ty)


class Broken:
    """``a op b`` with the WGSL text broken before ``op`` onto a line of its own, ``pad``
    indented (the quantized Q3_K scale); GLSL: the operator as any other."""

    def __init__(self, op, a, b, pad="        "):
        self.bin, self.pad = Bin(op, a, b), pad

    @property
    def ty(self):
        return self.bin.ty

    def wgsl(self, p):
        return f"{p.expr(self.bin.a)}\n{self.pad}{self.bin.op} {p.expr(self.bin.b)}"

    def glsl(self, p):
        return p.expr(self.bin)


def broken(e: Bin, pad="        "):
    return Broken(e.op, e.a, e.b, pad)


class OpenBlock:
    """``{ s1 s2`` on one line, then ``body`` a statement a line, then ``}`` (``head``: the
    statements on the opening line; GLSL: a block as any other)."""

    def __init__(self, head, body):
        self.head, self.body = tuple(head), tuple(body)

    def wgsl(self, p):
        return ["{ " + p.inline(self.head)] + p.block(self.body, 1) + ["}"]

    def glsl(self, p):
        return ["{"] + p.block(self.head + self.body, 1) + ["}"]


def buffers(b) -> tuple:
    """The ``Buffer`` declarations of a ``common.Bindings`` (arrays of buffers included)."""
    return tuple(Buffer(t, id(x) in b.written, len(x) if isinstance(x, tuple) else None)
                 for x, t in zip(b.bufs, b.types))


def module(b, items, workgroup, body, builtins=ENTRY_1D) -> ComputeKernel:
    """The kernel of a template ``{b.decls()}\\n{items}\\n\\n{entry}``."""
    return ComputeKernel(buffers(b), workgroup, tuple(body), module=tuple(items) + (Blank(),), builtins=builtins,
                         enable_f16=b.enable_f16)


# ------------------------------------------------------------------------ the output store
_LEAVES = frozenset({"leaf", "acc", "acc2", "lit", "const"})


def store_supported(kernel) -> bool:
    """Whether ``store_function`` builds ``kernel``'s store: an epilogue of the output's own
    value, its operands, literals and elementwise ops (``expr.ExprWriter``'s trees)."""
    return kernel.epilogue is None or _elementwise(kernel.epilogue)


def _elementwise(e) -> bool:
    # (a module function: a recursive closure would be a cycle left for the collector)
    return e[0] in _LEAVES or (e[0] == "op" and all(map(_elementwise, e[2])))


def coords(var, shape, prefix) -> list:
    """``common.coords`` as statements."""
    if not shape:
        return []
    r = Name(f"{prefix}r", U32)
    out = [Var(r.id, var)]
    out += [Line((Let(f"{prefix}{d}", Bin("%", r, U(shape[d]))), Assign(r.id, Bin("/", r, U(shape[d])))))
            for d in range(len(shape) - 1, 0, -1)]
    return out + [Let(f"{prefix}0", r)]


def offset(off, strides, prefix):
    """``common.offset_expr`` as a tree."""
    ts = [U(off)] if off else []
    ts += [Name(f"{prefix}{d}", U32) if st == 1 else Bin("*", Name(f"{prefix}{d}", U32), U(st))
           for d, st in enumerate(strides) if st != 0]
    return add(*ts) if ts else U(0)


def store_function(kernel, bind, name="store_out") -> list:
    """``expr.OutputStore(kernel, bind, name=name)``'s module items (the helpers its epilogue
    calls that the module lacks, then the function) as trees, its bindings registered on
    ``bind`` as OutputStore registers them (``store_supported`` kernels)."""
    from .common import broadcast_view_strides
    from .expr import ExprWriter
    assert store_supported(kernel), kernel.name
    out = kernel.out
    ob = bind.index(out.buf, out.dtype, write=True)
    leaves = [(bind.index(v.buf, v.dtype), v) for v in kernel.epi_reads]
    bind.scalar.update(bi for bi, _ in leaves)
    f = Name("f", U32)
    body = []
    smap = kernel.spec.get("store_map")
    if smap is not None:
        shape, strides = smap
        rm = [1] * len(shape)
        for d in range(len(shape) - 2, -1, -1):
            rm[d] = rm[d + 1] * shape[d + 1]
        ts = [Bin("*", Group(Bin("%", Group(Bin("/", f, U(s))), U(n))), U(r)) for s, n, r in zip(strides, shape, rm)
              if n != 1]
        body.append(Let("fd", add(*ts) if ts else U(0)))
    fd_from = kernel.spec.get("fd_from", len(leaves)) if smap is not None else len(leaves)
    dest = Name("fd" if smap is not None else "f", U32)
    spaces = {(dest.id, out.shape): "e"}
    body += coords(dest, out.shape, "e")
    for k, (bi, v) in enumerate(leaves):
        key = ("fd" if k >= fd_from else "f", v.shape)
        if key not in spaces:
            spaces[key] = f"s{len(spaces)}_"
            body += coords(Name(key[0], U32), v.shape, spaces[key])
        body.append(Let(f"l{k}", Load(bi, offset(v.offset, broadcast_view_strides(v, v.shape), spaces[key]),
                                      wgsl_type(v.dtype))))
    from ..graph import f32

    def leaf(e):
        if e[0] in ("acc", "acc2"):
            return Name(e[0], F32), f32
        v = leaves[e[1]][1]
        return Name(f"l{e[1]}", wgsl_type(v.dtype)), v.dtype
    w = ExprWriter(leaf, ast=True)
    val, dt = w.emit(kernel.epilogue or ("acc",))
    body += w.stmts
    if dt is not out.dtype:
        val = Convert(wgsl_type(out.dtype), val)
    idx = add(U(out.offset), dest) if out.is_contiguous() else offset(out.offset, out.strides, "e")
    stores = kernel.spec.get("stores", ())
    if stores:
        body.append(Let("stored", val))
        val = Name("stored", val.ty)
    body.append(Store(ob, idx, val))
    for s in stores:
        sb = bind.index(s.buf, s.dtype, write=True)
        body.append(Store(sb, offset(s.offset, s.strides, "e"), val if s.dtype is out.dtype else Convert(wgsl_type(s.dtype), val)))
    params = (f, Name("acc", F32)) + ((Name("acc2", F32),) if "pair" in kernel.spec else ())
    return w.helper_functions(bind) + [Function(name, params, tuple(body))]


class Wrapped:
    """A ``Construct`` whose WGSL arguments run over several lines, ``rows`` of them a line,
    each further line ``pad`` indented (the quantized decoders); GLSL: the constructor as
    any other."""

    def __init__(self, ty, args, rows, pad):
        self.c, self.rows, self.pad = Construct(ty, tuple(args)), tuple(rows), pad

    @property
    def ty(self):
        return self.c.ty

    def wgsl(self, p):
        args, lines, i = [p.expr(a) for a in self.c.args], [], 0
        for n in self.rows:
            lines.append(", ".join(args[i:i + n]))
            i += n
        return f"{self.c.ty}(" + f",\n{self.pad}".join(lines) + ")"

    def glsl(self, p):
        return p.expr(self.c)


class Minus:
    """``-1.0``: a negated literal where WGSL keeps it abstract (both operands of a
    ``select`` literals), which the translator prints as ``(-1.0)``."""

    def __init__(self, lit: Lit):
        self.lit = lit

    @property
    def ty(self):
        return self.lit.ty

    def wgsl(self, p):
        return "-" + p.expr(self.lit)

    def glsl(self, p):
        return f"(-{p.expr(self.lit)})"


class Lines:
    """Statements the WGSL text lays out on lines of its own making: ``rows``, each a tuple
    of statements printed on one line after its ``indent`` (the GEMV norm's sums, a block
    whose braces share lines with statements); GLSL: a block of them all when ``block``,
    else the statements one a line."""

    def __init__(self, rows, indents, block=True):
        self.rows, self.indents, self.block = tuple(tuple(r) for r in rows), tuple(indents), block

    def wgsl(self, p):
        return [ind + p.inline(r) for ind, r in zip(self.indents, self.rows)]

    def glsl(self, p):
        body = [s for r in self.rows for s in r if not isinstance(s, Text)]
        return ["{"] + p.block(body, 1) + ["}"] if self.block else p.block(body, 0)


class Text:
    """A brace of a ``Lines`` row (``{`` or ``}``): WGSL layout only."""

    def __init__(self, text):
        self.text = text

    def wgsl(self, p):
        return self.text


def batch_offsets(a, b, batch, index):
    """The lines splitting the batch index into coordinates (``z{d}``), and the operands'
    element offset trees."""
    from .common import contiguous_batch_strides
    sa = contiguous_batch_strides(a.shape[:-2], batch, a.shape[-2] * a.shape[-1])
    sb = contiguous_batch_strides(b.shape[:-2], batch, b.shape[-2] * b.shape[-1])
    br = Name("br", U32)
    lines, aoff, boff = [Var("br", index)], [U(a.offset)], [U(b.offset)]
    for d in range(len(batch) - 1, -1, -1):
        z = Name(f"z{d}", U32)
        lines.append(Line((Let(z.id, Bin("%", br, U(batch[d]))), Assign("br", Bin("/", br, U(batch[d]))))))
        if sa[d]:
            aoff.append(Bin("*", z, U(sa[d])))
        if sb[d]:
            boff.append(Bin("*", z, U(sb[d])))
    return lines, add(*aoff), add(*boff)


def affine(e, ks, K, weight, bias, ty="f32"):
    """A norm's affine as a tree: ``e * ty(weight[k]) + ty(bias[k])`` (each term where present)
    at the row positions ``ks`` (one, or four for a vec4), indices clamped to the row."""
    def read(binding, view):
        vals = tuple(Convert(F32, Load(binding, add(U(view.offset), Call("min", (k, U(K - 1)), U32)), wgsl_type(view.dtype)))
                     for k in ks)
        return Convert(ty, vals[0]) if ty == F32 else Construct(ty, vals)
    if weight[0] is not None:
        e = Bin("*", e, read(*weight))
    if bias[0] is not None:
        e = Bin("+", e, read(*bias))
    return e


class FlatIf:
    """``if (cond) {`` with its body on the level of the ``if`` itself (the tiled matmul's
    guarded loads); GLSL: an ``if`` as any other."""

    def __init__(self, cond, body):
        from .kernel_ast import If
        self.stmt = If(cond, tuple(body))

    def wgsl(self, p):
        return [f"if ({p.expr(self.stmt.cond)}) {{"] + p.block(self.stmt.then, 0) + ["}"]

    def glsl(self, p):
        return p.lines(self.stmt, 0)


class Product:
    """``{ head`` then ``loop`` with its body one level deeper than its own (the tiled
    matmul's multiply step over a K tile), then ``}``; GLSL: a block as any other."""

    def __init__(self, head, loop):
        self.head, self.loop = tuple(head), loop

    def wgsl(self, p):
        return (["{ " + p.inline(self.head), PAD4 + p.for_head(self.loop) + " {"] + p.block(self.loop.body, 3)
                + [PAD4 + "}", "}"])

    def glsl(self, p):
        from .kernel_ast import Block
        return p.lines(Block(self.head + (self.loop,)), 0)


PAD4 = "    "


_FIELDS: dict = {}
_PLAIN = frozenset({str, int, float, bool, type(None)})


def remap(x, fn):
    """``x`` (a tree, or a tuple / list of them) with ``fn`` applied to every node, children
    first: the nodes of ``kernel_ast`` and this module's layout nodes (a node none of whose
    children changed is kept, then given to ``fn``)."""
    k = type(x)
    if k in _PLAIN:
        return x
    if k is tuple or k is list:
        out = [y if type(y) in _PLAIN else remap(y, fn) for y in x]
        for a, b in zip(out, x):
            if a is not b:
                return k(out)
        return x
    names = _FIELDS.get(k)
    if names is None:
        names = _fields(k, x)
        if names is None:
            return x
    if not names:       # a layout node of this module
        old = x.__dict__
        new = {a: v if type(v) in _PLAIN else remap(v, fn) for a, v in old.items()}
        for a, v in old.items():
            if new[a] is not v:
                import copy
                x = copy.copy(x)
                x.__dict__ = new
                break
        return fn(x)
    old = [getattr(x, a) for a in names]
    kids = [v if type(v) in _PLAIN else remap(v, fn) for v in old]
    for a, b in zip(kids, old):
        if a is not b:      # (the node's fields are its __init__'s, in order)
            x = k(*kids)
            break
    return fn(x)


def _fields(k, x):
    """The init fields of node class ``k`` (``_FIELDS``), () for a layout node of this
    module, None for anything else (kept as it is)."""
    import dataclasses
    if dataclasses.is_dataclass(k):
        fields = dataclasses.fields(k)
        assert all(f.init and not f.kw_only for f in fields), f"{k.__name__}: a field remap cannot pass"
        names = _FIELDS[k] = tuple(f.name for f in fields)
        return names
    if k.__module__ == __name__ and hasattr(x, "__dict__"):
        names = _FIELDS[k] = ()
        return names
    return None


def rebind(b, members, items, index):
    """``items`` (module items built on ``members[0]``, a Bindings of their own; the other
    members the Bindings of alike items of other parts) with their bindings bound on ``b``,
    as ``common.bind_roles`` binds a text: a binding every member gives the same buffer stays
    one binding, the others become an array of the members' buffers, indexed by ``index``."""
    from .kernel_ast import Load as L, Store as S
    first, where = members[0], []
    for r, ty in enumerate(first.types):
        bufs = [m.bufs[r] for m in members]
        written = id(first.bufs[r]) in first.written
        if all(x is bufs[0] for x in bufs):
            where.append((b.slot(bufs[0], ty, written), None))
        else:
            where.append((b.array(bufs, ty, written), index))

    def fn(node):
        if type(node) in (L, S) and node.member is None:
            to, member = where[node.binding]
            return replace(node, binding=to, member=member)
        return node
    return remap(items, fn)
