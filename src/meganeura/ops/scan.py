"""Scans and reductions built from the primitive ops (so every backend and autodiff have
them with nothing more): cumsum, prod, logsumexp, argmax / argmin."""
from __future__ import annotations

import numpy as np

from .elementwise import abs, cast, eq, exp, log, lt, stop_gradient, where
from .reduce import amax, amin, sum
from .registry import norm_dim, norm_dims, op_error
from .shape import broadcast_to, concat, reshape, slice, squeeze


def cumsum(x, dim, dtype=None):
    """torch.cumsum: running sums along ``dim``, as log2(n) shifted adds (Hillis and
    Steele's scan): f32 arithmetic whatever the precision mode, fused pointwise work."""
    if dtype is not None:
        x = cast(x, dtype)
    if x.ndim == 0:
        norm_dims("cumsum", dim, 0, x)
        return x
    d = norm_dim("cumsum", dim, x.ndim, x)
    n, k = x.shape[d], 1
    while k < n:
        zeros = broadcast_to(x.graph.constant(np.asarray(0), x.dtype), tuple(k if a == d else s for a, s in enumerate(x.shape)))
        x = x + concat([zeros, slice(x, d, 0, n - k)], d)
        k *= 2
    return x


def prod(x, dim=None, keepdim=False, dtype=None):
    """torch.prod: the product along ``dim`` (every element where None), halving the axis
    with pairwise products; exact gradients where elements are zero."""
    if dtype is not None:
        x = cast(x, dtype)
    if dim is None:
        out = prod(reshape(x, (-1,)), 0)
        return reshape(out, (1,) * x.ndim) if keepdim else out
    if x.ndim == 0:
        norm_dims("prod", dim, 0, x)
        return x
    d = norm_dim("prod", dim, x.ndim, x)
    if x.shape[d] == 0:
        one = broadcast_to(x.graph.constant(np.asarray(1), x.dtype), tuple(1 if a == d else s for a, s in enumerate(x.shape)))
        return one if keepdim else squeeze(one, d)
    while x.shape[d] > 1:
        n = x.shape[d]
        h = n // 2
        head = slice(x, d, 0, h) * slice(x, d, h, 2 * h)
        x = concat([head, slice(x, d, 2 * h, n)], d) if n % 2 else head
    return x if keepdim else squeeze(x, d)


def logsumexp(x, dim, keepdim=False):
    """torch.logsumexp: log(sum(exp(x))) along ``dim``, shifted by the maximum (a row of
    -inf gives -inf, a +inf gives +inf)."""
    if not x.dtype.is_float:
        raise op_error("logsumexp", "needs a float tensor", x)
    m = stop_gradient(amax(x, dim, keepdim=True))
    m = where(eq(abs(m), float("inf")), 0.0, m)
    out = log(sum(exp(x - m), dim, keepdim=True)) + m
    dims = norm_dims("logsumexp", dim, x.ndim, x)
    return out if keepdim or not dims else reshape(out, tuple(s for a, s in enumerate(out.shape) if a not in dims))


def _arg(op, pick, x, dim, keepdim):
    if dim is None:
        out = _arg(op, pick, reshape(x, (-1,)), 0, False)
        return reshape(out, (1,) * x.ndim) if keepdim else out
    if x.ndim == 0:
        norm_dims(op, dim, 0, x)
        return cast(x.graph.constant(np.asarray(0)), "i32")
    d = norm_dim(op, dim, x.ndim, x)
    xf = x if x.dtype.is_float else cast(x, "f32")
    _, _, first = _first_extreme(op, pick, xf, dim, d, keepdim)
    return cast(first, "i32")


def _first_extreme(op, pick, x, dim, d, keep_index):
    """(the extreme along ``d``, kept; the positions 0..n-1 along ``d``; the position of the
    first of equal extremes, as torch, in f32): what argmax and max.dim share."""
    n = x.shape[d]
    if n == 0:
        raise op_error(op, f"dim {dim} is empty: no index to give", x)
    m = pick(x, d, keepdim=True)
    pos = x.graph.constant(np.arange(n, dtype=np.float32).reshape(tuple(n if a == d else 1 for a in range(x.ndim))))
    return m, pos, amin(where(eq(x, m), pos, float(n)), d, keepdim=keep_index)


def extreme_with_index(op, pick, x, dim, keepdim):
    """(values, i32 indices) of torch.max / torch.min along one ``dim``: the index of the
    first extreme, as torch, and the gradient to that element only (torch's max.dim; amax
    splits it between ties). A row holding NaN gives NaN, as amax."""
    if x.ndim == 0:
        return pick(x, dim, keepdim), _arg(op, pick, x, dim, keepdim)
    d = norm_dim(op, dim, x.ndim, x)
    n = x.shape[d]
    m, pos, first = _first_extreme(op, pick, x, dim, d, True)
    picked = sum(where(eq(pos, first), x, 0.0), d, keepdim=True)    # x at the first extreme
    values, index = where(lt(first, float(n)), picked, stop_gradient(m)), cast(first, "i32")
    if keepdim:
        return values, index
    kept = tuple(s for a, s in enumerate(x.shape) if a != d)
    return reshape(values, kept), reshape(index, kept)


def argmax(x, dim=None, keepdim=False):
    """torch.argmax (i32 indices; the first maximum)."""
    return _arg("argmax", amax, x, dim, keepdim)


def argmin(x, dim=None, keepdim=False):
    """torch.argmin (i32 indices; the first minimum)."""
    return _arg("argmin", amin, x, dim, keepdim)
