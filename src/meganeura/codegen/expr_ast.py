"""Expressions on the typed kernel AST (``kernel_ast``): the op records' WGSL templates (their
``wgsl`` field, a small expression language over arguments ``{k}``) and the WGSL helper
functions as typed trees, the index maths every archetype shares (``coords``,
``offset_expr``) as statements and expressions, and the nodes ``expr.ExprWriter`` writes for
an op (``op_node``, ``ieee_guard_node``).

``parse`` reads the template language: arguments, literals (WGSL's, typed where they stand
as WGSL types them), names of a given type, ``-`` and ``!``, the binary operators, calls
of builtins, of ``select``, ``bitcast<T>``, type conversions and constructors, and of the
functions named in ``FUNCTIONS``; a written pair of parentheses is a ``Group``, so a tree
prints as the text it was read from (spaced as the printers space it).
"""
from __future__ import annotations

import functools
import math
import re

from .kernel_ast import (PRECEDENCE, Assign, Bin, Bitcast, Call, Construct, Convert, Function, Group, Let,
                         Line, Lit, Name, Neg, Not, Return, Select, Var, add, is_vec, name, scalar_of, u32)
from .kernel_ast_print import BUILTINS, WgslPrinter, abstract
from .common import wgsl_type

# the result types of the module functions a template or a helper may call
FUNCTIONS = {"isnan_f": "bool", "fmax_f32": "f32", "fmin_f32": "f32", "erf_f": "f32", "tanh_f": "f32",
             "gelu_erf": "f32", "gelu_erf_grad": "f32", "gelu_tanh": "f32", "gelu_tanh_grad": "f32",
             "mul_zero_f": "f32", "div_zero_f": "f32", "sub_self_f": "f32", "add_zero_f": "f32"}
SCALARS = ("u32", "i32", "f32", "f16", "bool")
_TOKEN = re.compile(r"\s*(\{\d+\}|0x[0-9a-fA-F]+[iu]?|\d+(?:\.\d*)?(?:e[-+]?\d+)?[fhiu]?|(?:bitcast|vec[234])<\w+>"
                    r"|[A-Za-z_]\w*|&&|\|\||<=|>=|==|!=|<<|>>|[-+*/%<>(),!&|^])")
_WGSL = WgslPrinter()


class TemplateError(ValueError):
    pass


# ------------------------------------------------------------------ typed node constructors
def retype(e, ty: str):
    """``e`` where WGSL gives an abstract literal the type ``ty`` (other nodes: as they are)."""
    if abstract(e):
        return Lit(e.value, scalar_of(ty), e.text)
    if type(e) is Neg and abstract(e.e):
        return Neg(retype(e.e, ty))
    return e


def _abstract(e) -> bool:
    return abstract(e) or (type(e) is Neg and abstract(e.e))


def binary(op, a, b):
    if op in ("<<", ">>"):
        return Bin(op, retype(a, "i32") if _abstract(a) else a, retype(b, "u32") if _abstract(b) else b)
    if _abstract(a) and not _abstract(b):
        a = retype(a, b.ty)
    elif _abstract(b) and not _abstract(a):
        b = retype(b, a.ty)
    return Bin(op, a, b)


def call(fn, args):
    args = list(args)
    if fn == "select":
        f, t, c = args
        if _abstract(f) and not _abstract(t):
            f = retype(f, t.ty)
        elif _abstract(t) and not _abstract(f):
            t = retype(t, f.ty)
        return Select(f, t, c)
    if fn.startswith("bitcast<"):
        (x,) = args
        return Bitcast(fn[8:-1], retype(x, "u32") if _abstract(x) else x)
    if fn.startswith("vec"):
        ty = fn
        return Construct(ty, tuple(retype(a, scalar_of(ty)) for a in args))
    if fn in SCALARS:
        (x,) = args
        return Convert(fn, x)
    if fn in BUILTINS:
        ref = next((a for a in args if not _abstract(a) and is_vec(a.ty)), None) or \
            next((a for a in args if not _abstract(a)), None)
        ty = ref.ty if ref is not None else args[0].ty
        args = [retype(a, ty) for a in args]
        if fn == "dot":
            ty = scalar_of(ty)
        return Call(fn, tuple(args), ty)
    if fn in FUNCTIONS:
        return Call(fn, tuple(args), FUNCTIONS[fn])
    raise TemplateError(f"unknown function {fn!r}")


# ----------------------------------------------------------------------------- the parser
@functools.lru_cache(maxsize=512)
def _program(text: str):
    """``text`` parsed into a builder of its tree: (args, names) -> node."""
    toks = _TOKEN.findall(text)
    if "".join(toks) != text.replace(" ", ""):
        raise TemplateError(f"outside the template language: {text!r}")
    pos = [0]

    def peek():
        return toks[pos[0]] if pos[0] < len(toks) else None

    def take(want=None):
        tok = peek()
        if tok is None or (want is not None and tok != want):
            raise TemplateError(f"expected {want or 'more'} in {text!r}")
        pos[0] += 1
        return tok

    def expr(level=1):
        left = unary()
        while (op := peek()) in PRECEDENCE and PRECEDENCE[op] >= level:
            take()
            right = expr(PRECEDENCE[op] + 1)
            left = (lambda op, a, b: lambda env: binary(op, a(env), b(env)))(op, left, right)
        return left

    def unary():
        if peek() in ("-", "!"):
            op = take()
            inner = unary()
            return (lambda env: Neg(inner(env))) if op == "-" else (lambda env: Not(inner(env)))
        return primary()

    def primary():
        tok = take()
        if tok.startswith("{"):
            k = int(tok[1:-1])
            return lambda env: env[0][k]
        if tok[0].isdigit():
            lit = _literal(tok)
            return lambda env: lit
        if tok == "(":
            inner = expr()
            take(")")
            return lambda env: Group(inner(env))
        if tok in ("true", "false"):
            return lambda env: Lit(tok == "true", "bool", tok)
        if peek() == "(":
            take()
            params = []
            while peek() != ")":
                params.append(expr())
                if peek() != ")":
                    take(",")
            take(")")
            return lambda env: call(tok, [p(env) for p in params])
        return lambda env: env[1][tok]
    tree = expr()
    if pos[0] != len(toks):
        raise TemplateError(f"unexpected {toks[pos[0]]!r} in {text!r}")
    return tree


def _literal(tok: str) -> Lit:
    if tok[:2] == "0x":
        return Lit(int(tok.rstrip("iu"), 16), {"u": "u32", "i": "i32"}.get(tok[-1], "i32"), tok)
    if tok[-1] in "fhiu":
        ty = {"f": "f32", "h": "f16", "i": "i32", "u": "u32"}[tok[-1]]
        return Lit(float(tok[:-1]) if ty[0] == "f" else int(tok[:-1]), ty, tok)
    return Lit(float(tok), "f32", tok) if any(c in tok for c in ".e") else Lit(int(tok), "i32", tok)


def parse(text: str, args=(), names=None):
    """The tree of template ``text`` over argument nodes ``args`` and ``names`` (name ->
    node)."""
    return _program(text)((list(args), names or {}))


def template_names(text: str) -> bool:
    """Whether ``text`` is in the template language (else ``TemplateError``)."""
    _program(text)
    return True


# ----------------------------------------------------------------------------- the helpers
def _helper(name, params, ret, body, inline=False):
    env = {p: Name(p, t) for p, t in params}
    stmts = []
    for kind, *rest in body:
        if kind == "let":
            node = parse(rest[1], names=env)
            node = retype(node, "f32") if _abstract(node) else node
            stmts.append(Let(rest[0], node))
            env[rest[0]] = Name(rest[0], node.ty)
        else:
            stmts.append(Return(retype(parse(rest[0], names=env), ret)))
    return Function(name, tuple(env[p] for p, _ in params), tuple(stmts), ret, inline)


X, AB = (("x", "f32"),), (("a", "f32"), ("b", "f32"))
XS = (("x", "f32"), ("sign", "u32"))
NAN_BITS = "bitcast<f32>(0x7fc00000u)"
# erf: Abramowitz-Stegun 7.1.26 (|error| < 1.5e-7, below f32 resolution of the results). NaN
# is tested on the bits: SPIR-V's FMax/FMin/FClamp leave NaN operands undefined (llvmpipe
# drops them) and a driver may fold ``x != x`` to false, so max/min/relu/tanh select the NaN
# explicitly. tanh: exp is clamped so it cannot overflow; tiny |x| returns x (exact to f32,
# keeps -0.0). mul_zero_f .. add_zero_f: products, quotients and differences whose value a
# driver would fold (``expr.ieee_guard``), computed on the bits: exact as IEEE 754 defines
# them, with no float operation to fold.
HELPER_FUNCTIONS = {f.name: f for f in (
    _helper("isnan_f", X, "bool", [("ret", "(bitcast<u32>(x) & 0x7fffffffu) > 0x7f800000u")], True),
    _helper("fmax_f32", AB, "f32", [("ret", "select(select(max(a, b), b, isnan_f(b)), a, isnan_f(a))")], True),
    _helper("fmin_f32", AB, "f32", [("ret", "select(select(min(a, b), b, isnan_f(b)), a, isnan_f(a))")], True),
    _helper("erf_f", X, "f32", [
        ("let", "t", "1.0 / (1.0 + 0.3275911 * abs(x))"),
        ("let", "y", "1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t "
                     "+ 0.254829592) * t * exp(-x * x)"),
        ("ret", "select(select(-y, y, x >= 0.0), x, isnan_f(x))")]),
    _helper("tanh_f", X, "f32", [("let", "e", "exp(2.0 * clamp(x, -15.0, 15.0))"),
                                 ("ret", "select((e - 1.0) / (e + 1.0), x, abs(x) < 1e-4 || isnan_f(x))")]),
    _helper("gelu_erf", X, "f32", [("ret", "0.5 * x * (1.0 + erf_f(x * 0.70710678118654752))")], True),
    _helper("gelu_erf_grad", X, "f32", [
        ("ret", "0.5 * (1.0 + erf_f(x * 0.70710678118654752)) + x * exp(-0.5 * x * x) * 0.39894228040143268")]),
    _helper("gelu_tanh", X, "f32", [
        ("ret", "0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)))")]),
    _helper("gelu_tanh_grad", X, "f32", [
        ("let", "c", "0.79788456080286536"), ("let", "t", "tanh_f(c * (x + 0.044715 * x * x * x))"),
        ("ret", "0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x)")]),
    _helper("mul_zero_f", XS, "f32", [
        ("let", "b", "bitcast<u32>(x)"),
        ("ret", f"select(bitcast<f32>((b & 0x80000000u) ^ sign), {NAN_BITS}, (b & 0x7fffffffu) >= 0x7f800000u)")]),
    _helper("div_zero_f", XS, "f32", [
        ("let", "b", "bitcast<u32>(x)"), ("let", "m", "b & 0x7fffffffu"),
        ("ret", f"select(bitcast<f32>(((b & 0x80000000u) ^ sign) | 0x7f800000u), {NAN_BITS}, "
                "m == 0u || m > 0x7f800000u)")]),
    _helper("sub_self_f", X, "f32", [("ret", f"select(0.0, {NAN_BITS}, (bitcast<u32>(x) & 0x7fffffffu) >= 0x7f800000u)")]),
    _helper("add_zero_f", X, "f32", [("ret", "select(x, 0.0, x == 0.0)")], True),
)}


# ----------------------------------------------------------------------------- index maths
def coords(var, shape, prefix="c") -> list:
    """``common.coords`` as statements: flat index ``var`` (a node) split into coordinates
    ``{prefix}0..`` of ``shape``."""
    if not shape:
        return []
    r = name(f"{prefix}r")
    out = [Var(r.id, var)]
    for d in range(len(shape) - 1, 0, -1):
        out.append(Line((Let(f"{prefix}{d}", Bin("%", r, u32(shape[d]))), Assign(r.id, Bin("/", r, u32(shape[d]))))))
    return out + [Let(f"{prefix}0", r)]


def offset_expr(offset, strides, prefix="c", dims=None):
    """``common.offset_expr`` as a node."""
    dims = range(len(strides)) if dims is None else dims
    terms = [u32(offset)] if offset else []
    terms += [name(f"{prefix}{d}") if strides[i] == 1 else Bin("*", name(f"{prefix}{d}"), u32(strides[i]))
              for i, d in zip(range(len(strides)), dims) if strides[i] != 0]
    return add(*terms) if terms else u32(0)


# ----------------------------------------------------------------------------- op nodes
def _lit(value, dtype):
    return Lit(value, dtype)


def _literal_value(e):
    """The value of a literal expression (a ``lit`` or a scalar ``const``), else None."""
    if e[0] == "lit":
        return float(e[1])
    if e[0] == "const" and e[1].dtype.is_float:
        return float(e[1].attrs["value"].reshape(-1)[0])
    return None


def ieee_guard_node(t, kids, args, used):
    """The f32 node of an add, sub, mul or div whose IEEE result a driver folds away, else
    None (``expr.ieee_guard`` says which and why); ``args``: the operands' nodes."""
    if t.op not in ("add", "sub", "mul", "div") or t.dtype.name != "f32" or len(kids) != 2:
        return None
    vals = [_literal_value(k) for k in kids]

    def sign(v):
        return Lit(0x80000000, "u32", "0x80000000u") if math.copysign(1.0, v) < 0 else u32(0)
    node = None
    if None not in vals:
        # literals on both sides with a non-finite result (WGSL refuses 0.0 / 0.0): folded
        # here as IEEE says; finite ones are left to the shader compiler
        import numpy as np
        a, b = np.float32(vals[0]), np.float32(vals[1])
        with np.errstate(all="ignore"):
            v = {"add": a + b, "sub": a - b, "mul": a * b, "div": a / b}[t.op]
        return _lit(float(v), t.dtype) if not np.isfinite(v) or (t.op == "div" and b == 0) else None
    if any(v is not None and math.isnan(v) for v in vals):
        return _lit(float("nan"), t.dtype)     # NaN whatever the other operand (a folded 0 * NaN would be 0)
    if t.op == "mul" and any(v is not None and math.isinf(v) for v in vals) and None in vals:
        x = vals.index(None)
        node = Call("div_zero_f", (args[x], sign(vals[1 - x])), "f32")      # x * inf == x / 0
    elif t.op == "mul" and 0.0 in vals:
        z = vals.index(0.0)
        if vals[1 - z] is None:
            node = Call("mul_zero_f", (args[1 - z], sign(vals[z])), "f32")
    elif t.op == "div" and vals[1] == 0.0 and vals[0] is None:
        node = Call("div_zero_f", (args[0], sign(vals[1])), "f32")
    elif t.op == "sub" and _WGSL.expr(args[0]) == _WGSL.expr(args[1]) and vals[0] is None:
        node = Call("sub_self_f", (args[0],), "f32")
    elif t.op in ("add", "sub") and None in vals:
        x = vals.index(None)
        other = vals[1 - x]
        # x + 0.0 and x - (-0.0) are x except that -0.0 becomes +0.0
        plus_zero = other == 0.0 and (math.copysign(1.0, other) > 0) == (t.op == "add")
        if plus_zero and (t.op == "add" or x == 0):
            node = Call("add_zero_f", (args[x],), "f32")
    if node is not None:
        used.add(node.fn)
    return node


def nan_max_node(a, b, dtype, used, op="max"):
    """``expr.nan_max`` as a node."""
    if not dtype.is_float:
        return call(op, (a, b))
    name = f"f{op}_{dtype.name}"
    used.update([name, "isnan_f"])
    return Call(name, (a, b), wgsl_type(dtype))


def op_node(t, args, arg_dtypes, used, helper_deps):
    """The node of elementwise node ``t`` applied to argument nodes ``args`` (as
    ``expr.op_text`` writes its WGSL)."""
    from .scalar_ops import SCALAR
    ex = SCALAR[t.op]
    if t.op == "cast":
        return Convert(wgsl_type(t.dtype), args[0])
    # operands of another float type than the node's (an f16 load into an f32 node) convert
    if t.op not in ("where",) and t.dtype.is_float:
        args = [a if d is t.dtype or not d.is_float else Convert(wgsl_type(t.dtype), a) for a, d in zip(args, arg_dtypes)]
    if t.op == "pow":
        e = t.attrs["exponent"]
        one = _lit(1.0, t.dtype)
        if float(e).is_integer() and abs(e) <= 8:
            n = int(abs(e))
            prod = one
            if n:
                prod = args[0]
                for _ in range(n - 1):
                    prod = Bin("*", prod, args[0])
                prod = Group(prod)
            return prod if e >= 0 else Group(Bin("/", one, prod))
        if e == 0.5:
            return call("sqrt", (args[0],))
        return call("pow", (args[0], _lit(e, t.dtype)))
    if t.op in ("gelu", "gelu_grad"):
        ex = ex[t.attrs["approximate"]]
    if t.op == "where":
        if arg_dtypes[0].name != "u32":
            args = [Convert("u32", args[0])] + list(args[1:])
        args = [args[0]] + [a if d is t.dtype or not d.is_float else Convert(wgsl_type(t.dtype), a)
                            for a, d in zip(args[1:], arg_dtypes[1:])]
    if t.op == "tanh":
        ex = "tanh_f({0})"
    if t.op == "erf":
        ex = "erf_f({0})"
    if t.op == "sign" and not t.dtype.is_float:
        ex = "sign({0})"
    for h in HELPER_FUNCTIONS:
        if h + "(" in ex:
            used.add(h)
            used.update(helper_deps.get(h, []))
    if t.op == "relu":
        return nan_max_node(args[0], _lit(0, t.dtype), t.dtype, used)
    if t.op in ("maximum", "minimum"):
        return nan_max_node(args[0], args[1], t.dtype, used, t.op[:3])
    return parse(ex, args)
