"""Elementwise ops: unary and binary maths with NumPy broadcasting, comparisons, where, cast.

Each record is ``pointwise``: an element of the output depends on the same element of each
(broadcast) operand, so the GPU backend fuses chains of them into one kernel (their scalar
code is the code generator's: ``codegen/scalar_ops.py``).
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Tensor, dtype_of, u32
from .registry import as_tensor, broadcast_shapes, emit, register, require_float, same_dtype, unbroadcast

_erf = np.vectorize(math.erf, otypes=[np.float64])
SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _erf_like(x):
    return _erf(x).astype(x.dtype)


def _unary_infer(name, float_only=True):
    def infer(ins, **attrs):
        if float_only:
            require_float(name, ins[0])
        return ins[0].shape, ins[0].dtype
    return infer


def _unary(name, ref, vjp, float_only=True, differentiable=True):
    register(name, _unary_infer(name, float_only), ref, vjp, differentiable=differentiable, pointwise=True)

    def fn(x):
        return emit(name, [x])
    fn.__name__ = name
    fn.__doc__ = f"Elementwise {name}."
    return fn


def _gelu_ref(x, approximate="none"):
    if approximate == "tanh":
        return 0.5 * x * (1 + np.tanh(x.dtype.type(SQRT_2_OVER_PI) * (x + x.dtype.type(0.044715) * x ** 3)))
    return 0.5 * x * (1 + _erf_like(x / x.dtype.type(math.sqrt(2.0))))


def _gelu_grad_ref(x, approximate="none"):
    if approximate == "tanh":
        c = x.dtype.type(SQRT_2_OVER_PI)
        inner = c * (x + x.dtype.type(0.044715) * x ** 3)
        t = np.tanh(inner)
        return 0.5 * (1 + t) + 0.5 * x * (1 - t * t) * c * (1 + x.dtype.type(3 * 0.044715) * x * x)
    cdf = 0.5 * (1 + _erf_like(x / x.dtype.type(math.sqrt(2.0))))
    pdf = np.exp(-0.5 * x * x) / x.dtype.type(math.sqrt(2 * math.pi))
    return cdf + x * pdf


def _sigmoid_ref(x):
    return 1 / (1 + np.exp(-x))


neg = _unary("neg", lambda x: -x, lambda ct, y, x: [neg(ct)], float_only=False)
exp = _unary("exp", np.exp, lambda ct, y, x: [ct * y])
log = _unary("log", np.log, lambda ct, y, x: [ct / x])
sqrt = _unary("sqrt", np.sqrt, lambda ct, y, x: [ct * 0.5 / y])
rsqrt = _unary("rsqrt", lambda x: 1 / np.sqrt(x), lambda ct, y, x: [ct * (-0.5) * y * y * y])
sign = _unary("sign", np.sign, None, differentiable=False)
abs = _unary("abs", np.abs, lambda ct, y, x: [ct * sign(x)], float_only=False)
tanh = _unary("tanh", np.tanh, lambda ct, y, x: [ct * (1.0 - y * y)])
sigmoid = _unary("sigmoid", _sigmoid_ref, lambda ct, y, x: [ct * y * (1.0 - y)])
# the gradient masks by the output (y > 0 exactly where x > 0), as torch's threshold_backward:
# backward then keeps the output, which the next layer keeps anyway, not the input too
relu = _unary("relu", lambda x: np.maximum(x, x.dtype.type(0)), lambda ct, y, x: [where(y > 0.0, ct, 0.0)])
erf = _unary("erf", _erf_like, lambda ct, y, x: [ct * exp(neg(x * x)) * (2.0 / math.sqrt(math.pi))])
silu = _unary("silu", lambda x: x * _sigmoid_ref(x),
              lambda ct, y, x: [ct * _silu_grad(x)])


def _silu_grad(x):
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


register("gelu", _unary_infer("gelu"), _gelu_ref,
         lambda ct, y, x, approximate="none": [ct * emit("gelu_grad", [x], approximate=approximate)],
         pointwise=True)
register("gelu_grad", _unary_infer("gelu_grad"), _gelu_grad_ref, None, differentiable=False,
         pointwise=True)


def gelu(x, approximate="none"):
    """GELU, exact (erf) or ``approximate='tanh'``, as torch.nn.functional.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return emit("gelu", [x], approximate=approximate)


sin = _unary("sin", np.sin, lambda ct, y, x: [ct * cos(x)])
cos = _unary("cos", np.cos, lambda ct, y, x: [neg(ct * sin(x))])
reciprocal = _unary("reciprocal", lambda x: x.dtype.type(1) / x, lambda ct, y, x: [neg(ct * y * y)])
log1p = _unary("log1p", np.log1p, lambda ct, y, x: [ct / (x + 1.0)])
expm1 = _unary("expm1", np.expm1, lambda ct, y, x: [ct * (y + 1.0)])
# rounding: piecewise constant, so no gradient (torch's is zero too); round is half to even
floor = _unary("floor", np.floor, None, differentiable=False)
ceil = _unary("ceil", np.ceil, None, differentiable=False)
trunc = _unary("trunc", np.trunc, None, differentiable=False)
_round = _unary("round", np.round, None, differentiable=False)


def round(x, decimals=0):
    """torch.round: half to even, at ``decimals`` digits (negative: tens, hundreds, ...)."""
    if not decimals:
        return _round(x)
    scale = 10.0 ** int(decimals)
    return _round(x * scale) / scale


def softplus(x, beta=1.0, threshold=20.0):
    """torch.nn.functional.softplus: log(1 + exp(beta x)) / beta, x itself where beta x >
    threshold; written as max(bx, 0) + log1p(exp(-|bx|)) so no exp overflows."""
    bx = x * float(beta)
    soft = (relu(bx) + log1p(exp(neg(abs(bx))))) * (1.0 / float(beta))
    return where(bx > float(threshold), x, soft)


def leaky_relu(x, negative_slope=0.01, inplace=False):
    """torch.nn.functional.leaky_relu."""
    return where(x > 0.0, x, x * float(negative_slope))


def hardsigmoid(x, inplace=False):
    """torch.nn.functional.hardsigmoid: clamp(x / 6 + 1/2, 0, 1) (ONNX HardSigmoid takes
    other slopes: ``clamp(alpha x + beta, 0, 1)``)."""
    return clamp(x * (1.0 / 6.0) + 0.5, 0.0, 1.0)


def hardswish(x, inplace=False):
    """torch.nn.functional.hardswish: x * hardsigmoid(x)."""
    return x * hardsigmoid(x)


def masked_fill(x, mask, value):
    """torch.masked_fill: ``value`` (a number or 0-d tensor) where ``mask`` is non-zero."""
    if isinstance(value, Tensor) and value.dtype is not x.dtype:
        value = cast(value, x.dtype)
    return where(mask, value, x)


# ------------------------------------------------------------------------------ pow
register("pow", _unary_infer("pow"), lambda x, exponent: np.power(x, x.dtype.type(exponent)),
         lambda ct, y, x, exponent: [ct * (exponent * pow(x, exponent - 1.0))] if exponent != 1 else [ct],
         pointwise=True)


def pow(x, exponent):
    """x ** exponent. A constant exponent handles negative x for integer powers. A tensor
    exponent (or a number base with a tensor exponent) computes exp(exponent * log(x)), so
    the base must be positive: a negative base gives nan, as torch does for non-integer powers."""
    if isinstance(exponent, Tensor) or not isinstance(x, Tensor):
        x, exponent = _pair(x, exponent)
        return exp(exponent * log(x))
    if float(exponent) == 1.0:
        return x
    return emit("pow", [x], exponent=float(exponent))


def square(x):
    return x * x


def clamp(x, min=None, max=None):
    """torch.clamp: bounds are numbers or tensors (broadcast, converted to ``x``'s dtype);
    either may be None; where min > max the result is max, as torch."""
    if min is None and max is None:
        raise ValueError("clamp: give min and/or max")
    if min is not None:
        x = maximum(x, cast(min, x.dtype) if isinstance(min, Tensor) else min)
    if max is not None:
        x = minimum(x, cast(max, x.dtype) if isinstance(max, Tensor) else max)
    return x


clip = clamp


def clamp_min(x, min):
    return clamp(x, min=min)


def clamp_max(x, max):
    return clamp(x, max=max)


# ---------------------------------------------------------------------------- binary
def _binary_infer(name, out_dtype=None):
    def infer(ins):
        a, b = ins
        dt = same_dtype(name, a, b)
        return broadcast_shapes(name, a, b), (out_dtype or dt)
    return infer


def _binary(name, ref, vjp, out_dtype=None, differentiable=True):
    register(name, _binary_infer(name, out_dtype), ref, vjp, differentiable=differentiable, pointwise=True)

    def fn(a, b):
        a, b = _pair(a, b)
        return emit(name, [a, b])
    fn.__name__ = name
    return fn


def _pair(a, b):
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):
        raise TypeError("at least one operand must be a Tensor")
    if not isinstance(a, Tensor):
        a = as_tensor(a, b)
    if not isinstance(b, Tensor):
        b = as_tensor(b, a)
    return a, b


def _ub(ct, x):
    return unbroadcast(ct, x.shape)


_add = _binary("add", lambda a, b: a + b, lambda ct, y, a, b: [_ub(ct, a), _ub(ct, b)])
_sub = _binary("sub", lambda a, b: a - b, lambda ct, y, a, b: [_ub(ct, a), _ub(neg(ct), b)])
mul = _binary("mul", lambda a, b: a * b, lambda ct, y, a, b: [_ub(ct * b, a), _ub(ct * a, b)])
_div = _binary("div", lambda a, b: a / b,
               lambda ct, y, a, b: [_ub(ct / b, a), _ub(neg(ct * y / b), b)])


def _scaled(b, alpha, op):
    if alpha is None or (not isinstance(alpha, bool) and alpha == 1):
        return b
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)):
        raise TypeError(f"{op}: alpha must be a number, got {alpha!r}")
    return b * alpha


def add(input, other, alpha=1):
    """torch.add: input + alpha * other."""
    return _add(input, _scaled(other, alpha, "add"))


def sub(input, other, alpha=1):
    """torch.sub: input - alpha * other."""
    return _sub(input, _scaled(other, alpha, "sub"))


def div(input, other, rounding_mode=None):
    """torch.div: true division, or rounded toward zero (``"trunc"``) or down (``"floor"``);
    a rounded quotient has no gradient, as in torch. Integer operands are rounded through
    f32 (exact below 2**24)."""
    if rounding_mode is None:
        return _div(input, other)
    if rounding_mode not in ("trunc", "floor"):
        raise ValueError(f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}")
    a, b = _pair(input, other)
    same_dtype("div", a, b)
    rnd = trunc if rounding_mode == "trunc" else floor
    if a.dtype.is_float:
        return rnd(_div(a, b))
    return cast(rnd(_div(cast(a, "f32"), cast(b, "f32"))), a.dtype)
maximum = _binary("maximum", np.maximum,
                  lambda ct, y, a, b: [_ub(where(a >= b, ct, 0.0), a), _ub(where(a >= b, 0.0, ct), b)])
minimum = _binary("minimum", np.minimum,
                  lambda ct, y, a, b: [_ub(where(a <= b, ct, 0.0), a), _ub(where(a <= b, 0.0, ct), b)])


def _cmp(name, ref):
    return _binary(name, lambda a, b: ref(a, b).astype(np.uint32), None, out_dtype=u32, differentiable=False)


lt = _cmp("lt", np.less)
le = _cmp("le", np.less_equal)
gt = _cmp("gt", np.greater)
ge = _cmp("ge", np.greater_equal)
eq = _cmp("eq", np.equal)
ne = _cmp("ne", np.not_equal)


# ----------------------------------------------------------------------------- where
def _where_infer(ins):
    c, a, b = ins
    if c.dtype.is_float:
        raise TypeError(f"where: condition {c.name!r} has dtype {c.dtype.name}, expected an integer mask (u32/i32)")
    dt = same_dtype("where", a, b)
    return broadcast_shapes("where", c, a, b), dt


register("where", _where_infer, lambda c, a, b: np.where(c != 0, a, b),
         lambda ct, y, c, a, b: [None, _ub(where(c, ct, 0.0), a), _ub(where(c, 0.0, ct), b)],
         pointwise=True)


def where(condition, input, other):
    """torch.where(condition, input, other): ``input`` where condition is non-zero."""
    ref = input if isinstance(input, Tensor) else other
    if not isinstance(ref, Tensor):
        raise TypeError("where: input or other must be a Tensor")
    input, other = as_tensor(input, ref), as_tensor(other, ref)
    return emit("where", [condition, input, other])


# ------------------------------------------------------------------------------ cast
def _cast_infer(ins, dtype):
    return ins[0].shape, dtype_of(dtype)


register("cast", _cast_infer, lambda x, dtype: x.astype(dtype_of(dtype).np),
         lambda ct, y, x, dtype: [cast(ct, x.dtype) if x.dtype.is_float else None], pointwise=True)


def cast(x, dtype):
    dtype = dtype_of(dtype)
    if x.dtype is dtype:
        return x
    return emit("cast", [x], dtype=dtype.name)


# ----------------------------------------------------------------------- stop_gradient
register("stop_gradient", lambda ins: (ins[0].shape, ins[0].dtype), lambda x: x, None,
         differentiable=False, pointwise=True)


def stop_gradient(x):
    """Identity whose gradient is zero (torch's ``.detach()``)."""
    return emit("stop_gradient", [x])


detach = stop_gradient

# ------------------------------------------------------------------------------ recompute
# The input of a checkpointed region as its recomputation in the backward pass reads it
# (autodiff.checkpoint): an identity whose ``region`` attribute keeps the recomputed nodes
# apart from the forward ones, which merging common subexpressions would otherwise undo.
register("recompute", lambda ins, region: (ins[0].shape, ins[0].dtype), lambda x, region: x, None,
         differentiable=False, pointwise=True)


def recompute(x, region: int):
    return emit("recompute", [x], region=int(region))
