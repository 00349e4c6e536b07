"""Scalar expressions of the kernel IR rendered as WGSL, and the output store that every
archetype ends with (where a fused epilogue runs).

An expression is a tuple tree: ("leaf", i) a value read by the kernel, ("acc",) the
archetype's own value (in an epilogue), ("lit", value, dtype), ("const", scalar tensor),
("op", node, [children]) an elementwise graph node applied to its children. Types follow
the nodes' dtypes; mixed f16/f32 operands are converted where a node's inputs differ.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..ops.registry import OPS
from ..graph import f32 as _F32
from .common import broadcast_view_strides, coords, literal, offset_expr

# WGSL helpers, included when an expression uses them. erf: Abramowitz-Stegun 7.1.26
# (|error| < 1.5e-7, below f32 resolution of the results). NaN is tested on the bits:
# SPIR-V's FMax/FMin/FClamp leave NaN operands undefined (llvmpipe drops them) and a
# driver may fold ``x != x`` to false, so max/min/relu/tanh select the NaN explicitly.
HELPERS = {
    "isnan_f": """fn isnan_f(x: f32) -> bool { return (bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u; }""",
    "fmax_f32": """fn fmax_f32(a: f32, b: f32) -> f32 { return select(select(max(a, b), b, isnan_f(b)), a, isnan_f(a)); }""",
    "fmin_f32": """fn fmin_f32(a: f32, b: f32) -> f32 { return select(select(min(a, b), b, isnan_f(b)), a, isnan_f(a)); }""",
    "erf_f": """fn erf_f(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-x * x);
    return select(select(-y, y, x >= 0.0), x, isnan_f(x));
}""",
    # exp is clamped so it cannot overflow; tiny |x| returns x (exact to f32, keeps -0.0)
    "tanh_f": """fn tanh_f(x: f32) -> f32 {
    let e = exp(2.0 * clamp(x, -15.0, 15.0));
    return select((e - 1.0) / (e + 1.0), x, abs(x) < 1e-4 || isnan_f(x));
}""",
    "gelu_erf": """fn gelu_erf(x: f32) -> f32 { return 0.5 * x * (1.0 + erf_f(x * 0.70710678118654752)); }""",
    "gelu_erf_grad": """fn gelu_erf_grad(x: f32) -> f32 {
    return 0.5 * (1.0 + erf_f(x * 0.70710678118654752)) + x * exp(-0.5 * x * x) * 0.39894228040143268;
}""",
    "gelu_tanh": """fn gelu_tanh(x: f32) -> f32 {
    return 0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)));
}""",
    "gelu_tanh_grad": """fn gelu_tanh_grad(x: f32) -> f32 {
    let c = 0.79788456080286536;
    let t = tanh_f(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}""",
    # products, quotients and differences whose value a driver would fold (see ieee_guard),
    # computed on the bits: exact as IEEE 754 defines them, with no float operation to fold
    "mul_zero_f": """fn mul_zero_f(x: f32, sign: u32) -> f32 {
    let b = bitcast<u32>(x);
    return select(bitcast<f32>((b & 0x80000000u) ^ sign), bitcast<f32>(0x7fc00000u), (b & 0x7fffffffu) >= 0x7f800000u);
}""",
    "div_zero_f": """fn div_zero_f(x: f32, sign: u32) -> f32 {
    let b = bitcast<u32>(x);
    let m = b & 0x7fffffffu;
    return select(bitcast<f32>(((b & 0x80000000u) ^ sign) | 0x7f800000u), bitcast<f32>(0x7fc00000u), m == 0u || m > 0x7f800000u);
}""",
    "sub_self_f": """fn sub_self_f(x: f32) -> f32 {
    return select(0.0, bitcast<f32>(0x7fc00000u), (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u);
}""",
    "add_zero_f": """fn add_zero_f(x: f32) -> f32 { return select(x, 0.0, x == 0.0); }""",
}
HELPER_DEPS = {"gelu_erf": ["erf_f", "isnan_f"], "gelu_erf_grad": ["erf_f", "isnan_f"],
               "gelu_tanh": ["tanh_f", "isnan_f"], "gelu_tanh_grad": ["tanh_f", "isnan_f"],
               "erf_f": ["isnan_f"], "tanh_f": ["isnan_f"], "fmax_f32": ["isnan_f"], "fmin_f32": ["isnan_f"]}


def nan_max(a, b, dtype, used, op="max"):
    """WGSL ``max``/``min`` of ``a`` and ``b`` that returns NaN if either is NaN (as torch);
    float maths is f32 here (f16 nodes are computed in f32)."""
    if not dtype.is_float:
        return f"{op}({a}, {b})"
    name = f"f{op}_{dtype.name}"
    used.update([name, "isnan_f"])
    return f"{name}({a}, {b})"


@dataclass(frozen=True)
class Node:
    """An elementwise op made by a lowering rather than found in the graph (the sum of
    split-K partials): what expressions need of a graph node."""
    op: str
    dtype: object
    attrs: dict = field(default_factory=dict)
    shape: tuple = ()


def op_text(t, args, arg_dtypes, used):
    """WGSL for elementwise node ``t`` applied to argument expressions ``args``."""
    ex = OPS[t.op].extra["wgsl"]
    if t.op == "cast":
        return f"{t.dtype.wgsl}({args[0]})"
    # operands of another float type than the node's (an f16 load into an f32 node) convert
    if t.op not in ("where",) and t.dtype.is_float:
        args = [a if d is t.dtype or not d.is_float else f"{t.dtype.wgsl}({a})" for a, d in zip(args, arg_dtypes)]
    if t.op == "pow":
        e = t.attrs["exponent"]
        if float(e).is_integer() and abs(e) <= 8:
            n = int(abs(e))
            prod = "(" + " * ".join([args[0]] * n) + ")" if n else literal(1.0, t.dtype)
            return prod if e >= 0 else f"({literal(1.0, t.dtype)} / {prod})"
        if e == 0.5:
            return f"sqrt({args[0]})"
        return f"pow({args[0]}, {literal(e, t.dtype)})"
    if t.op in ("gelu", "gelu_grad"):
        ex = ex[t.attrs["approximate"]]
    if t.op == "where":
        if arg_dtypes[0].name != "u32":
            args = [f"u32({args[0]})"] + list(args[1:])
        args = [args[0]] + [a if d is t.dtype or not d.is_float else f"{t.dtype.wgsl}({a})"
                            for a, d in zip(args[1:], arg_dtypes[1:])]
    if t.op == "tanh":
        ex = "tanh_f({0})"
    if t.op == "erf":
        ex = "erf_f({0})"
    if t.op == "sign" and not t.dtype.is_float:
        ex = "sign({0})"
    for name in HELPERS:
        if name + "(" in ex:
            used.add(name)
            used.update(HELPER_DEPS.get(name, []))
    if t.op == "relu":
        return nan_max(args[0], literal(0, t.dtype), t.dtype, used)
    if t.op in ("maximum", "minimum"):
        return nan_max(args[0], args[1], t.dtype, used, t.op[:3])
    return ex.format(*args)


def _literal_value(e):
    """The value of a literal expression (a ``lit`` or a scalar ``const``), else None."""
    if e[0] == "lit":
        return float(e[1])
    if e[0] == "const" and e[1].dtype.is_float:
        return float(e[1].attrs["value"].reshape(-1)[0])
    return None


def ieee_guard(t, kids, args, used):
    """f32 text for an add, sub, mul or div whose IEEE result a driver folds away, else None.
    Drivers fold ``x * 0.0`` to 0, ``x / 0.0`` to anything (llvmpipe: 0), ``x - x`` to 0
    and ``x + 0.0`` to x (wrong for -0.0), whatever the value of x, and ``x * NaN`` or
    ``x * inf`` to what a constant x would give (0 * NaN folds to 0 once x is known 0); float controls stop the
    last two only where a device offers them, and never on the WGSL path, so these are
    computed on the bits (helpers ``mul_zero_f``, ``div_zero_f``, ``sub_self_f``, ``add_zero_f``)."""
    if t.op not in ("add", "sub", "mul", "div") or t.dtype.name != "f32" or len(kids) != 2:
        return None
    vals = [_literal_value(k) for k in kids]
    sign = lambda v: "0x80000000u" if math.copysign(1.0, v) < 0 else "0u"   # noqa: E731
    text = None
    if None not in vals:
        # literals on both sides with a non-finite result (WGSL refuses 0.0 / 0.0): folded
        # here as IEEE says; finite ones are left to the shader compiler
        import numpy as np
        a, b = np.float32(vals[0]), np.float32(vals[1])
        with np.errstate(all="ignore"):
            v = {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[t.op]
        return literal(v, t.dtype) if not np.isfinite(v) or (t.op == "div" and b == 0) else None
    if any(v is not None and math.isnan(v) for v in vals):
        # NaN whatever the other operand (a folded 0 * NaN would be 0)
        return literal(float("nan"), t.dtype)
    if t.op == "mul" and any(v is not None and math.isinf(v) for v in vals) and None in vals:
        x = vals.index(None)
        text, name = f"div_zero_f({args[x]}, {sign(vals[1 - x])})", "div_zero_f"   # x * inf == x / 0
    elif t.op == "mul" and 0.0 in vals:
        z = vals.index(0.0)
        if vals[1 - z] is None:
            text, name = f"mul_zero_f({args[1 - z]}, {sign(vals[z])})", "mul_zero_f"
    elif t.op == "div" and vals[1] == 0.0 and vals[0] is None:
        text, name = f"div_zero_f({args[0]}, {sign(vals[1])})", "div_zero_f"
    elif t.op == "sub" and args[0] == args[1] and vals[0] is None:
        text, name = f"sub_self_f({args[0]})", "sub_self_f"
    elif t.op in ("add", "sub") and None in vals:
        x = vals.index(None)
        other = vals[1 - x]
        # x + 0.0 and x - (-0.0) are x except that -0.0 becomes +0.0
        plus_zero = other == 0.0 and (math.copysign(1.0, other) > 0) == (t.op == "add")
        if plus_zero and (t.op == "add" or x == 0):
            text, name = f"add_zero_f({args[x]})", "add_zero_f"
    if text is not None:
        used.add(name)
    return text


def _as_f32(t):
    """``t`` as an f32 node (same op and attributes) for rendering its f32 arithmetic."""
    return Node(t.op, _F32, dict(t.attrs), tuple(t.shape))


class ExprWriter:
    """Emits an expression tree as WGSL ``let`` lines; ``leaf(e)`` gives (text, dtype) for
    ("leaf", i), ("rleaf", i) (a leaf read through its consumer's index function) and
    ("acc",) nodes. ``last_coord``: the output's last coordinate (for rotate_half)."""

    def __init__(self, leaf, prefix="t", last_coord=None):
        self.leaf, self.prefix, self.last_coord = leaf, prefix, last_coord
        self.lines, self.used, self.n = [], set(), 0
        # (node, its arguments' values) -> value: a subexpression that appears twice (a
        # producer's value both stored and used by its reader) is computed once
        self.done = {}

    def emit(self, e):
        if e[0] in ("leaf", "acc", "rleaf", "acc2", "red"):
            return self.leaf(e)
        if e[0] == "lit":
            return literal(e[1], e[2]), e[2]
        if e[0] == "const":
            c = e[1]
            return literal(c.attrs["value"].reshape(-1)[0], c.dtype), c.dtype
        _, t, kids = e
        args = [self.emit(k) for k in kids]
        key = (id(t), tuple(a for a, _ in args))
        if key in self.done:
            return self.done[key]
        if t.op == "rotate_half":
            # the operand was read at (j + h) mod 2h; the first half is negated
            a = args[0][0]
            text = f"select({a}, -{a}, {self.last_coord} < {t.shape[-1] // 2}u)"
        elif (guarded := ieee_guard(t, kids, [a for a, d in args], self.used)) is not None and \
                all(d.name == "f32" for _, d in args):
            text = guarded
        elif t.dtype.name == "f16" and t.op not in ("cast", "where"):
            # half-precision maths runs in f32 and rounds once per op (as NumPy and
            # PyTorch's CPU kernels do); the helpers are f32 functions
            f32 = _F32
            text = op_text(_as_f32(t), [a if d.name != "f16" else f"f32({a})" for a, d in args],
                           [f32 if d.name == "f16" else d for _, d in args], self.used)
            text = f"f16({text})"
        else:
            text = op_text(t, [a for a, _ in args], [d for _, d in args], self.used)
        self.n += 1
        self.lines.append(f"    let {self.prefix}{self.n} = {text};")
        self.done[key] = f"{self.prefix}{self.n}", t.dtype
        return self.done[key]

    def helpers(self, bind=None) -> list[str]:
        """The helper functions the emitted lines call; with ``bind``, only those not yet
        in that module (which then records them)."""
        names = [h for h in HELPERS if h in self.used and (bind is None or h not in bind.helpers_done)]
        if bind is not None:
            bind.helpers_done.update(names)
        return [HELPERS[h] for h in names]


def expr_ops(e) -> list[str]:
    """Op names in an expression, innermost first (for kernel names)."""
    if e is None or e[0] != "op":
        return []
    return [n for k in e[2] for n in expr_ops(k)] + [e[1].op]


def read_leaves(leaves, shape, bind, prefix="c"):
    """WGSL ``let v{k} = ...`` lines reading each view (broadcast) at the coordinates
    ``prefix0..`` of ``shape``, and the (name, dtype) pairs an ExprWriter's leaves map to."""
    lines, vals = [], []
    for k, v in enumerate(leaves):
        bi = bind.index(v.buf, v.dtype)
        lines.append(f"    let v{k} = b{bi}[{offset_expr(v.offset, broadcast_view_strides(v, shape), prefix)}];")
        vals.append((f"v{k}", v.dtype))
    return lines, vals


def store_lines(bind, ob, idx, val, dtype, stores=(), prefix="c", store_strides=None) -> list[str]:
    """WGSL lines storing ``val`` (of ``dtype``) at ``idx`` of binding ``ob`` and, converted,
    at each view of ``stores`` (second stores of the same value: a concat's slice, an f16
    copy), indexed by the coordinates ``prefix0..`` of the output (through ``store_strides``,
    one per store, where the caller indexes coalesced coordinates)."""
    lines = []
    if stores:
        lines.append(f"    let stored = {val};")
        val = "stored"
    lines.append(f"    b{ob}[{idx}] = {val};")
    for j, s in enumerate(stores):
        sb = bind.index(s.buf, s.dtype, write=True)
        sv = val if s.dtype is dtype else f"{s.dtype.wgsl}({val})"
        strides = s.strides if store_strides is None else store_strides[j]
        lines.append(f"    b{sb}[{offset_expr(s.offset, strides, prefix)}] = {sv};")
    return lines


class OutputStore:
    """``fn store_out(f: u32, acc: f32)``: stores an archetype's value for the output
    element of flat (row-major, logical) index ``f``, through the kernel's epilogue if it
    has one. Registers the output and epilogue bindings on ``bind``."""

    def __init__(self, kernel, bind, acc_dtype=None, name="store_out"):
        from ..graph import f32
        out = kernel.out
        self.acc_dtype = acc_dtype or f32
        self.bind = bind
        self.ob = bind.index(out.buf, out.dtype, write=True)
        leaves = [(bind.index(v.buf, v.dtype), v) for v in kernel.epi_reads]
        # read element by element here: a sibling part of the launch must not redeclare them vec4
        bind.scalar.update(bi for bi, _ in leaves)
        lines = []
        smap = kernel.spec.get("store_map")
        if smap is not None:
            # a transposed store: element f of the archetype's output goes where the copy
            # that was fused away put it (row-major position of its coordinates in ``shape``)
            shape, strides = smap
            rm = [1] * len(shape)
            for d in range(len(shape) - 2, -1, -1):
                rm[d] = rm[d + 1] * shape[d + 1]
            terms = [f"((f / {s}u) % {n}u) * {r}u" for s, n, r in zip(strides, shape, rm) if n != 1]
            lines.append(f"    let fd = {' + '.join(terms) or '0u'};")
        # operands are views of the iteration shape they were fused at, indexed by f (or,
        # for those fused after a transposed store, by fd): split the index into
        # coordinates of each distinct (index, shape)
        fd_from = kernel.spec.get("fd_from", len(leaves)) if smap is not None else len(leaves)
        dest = "fd" if smap is not None else "f"
        spaces = {(dest, out.shape): "e"}
        lines += coords(dest, out.shape, "e")
        for k, (bi, v) in enumerate(leaves):
            key = ("fd" if k >= fd_from else "f", v.shape)
            if key not in spaces:
                spaces[key] = f"s{len(spaces)}_"
                lines += coords(key[0], v.shape, spaces[key])
            lines.append(f"    let l{k} = b{bi}[{offset_expr(v.offset, broadcast_view_strides(v, v.shape), spaces[key])}];")

        def leaf(e):
            if e[0] == "acc":
                return "acc", self.acc_dtype
            if e[0] == "acc2":          # a paired product's value (kernel.spec["pair"])
                return "acc2", self.acc_dtype
            return f"l{e[1]}", leaves[e[1]][1].dtype
        w = ExprWriter(leaf)
        val, dt = w.emit(kernel.epilogue or ("acc",))
        if dt is not out.dtype:
            val = f"{out.dtype.wgsl}({val})"
        idx = f"{out.offset}u + {dest}" if out.is_contiguous() else offset_expr(out.offset, out.strides, "e")
        self.used = w.used
        body = lines + w.lines + store_lines(bind, self.ob, idx, val, out.dtype, kernel.spec.get("stores", ()), "e")
        acc2 = f", acc2: {self.acc_dtype.wgsl}" if "pair" in kernel.spec else ""
        self.fn = f"fn {name}(f: u32, acc: {self.acc_dtype.wgsl}{acc2}) {{\n" + "\n".join(body) + "\n}"

    def require(self, *names):
        """Helpers the archetype's own body calls (emitted once, with the epilogue's)."""
        for n in names:
            self.used.update([n] + HELPER_DEPS.get(n, []))
        return self

    def module_text(self) -> str:
        """The helpers and ``store_out``, for module scope (after the binding decls)."""
        # several stores can share a module (merged matmuls): each helper once per module
        new = [h for h in HELPERS if h in self.used and h not in self.bind.helpers_done]
        self.bind.helpers_done.update(new)
        return "\n".join([HELPERS[h] for h in new] + [self.fn])
