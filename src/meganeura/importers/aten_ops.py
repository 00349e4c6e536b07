"""The ATen op table: each supported ATen overload (after torch.export's decompositions)
mapped onto meganeura ops, one small rule a row.

A rule takes ``(cx, *args, **kwargs)``: tensors as meganeura Tensors, constants the graph
does not depend on as torch tensors (``cx.t`` makes them graph constants), everything else
as torch passes it. Nodes whose inputs are all constants never reach a rule: the importer
evaluates them with torch itself (masks, position ids, rotary tables), so the table only
needs ops whose inputs can come from the model's inputs or weights.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import Tensor
from .errors import Unavailable, rule_table

INT64_MAX = 2 ** 63 - 1
TABLE, rule = rule_table()


def _pair(cx, a, b):
    """Both operands as tensors of one dtype, promoted as torch (an int and a float: float)."""
    if isinstance(a, Tensor) and isinstance(b, Tensor):
        if a.dtype is not b.dtype:
            if a.dtype.is_float and not b.dtype.is_float:
                b = ops.cast(b, a.dtype)
            elif b.dtype.is_float and not a.dtype.is_float:
                a = ops.cast(a, b.dtype)
            else:
                b = ops.cast(b, a.dtype)
        return a, b
    if not isinstance(a, Tensor):
        b2, a2 = _pair(cx, b, a)
        return a2, b2
    if isinstance(b, bool):
        b = int(b)
    if not isinstance(b, (int, float)):          # a constant tensor
        b = cx.t(b, like=a)
        return _pair(cx, a, b)
    if isinstance(b, float) and not a.dtype.is_float:
        a = ops.cast(a, cx.float_dtype)
    return a, b


def _binary(fn):
    return lambda cx, a, b: fn(*_pair(cx, a, b))


# ------------------------------------------------------------------ elementwise maths
@rule("aten.add.Tensor", "aten.add.Scalar")
def _add(cx, a, b, alpha=1):
    a, b = _pair(cx, a, b)
    return ops.add(a, b if alpha == 1 else b * alpha)


@rule("aten.sub.Tensor", "aten.sub.Scalar")
def _sub(cx, a, b, alpha=1):
    a, b = _pair(cx, a, b)
    return ops.sub(a, b if alpha == 1 else b * alpha)


@rule("aten.rsub.Scalar", "aten.rsub.Tensor")
def _rsub(cx, a, b, alpha=1):
    return _sub(cx, b, a if alpha == 1 else a * alpha)


TABLE["aten.mul.Tensor"] = TABLE["aten.mul.Scalar"] = _binary(ops.mul)
TABLE["aten.maximum.default"] = _binary(ops.maximum)
TABLE["aten.minimum.default"] = _binary(ops.minimum)
for _n in ("eq", "ne", "lt", "le", "gt", "ge"):
    TABLE[f"aten.{_n}.Tensor"] = TABLE[f"aten.{_n}.Scalar"] = _binary(getattr(ops, _n))


@rule("aten.div.Tensor", "aten.div.Scalar", "aten.div.Tensor_mode")
def _div(cx, a, b, rounding_mode=None):
    if rounding_mode is not None:
        raise NotImplementedError(f"division with rounding_mode={rounding_mode!r} (no floor/trunc op)")
    a, b = _pair(cx, a, b)
    if isinstance(a, Tensor) and not a.dtype.is_float:
        a = ops.cast(a, cx.float_dtype)
    return ops.div(a, b)


@rule("aten.pow.Tensor_Scalar")
def _pow(cx, x, exponent):
    return ops.pow(x, float(exponent))


@rule("aten.pow.Tensor_Tensor", "aten.pow.Scalar")
def _pow_tensor(cx, x, exponent):
    x, exponent = _pair(cx, x, exponent)
    return ops.pow(x, exponent)


for _n in ("neg", "exp", "log", "sqrt", "rsqrt", "tanh", "sigmoid", "relu", "abs", "erf", "sign", "silu"):
    TABLE[f"aten.{_n}.default"] = (lambda f: lambda cx, x: f(x))(getattr(ops, _n))


@rule("aten.reciprocal.default")
def _reciprocal(cx, x):
    return ops.div(1.0, x)


@rule("aten.gelu.default")
def _gelu(cx, x, approximate="none"):
    return ops.gelu(x, approximate=approximate)


@rule("aten.clamp.default", "aten.clamp.Tensor")
def _clamp(cx, x, min=None, max=None):
    lo = cx.t(min, like=x) if min is not None and not isinstance(min, (int, float, Tensor)) else min
    hi = cx.t(max, like=x) if max is not None and not isinstance(max, (int, float, Tensor)) else max
    return ops.clamp(x, lo, hi)


@rule("aten.clamp_min.default")
def _clamp_min(cx, x, m):
    return ops.clamp(x, min=m)


@rule("aten.clamp_max.default")
def _clamp_max(cx, x, m):
    return ops.clamp(x, max=m)


@rule("aten.hardtanh.default")
def _hardtanh(cx, x, lo=-1.0, hi=1.0):
    return ops.clamp(x, lo, hi)


@rule("aten.where.self", "aten.where.ScalarOther", "aten.where.ScalarSelf", "aten.where.Scalar")
def _where(cx, cond, a, b):
    like = next((v for v in (a, b, cond) if isinstance(v, Tensor)), None)
    cond = cx.t(cond, like=like) if not isinstance(cond, Tensor) else cond
    if isinstance(a, Tensor) or isinstance(b, Tensor) or not isinstance(a, (int, float)):
        a, b = _pair(cx, cx.t(a, like=like) if not isinstance(a, (int, float, Tensor)) else a,
                     cx.t(b, like=like) if not isinstance(b, (int, float, Tensor)) else b)
    return ops.where(cond, a, b)


@rule("aten.logical_not.default", "aten.bitwise_not.default")
def _logical_not(cx, x):
    return ops.eq(_as_u32(x), 0)


def _as_u32(x):
    return x if x.dtype.name == "u32" else ops.ne(x, 0)


@rule("aten.logical_and.default", "aten.bitwise_and.Tensor")
def _logical_and(cx, a, b):
    a, b = _pair(cx, a, b)
    return ops.mul(_as_u32(a), _as_u32(b))


@rule("aten.logical_or.default", "aten.bitwise_or.Tensor")
def _logical_or(cx, a, b):
    a, b = _pair(cx, a, b)
    return ops.ne(ops.add(_as_u32(a), _as_u32(b)), 0)


# ------------------------------------------------------------------- casts and copies
@rule("aten._to_copy.default", "aten.to.dtype")
def _to_copy(cx, x, dtype=None, **_):
    return x if dtype is None else ops.cast(x, cx.dtype(dtype))


for _n in ("aten.clone.default", "aten.alias.default", "aten.detach.default", "aten.lift_fresh_copy.default",
           "aten.contiguous.default", "aten.dropout.default"):
    TABLE[_n] = lambda cx, x, *a, **k: x


@rule("aten.native_dropout.default")
def _native_dropout(cx, x, p, train):
    if train and p > 0:
        raise NotImplementedError(f"dropout with p={p} in training mode (randomness is not supported; set p=0)")
    return (x, Unavailable("dropout's mask"))


# ------------------------------------------------------------------------ shapes
@rule("aten.view.default", "aten._unsafe_view.default", "aten.reshape.default")
def _view(cx, x, shape):
    return ops.reshape(x, tuple(int(s) for s in shape))


@rule("aten.permute.default")
def _permute(cx, x, dims):
    return ops.permute(x, tuple(dims))


@rule("aten.transpose.int")
def _transpose(cx, x, d0, d1):
    return ops.transpose(x, d0, d1)


@rule("aten.t.default")
def _t(cx, x):
    return x if x.ndim < 2 else ops.transpose(x, 0, 1)


@rule("aten.expand.default")
def _expand(cx, x, shape):
    lead = len(shape) - x.ndim
    full = tuple(x.shape[i - lead] if s == -1 else int(s) for i, s in enumerate(shape))
    return ops.broadcast_to(x, full)


@rule("aten.unsqueeze.default")
def _unsqueeze(cx, x, dim):
    return ops.unsqueeze(x, dim)


@rule("aten.squeeze.dim", "aten.squeeze.dims", "aten.squeeze.default")
def _squeeze(cx, x, dim=None):
    return ops.squeeze(x, tuple(dim) if isinstance(dim, (list, tuple)) else dim)


@rule("aten.slice.Tensor")
def _slice(cx, x, dim=0, start=None, end=None, step=1):
    end = None if end is not None and end >= INT64_MAX else end
    return ops.slice(x, dim, start, end, step)


@rule("aten.select.int")
def _select(cx, x, dim, index):
    d = dim % x.ndim
    i = index % x.shape[d]
    return ops.squeeze(ops.slice(x, d, i, i + 1), d)


@rule("aten.cat.default")
def _cat(cx, tensors, dim=0):
    like = next(t for t in tensors if isinstance(t, Tensor))
    ts = [t if isinstance(t, Tensor) else cx.t(t, like=like) for t in tensors]
    ts = [t for t in ts if t.size or t.ndim > 1]          # torch's legacy empty (0,) operands
    return ops.concat(ts, dim)


@rule("aten.split_with_sizes.default", "aten.split.Tensor")
def _split(cx, x, sizes, dim=0):
    return tuple(ops.split(x, sizes if isinstance(sizes, int) else list(sizes), dim))


@rule("aten.as_strided.default")
def _as_strided(cx, x, size, stride, storage_offset=None):
    """A view of the input's storage (torch's decompositions re-stride values with it, as to
    channels-last before a permute). Our values are logical, so the storage is the input in
    its own torch layout: the positions the view reads are computed here; a view that reads
    every element in logical order is a reshape, any other one gathers them."""
    val = cx.node.args[0].meta.get("val")
    size, stride = tuple(int(s) for s in size), tuple(int(s) for s in stride)
    if val is None:
        raise NotImplementedError("as_strided of a value with no recorded layout")
    # the input's storage position of each of its logical elements, then the view's reads
    pos = np.zeros(tuple(val.shape), np.int64) + int(val.storage_offset())
    for d, (n, st) in enumerate(zip(val.shape, val.stride())):
        pos += (np.arange(int(n)) * int(st)).reshape((-1,) + (1,) * (val.ndim - d - 1))
    reads = np.zeros(size, np.int64) + (int(val.storage_offset()) if storage_offset is None else int(storage_offset))
    for d, (n, st) in enumerate(zip(size, stride)):
        reads += (np.arange(n) * st).reshape((-1,) + (1,) * (len(size) - d - 1))
    element = np.full(max(int(pos.max(initial=0)), int(reads.max(initial=0))) + 1, -1, np.int64)
    element[pos.ravel()] = np.arange(pos.size)          # storage position -> the input's element
    index = element[reads.ravel()]
    if (index < 0).any():
        bad = int(reads.ravel()[np.argmax(index < 0)])
        raise NotImplementedError(f"as_strided(size={list(size)}, stride={list(stride)}) reads storage "
                                  f"position {bad} outside the input {tuple(val.shape)}")
    flat = ops.reshape(x, (x.size,))
    if not np.array_equal(index, np.arange(x.size)):
        flat = ops.index_select(flat, 0, cx.t(index.astype(np.int32)))
    return ops.reshape(flat, size)


@rule("aten.unbind.int")
def _unbind(cx, x, dim=0):
    return tuple(_select(cx, x, dim, i) for i in range(x.shape[dim % x.ndim]))


@rule("aten.flatten.using_ints")
def _flatten(cx, x, start=0, end=-1):
    return ops.flatten(x, start, end)


@rule("aten.gather.default")
def _gather(cx, x, dim, index, sparse_grad=False):
    return ops.gather(x, dim, index if isinstance(index, Tensor) else cx.t(index))


@rule("aten.index_select.default")
def _index_select(cx, x, dim, index):
    return ops.index_select(x, dim, index if isinstance(index, Tensor) else cx.t(index))


@rule("aten.index.Tensor")
def _index(cx, x, indices):
    """x[..., idx, ...] with one index tensor (the rest None): an index_select."""
    real = [(i, ix) for i, ix in enumerate(indices) if ix is not None]
    if len(real) != 1:
        raise NotImplementedError("advanced indexing with more than one index tensor")
    d, ix = real[0]
    ix = ix if isinstance(ix, Tensor) else cx.t(ix)
    flat = ops.index_select(x, d, ops.reshape(ix, (ix.size,)))
    return ops.reshape(flat, x.shape[:d] + ix.shape + x.shape[d + 1:])


@rule("aten.embedding.default")
def _embedding(cx, weight, ids, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    ids = ids if isinstance(ids, Tensor) else cx.t(ids)
    return ops.embedding(ids, weight)


# ------------------------------------------------------------------------ reductions
def _dims(dim):
    return None if dim is None or (isinstance(dim, (list, tuple)) and len(dim) == 0) else \
        (tuple(dim) if isinstance(dim, (list, tuple)) else dim)


@rule("aten.sum.dim_IntList", "aten.sum.default")
def _sum(cx, x, dim=None, keepdim=False, dtype=None):
    return ops.sum(x if dtype is None else ops.cast(x, cx.dtype(dtype)), _dims(dim), keepdim)


@rule("aten.mean.dim", "aten.mean.default")
def _mean(cx, x, dim=None, keepdim=False, dtype=None):
    return ops.mean(x if dtype is None else ops.cast(x, cx.dtype(dtype)), _dims(dim), keepdim)


@rule("aten.amax.default")
def _amax(cx, x, dim=(), keepdim=False):
    return ops.amax(x, _dims(dim), keepdim)


@rule("aten.amin.default")
def _amin(cx, x, dim=(), keepdim=False):
    return ops.amin(x, _dims(dim), keepdim)


@rule("aten.max.dim")
def _max_dim(cx, x, dim, keepdim=False):
    return tuple(ops.max(x, dim, keepdim))


@rule("aten.min.dim")
def _min_dim(cx, x, dim, keepdim=False):
    return tuple(ops.min(x, dim, keepdim))


@rule("aten.max.default")
def _max_all(cx, x):
    return ops.max(x)


@rule("aten.min.default")
def _min_all(cx, x):
    return ops.min(x)


@rule("aten.var.correction")
def _var(cx, x, dim=None, correction=1, keepdim=False):
    return ops.var(x, _dims(dim), correction=1 if correction is None else correction, keepdim=keepdim)


# ------------------------------------------------------------------------ linear algebra
@rule("aten.mm.default", "aten.bmm.default", "aten.matmul.default")
def _mm(cx, a, b):
    return ops.matmul(a, b)


@rule("aten.addmm.default")
def _addmm(cx, bias, a, b, beta=1, alpha=1):
    y = ops.matmul(a, b)
    y = y if alpha == 1 else y * alpha
    return y + (bias if beta == 1 else bias * beta)


@rule("aten.linear.default")
def _linear(cx, x, w, b=None):
    return ops.linear(x, w, b)


# ------------------------------------------------------------------------ nn
@rule("aten._softmax.default", "aten.softmax.int")
def _softmax(cx, x, dim, half_to_float=False):
    return ops.softmax(x, dim)


@rule("aten._log_softmax.default", "aten.log_softmax.int")
def _log_softmax(cx, x, dim, half_to_float=False):
    return ops.log_softmax(x, dim)


@rule("aten.native_layer_norm.default")
def _layer_norm(cx, x, shape, weight=None, bias=None, eps=1e-5):
    return (ops.layer_norm(x, tuple(shape), weight, bias, eps), Unavailable("layer norm's mean"),
            Unavailable("layer norm's rstd"))


@rule("aten.native_group_norm.default")
def _group_norm(cx, x, weight, bias, n, c, hw, groups, eps):
    return (ops.group_norm(x, groups, weight, bias, eps), Unavailable("group norm's mean"),
            Unavailable("group norm's rstd"))


@rule("aten._native_batch_norm_legit_no_training.default")
def _batch_norm_eval(cx, x, weight, bias, running_mean, running_var, momentum, eps):
    return (ops.batch_norm(x, running_mean, running_var, weight, bias, False, momentum, eps),
            Unavailable("batch norm's saved mean"), Unavailable("batch norm's saved rstd"))


@rule("aten._native_batch_norm_legit_functional.default")
def _batch_norm_train(cx, x, weight, bias, running_mean, running_var, training, momentum, eps):
    if not training:
        return _batch_norm_eval(cx, x, weight, bias, running_mean, running_var, momentum, eps) + \
            (running_mean, running_var)
    y = ops.batch_norm(x, None, None, weight, bias, True, momentum, eps)
    mean, var = ops.batch_norm_stats(x)         # unbiased variance, as torch's running_var
    new_mean = running_mean * (1.0 - momentum) + mean * momentum
    new_var = running_var * (1.0 - momentum) + var * momentum
    return (y, Unavailable("batch norm's saved mean"), Unavailable("batch norm's saved rstd"), new_mean, new_var)


@rule("aten.convolution.default")
def _convolution(cx, x, w, b, stride, padding, dilation, transposed, output_padding, groups):
    if transposed:
        raise NotImplementedError("transposed convolution")
    if w.ndim == 4:
        return ops.conv2d(x, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)
    if w.ndim == 3:
        return ops.conv1d(x, w, b, tuple(stride), tuple(padding), tuple(dilation), groups)
    raise NotImplementedError(f"{w.ndim - 2}-D convolution (conv1d and conv2d are supported)")


@rule("aten.max_pool2d_with_indices.default")
def _max_pool(cx, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    return (ops.max_pool2d(x, tuple(kernel), tuple(stride) or None, padding, dilation, ceil_mode),
            Unavailable("max pooling's indices"))


@rule("aten.max_pool2d.default")
def _max_pool_values(cx, x, kernel, stride=(), padding=0, dilation=1, ceil_mode=False):
    return ops.max_pool2d(x, tuple(kernel), tuple(stride) or None, padding, dilation, ceil_mode)


@rule("aten.avg_pool2d.default")
def _avg_pool(cx, x, kernel, stride=(), padding=0, ceil_mode=False, count_include_pad=True, divisor_override=None):
    return ops.avg_pool2d(x, tuple(kernel), tuple(stride) or None, padding, ceil_mode, count_include_pad,
                          divisor_override)


@rule("aten.upsample_bilinear2d.vec")
def _upsample_bilinear(cx, x, output_size, align_corners, scale_factors=None):
    if output_size is not None:
        return ops.upsample_bilinear2d(x, tuple(output_size), align_corners=align_corners)
    return ops.upsample_bilinear2d(x, scale_factor=tuple(scale_factors), align_corners=align_corners)


@rule("aten.upsample_bilinear2d.default")
def _upsample_bilinear_sized(cx, x, output_size, align_corners, scales_h=None, scales_w=None):
    if scales_h is not None or scales_w is not None:
        return ops.upsample_bilinear2d(x, scale_factor=(scales_h, scales_w), align_corners=align_corners)
    return ops.upsample_bilinear2d(x, tuple(output_size), align_corners=align_corners)


@rule("aten.constant_pad_nd.default")
def _constant_pad(cx, x, pad, value=0):
    return ops.pad(x, tuple(pad), value=value)


@rule("aten._adaptive_avg_pool2d.default", "aten.adaptive_avg_pool2d.default")
def _adaptive_avg_pool(cx, x, size):
    return ops.adaptive_avg_pool2d(x, tuple(size))


@rule("aten.scaled_dot_product_attention.default")
def _sdpa(cx, q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        attn_mask = cx.t(attn_mask, like=q)
    return ops.scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, is_causal, scale, enable_gqa)


# ------------------------------------------------------------------------ fills and tests
@rule("aten.full_like.default", "aten.zeros_like.default", "aten.ones_like.default")
def _full_like(cx, x, value=None, dtype=None, **_):
    fill = {"aten.zeros_like.default": 0, "aten.ones_like.default": 1}.get(cx.target, value)
    dt = cx.dtype(dtype) if dtype is not None else x.dtype
    c = cx.g.constant(np.full((), fill, dtype=np.float64 if dt.is_float else np.int64), dt)
    return ops.broadcast_to(c, x.shape)


def _reduced(x, dim):
    dims = _dims(dim)
    axes = range(x.ndim) if dims is None else [d % max(x.ndim, 1) for d in (dims if isinstance(dims, tuple) else (dims,))]
    return int(np.prod([x.shape[d] for d in axes])) if x.ndim else 1


def _count_true(cx, x, dim, keepdim):
    return ops.sum(ops.cast(_as_u32(x), cx.float_dtype), _dims(dim), keepdim)


@rule("aten.any.dim", "aten.any.dims", "aten.any.default")
def _any(cx, x, dim=None, keepdim=False):
    return ops.gt(_count_true(cx, x, dim, keepdim), 0.0)


@rule("aten.all.dim", "aten.all.dims", "aten.all.default")
def _all(cx, x, dim=None, keepdim=False):
    return ops.ge(_count_true(cx, x, dim, keepdim), float(_reduced(x, dim)))


@rule("aten.isinf.default")
def _isinf(cx, x):
    return ops.eq(ops.abs(x), float("inf"))


@rule("aten.isnan.default")
def _isnan(cx, x):
    return ops.ne(x, x)
