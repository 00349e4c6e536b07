"""Scalar expressions of the kernel IR rendered as WGSL, and the output store that every
archetype ends with (where a fused epilogue runs).

An expression is a tuple tree: ("leaf", i) a value read by the kernel, ("acc",) the
archetype's own value (in an epilogue), ("lit", value, dtype), ("const", scalar tensor),
("op", node, [children]) an elementwise graph node applied to its children. Types follow
the nodes' dtypes; mixed f16/f32 operands are converted where a node's inputs differ.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..graph import f32 as _F32
from .common import broadcast_view_strides, wgsl_type
from .expr_ast import HELPER_FUNCTIONS, ieee_guard_node, op_node
from .expr_ast import coords as coords_stmts
from .expr_ast import offset_expr as offset_node
from .kernel_ast import Bin, Convert, Function, Group, Let, Lit, Load, Name, Neg, Select, Store, WgslPrinter, add, u32

# WGSL helpers, included when an expression uses them: printed from their trees
# (``expr_ast.HELPER_FUNCTIONS``, which says what each computes and why)
HELPERS = {name: WgslPrinter().function(fn) for name, fn in HELPER_FUNCTIONS.items()}
HELPER_DEPS = {"gelu_erf": ["erf_f", "isnan_f"], "gelu_erf_grad": ["erf_f", "isnan_f"],
               "gelu_tanh": ["tanh_f", "isnan_f"], "gelu_tanh_grad": ["tanh_f", "isnan_f"],
               "erf_f": ["isnan_f"], "tanh_f": ["isnan_f"], "fmax_f32": ["isnan_f"], "fmin_f32": ["isnan_f"]}


@dataclass(frozen=True)
class Node:
    """An elementwise op made by a lowering rather than found in the graph (the sum of
    split-K partials): what expressions need of a graph node."""
    op: str
    dtype: object
    attrs: dict = field(default_factory=dict)
    shape: tuple = ()


def op_text(t, args, arg_dtypes, used):
    """WGSL for elementwise node ``t`` applied to argument expressions ``args`` (texts)."""
    names = [Name(a, d.wgsl) for a, d in zip(args, arg_dtypes)]
    return _WGSL.expr(op_node(t, names, arg_dtypes, used, HELPER_DEPS))


def ieee_guard(t, kids, args, used):
    """f32 text for an add, sub, mul or div whose IEEE result a driver folds away, else None.
    Drivers fold ``x * 0.0`` to 0, ``x / 0.0`` to anything (llvmpipe: 0), ``x - x`` to 0
    and ``x + 0.0`` to x (wrong for -0.0), whatever the value of x, and ``x * NaN`` or
    ``x * inf`` to what a constant x would give (0 * NaN folds to 0 once x is known 0); float
    controls stop the last two only where a device offers them, and never on the WGSL path,
    so these are computed on the bits (helpers ``mul_zero_f``, ``div_zero_f``, ``sub_self_f``,
    ``add_zero_f``): ``expr_ast.ieee_guard_node``."""
    node = ieee_guard_node(t, kids, [Name(a, "f32") for a in args], used)
    return None if node is None else _WGSL.expr(node)


def _as_f32(t):
    """``t`` as an f32 node (same op and attributes) for rendering its f32 arithmetic."""
    return Node(t.op, _F32, dict(t.attrs), tuple(t.shape))


_WGSL = WgslPrinter()


class ExprWriter:
    """Emits an expression tree as ``let`` statements of the kernel AST (``stmts``; as WGSL
    lines: ``lines``). ``leaf(e)`` gives (value, dtype) for ("leaf", i), ("rleaf", i) (a leaf
    read through its consumer's index function) and ("acc",) nodes: the value a node of the
    kernel AST (``ast=True``; ``emit`` then returns nodes) or its WGSL text (``emit`` returns
    texts). ``last_coord``: the output's last coordinate (for rotate_half), a name or a node."""

    def __init__(self, leaf, prefix="t", last_coord=None, ast=False):
        self.leaf, self.prefix, self.last_coord, self.ast = leaf, prefix, last_coord, ast
        self.stmts, self.used, self.n = [], set(), 0
        # (node, its arguments' values) -> value: a subexpression that appears twice (a
        # producer's value both stored and used by its reader) is computed once
        self.done = {}

    @property
    def lines(self) -> list[str]:
        return ["    " + _WGSL.stmt(s) for s in self.stmts]

    def emit(self, e):
        node, dt = self.node(e)
        return (node if self.ast else _WGSL.expr(node)), dt

    def _leaf(self, e):
        v, dt = self.leaf(e)
        return (v if self.ast else Name(v, wgsl_type(dt))), dt

    def node(self, e):
        """(the node of ``e``'s value, its dtype), its ``let`` statements appended."""
        if e[0] in ("leaf", "acc", "rleaf", "acc2", "red"):
            return self._leaf(e)
        if e[0] == "lit":
            return Lit(e[1], e[2]), e[2]
        if e[0] == "const":
            c = e[1]
            return Lit(c.attrs["value"].reshape(-1)[0], c.dtype), c.dtype
        _, t, kids = e
        args = [self.node(k) for k in kids]
        key = (id(t), tuple(_WGSL.expr(a) for a, _ in args))
        if key in self.done:
            return self.done[key]
        if t.op == "rotate_half":
            # the operand was read at (j + h) mod 2h; the first half is negated
            a = args[0][0]
            last = self.last_coord if not isinstance(self.last_coord, str) else Name(self.last_coord, "u32")
            node = Select(a, Neg(a), Bin("<", last, u32(t.shape[-1] // 2)))
        elif (guarded := ieee_guard_node(t, kids, [a for a, _ in args], self.used)) is not None and \
                all(d.name == "f32" for _, d in args):
            node = guarded
        elif t.dtype.name == "f16" and t.op not in ("cast", "where"):
            # half-precision maths runs in f32 and rounds once per op (as NumPy and
            # PyTorch's CPU kernels do); the helpers are f32 functions
            f32 = _F32
            node = op_node(_as_f32(t), [a if d.name != "f16" else Convert("f32", a) for a, d in args],
                           [f32 if d.name == "f16" else d for _, d in args], self.used, HELPER_DEPS)
            node = Convert("f16", node)
        else:
            node = op_node(t, [a for a, _ in args], [d for _, d in args], self.used, HELPER_DEPS)
        self.n += 1
        name = f"{self.prefix}{self.n}"
        self.stmts.append(Let(name, node))
        self.done[key] = Name(name, node.ty), t.dtype
        return self.done[key]

    def helpers(self, bind=None) -> list[str]:
        """The helper functions the emitted lines call; with ``bind``, only those not yet
        in that module (which then records them)."""
        return [_WGSL.function(f) for f in self.helper_functions(bind)]

    def helper_functions(self, bind=None) -> list:
        """``helpers`` as functions of the kernel AST."""
        names = [h for h in HELPERS if h in self.used and (bind is None or h not in bind.helpers_done)]
        if bind is not None:
            bind.helpers_done.update(names)
        return [HELPER_FUNCTIONS[h] for h in names]


def expr_ops(e) -> list[str]:
    """Op names in an expression, innermost first (for kernel names)."""
    if e is None or e[0] != "op":
        return []
    return [n for k in e[2] for n in expr_ops(k)] + [e[1].op]


def read_leaves(leaves, shape, bind, prefix="c", ast=False):
    """``let v{k} = ...`` reading each view (broadcast) at the coordinates ``prefix0..`` of
    ``shape``, and the (value, dtype) pairs an ExprWriter's leaves map to: WGSL lines and
    names, or (``ast``) statements and nodes of the kernel AST."""
    stmts, vals = [], []
    for k, v in enumerate(leaves):
        bi = bind.index(v.buf, v.dtype)
        stmts.append(Let(f"v{k}", Load(bi, offset_node(v.offset, broadcast_view_strides(v, shape), prefix), wgsl_type(v.dtype))))
        vals.append((Name(f"v{k}", wgsl_type(v.dtype)) if ast else f"v{k}", v.dtype))
    return (stmts if ast else ["    " + _WGSL.stmt(x) for x in stmts]), vals


def store_stmts(bind, ob, idx, val, dtype, stores=(), prefix="c", store_strides=None) -> list:
    """Statements storing ``val`` (a node of ``dtype``) at ``idx`` (a node) of binding ``ob``
    and, converted, at each view of ``stores`` (second stores of the same value: a concat's
    slice, an f16 copy), indexed by the coordinates ``prefix0..`` of the output (through
    ``store_strides``, one per store, where the caller indexes coalesced coordinates)."""
    out = []
    if stores:
        out.append(Let("stored", val))
        val = Name("stored", val.ty)
    out.append(Store(ob, idx, val))
    for j, s in enumerate(stores):
        sb = bind.index(s.buf, s.dtype, write=True)
        sv = val if s.dtype is dtype else Convert(wgsl_type(s.dtype), val)
        strides = s.strides if store_strides is None else store_strides[j]
        out.append(Store(sb, offset_node(s.offset, strides, prefix), sv))
    return out


def store_lines(bind, ob, idx, val, dtype, stores=(), prefix="c", store_strides=None) -> list[str]:
    """``store_stmts`` as WGSL lines, ``idx`` and ``val`` texts."""
    stmts = store_stmts(bind, ob, Name(idx, "u32"), Name(val, wgsl_type(dtype)), dtype, stores, prefix, store_strides)
    return ["    " + _WGSL.stmt(s) for s in stmts]


class OutputStore:
    """``fn store_out(f: u32, acc: f32)``: stores an archetype's value for the output
    element of flat (row-major, logical) index ``f``, through the kernel's epilogue if it
    has one. Registers the output and epilogue bindings on ``bind``. ``function``: the
    function on the kernel AST (``module_items``: with the helpers it calls), ``fn`` its WGSL."""

    def __init__(self, kernel, bind, acc_dtype=None, name="store_out"):
        from ..graph import f32
        out = kernel.out
        self.acc_dtype = acc_dtype or f32
        self.bind = bind
        self.ob = bind.index(out.buf, out.dtype, write=True)
        leaves = [(bind.index(v.buf, v.dtype), v) for v in kernel.epi_reads]
        # read element by element here: a sibling part of the launch must not redeclare them vec4
        bind.scalar.update(bi for bi, _ in leaves)
        stmts = []
        smap = kernel.spec.get("store_map")
        F, FD = Name("f", "u32"), Name("fd", "u32")
        if smap is not None:
            # a transposed store: element f of the archetype's output goes where the copy
            # that was fused away put it (row-major position of its coordinates in ``shape``)
            shape, strides = smap
            rm = [1] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                rm[d] = rm[d + 1] * shape[d + 1]
            terms = [Bin("*", Group(Bin("%", Group(Bin("/", F, u32(s))), u32(n))), u32(r))
                     for s, n, r in zip(strides, shape, rm) if n != 1]
            stmts.append(Let("fd", add(*terms) if terms else u32(0)))
        # operands are views of the iteration shape they were fused at, indexed by f (or,
        # for those fused after a transposed store, by fd): split the index into
        # coordinates of each distinct (index, shape)
        fd_from = kernel.spec.get("fd_from", len(leaves)) if smap is not None else len(leaves)
        dest = FD if smap is not None else F
        spaces = {(dest.id, out.shape): "e"}
        stmts += coords_stmts(dest, out.shape, "e")
        for k, (bi, v) in enumerate(leaves):
            key = ("fd" if k >= fd_from else "f", v.shape)
            if key not in spaces:
                spaces[key] = f"s{len(spaces)}_"
                stmts += coords_stmts(Name(key[0], "u32"), v.shape, spaces[key])
            at = offset_node(v.offset, broadcast_view_strides(v, v.shape), spaces[key])
            stmts.append(Let(f"l{k}", Load(bi, at, wgsl_type(v.dtype))))
        acc_ty = wgsl_type(self.acc_dtype)

        def leaf(e):
            if e[0] == "acc":
                return Name("acc", acc_ty), self.acc_dtype
            if e[0] == "acc2":          # a paired product's value (kernel.spec["pair"])
                return Name("acc2", acc_ty), self.acc_dtype
            return Name(f"l{e[1]}", wgsl_type(leaves[e[1]][1].dtype)), leaves[e[1]][1].dtype
        w = ExprWriter(leaf, ast=True)
        val, dt = w.emit(kernel.epilogue or ("acc",))
        if dt is not out.dtype:
            val = Convert(wgsl_type(out.dtype), val)
        idx = add(u32(out.offset), dest) if out.is_contiguous() else offset_node(out.offset, out.strides, "e")
        self.used = w.used
        body = stmts + w.stmts + store_stmts(bind, self.ob, idx, val, out.dtype, kernel.spec.get("stores", ()), "e")
        params = (F, Name("acc", acc_ty)) + ((Name("acc2", acc_ty),) if "pair" in kernel.spec else ())
        self.function = Function(name, params, tuple(body))
        self.fn = _WGSL.function(self.function)

    def require(self, *names):
        """Helpers the archetype's own body calls (emitted once, with the epilogue's)."""
        for n in names:
            self.used.update([n] + HELPER_DEPS.get(n, []))
        return self

    def module_items(self) -> list:
        """The helpers and ``store_out`` as functions of the kernel AST, for module scope
        (after the bindings); several stores can share a module (merged matmuls): each
        helper once per module."""
        new = [h for h in HELPERS if h in self.used and h not in self.bind.helpers_done]
        self.bind.helpers_done.update(new)
        return [HELPER_FUNCTIONS[h] for h in new] + [self.function]

    def module_text(self) -> str:
        """``module_items`` as WGSL."""
        return "\n".join(_WGSL.item(it) for it in self.module_items())
