"""Neural-network ops: softmax, losses, embedding (normalisations are in ``normalization.py``, rotary
embedding in ``rotary.py``).

Composite ops (softmax, log_softmax, cross_entropy) are single nodes with a fused NumPy
reference and a VJP written in primitive ops; each carries ``decompose``, which rebuilds it
from primitives for the GPU backend. mse_loss is a plain composition of primitives and adds
no op.

New primitives (simple index kernels):
- ``embedding``: out[p..., j] = weight[ids[p...], j]
- ``embedding_grad``: out[v, j] = sum over positions p (in flat order) with ids[p] == v of ct[p, j]
- ``one_hot``: out[p..., c] = 1 if labels[p...] == c else 0 (out-of-range labels give a zero row)

Indices cannot be checked when the graph is built. The NumPy reference raises on an
out-of-range id or label (as PyTorch does). On the GPU, with ``MEGANEURA_CHECKED=1``, the
embedding and one_hot kernels report such an index and the step raises IndexError naming
the op (cross_entropy for its labels) and the tensor; in trusted mode nothing is checked
but nothing is read out of bounds: embedding gives a zero row, embedding_grad drops it, and
cross_entropy counts such a label as an ignored row (its one_hot row is zero).
"""
from __future__ import annotations

import numpy as np

from ..graph import Tensor, dtype_of, f32, fmt_shape
from .elementwise import cast, exp, log, maximum, ne, neg, stop_gradient, where
from .reduce import amax, mean, reduce_sum
from .registry import emit, norm_dim, op_error, register, require_float, require_int, same_dtype
from .shape import permute, reshape


__all__ = ["softmax", "log_softmax", "cross_entropy", "mse_loss", "one_hot", "embedding", "embedding_grad",
           "safe_softmax"]

_REDUCTIONS = ("mean", "sum", "none")


def _ksum(x, dims):
    return reduce_sum(x, tuple(dims), keepdim=True)


def _kmean(x, dims):
    return mean(x, tuple(dims), keepdim=True)


def _float_infer(op):
    def infer(ins, **attrs):
        require_float(op, ins[0])
        if ins[0].ndim == 0:
            raise op_error(op, "input must have rank >= 1", ins[0])
        return ins[0].shape, ins[0].dtype
    return infer


# --------------------------------------------------------------------------- softmax
def _softmax_ref(x, dim):
    if x.size == 0:             # (no maximum over an empty axis): an empty result, as torch
        return np.empty_like(x)
    e = np.exp(x - np.max(x, axis=dim, keepdims=True))
    return e / np.sum(e, axis=dim, keepdims=True, dtype=x.dtype)


def _log_softmax_ref(x, dim):
    if x.size == 0:
        return np.empty_like(x)
    z = x - np.max(x, axis=dim, keepdims=True)
    return z - np.log(np.sum(np.exp(z), axis=dim, keepdims=True, dtype=x.dtype))


# the max only shifts for stability: its gradient cancels, so it is cut from autodiff
def _softmax_graph(x, dim):
    if x.size == 0:             # an empty result (amax refuses an empty axis)
        return x * 1.0
    e = exp(x - stop_gradient(amax(x, dim, keepdim=True)))
    return e / _ksum(e, (dim,))


def _log_softmax_graph(x, dim):
    if x.size == 0:
        return x * 1.0
    z = x - stop_gradient(amax(x, dim, keepdim=True))
    return z - log(_ksum(exp(z), (dim,)))


register("softmax", _float_infer("softmax"), _softmax_ref,
         lambda ct, y, x, dim: [y * (ct - _ksum(ct * y, (dim,)))], decompose=_softmax_graph)
register("log_softmax", _float_infer("log_softmax"), _log_softmax_ref,
         lambda ct, y, x, dim: [ct - exp(y) * _ksum(ct, (dim,))], decompose=_log_softmax_graph)


def _safe_softmax_ref(x, dim):
    if x.size == 0:
        return np.empty_like(x)
    m = np.max(x, axis=dim, keepdims=True)
    live = m > -np.inf
    e = np.exp(x - np.where(live, m, 0))
    return e / np.where(live, np.sum(e, axis=dim, keepdims=True, dtype=x.dtype), 1)


def _safe_softmax_graph(x, dim):
    if x.size == 0:
        return x * 1.0
    m = stop_gradient(amax(x, dim, keepdim=True))
    live = m > float("-inf")                 # the row has a position left
    e = exp(x - where(live, m, 0.0))         # all zeros in a fully masked row
    return e / where(live, _ksum(e, (dim,)), 1.0)


# softmax where a row of -inf gives zeros instead of NaN (torch's attention "safe softmax");
# its VJP is softmax's, which is zero on such rows
register("safe_softmax", _float_infer("safe_softmax"), _safe_softmax_ref,
         lambda ct, y, x, dim: [y * (ct - _ksum(ct * y, (dim,)))], decompose=_safe_softmax_graph)


def safe_softmax(input, dim=-1):
    """Softmax along ``dim`` that maps a row with every entry -inf to zeros (masked attention)."""
    return _softmax_like("safe_softmax", input, dim, None)


def _softmax_like(op, input, dim, dtype):
    if dim is None:  # torch's legacy implicit dim
        dim = 0 if input.ndim in (0, 1, 3) else 1
    if dtype is not None:
        input = cast(input, dtype)
    if input.ndim == 0:   # torch: a 0-d input is one row of one element
        norm_dim(op, int(dim), 1, input)
        return reshape(emit(op, [reshape(input, (1,))], dim=0), ())
    return emit(op, [input], dim=norm_dim(op, int(dim), input.ndim, input))


def softmax(input, dim=-1, _stacklevel=3, dtype=None):
    """torch.nn.functional.softmax (max-subtracted, so large logits do not overflow)."""
    return _softmax_like("softmax", input, dim, dtype)


def log_softmax(input, dim=-1, _stacklevel=3, dtype=None):
    """torch.nn.functional.log_softmax (max-subtracted)."""
    return _softmax_like("log_softmax", input, dim, dtype)


# --------------------------------------------------------------------------- one_hot
# ``ignore_index``: a label whose row is zero by design (cross_entropy's ignored rows);
# ``caller``: (op, tensor) named by checked mode's error for any other out-of-range label
def _one_hot_infer(ins, num_classes, dtype, ignore_index=None, caller=None):
    require_int("one_hot", ins[0])
    return ins[0].shape + (num_classes,), dtype_of(dtype)


def _one_hot_ref(labels, num_classes, dtype, ignore_index=None, caller=None):
    lab = labels[..., None].astype(np.int64)
    hot = lab == np.arange(num_classes)
    if ignore_index is not None:
        hot &= lab != ignore_index
    return hot.astype(dtype_of(dtype).np)


# out[p..., c] reads labels[p...] and compares it with c
register("one_hot", _one_hot_infer, _one_hot_ref, None, differentiable=False)


def one_hot(tensor, num_classes=-1, dtype=f32):
    """torch.nn.functional.one_hot, but ``num_classes`` is required (a static graph cannot
    look at the data), the result is ``dtype`` (f32 unless told; torch gives int64), and a
    label outside [0, num_classes) gives a zero row instead of an error."""
    if int(num_classes) < 1:
        raise op_error("one_hot", f"num_classes must be a positive int given up front, got {num_classes}", tensor)
    return emit("one_hot", [tensor], num_classes=int(num_classes), dtype=dtype_of(dtype).name)


# ---------------------------------------------------------------------- cross_entropy
def _ce_infer(ins, ignore_index, reduction, label_smoothing):
    logits, labels = ins
    require_float("cross_entropy", logits)
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise op_error("cross_entropy", "expected logits (N, C) and labels (N,)", logits, labels)
    return (() if reduction != "none" else labels.shape), logits.dtype


def _ce_ref(logits, labels, ignore_index, reduction, label_smoothing):
    n, c = logits.shape
    lab = labels.astype(np.int64)
    valid = lab != ignore_index
    bad = valid & ((lab < 0) | (lab >= c))
    if bad.any():
        raise IndexError(f"cross_entropy: label {int(lab[bad][0])} is out of range for {c} classes")
    dt = logits.dtype
    q = (np.where(valid, lab, -1)[:, None] == np.arange(c)).astype(dt)
    if label_smoothing:
        q = q * dt.type(1 - label_smoothing) + valid[:, None].astype(dt) * dt.type(label_smoothing / c)
    with np.errstate(invalid="ignore"):
        loss = -np.sum(_target_terms_ref(q, _log_softmax_ref(logits, 1)), axis=1, dtype=dt)
    if reduction == "none":
        return loss
    total = np.sum(loss, dtype=dt)
    if reduction == "sum":
        return total
    with np.errstate(invalid="ignore", divide="ignore"):  # every row ignored: nan, as torch
        return np.asarray(total / dt.type(valid.sum()), dtype=dt)


def _target_terms_ref(q, logp):
    """q * log p, 0 where q is 0: a class masked out with a -inf logit (log p = -inf) that is
    not the target adds nothing, as in torch (0 * -inf would be NaN)."""
    return np.where(q != 0, q * logp, q.dtype.type(0))


def _target_terms(q, logp):
    """The graph of ``_target_terms_ref``."""
    return where(ne(q, 0.0), q * logp, 0.0)


def _ce_target(logits, labels, ignore_index, label_smoothing):
    """Per-row target distribution q (N, C) (zero rows where ignored) and the one-hot."""
    c = logits.shape[1]
    # ignored rows are zero rows; any other label outside [0, c) is an error in checked mode
    oh = emit("one_hot", [labels], num_classes=c, dtype=logits.dtype.name, ignore_index=int(ignore_index),
              caller=("cross_entropy", labels.name))
    q = oh
    if label_smoothing:
        q = oh * (1.0 - label_smoothing) + _ksum(oh, (1,)) * (label_smoothing / c)
    return q, oh


def _ce_graph(logits, labels, ignore_index, reduction, label_smoothing):
    q, oh = _ce_target(logits, labels, ignore_index, label_smoothing)
    if logits.size == 0:
        loss = neg(reduce_sum(_target_terms(q, _log_softmax_graph(logits, 1)), (1,)))
    else:
        # -sum(q * log p) = sum(q) * logsumexp(x) - sum(q * x): the target terms read the
        # logits themselves, before anything else, so the shifted logits x - max are never
        # stored for them (they are one more rows x classes buffer: SmolLM2 at 1024 tokens,
        # 192 MiB) and exp(x - max) may be written over the logits
        picked = reduce_sum(_target_terms(q, logits), (1,))
        m = stop_gradient(amax(logits, 1, keepdim=True))
        lse = reshape(m, m.shape[:1]) + log(reduce_sum(exp(logits - m), (1,)))
        loss = reduce_sum(q, (1,)) * lse - picked
    if reduction == "none":
        return loss
    total = reduce_sum(loss, (0,))
    return total if reduction == "sum" else total / reduce_sum(oh, (0, 1))


def _ce_vjp(ct, y, logits, labels, ignore_index, reduction, label_smoothing):
    q, oh = _ce_target(logits, labels, ignore_index, label_smoothing)
    g = _softmax_graph(logits, 1) * _ksum(oh, (1,)) - q
    if reduction == "none":
        return [g * reshape(ct, ct.shape + (1,)), None]
    if reduction == "mean":  # numerator is zero when no row counts: 0, like torch, not nan
        ct = ct / maximum(reduce_sum(oh, (0, 1)), 1.0)
    return [g * ct, None]


register("cross_entropy", _ce_infer, _ce_ref, _ce_vjp, decompose=_ce_graph)


def cross_entropy(input, target, weight=None, size_average=None, ignore_index=-100, reduce=None,
                  reduction="mean", label_smoothing=0.0):
    """torch.nn.functional.cross_entropy.

    ``input`` is (C,), (N, C) or (N, C, d1, ...). ``target`` is either integer class
    indices () / (N,) / (N, d1, ...) (i32/u32), or class probabilities of the input's shape
    (float). ``weight`` (C,) weighs each class. With class indices, 'mean' divides by the
    summed weights of the rows whose label is not ``ignore_index`` (nan when every row is
    ignored, as torch); with probabilities, by the number of rows."""
    reduction = _legacy_reduction("cross_entropy", size_average, reduce, reduction)
    require_float("cross_entropy", input)
    if weight is not None or target.dtype.is_float:
        return _ce_general(input, target, weight, int(ignore_index), reduction, float(label_smoothing))
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    if input.ndim == 0:
        raise op_error("cross_entropy", "input must have a class axis", input)
    want = () if input.ndim == 1 else input.shape[:1] + input.shape[2:]
    if target.shape != want:
        raise op_error("cross_entropy", f"target must have shape {fmt_shape(want)} for input "
                       f"{fmt_shape(input.shape)} (classes on axis {0 if input.ndim == 1 else 1})", input, target)
    c = input.shape[0 if input.ndim == 1 else 1]
    if input.ndim == 1:
        logits = reshape(input, (1, c))
    elif input.ndim == 2:
        logits = input
    else:  # classes last, then one row per (n, d1, ...)
        logits = reshape(permute(input, (0,) + tuple(range(2, input.ndim)) + (1,)), (-1, c))
    labels = reshape(target, (logits.shape[0],))
    out = emit("cross_entropy", [logits, labels], ignore_index=int(ignore_index), reduction=reduction,
               label_smoothing=float(label_smoothing))
    return reshape(out, target.shape) if reduction == "none" else out


def _classes_last(input):
    """(rows, C) logits with the class axis last, and the per-row shape."""
    c = input.shape[0 if input.ndim == 1 else 1]
    if input.ndim == 1:
        return reshape(input, (1, c)), ()
    if input.ndim == 2:
        return input, input.shape[:1]
    rows = input.shape[:1] + input.shape[2:]
    return reshape(permute(input, (0,) + tuple(range(2, input.ndim)) + (1,)), (-1, c)), rows


def _ce_general(input, target, weight, ignore_index, reduction, label_smoothing):
    """Cross-entropy with class weights and/or probability targets, composed from
    log_softmax and primitives (torch's formulas, label smoothing included)."""
    if input.ndim == 0:
        raise op_error("cross_entropy", "input must have a class axis", input)
    if not 0.0 <= label_smoothing <= 1.0:
        raise ValueError(f"cross_entropy: label_smoothing must be in [0, 1], got {label_smoothing}")
    logits, rows = _classes_last(input)
    c = logits.shape[1]
    if weight is not None and (not isinstance(weight, Tensor) or weight.shape != (c,)):
        if isinstance(weight, Tensor):
            raise op_error("cross_entropy", f"weight must have shape ({c},), one per class", input, weight)
        weight = input.graph.constant(np.asarray(weight, input.dtype.np).reshape(-1))
        if weight.shape != (c,):
            raise op_error("cross_entropy", f"weight must have shape ({c},), one per class", input, weight)
    logp = emit("log_softmax", [logits], dim=1)
    wlogp = logp * weight if weight is not None else logp
    if target.dtype.is_float:                       # probabilities (or soft labels)
        if target.shape != input.shape:
            raise op_error("cross_entropy", "probability targets must have the input's shape", input, target)
        q, _ = _classes_last(target)
        if label_smoothing:
            q = q * (1.0 - label_smoothing) + label_smoothing / c
        loss = neg(reduce_sum(q * wlogp, (1,)))
        if reduction == "none":
            return reshape(loss, rows)
        total = reduce_sum(loss, (0,))
        # the mean over no rows is NaN, as torch's
        return total if reduction == "sum" else total * (1.0 / logits.shape[0] if logits.shape[0] else float("nan"))
    if target.shape != rows:
        raise op_error("cross_entropy", f"target must have shape {fmt_shape(rows)} for input "
                       f"{fmt_shape(input.shape)}", input, target)
    labels = reshape(target, (logits.shape[0],))
    oh = _ce_target(logits, labels, ignore_index, 0.0)[1]            # zero rows where ignored
    w_row = reduce_sum(oh * weight, (1,))                            # weight of each row's class, 0 if ignored
    loss = neg(reduce_sum(_target_terms(oh, wlogp), (1,)))
    if label_smoothing:
        valid = reduce_sum(oh, (1,))
        smooth = neg(reduce_sum(wlogp, (1,))) * valid
        loss = loss * (1.0 - label_smoothing) + smooth * (label_smoothing / c)
    if reduction == "none":
        return reshape(loss, rows)
    total = reduce_sum(loss, (0,))
    return total if reduction == "sum" else total / reduce_sum(w_row, (0,))


def _legacy_reduction(op, size_average, reduce, reduction):
    if size_average is not None or reduce is not None:  # torch's deprecated flags win
        size_average = True if size_average is None else size_average
        reduction = "none" if reduce is False else ("mean" if size_average else "sum")
    if reduction not in _REDUCTIONS:
        raise ValueError(f"{op}: reduction must be one of {_REDUCTIONS}, got {reduction!r}")
    return reduction


# --------------------------------------------------------------------------- mse_loss
def mse_loss(input, target, size_average=None, reduce=None, reduction="mean", weight=None):
    """torch.nn.functional.mse_loss (shapes broadcast; with ``weight``, 'mean' divides by
    the weights' sum, as torch)."""
    reduction = _legacy_reduction("mse_loss", size_average, reduce, reduction)
    if isinstance(input, Tensor) and isinstance(target, Tensor):
        same_dtype("mse_loss", input, target)
    d = input - target
    err = d * d
    if weight is not None:
        if weight.shape != input.shape:
            raise op_error("mse_loss", f"weight must have the input's shape {fmt_shape(input.shape)}", weight)
        err = err * weight
    if reduction == "none":
        return err
    total = reduce_sum(err, tuple(range(err.ndim)))
    if reduction == "sum":
        return total
    if weight is not None:
        return total / reduce_sum(weight, tuple(range(weight.ndim)))
    return total * (1.0 / max(err.size, 1))


# -------------------------------------------------------------------------- embedding
def _embedding_infer(ins, padding_idx=None):
    ids, weight = ins
    require_int("embedding", ids)
    require_float("embedding", weight)
    if weight.ndim != 2:
        raise op_error("embedding", "weight must be 2-D (num_embeddings, embedding_dim)", weight)
    return ids.shape + weight.shape[1:], weight.dtype


def _check_ids(op, ids, n):
    i = ids.astype(np.int64)
    bad = (i < 0) | (i >= n)
    if bad.any():
        raise IndexError(f"{op}: id {int(i[bad][0])} is out of range for {n} embeddings")
    return i


def _embedding_vjp(ct, y, ids, weight, padding_idx=None):
    if padding_idx is not None:  # the padding row gets no gradient
        ct = where(reshape(ne(ids, padding_idx), ids.shape + (1,)), ct, 0.0)
    return [None, embedding_grad(ids, ct, weight.shape[0])]


# out[p..., j] reads weight[ids[p...], j]
register("embedding", _embedding_infer, lambda ids, w, padding_idx=None: w[_check_ids("embedding", ids, w.shape[0])],
         _embedding_vjp)


def _embedding_grad_infer(ins, num_embeddings):
    ids, ct = ins
    require_int("embedding_grad", ids)
    require_float("embedding_grad", ct)
    if ct.ndim != ids.ndim + 1 or ct.shape[:-1] != ids.shape:
        raise op_error("embedding_grad", "cotangent must have shape ids.shape + (embedding_dim,)", ids, ct)
    return (num_embeddings, ct.shape[-1]), ct.dtype


def _embedding_grad_ref(ids, ct, num_embeddings):
    out = np.zeros((num_embeddings, ct.shape[-1]), dtype=ct.dtype)
    np.add.at(out, _check_ids("embedding_grad", ids, num_embeddings).reshape(-1), ct.reshape(-1, ct.shape[-1]))
    return out


# out[v, j] = sum of ct[p, j] over flat positions p in increasing order with ids[p] == v;
# a loop in a fixed order per output element, so the result is deterministic (no atomics)
register("embedding_grad", _embedding_grad_infer, _embedding_grad_ref,
         lambda ct, y, ids, g, num_embeddings: [None, emit("embedding", [ids, ct], padding_idx=None)])


def embedding(input, weight, padding_idx=None, max_norm=None, norm_type=2.0, scale_grad_by_freq=False,
              sparse=False):
    """torch.nn.functional.embedding: rows of ``weight`` (num_embeddings, dim) picked by the
    integer ``input``. Ids are not range-checked at graph time (see the module doc).
    ``sparse`` is accepted and ignored (gradients are dense)."""
    if max_norm is not None:
        raise NotImplementedError(f"embedding: max_norm is not supported (max_norm={max_norm!r}); renormalise "
                                  "the weight separately")
    if scale_grad_by_freq:
        raise NotImplementedError("embedding: scale_grad_by_freq=True is not supported")
    if padding_idx is not None:
        n = weight.shape[0]
        if not -n <= padding_idx < n:
            raise op_error("embedding", f"padding_idx {padding_idx} out of range for {n} embeddings", weight)
        padding_idx = int(padding_idx) % n
    return emit("embedding", [input, weight], padding_idx=padding_idx)


def embedding_grad(ids, ct, num_embeddings):
    """Scatter-add: the (num_embeddings, dim) gradient of embedding(ids, weight)."""
    return emit("embedding_grad", [ids, ct], num_embeddings=int(num_embeddings))
