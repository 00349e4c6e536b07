"""Normalisation ops: layer_norm, rms_norm, group_norm and batch_norm (training mode) are
single nodes with a fused NumPy reference, a VJP written in primitive ops and a
``decompose`` that rebuilds them from primitives for the GPU backend; batch_norm in eval
mode and batch_norm_stats are compositions of primitives. ``norm_stat`` is a statistic
(mean or inverse deviation over the rows) the forward norm kernel stores for the backward."""
from __future__ import annotations

import numpy as np

from ..graph import fmt_shape
from .elementwise import rsqrt
from .reduce import reduce_sum
from .registry import emit, op_error, register, require_float, same_dtype, unbroadcast
from .shape import permute, reshape
from .nn import _kmean

__all__ = ["rms_norm", "layer_norm", "group_norm", "batch_norm", "batch_norm_stats"]


# ------------------------------------------------------------------ normalisation core
# Each norm standardises a view of x over some axes, then applies a per-feature affine.
# _layout gives (view shape, reduced axes of the view, shape the weight/bias broadcast as).
def _layout(op, shape, attrs):
    nd = len(shape)
    if op in ("layer_norm", "rms_norm"):
        k = len(attrs["normalized_shape"])
        return shape, tuple(range(nd - k, nd)), shape[nd - k:]
    chan = (shape[1],) + (1,) * (nd - 2)
    if op == "group_norm":
        g = attrs["num_groups"]
        return (shape[0], g, int(np.prod(shape[1:], dtype=np.int64)) // g), (2,), chan
    return shape, (0,) + tuple(range(2, nd)), chan  # batch_norm over the batch


def _params(ins, attrs):
    """(weight, bias) from the node's inputs after x, None where absent."""
    rest = list(ins)
    w = rest.pop(0) if attrs.get("has_weight") else None
    b = rest.pop(0) if attrs.get("has_bias") else None
    return w, b


def _norm_ref(op):
    center = op != "rms_norm"

    def ref(x, *params, **attrs):
        view, axes, aff = _layout(op, x.shape, attrs)
        v = x.reshape(view)
        eps = x.dtype.type(attrs["eps"])
        if center:
            v = v - np.mean(v, axis=axes, keepdims=True, dtype=x.dtype)
        n = (v / np.sqrt(np.mean(v * v, axis=axes, keepdims=True, dtype=x.dtype) + eps)).reshape(x.shape)
        w, b = _params(params, attrs)
        if w is not None:
            n = n * w.reshape(aff)
        if b is not None:
            n = n + b.reshape(aff)
        return n
    return ref


def _standardize(v, axes, eps, center):
    """(normalised v, 1/sqrt(var + eps) kept over axes) in graph ops."""
    if center:
        v = v - _kmean(v, axes)
    r = rsqrt(_kmean(v * v, axes) + eps)
    return v * r, r


def _norm_graph(op):
    center = op != "rms_norm"

    def dec(x, *params, **attrs):
        view, axes, aff = _layout(op, x.shape, attrs)
        if op == "group_norm":
            # a layer norm over each (sample, group) row: one row kernel on the GPU, the
            # per-channel affine below becoming its epilogue
            n = reshape(emit("layer_norm", [reshape(x, view)], normalized_shape=(view[-1],), eps=attrs["eps"],
                             has_weight=False, has_bias=False), x.shape)
        elif op == "batch_norm":
            # a layer norm over each channel's (sample, position) row of the transposed view
            nb, c = x.shape[0], x.shape[1]
            hw = int(np.prod(x.shape[2:], dtype=np.int64))
            rows = permute(reshape(x, (nb, c, hw)), (1, 0, 2))
            ln = emit("layer_norm", [rows], normalized_shape=(nb, hw), eps=attrs["eps"], has_weight=False,
                      has_bias=False)
            n = reshape(permute(ln, (1, 0, 2)), x.shape)
        else:
            n = reshape(_standardize(reshape(x, view), axes, attrs["eps"], center)[0], x.shape)
        w, b = _params(params, attrs)
        if w is not None:
            n = n * reshape(w, aff)
        if b is not None:
            n = n + reshape(b, aff)
        return n
    return dec


# ------------------------------------------------ statistics the forward norm kernel stores
# A norm's backward needs the forward's statistics. ``norm_stat`` is one of them (the mean,
# or 1/sqrt(var + eps)) over the trailing ``k`` dims of its input, kept as size-1 dims. The
# backward reads them over exactly the view the forward norm kernel normalises, so on the
# GPU the compiler stores them from that kernel (fusion pass ``normstats``) instead of
# reducing the input again; alone, a stats-only row kernel computes them.
NORM_STAT = "norm_stat"


def _stat_infer(ins, stat, k, center, eps):
    x = ins[0]
    require_float(NORM_STAT, x)
    if stat not in ("mean", "rstd") or not 1 <= k <= x.ndim or (stat == "mean" and not center):
        raise op_error(NORM_STAT, f"bad statistic {stat!r} over {k} trailing dims (center={center})", x)
    return x.shape[:x.ndim - k] + (1,) * k, x.dtype


def _stat_ref(x, stat, k, center, eps):
    axes = tuple(range(x.ndim - k, x.ndim))
    m = np.mean(x, axis=axes, keepdims=True, dtype=x.dtype)
    if stat == "mean":
        return m
    v = x - m if center else x
    return (1 / np.sqrt(np.mean(v * v, axis=axes, keepdims=True, dtype=x.dtype) + x.dtype.type(eps))).astype(x.dtype)


def _stat_graph(x, stat, k, center, eps):
    axes = tuple(range(x.ndim - k, x.ndim))
    if stat == "mean":
        return _kmean(x, axes)
    return _standardize(x, axes, eps, center)[1]


def _stat_vjp(ct, out, x, **attrs):
    from ..autodiff import grad
    return grad(_stat_graph(x, **attrs), [x], ct)


register(NORM_STAT, _stat_infer, _stat_ref, _stat_vjp, decompose=_stat_graph)


def _norm_stats(op, x, attrs):
    """(normalised x, 1/sqrt(var + eps)) for ``op``'s backward, the statistics read as
    ``norm_stat`` nodes over the view the forward's layer-norm kernel normalises (a group
    norm's groups, a batch norm's transposed channels), broadcast back to x's layout."""
    center, eps = op != "rms_norm", float(attrs["eps"])
    if op == "batch_norm":
        nb, c = x.shape[0], x.shape[1]
        hw = int(np.prod(x.shape[2:], dtype=np.int64))
        rows, k, kept = permute(reshape(x, (nb, c, hw)), (1, 0, 2)), 2, (1, c) + (1,) * (x.ndim - 2)
    else:
        view, axes, _ = _layout(op, x.shape, attrs)
        rows, k, kept = reshape(x, view), len(axes), None

    def stat(name):
        v = emit(NORM_STAT, [rows], stat=name, k=k, center=center, eps=eps)
        return reshape(v, kept) if kept is not None else v
    r = stat("rstd")
    xv = x if op == "batch_norm" else rows
    n = (xv - stat("mean")) * r if center else xv * r
    return n, r


def _norm_vjp(op):
    center = op != "rms_norm"

    def vjp(ct, y, x, *params, **attrs):
        view, axes, aff = _layout(op, x.shape, attrs)
        n, r = _norm_stats(op, x, attrs)
        w, b = _params(params, attrs)
        dn = reshape(ct * reshape(w, aff) if w is not None else ct, view)
        inner = dn - n * _kmean(dn * n, axes)
        if center:
            inner = inner - _kmean(dn, axes)
        out = [reshape(r * inner, x.shape)]
        if w is not None:
            out.append(reshape(unbroadcast(ct * reshape(n, x.shape), aff), w.shape))
        if b is not None:
            out.append(reshape(unbroadcast(ct, aff), b.shape))
        return out
    return vjp


def _norm_infer(op):
    def infer(ins, **attrs):
        x = ins[0]
        require_float(op, *ins)
        same_dtype(op, *ins)
        want = attrs["normalized_shape"] if op in ("layer_norm", "rms_norm") else (x.shape[1],)
        w, b = _params(ins[1:], attrs)
        for t, what in ((w, "weight"), (b, "bias")):
            if t is not None and t.shape != want:
                raise op_error(op, f"{what} must have shape {fmt_shape(want)}", x, t)
        return x.shape, x.dtype
    return infer


for _op in ("layer_norm", "rms_norm", "group_norm", "batch_norm"):
    register(_op, _norm_infer(_op), _norm_ref(_op), _norm_vjp(_op), decompose=_norm_graph(_op))


def _affine_inputs(x, weight, bias):
    ins = [x] + [t for t in (weight, bias) if t is not None]
    return ins, {"has_weight": weight is not None, "has_bias": bias is not None}


def _check_normalized_shape(op, x, normalized_shape):
    ns = (int(normalized_shape),) if isinstance(normalized_shape, (int, np.integer)) else \
        tuple(int(s) for s in normalized_shape)
    if not ns or x.shape[x.ndim - len(ns):] != ns or len(ns) > x.ndim:
        raise op_error(op, f"normalized_shape {fmt_shape(ns)} must be the input's trailing dimensions", x)
    return ns


def layer_norm(input, normalized_shape, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.layer_norm: standardise over the trailing ``normalized_shape``
    axes (biased variance), then ``* weight + bias``."""
    ns = _check_normalized_shape("layer_norm", input, normalized_shape)
    ins, flags = _affine_inputs(input, weight, bias)
    return emit("layer_norm", ins, normalized_shape=ns, eps=float(eps), **flags)


def rms_norm(input, normalized_shape, weight=None, eps=None):
    """torch.nn.functional.rms_norm: x / sqrt(mean(x^2) + eps) * weight. ``eps=None`` is
    f32's machine epsilon, as torch (which takes it from the f32 compute type for f16)."""
    ns = _check_normalized_shape("rms_norm", input, normalized_shape)
    if eps is None:
        eps = float(np.finfo(np.float32).eps)
    ins, flags = _affine_inputs(input, weight, None)
    return emit("rms_norm", ins, normalized_shape=ns, eps=float(eps), has_weight=flags["has_weight"])


def group_norm(input, num_groups, weight=None, bias=None, eps=1e-5):
    """torch.nn.functional.group_norm on (N, C, *): standardise each of ``num_groups``
    channel groups per sample, then a per-channel ``* weight + bias``."""
    if input.ndim < 2:
        raise op_error("group_norm", "input must be (N, C, *)", input)
    c = input.shape[1]
    if num_groups < 1 or c % num_groups:
        raise op_error("group_norm", f"{c} channels cannot be split into {num_groups} groups", input)
    ins, flags = _affine_inputs(input, weight, bias)
    return emit("group_norm", ins, num_groups=int(num_groups), eps=float(eps), **flags)


def _channel_shape(x):
    return (x.shape[1],) + (1,) * (x.ndim - 2)


def batch_norm(input, running_mean, running_var, weight=None, bias=None, training=False, momentum=0.1, eps=1e-5):
    """torch.nn.functional.batch_norm on (N, C, *).

    Training: normalise with the batch's mean and biased variance; the running statistics
    are not updated here (the graph is pure): use batch_norm_stats and update them as
    state, e.g. ``rm * (1 - momentum) + mean * momentum``. Eval: use ``running_mean`` and
    ``running_var`` (ordinary tensors)."""
    op = "batch_norm"
    if input.ndim < 2:
        raise op_error(op, "input must be (N, C, *)", input)
    c = input.shape[1]
    for t, what in ((running_mean, "running_mean"), (running_var, "running_var")):
        if t is not None and t.shape != (c,):
            raise op_error(op, f"{what} must have shape ({c},)", input, t)
    if training:
        if input.size // max(c, 1) == 1:      # (an empty batch is an empty result, as torch)
            raise op_error(op, "training needs more than 1 value per channel", input)
        ins, flags = _affine_inputs(input, weight, bias)
        return emit(op, ins, eps=float(eps), **flags)
    if running_mean is None or running_var is None:
        raise ValueError("batch_norm: eval mode (training=False) needs running_mean and running_var")
    for t, what in ((weight, "weight"), (bias, "bias")):
        if t is not None and t.shape != (c,):
            raise op_error(op, f"{what} must have shape ({c},)", input, t)
    cs = _channel_shape(input)
    y = (input - reshape(running_mean, cs)) * rsqrt(reshape(running_var, cs) + float(eps))
    if weight is not None:
        y = y * reshape(weight, cs)
    if bias is not None:
        y = y + reshape(bias, cs)
    return y


def batch_norm_stats(input):
    """Per-channel (mean, unbiased variance) of (N, C, *) over all axes but 1: what a
    training step feeds into the running statistics."""
    if input.ndim < 2:
        raise op_error("batch_norm_stats", "input must be (N, C, *)", input)
    require_float("batch_norm_stats", input)
    n = input.size // max(input.shape[1], 1)
    if n <= 1:
        raise op_error("batch_norm_stats", "needs more than 1 value per channel", input)
    axes = (0,) + tuple(range(2, input.ndim))
    m = _kmean(input, axes)
    d = input - m
    return reshape(m, (input.shape[1],)), reduce_sum(d * d, axes) * (1.0 / (n - 1))
