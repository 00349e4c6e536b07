"""Building the attention and gather kernels on the typed kernel AST (``kernel_ast``):
``E``, a handle on an expression node whose Python operators make ``Bin`` nodes, so that a
builder reads like the WGSL it prints; ``Body``, statements added in the order of the
template's lines; and the layout nodes these templates need (the WGSL text only: GLSL
prints the statement inside as it always does).

Parentheses are never implied: where the WGSL writes a pair the builder writes ``grp`` (a
``Group``); every operator makes one ``Bin`` in Python's order of evaluation, which for the
arithmetic, shift and bitwise operators is WGSL's; comparisons are methods (``a.lt(b)``) and
``&&`` / ``||`` functions (``land``, ``lor``), as Python's own would bind otherwise.
Integers beside an expression take its type (``lid + 4`` is ``lid + 4u``); an array or
vector indexed by a Python int reads WGSL's abstract literal (``s[0]``; GLSL ``s[0u]``).
"""
from __future__ import annotations

import contextlib
import functools
import re
from dataclasses import dataclass

from . import kernel_ast as K
from .common import literal

_ELEM = re.compile(r"^(?:array<(.+), \d+>|vec\d<(\w+)>)$")


def elem_type(ty: str) -> str:
    """The element type of an array or vector type (``array<vec4<f32>, 8>``: vec4<f32>)."""
    m = _ELEM.match(ty)
    if m is None:
        raise TypeError(f"not an array or vector type: {ty}")
    return m.group(1) or m.group(2)


def node(x):
    """The node of ``x`` (an ``E`` or a node)."""
    return x.n if isinstance(x, E) else x


@functools.lru_cache(maxsize=8192, typed=True)
def _lit_node(value, ty, text):
    """The ``Lit`` of ``value`` in WGSL type ``ty``, its spelling (``common.literal``'s unless
    ``text``) kept in it: a kernel writes the same few literals thousands of times, and the
    printers then read the spelling instead of making it again."""
    from ..graph import DTYPES
    dt = DTYPES[ty]
    return K.Lit(value, dt, text or literal(value, dt))


def lit(value, ty="u32", text=""):
    """A literal of WGSL type ``ty``, spelled as ``common.literal`` writes it (or ``text``)."""
    return E(_lit_node(value, ty, text))


def _coerce(x, like):
    if isinstance(x, E):
        return x.n
    if isinstance(x, bool):
        raise TypeError("a Python bool in a kernel expression")
    if isinstance(x, int):
        ty = K.scalar_of(like.ty)
        return _lit_node(int(x), ty if ty in ("u32", "i32") else "u32", "")
    if isinstance(x, float):
        return _lit_node(float(x), "f32", "")
    return x


class E:
    """An expression node with operators (see the module docstring)."""
    __slots__ = ("n",)

    def __init__(self, n):
        self.n = n

    @property
    def ty(self):
        return self.n.ty

    def _bin(self, op, other, swap=False):
        o = _coerce(other, self.n)
        return E(K.Bin(op, o, self.n) if swap else K.Bin(op, self.n, o))

    def __add__(self, o):
        return self._bin("+", o)

    def __radd__(self, o):
        return self._bin("+", o, True)

    def __sub__(self, o):
        return self._bin("-", o)

    def __rsub__(self, o):
        return self._bin("-", o, True)

    def __mul__(self, o):
        return self._bin("*", o)

    def __rmul__(self, o):
        return self._bin("*", o, True)

    def __truediv__(self, o):
        return self._bin("/", o)

    def __mod__(self, o):
        return self._bin("%", o)

    def __and__(self, o):
        return self._bin("&", o)

    def __xor__(self, o):
        return self._bin("^", o)

    def __rshift__(self, o):
        return self._bin(">>", o)

    def __neg__(self):
        return E(K.Neg(self.n))

    def __invert__(self):
        return E(K.Not(self.n))

    def lt(self, o):
        return self._bin("<", o)

    def le(self, o):
        return self._bin("<=", o)

    def gt(self, o):
        return self._bin(">", o)

    def ge(self, o):
        return self._bin(">=", o)

    def eq(self, o):
        return self._bin("==", o)

    def ne(self, o):
        return self._bin("!=", o)

    def __getitem__(self, i):
        idx = _lit_node(int(i), "u32", str(int(i))) if isinstance(i, int) else node(i)
        return E(K.Index(self.n, idx, elem_type(self.n.ty)))

    def __getattr__(self, attr):
        if attr in ("x", "y", "z", "w"):
            return E(K.Field(self.n, attr, elem_type(self.n.ty)))
        raise AttributeError(attr)


@functools.lru_cache(maxsize=4096)
def _name_node(id_, ty):
    return K.Name(id_, ty)


def name(id_, ty):
    """A variable (one node per name and type: a kernel names the same few thousands of times)."""
    return E(_name_node(id_, ty))


def grp(x):
    return E(K.Group(node(x)))


def call(fn, *args, ty=None):
    """A call of a builtin or a function of the module; ``ty`` defaults to the first
    argument's (``dot``: its element type)."""
    ns = tuple(node(a) for a in args)
    if ty is None:
        ty = K.scalar_of(ns[0].ty) if fn == "dot" else ns[0].ty
    return E(K.Call(fn, ns, ty))


def sel(f, t, cond):
    """WGSL ``select(f, t, cond)``."""
    tn = node(t)
    return E(K.Select(_coerce(f, tn), tn, node(cond)))


def land(*xs):
    e = node(xs[0])
    for x in xs[1:]:
        e = K.Bin("&&", e, node(x))
    return E(e)


def lor(*xs):
    e = node(xs[0])
    for x in xs[1:]:
        e = K.Bin("||", e, node(x))
    return E(e)


def conv(ty, x):
    return E(K.Convert(ty, node(x)))


def bitcast(ty, x):
    return E(K.Bitcast(ty, node(x)))


def construct(ty, *args):
    return E(K.Construct(ty, tuple(node(a) for a in args)))


def load(binding, index, ty):
    return E(K.Load(binding, node(index), ty))


def f32(v):
    """An f32 literal as ``common.literal`` writes it (infinities as bit patterns)."""
    return lit(float(v), "f32")


NEG_INF = f32(float("-inf"))
POS_INF = f32(float("inf"))


def sum_terms(terms):
    """``terms`` summed left to right (one term: itself)."""
    return E(K.add(*(node(t) for t in terms)))


def group_index():
    """``wid.x + wid.y * nwg.x`` (``common.GROUP_INDEX``)."""
    wid, nwg = E(K.WID), E(K.NWG)
    return wid.x + wid.y * nwg.x


LID = E(K.LID)


class SharedArray(E):
    """A workgroup array: indexable as a name; ``decl`` its module declaration."""
    __slots__ = ("decl",)

    def __init__(self, nm, elem, count):
        super().__init__(K.Name(nm, f"array<{elem}, {count}>"))
        self.decl = K.Shared(nm, elem, count)


def buffers(b) -> tuple:
    """The ``kernel_ast.Buffer`` of each binding of ``b`` (a ``common.Bindings``)."""
    return tuple(K.Buffer(t, id(x) in b.written) for x, t in zip(b.bufs, b.types))


# --------------------------------------------------------------------------- layout nodes
@dataclass(frozen=True)
class Comment:
    """A comment line of the WGSL text (GLSL: nothing)."""
    text: str

    def wgsl(self, printer):
        return self.text

    def glsl(self, printer):
        return []


@dataclass(frozen=True)
class Commented:
    """A statement with a comment after it on its WGSL line (``suffix``: the spaces and the
    comment)."""
    stmt: object
    suffix: str

    def wgsl(self, printer):
        return printer.stmt(self.stmt) + self.suffix

    def glsl(self, printer):
        return printer.lines(self.stmt, 0)


@dataclass(frozen=True)
class Indented:
    """A statement whose WGSL lines are indented ``more`` further than its depth's."""
    stmt: object
    more: str

    def wgsl(self, printer):
        return [self.more + ln for ln in printer.lines(self.stmt, 0)]

    def glsl(self, printer):
        return printer.lines(self.stmt, 0)


@dataclass(frozen=True)
class Laid:
    """A block statement (``Block``, ``If`` without else, ``For``) in the layout of a
    template's lines: its first ``head`` statements on the opening line (a block statement
    among them continues from there, its later lines at the statement's own indentation),
    the others indented ``indent`` further, and with ``tail`` the closing brace on the last
    line."""
    stmt: object
    head: int = 0
    indent: str = "    "
    tail: bool = False

    def wgsl(self, printer):
        s = self.stmt
        if isinstance(s, K.If):
            assert not s.orelse, "a laid-out if has no else"
            opening, body = f"if ({printer.expr(s.cond)}) {{", s.then
        elif isinstance(s, K.For):
            opening, body = printer.for_head(s) + " {", s.body
        else:
            opening, body = "{", s.body
        out = [opening]
        for j, x in enumerate(body):
            lines = printer.lines(x, 0)
            if j < self.head:
                out[-1] += " " + lines[0]
                out += lines[1:]
            else:
                out += [self.indent + ln if ln else "" for ln in lines]
        if self.tail:
            out[-1] += " }"
        else:
            out.append("}")
        return out

    def glsl(self, printer):
        return printer.lines(self.stmt, 0)


def laid(stmt, layout: dict):
    """``stmt`` in ``layout`` (``inline``, ``head``, ``indent``, ``tail``; none: as the
    printer lays it out)."""
    layout = dict(layout)
    if layout.pop("inline", False):
        return _inline(stmt)
    if layout:
        return Laid(stmt, **layout)
    return stmt


def _inline(stmt):
    if isinstance(stmt, K.If):
        return K.If(stmt.cond, stmt.then, stmt.orelse, inline=True)
    if isinstance(stmt, K.For):
        return K.For(stmt.init, stmt.cond, stmt.update, stmt.body, inline=True)
    return InlineBlock(stmt.body)


@dataclass(frozen=True)
class InlineBlock:
    """``{ a; b; }`` on one WGSL line (GLSL: a block)."""
    body: tuple

    def wgsl(self, printer):
        return printer.stmt(K.Block(self.body))

    def glsl(self, printer):
        return printer.lines(K.Block(self.body), 0)


# ------------------------------------------------------------------------------ statements
class Body:
    """Statements added in the order of the template's lines: ``let`` / ``var`` return the
    name as an ``E``; ``with body.block() / for_(...) / if_(...)`` nest, in a layout
    (``laid``); ``with body.extra(more)`` indents what is added inside further."""

    def __init__(self):
        self.stack = [[]]

    @property
    def stmts(self) -> tuple:
        assert len(self.stack) == 1
        return tuple(self.stack[0])

    def add(self, *stmts):
        self.stack[-1].extend(stmts)

    def _with_comment(self, s, comment):
        self.add(Commented(s, comment) if comment else s)

    def let(self, nm, e, comment=None):
        self._with_comment(K.Let(nm, node(e)), comment)
        return name(nm, node(e).ty)

    def var(self, nm, e=None, ty=None, comment=None):
        self._with_comment(K.Var(nm, None if e is None else node(e), ty), comment)
        return name(nm, ty or node(e).ty)

    def assign(self, target, e):
        t = node(target)
        if isinstance(t, K.Index):
            self.add(K.AssignIndex(t.base, t.index, node(e)))
        else:
            self.add(K.Assign(t.id if isinstance(t, K.Name) else t, node(e)))

    def store(self, binding, index, value):
        self.add(K.Store(binding, node(index), node(value)))

    def call(self, fn, *args):
        self.add(K.ExprStmt(K.Call(fn, tuple(node(a) for a in args), "void")))

    def barrier(self):
        self.add(K.Barrier("workgroup"))

    def ret(self):
        self.add(K.Return())

    def cont(self):
        self.add(K.Continue())

    def comment(self, text):
        self.add(Comment(text))

    def line(self, fn):
        """The statements ``fn(self)`` adds, on one WGSL line."""
        self.stack.append([])
        fn(self)
        self.add(K.Line(tuple(self.stack.pop())))

    @contextlib.contextmanager
    def _nest(self, make, value=None):
        self.stack.append([])
        yield value
        self.add(make(tuple(self.stack.pop())))

    def if_(self, cond, **layout):
        return self._nest(lambda body: laid(K.If(node(cond), body), layout))

    def block(self, **layout):
        return self._nest(lambda body: laid(K.Block(body), layout))

    def for_(self, var, init, cond, step, **layout):
        """``for (var {var} = init; cond(v); v = step(v)) { .. }``, yielding ``v``."""
        v = name(var, node(init).ty)
        c, s = node(cond(v)), node(step(v))
        return self._nest(lambda body: laid(K.For(K.Var(var, node(init)), c, K.Assign(var, s), body), layout), v)

    @contextlib.contextmanager
    def extra(self, more):
        self.stack.append([])
        yield
        self.add(*(Indented(s, more) for s in self.stack.pop()))


def substitute(tree, fn):
    """``tree`` (nodes, tuples of them) with each node for which ``fn`` gives a value
    replaced by that value (children first; ``kernel_ast_matmul.remap``'s walk, which keeps
    a node with nothing replaced under it, and its printed text with it)."""
    from .kernel_ast_matmul import remap

    def one(node):
        got = fn(node)
        return node if got is None else got
    return remap(tree, one)
