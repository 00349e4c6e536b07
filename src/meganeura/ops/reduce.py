"""Reductions along axes: sum, mean, max (torch's ``dim=`` / ``keepdim=``)."""
from __future__ import annotations

import numpy as np

from .registry import emit, norm_dims, register, require_float


def _reduce_infer(name):
    def infer(ins, dims, keepdim):
        x = ins[0]
        if name != "reduce_sum":
            require_float(name, x)
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
         lambda ct, y, x, dims, keepdim: [_spread(ct, x, dims)], wgsl_reduce="sum")
register("reduce_mean", _reduce_infer("reduce_mean"),
         lambda x, dims, keepdim: np.mean(x, axis=dims, keepdims=keepdim, dtype=x.dtype),
         lambda ct, y, x, dims, keepdim: [_spread(ct, x, dims) * (1.0 / (_count(x, dims) or 1))],
         wgsl_reduce="mean")
register("reduce_max", _reduce_infer("reduce_max"),
         lambda x, dims, keepdim: np.max(x, axis=dims, keepdims=keepdim), _max_vjp, wgsl_reduce="max")


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


def max(x, dim=None, keepdim=False):
    """Maximum values along ``dim`` (values only; torch.max(x, dim).values)."""
    return amax(x, dim, keepdim)
