"""A small typed kernel AST, printed as WGSL (wgpu) or as GLSL 4.50 (glslang, the direct
Vulkan backend): the way off "render WGSL, parse it, print GLSL" (``codegen/glsl.py``).

A renderer that builds its kernel here gets both languages from one tree (``printed``
returns its WGSL and hands the tree to the compile, ``collected_trees``: a plan holds the
tree of each of its texts, ``KernelPlan.trees``, from which the Vulkan finishing stage,
``compilation.vulkan``, prints its GLSL). Every kernel family is built here; nothing
parses WGSL back.

The tree holds what the printers must decide between the languages, no more:

- expressions carry their WGSL type name (``u32``, ``f32``, ``vec4<f32>``...): GLSL
  declarations need it, WGSL's ``let`` does not; a literal carries the type WGSL gives it
  where it stands (an abstract ``0.0`` beside an f16 is an f16), and its WGSL spelling;
- ``Group`` is a pair of parentheses the kernel writes; otherwise WGSL prints binary
  operators by precedence and GLSL parenthesises every one;
- the layout of the WGSL text (statements sharing a line: ``Line``; a block on one line:
  ``inline``; an empty line: ``Blank``), so that the WGSL keeps the bytes the templates wrote.

A node class of another module (a family's own construct) prints itself: the printers call
its ``wgsl(printer)`` / ``glsl(printer)`` methods (an expression returns its text and has a
``ty``; a statement returns its lines, or one text, unindented; a module item its WGSL
text and its GLSL declaration lines).

The GLSL printer wrote exactly what the WGSL-to-GLSL translator it replaced wrote for the same
WGSL; golden digests of that GLSL (``tests/data/glsl_digests.json``) keep it so. The
printers are in ``kernel_ast_print``.
"""
from __future__ import annotations

import contextlib
import functools
from contextvars import ContextVar
from dataclasses import dataclass

GLSL_NAMES = {"round": "roundEven", "inverseSqrt": "inversesqrt", "atan2": "atan", "countOneBits": "bitCount",
              "reverseBits": "bitfieldReverse"}
GLSL_TYPE = {"u32": "uint", "i32": "int", "f32": "float", "f16": "float16_t", "bool": "bool"}
# WGSL binding precedence of the binary operators (higher binds tighter; unary operators: UNARY)
PRECEDENCE = {"||": 1, "&&": 2, "|": 3, "^": 4, "&": 5, "==": 6, "!=": 6, "<": 7, ">": 7, "<=": 7, ">=": 7,
              "<<": 8, ">>": 8, "+": 9, "-": 9, "*": 10, "/": 10, "%": 10}
UNARY = 11
COMPARE = frozenset({"==", "!=", "<", ">", "<=", ">="})
# the header lines of every kernel of the Vulkan backend that uses f16; those that ask the
# driver to keep IEEE signed zeros, infinities and NaN are ``glsl_target.IEEE_PRESERVE``
GLSL_F16 = ["#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
            "#extension GL_EXT_shader_16bit_storage : require"]


# nodes are dataclasses that are never changed once built (the printers keep a node's text on
# it): hashed and compared by their fields, but not frozen, as building a frozen dataclass
# costs three times as much and renderers build a few hundred nodes per kernel
def node(cls):
    cls._wgsl = None            # (the printers' memo of the node's WGSL text and abstract value)
    cls._abstract = ()
    return dataclass(unsafe_hash=True)(cls)


def is_vec(ty: str) -> bool:
    return ty.startswith("vec")


def scalar_of(ty: str) -> str:
    """The element type of a scalar, vector or array type name."""
    if ty.startswith("array<"):
        return scalar_of(ty[6:].rsplit(",", 1)[0] if "," in ty else ty[6:-1])
    return ty[5:-1] if is_vec(ty) else ty


def is_float(ty: str) -> bool:
    return scalar_of(ty) in ("f32", "f16")


# ----------------------------------------------------------------------------- expressions
@node
class Name:
    id: str
    ty: str


@node
class Lit:
    """A literal of ``dtype`` (a graph dtype, or a WGSL type name such as ``bool``);
    ``text``: its WGSL spelling where the kernel writes it otherwise than ``common.literal``
    (an abstract ``0``, ``0.0``, a template's ``1e-3``)."""
    value: object
    dtype: object
    text: str = ""

    @property
    def ty(self):
        return getattr(self.dtype, "name", self.dtype)


@node
class Bin:
    op: str
    a: object
    b: object

    @property
    def ty(self):
        a = self.a.ty
        if self.op in COMPARE:
            v = a if is_vec(a) else self.b.ty
            return f"vec{v[3]}<bool>" if is_vec(v) else "bool"
        if self.op in ("&&", "||"):
            return "bool"
        if self.op in ("<<", ">>"):
            return a
        return a if is_vec(a) else self.b.ty


@node
class Call:
    """A builtin (the same meaning in both languages, ``GLSL_NAMES`` where GLSL spells it
    otherwise) or a function of the module."""
    fn: str
    args: tuple
    ty: str


@node
class Neg:
    e: object

    @property
    def ty(self):
        return self.e.ty


@node
class Not:
    e: object

    @property
    def ty(self):
        return self.e.ty


@node
class Group:
    e: object

    @property
    def ty(self):
        return self.e.ty


@node
class Field:
    """A component (or swizzle) of a vector (``wid.x``)."""
    e: object
    name: str
    ty: str = "u32"


@node
class Index:
    """An element of a workgroup, private or local array (or of a vector)."""
    base: object
    index: object
    ty: str


@node
class Load:
    """``b{binding}[index]``; ``member``: the buffer of an array binding (``binding_array``)."""
    binding: int
    index: object
    ty: str
    member: object = None


@node
class Convert:
    ty: str
    e: object


@node
class Select:
    """WGSL ``select(f, t, cond)``."""
    f: object
    t: object
    cond: object

    @property
    def ty(self):
        return self.t.ty


@node
class Bitcast:
    ty: str
    e: object


@node
class Construct:
    """``vec4<f32>(...)``, ``array<f32, 4>(...)``."""
    ty: str
    args: tuple


# ------------------------------------------------------------------------------ statements
@node
class Let:
    name: str
    e: object
    ty: str | None = None       # written in the WGSL (``let x: f32 = ...``)


@node
class Var:
    """``var name = e;``, ``var name: ty;`` (zero, as WGSL's), ``var name: ty = e;``."""
    name: str
    e: object = None
    ty: str | None = None


@node
class Assign:
    """``name = e;`` (``name``: a variable's name, or an ``Index`` / ``Field`` / ``Load``)."""
    name: object
    e: object


@node
class AssignIndex:
    base: object
    index: object
    e: object


@node
class AssignOp:
    """``name op= e;`` (``op`` without the ``=``)."""
    name: object
    op: str
    e: object


@node
class Store:
    binding: int
    index: object
    value: object
    member: object = None


@node
class ExprStmt:
    e: object


@node
class If:
    """``orelse``: statements, or an ``If`` (``else if``); ``inline``: the WGSL writes the
    whole statement on one line."""
    cond: object
    then: tuple
    orelse: object = ()
    inline: bool = False


@node
class For:
    """``for (init; cond; update) { body }``: ``init`` a ``Var`` / ``Let`` / ``Assign`` or
    None, ``update`` an ``Assign`` / ``AssignOp`` or None."""
    init: object
    cond: object
    update: object
    body: tuple
    inline: bool = False


@node
class Block:
    """``{ body }``; ``flat``: the WGSL indents the body as the braces."""
    body: tuple
    flat: bool = False


@node
class Break:
    pass


@node
class Continue:
    pass


@node
class Return:
    value: object = None


@node
class Barrier:
    kind: str = "workgroup"        # "workgroup" / "storage" / "subgroup"


@node
class ReturnIf:
    cond: object


@node
class CallIf:
    """``if (cond) { fn(args); return; }``: a merged launch handing its workgroup to a part."""
    cond: object
    fn: str
    args: tuple


@node
class Line:
    """Statements the WGSL text writes on one line (GLSL: one a line)."""
    stmts: tuple


@node
class Blank:
    """An empty line of the WGSL text (a statement or a module item; GLSL: nothing)."""


# ---------------------------------------------------------------------------- module level
@node
class Buffer:
    ty: str             # element type (None: a binding never used, declared as words)
    write: bool
    count: int | None = None     # an array of ``count`` buffers (``binding_array``)


@node
class Shared:
    """``var<workgroup> name: array<ty, count>;``"""
    name: str
    ty: str
    count: int


@node
class Private:
    """``var<private> name: ty;`` (a scalar or vector, set before it is read)."""
    name: str
    ty: str


@node
class Function:
    """A function of the module, ``params`` Names; ``ret``: its result type (None: none);
    ``inline``: the WGSL writes it on one line."""
    name: str
    params: tuple
    body: tuple
    ret: str | None = None
    inline: bool = False


WID, LID, NWG = Name("wid", "vec3<u32>"), Name("lid", "u32"), Name("nwg", "vec3<u32>")
ENTRY_BUILTINS = (("workgroup_id", WID), ("local_invocation_index", LID), ("num_workgroups", NWG))


@node
class ComputeKernel:
    """One compute entry point over storage buffers ``b0..`` with the ``builtins`` (pairs of
    the WGSL builtin and its Name; by default ``wid``, ``lid``, ``nwg`` as ``common.ENTRY``)
    and a ``workgroup`` size (an int or a tuple). ``module``: the items before the entry in
    text order (``Function``, ``Shared``, ``Private``, ``Blank``); None: an empty line, the
    ``shared`` arrays and ``functions``, and an empty line (the pointwise layout).
    ``enable_f16``: ``enable f16;`` without an f16 binding."""
    buffers: tuple
    workgroup: object
    body: tuple
    functions: tuple = ()
    shared: tuple = ()
    module: tuple | None = None
    builtins: tuple = ENTRY_BUILTINS
    enable_f16: bool = False

    def items(self) -> tuple:
        if self.module is not None:
            return tuple(self.module)
        if self.shared or self.functions:
            return (Blank(), *self.shared, *self.functions, Blank())
        return (Blank(),)

    def uses_f16(self) -> bool:
        return self.enable_f16 or any("f16" in (b.ty or "") for b in self.buffers)     # (as ``Bindings.decls``)


def buffers(b) -> tuple:
    """The storage buffers a ``common.Bindings`` bound, as ``Buffer`` declarations (an array
    binding: ``count`` buffers; a position never claimed: words, unused)."""
    return tuple(Buffer(t, id(x) in b.written, len(x) if isinstance(x, tuple) else None)
                 for x, t in zip(b.bufs, b.types))


def add(*terms):
    """``terms`` summed left to right (one term: itself)."""
    e = terms[0]
    for t in terms[1:]:
        e = Bin("+", e, t)
    return e


@functools.lru_cache(maxsize=8192)
def u32(n: int, text: str = "") -> Lit:
    """A u32 literal (one node per value: nodes are never changed, and kernels use the same
    few constants many times)."""
    return Lit(int(n), "u32", text)


@functools.lru_cache(maxsize=8192)
def name(id: str, ty: str = "u32") -> Name:
    """``Name(id, ty)``, one node per pair (as ``u32``)."""
    return Name(id, ty)


def f32(v: float, text: str = "") -> Lit:
    from ..graph import f32 as F32
    return Lit(float(v), F32, text)


# the linear workgroup index under ``common.grid`` (``common.GROUP_INDEX``)
GROUP = add(Field(WID, "x"), Bin("*", Field(WID, "y"), Field(NWG, "x")))


# -------------------------------------------------------------------- printed kernels, by text
# ``printed`` hands each tree it prints to the compile collecting them (``collected_trees``):
# a plan holds the trees of its texts (``KernelPlan.trees``), from which the Vulkan compile
# stage prints their GLSL. Nothing keeps trees for the process: they live as long as the plan
# that needs them (a registry of every tree printed kept half a million nodes that each
# collection of the garbage collector scanned: a fifth of the device-free compile time).
_collecting: ContextVar = ContextVar("kernel_trees", default=())


def printed(tree) -> str:
    """``tree``'s WGSL; the tree goes to each ``collected_trees`` open in this context."""
    text = print_wgsl(tree)
    for trees in _collecting.get():
        trees[text] = tree
    return text


def printed_made(kernel, made, why: str) -> tuple:
    """(WGSL, bound buffers, workgroups) of a builder's ``made`` (tree, buffers, workgroups);
    None (``why``: what its builder does not build) raises: the tree is a kernel's only WGSL."""
    if made is None:
        raise NotImplementedError(f"kernel {kernel.name!r} ({kernel.archetype}): no kernel AST builds {why}")
    tree, bufs, groups = made
    return printed(tree), bufs, groups


@contextlib.contextmanager
def collected_trees(into=None):
    """Inside: each kernel printed (``printed``) lands in the yielded {WGSL text: tree}
    (``into`` where given), and in those of the blocks around this one."""
    trees = {} if into is None else into
    token = _collecting.set((*_collecting.get(), trees))
    try:
        yield trees
    finally:
        _collecting.reset(token)


def print_wgsl(k: ComputeKernel) -> str:
    return WgslPrinter().kernel(k)


def print_glsl(k: ComputeKernel, unroll: bool | None = None, preserve_ieee: bool = True) -> str:
    """``k``'s GLSL. ``unroll``: mark loops of at most 32 constant trips ``[[unroll]]`` (None:
    the MEGANEURA_GLSL_UNROLL switch, else no); ``preserve_ieee``: ask the driver to keep Inf,
    NaN and signed zeros (``glsl_target.IEEE_PRESERVE``)."""
    if unroll is None:
        from .glsl_target import unroll_switch
        unroll = bool(unroll_switch())
    return GlslPrinter(unroll, preserve_ieee).kernel(k)


from .kernel_ast_print import GlslPrinter, WgslPrinter  # noqa: E402  (the printers use the nodes above)
