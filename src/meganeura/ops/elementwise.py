"""Elementwise ops: unary and binary maths with NumPy broadcasting, comparisons, where, cast.

Each record carries ``wgsl``: its body as a WGSL expression over ``{0}``, ``{1}``, ... so the
GPU backend can fuse chains of them into one kernel.
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


def _unary(name, ref, vjp, wgsl, float_only=True, differentiable=True):
    register(name, _unary_infer(name, float_only), ref, vjp, differentiable=differentiable, wgsl=wgsl)

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


neg = _unary("neg", lambda x: -x, lambda ct, y, x: [neg(ct)], "(-{0})", float_only=False)
exp = _unary("exp", np.exp, lambda ct, y, x: [ct * y], "exp({0})")
log = _unary("log", np.log, lambda ct, y, x: [ct / x], "log({0})")
sqrt = _unary("sqrt", np.sqrt, lambda ct, y, x: [ct * 0.5 / y], "sqrt({0})")
rsqrt = _unary("rsqrt", lambda x: 1 / np.sqrt(x), lambda ct, y, x: [ct * (-0.5) * y * y * y], "inverseSqrt({0})")
sign = _unary("sign", np.sign, None, "sign({0})", differentiable=False)
abs = _unary("abs", np.abs, lambda ct, y, x: [ct * sign(x)], "abs({0})", float_only=False)
tanh = _unary("tanh", np.tanh, lambda ct, y, x: [ct * (1.0 - y * y)], "tanh({0})")
sigmoid = _unary("sigmoid", _sigmoid_ref, lambda ct, y, x: [ct * y * (1.0 - y)], "(1.0 / (1.0 + exp(-{0})))")
# the gradient masks by the output (y > 0 exactly where x > 0), as torch's threshold_backward:
# backward then keeps the output, which the next layer keeps anyway, not the input too
relu = _unary("relu", lambda x: np.maximum(x, x.dtype.type(0)), lambda ct, y, x: [where(y > 0.0, ct, 0.0)],
              "max({0}, 0.0)")
erf = _unary("erf", _erf_like, lambda ct, y, x: [ct * exp(neg(x * x)) * (2.0 / math.sqrt(math.pi))], "erf({0})")
silu = _unary("silu", lambda x: x * _sigmoid_ref(x),
              lambda ct, y, x: [ct * _silu_grad(x)], "({0} / (1.0 + exp(-{0})))")


def _silu_grad(x):
    s = sigmoid(x)
    return s * (1.0 + x * (1.0 - s))


register("gelu", _unary_infer("gelu"), _gelu_ref,
         lambda ct, y, x, approximate="none": [ct * emit("gelu_grad", [x], approximate=approximate)],
         wgsl={"none": "gelu_erf({0})", "tanh": "gelu_tanh({0})"})
register("gelu_grad", _unary_infer("gelu_grad"), _gelu_grad_ref, None, differentiable=False,
         wgsl={"none": "gelu_erf_grad({0})", "tanh": "gelu_tanh_grad({0})"})


def gelu(x, approximate="none"):
    """GELU, exact (erf) or ``approximate='tanh'``, as torch.nn.functional.gelu."""
    if approximate not in ("none", "tanh"):
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return emit("gelu", [x], approximate=approximate)


# ------------------------------------------------------------------------------ pow
register("pow", _unary_infer("pow"), lambda x, exponent: np.power(x, x.dtype.type(exponent)),
         lambda ct, y, x, exponent: [ct * (exponent * pow(x, exponent - 1.0))] if exponent != 1 else [ct],
         wgsl="pow_c({0})")


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
    """torch.clamp: bounds are numbers or tensors (broadcast); either may be None."""
    if min is None and max is None:
        raise ValueError("clamp: give min and/or max")
    if min is not None:
        x = maximum(x, min)
    if max is not None:
        x = minimum(x, max)
    return x


clip = clamp


# ---------------------------------------------------------------------------- binary
def _binary_infer(name, out_dtype=None):
    def infer(ins):
        a, b = ins
        dt = same_dtype(name, a, b)
        return broadcast_shapes(name, a, b), (out_dtype or dt)
    return infer


def _binary(name, ref, vjp, wgsl, out_dtype=None, differentiable=True):
    register(name, _binary_infer(name, out_dtype), ref, vjp, differentiable=differentiable, wgsl=wgsl)

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


add = _binary("add", lambda a, b: a + b, lambda ct, y, a, b: [_ub(ct, a), _ub(ct, b)], "({0} + {1})")
sub = _binary("sub", lambda a, b: a - b, lambda ct, y, a, b: [_ub(ct, a), _ub(neg(ct), b)], "({0} - {1})")
mul = _binary("mul", lambda a, b: a * b, lambda ct, y, a, b: [_ub(ct * b, a), _ub(ct * a, b)], "({0} * {1})")
div = _binary("div", lambda a, b: a / b,
              lambda ct, y, a, b: [_ub(ct / b, a), _ub(neg(ct * y / b), b)], "({0} / {1})")
maximum = _binary("maximum", np.maximum,
                  lambda ct, y, a, b: [_ub(where(a >= b, ct, 0.0), a), _ub(where(a >= b, 0.0, ct), b)],
                  "max({0}, {1})")
minimum = _binary("minimum", np.minimum,
                  lambda ct, y, a, b: [_ub(where(a <= b, ct, 0.0), a), _ub(where(a <= b, 0.0, ct), b)],
                  "min({0}, {1})")


def _cmp(name, ref, wgsl):
    return _binary(name, lambda a, b: ref(a, b).astype(np.uint32), None, wgsl, out_dtype=u32, differentiable=False)


lt = _cmp("lt", np.less, "u32({0} < {1})")
le = _cmp("le", np.less_equal, "u32({0} <= {1})")
gt = _cmp("gt", np.greater, "u32({0} > {1})")
ge = _cmp("ge", np.greater_equal, "u32({0} >= {1})")
eq = _cmp("eq", np.equal, "u32({0} == {1})")
ne = _cmp("ne", np.not_equal, "u32({0} != {1})")


# ----------------------------------------------------------------------------- where
def _where_infer(ins):
    c, a, b = ins
    if c.dtype.is_float:
        raise TypeError(f"where: condition {c.name!r} has dtype {c.dtype.name}, expected an integer mask (u32/i32)")
    dt = same_dtype("where", a, b)
    return broadcast_shapes("where", c, a, b), dt


register("where", _where_infer, lambda c, a, b: np.where(c != 0, a, b),
         lambda ct, y, c, a, b: [None, _ub(where(c, ct, 0.0), a), _ub(where(c, 0.0, ct), b)],
         wgsl="select({2}, {1}, {0} != 0u)")


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
         lambda ct, y, x, dtype: [cast(ct, x.dtype) if x.dtype.is_float else None], wgsl="cast")


def cast(x, dtype):
    dtype = dtype_of(dtype)
    if x.dtype is dtype:
        return x
    return emit("cast", [x], dtype=dtype.name)


# ----------------------------------------------------------------------- stop_gradient
register("stop_gradient", lambda ins: (ins[0].shape, ins[0].dtype), lambda x: x, None,
         differentiable=False, wgsl="{0}")


def stop_gradient(x):
    """Identity whose gradient is zero (torch's ``.detach()``)."""
    return emit("stop_gradient", [x])


detach = stop_gradient

# ------------------------------------------------------------------------------ recompute
# The input of a checkpointed region as its recomputation in the backward pass reads it
# (autodiff.checkpoint): an identity whose ``region`` attribute keeps the recomputed nodes
# apart from the forward ones, which merging common subexpressions would otherwise undo.
register("recompute", lambda ins, region: (ins[0].shape, ins[0].dtype), lambda x, region: x, None,
         differentiable=False, wgsl="{0}")


def recompute(x, region: int):
    return emit("recompute", [x], region=int(region))
