"""Reductions along axes: sum, mean, max (torch's ``dim=`` / ``keepdim=``)."""
from __future__ import annotations

from collections import namedtuple

import numpy as np

from ..graph import fmt_shape
from .registry import emit, norm_dims, op_error, register, require_float


def _reduce_infer(name):
    def infer(ins, dims, keepdim):
        x = ins[0]
        if name != "reduce_sum":
            require_float(name, x)
        if name == "reduce_max" and any(x.shape[d] == 0 for d in dims):
            # torch: "Expected reduction dim to have non-zero size"; there is no maximum of nothing
            raise op_error("amax", f"cannot reduce over an empty axis (dims {tuple(dims)} of shape "
                           f"{fmt_shape(x.shape)})", x)
        return tuple(1 if i in dims else s for i, s in enumerate(x.shape) if keepdim or i not in dims), x.dtype
    return infer


def _keep_shape(x, dims):
    return tuple(1 if i in dims else s for i, s in enumerate(x.shape))


def _spread(ct, x, dims):
    """Cotangent of a reduction, broadcast back over the reduced axes."""
    from . import broadcast_to, reshape
    return broadcast_to(reshape(ct, _keep_shape(x, dims)), x.shape)


def _count(x, dims):
    return int(np.prod([x.shape[d] for d in dims], dtype=np.int64))


def _max_vjp(ct, y, x, dims, keepdim):
    from . import broadcast_to, cast, eq, reshape
    yb = broadcast_to(reshape(y, _keep_shape(x, dims)), x.shape)
    hit = cast(eq(x, yb), x.dtype)
    ties = reduce_sum(hit, dims, keepdim=True)
    return [_spread(ct, x, dims) * hit / broadcast_to(ties, x.shape)]


register("reduce_sum", _reduce_infer("reduce_sum"),
         lambda x, dims, keepdim: np.sum(x, axis=dims, keepdims=keepdim, dtype=x.dtype),
         lambda ct, y, x, dims, keepdim: [_spread(ct, x, dims)])
register("reduce_mean", _reduce_infer("reduce_mean"),
         lambda x, dims, keepdim: np.mean(x, axis=dims, keepdims=keepdim, dtype=x.dtype),
         lambda ct, y, x, dims, keepdim: [_spread(ct, x, dims) * (1.0 / (_count(x, dims) or 1))])
register("reduce_max", _reduce_infer("reduce_max"),
         lambda x, dims, keepdim: np.max(x, axis=dims, keepdims=keepdim), _max_vjp)


def reduce_sum(x, dims, keepdim=False):
    return emit("reduce_sum", [x], dims=tuple(dims), keepdim=bool(keepdim))


def sum(x, dim=None, keepdim=False):
    """torch.sum(x, dim, keepdim); ``dim=None`` reduces every axis."""
    return emit("reduce_sum", [x], dims=norm_dims("sum", dim, x.ndim, x), keepdim=bool(keepdim))


def mean(x, dim=None, keepdim=False):
    """torch.mean(x, dim, keepdim)."""
    return emit("reduce_mean", [x], dims=norm_dims("mean", dim, x.ndim, x), keepdim=bool(keepdim))


def amax(x, dim=None, keepdim=False):
    """torch.amax: the maximum values along ``dim`` (gradient split evenly between ties)."""
    return emit("reduce_max", [x], dims=norm_dims("amax", dim, x.ndim, x), keepdim=bool(keepdim))


def amin(x, dim=None, keepdim=False):
    """torch.amin: the minimum values along ``dim`` (as -amax(-x))."""
    return -amax(-x, dim, keepdim)


def _is_other(b):
    from ..graph import Tensor
    return isinstance(b, Tensor) or isinstance(b, float) or (isinstance(b, np.ndarray) and b.dtype.kind == "f")


MaxResult = namedtuple("max", ("values", "indices"))     # torch.return_types.max
MinResult = namedtuple("min", ("values", "indices"))     # torch.return_types.min


def _with_indices(op, result, extreme, x, dim, keepdim):
    from .scan import extreme_with_index
    if isinstance(dim, (tuple, list)):
        raise TypeError(f"{op}: dim must be one int, got {tuple(dim)!r} for tensor of shape "
                        f"{fmt_shape(x.shape)} (a{op} reduces several dims, without indices)")
    require_float(op, x)
    return result(*extreme_with_index(op, extreme, x, dim, keepdim))


def max(x, dim=None, keepdim=False):
    """torch.max: ``max(x)`` is the maximum value; ``max(x, dim, keepdim)`` is the named
    tuple ``(values, indices)`` (i32 indices of the first maximum, the gradient to it, as
    torch); ``max(x, other)`` with a Tensor (or float) ``other`` is torch.maximum."""
    from .elementwise import maximum
    if _is_other(dim):
        return maximum(x, dim)
    if dim is None:
        return amax(x, None, keepdim)
    return _with_indices("max", MaxResult, amax, x, dim, keepdim)


def min(x, dim=None, keepdim=False):
    """torch.min: like ``max`` (the named tuple ``(values, indices)`` along ``dim``, the
    first minimum; elementwise with a Tensor)."""
    from .elementwise import minimum
    if _is_other(dim):
        return minimum(x, dim)
    if dim is None:
        return amin(x, None, keepdim)
    return _with_indices("min", MinResult, amin, x, dim, keepdim)


def _correction(op, dim, correction, unbiased):
    """(dim, correction) from torch's overloads: ``var(x, unbiased)``, ``var(x, dim,
    unbiased, keepdim)`` and ``var(x, dim, correction=, keepdim=)`` (None is 1)."""
    if isinstance(dim, bool):                   # torch.var(x, True): the bool is unbiased
        if unbiased is not None:
            raise TypeError(f"{op}: unbiased given twice (positionally as {dim} and as unbiased={unbiased})")
        dim, unbiased = None, dim
    if isinstance(correction, bool):            # torch.var(x, dim, unbiased)
        if unbiased is not None:
            raise TypeError(f"{op}: unbiased given twice ({correction} and unbiased={unbiased})")
        correction, unbiased = None, correction
    if unbiased is not None:
        if correction is not None:
            raise TypeError(f"{op}: give correction= or unbiased=, not both")
        correction = 1 if unbiased else 0
    if correction is None:
        correction = 1
    if not isinstance(correction, (int, float, np.integer, np.floating)):
        raise TypeError(f"{op}: correction must be a number, got {type(correction).__name__}")
    return dim, float(correction)


def var(x, dim=None, correction=None, keepdim=False, unbiased=None):
    """torch.var: the sum of squared deviations over ``dim`` divided by n - correction
    (``unbiased=False`` is correction 0; ``var(x, True)`` reads the bool as ``unbiased``,
    as torch does). As torch: n - correction <= 0 gives inf (NaN where every deviation is 0,
    and over an empty axis)."""
    dim, correction = _correction("var", dim, correction, unbiased)
    dims = norm_dims("var", dim, x.ndim, x)
    n = _count(x, dims) if dims else 1
    d = x - mean(x, dims, keepdim=True)
    ss = emit("reduce_sum", [d * d], dims=dims, keepdim=bool(keepdim))
    return ss * (1.0 / (n - correction) if n > correction else float("inf"))


def std(x, dim=None, correction=None, keepdim=False, unbiased=None):
    """torch.std: the square root of ``var`` (the same arguments)."""
    from .elementwise import sqrt
    return sqrt(var(x, dim, correction, keepdim, unbiased))
