"""Scaled dot-product attention as one op record.

One record (not a chain of ops) so a backend can swap in a fused flash-attention kernel;
``decompose`` builds the same result from matmul, elementwise, reduction and reshape ops
for backends without one.

Layout: q (*batch, Hq, Lq, D), k (*batch, Hkv, Lk, D), v (*batch, Hkv, Lk, Dv) -> out
(*batch, Hq, Lq, Dv); the head axis only matters for grouped kv heads (enable_gqa), so
rank-2 and rank-3 inputs (no head axis) work too, as in torch. As in torch, the batch dims
(and, without enable_gqa, the head dim) of q, k and v broadcast, across ranks too: a
(B, 1, Lk, D) key serves every query head, a (Lk, D) one every batch.

Grouped heads are never copied: q head h uses kv head h // G (G = Hq / Hkv, torch's
repeat_interleave), so q viewed as (*batch, Hkv, G * Lq, D) lines up with k's heads and a
plain batched matmul does the work; in the backward that same matmul sums over the group.

Masking follows torch 2.x: a float mask is added to the scaled scores, an integer (bool)
mask keeps positions where it is non-zero, ``is_causal`` keeps j <= i (top-left aligned,
also when Lq != Lk) and excludes a mask. A row with every position masked
gives zeros (and zero gradients), as torch's safe softmax does, not NaN.

The gradient is two more op records, so that a backend with a flash kernel can keep them
whole: ``attention_lse`` (each query row's log-sum-exp of its scaled, masked scores, which
the flash forward writes as a second output; +inf for a fully masked row, so that its
probabilities exp(s - lse) are zeros) and ``attention_grad`` (the gradient of q, k or v,
``wrt``, from q, k, v, dO, the LSE and D = rowsum(dO * O), recomputing the probabilities
instead of reading them). The k and v gradients share one kernel (``multi_output``). Where
no kernel takes them they decompose into the matmuls and softmax backward below, which
never read the LSE (it is then dead and never computed).
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Tensor, dtype_of, fmt_shape
from .registry import emit, op_error, register, unbroadcast

__all__ = ["scaled_dot_product_attention"]

OP = "scaled_dot_product_attention"
NEG_INF = float("-inf")


# ----------------------------------------------------------------------------- shapes
def _batch(op_hint, tensors, keep):
    """The broadcast of the tensors' leading dims (all but the last ``keep``), or a clear error."""
    try:
        return tuple(np.broadcast_shapes(*(t.shape[:-keep] for t in tensors)))
    except ValueError:
        raise op_error(OP, f"{op_hint} dims do not broadcast: "
                       + " vs ".join(fmt_shape(t.shape[:-keep]) for t in tensors), *tensors) from None


def _check(ins, is_causal=False, scale=1.0, enable_gqa=False):
    """Validate inputs; return (scores shape, output shape, group size G, the broadcast
    shapes of q, k and v). Batch dims broadcast across ranks as torch's matmul does."""
    if len(ins) not in (3, 4):
        raise ValueError(f"{OP}: expected 3 or 4 inputs (q, k, v[, mask]), got {len(ins)}")
    q, k, v = ins[:3]
    for t, what in ((q, "query"), (k, "key"), (v, "value")):
        if not t.dtype.is_float:
            raise TypeError(f"{OP}: {what} {t.name!r} has dtype {t.dtype.name}, expected a float dtype (f32 or f16)")
        if t.ndim < 2:
            raise op_error(OP, f"{what} must have rank >= 2 (..., L, D)", t)
    if not (q.dtype is k.dtype is v.dtype):
        raise TypeError(f"{OP}: query, key and value dtypes differ: "
                        + ", ".join(f"{t.name!r} {t.dtype.name}" for t in (q, k, v)))
    if q.shape[-1] != k.shape[-1]:
        raise op_error(OP, f"query and key embedding sizes differ: {q.shape[-1]} vs {k.shape[-1]} (last dim)", q, k)
    if k.shape[-2] != v.shape[-2]:
        raise op_error(OP, f"key and value lengths differ: {k.shape[-2]} vs {v.shape[-2]} (dim -2)", k, v)
    if enable_gqa:
        if min(q.ndim, k.ndim, v.ndim) < 3:
            raise op_error(OP, "enable_gqa needs a head axis: inputs of rank >= 3 (..., H, L, D)", q, k, v)
        hq, hkv = q.shape[-3], k.shape[-3]
        for t, what in ((k, "key"), (v, "value")):     # as torch, key and value may differ: each divides hq
            if t.shape[-3] == 0 or hq % t.shape[-3]:
                raise op_error(OP, f"enable_gqa: query heads ({hq}) must be a multiple of {what} heads "
                               f"({t.shape[-3]})", q, t)
        lead = _batch("batch", (q, k, v), 3)
        shapes = [lead + t.shape[-3:] for t in (q, k, v)]
        group = hq // hkv
    else:
        try:
            lead = tuple(np.broadcast_shapes(*(t.shape[:-2] for t in (q, k, v))))
        except ValueError:
            hint = (" (different head counts need enable_gqa=True)" if min(q.ndim, k.ndim) >= 3 and
                    q.shape[-3] != k.shape[-3] and k.shape[-3] != 1 and q.shape[-3] % k.shape[-3] == 0 else "")
            raise op_error(OP, "batch/head dims do not broadcast: "
                           + " vs ".join(fmt_shape(t.shape[:-2]) for t in (q, k, v)) + hint, q, k, v) from None
        shapes = [lead + t.shape[-2:] for t in (q, k, v)]
        group = 1
    qs, ks, vs = shapes
    scores = qs[:-1] + (ks[-2],)
    out = qs[:-1] + (vs[-1],)
    if len(ins) == 4:
        m = ins[3]
        if is_causal:
            # torch's math path refuses the pair too (its fused CPU path would combine them)
            raise op_error(OP, "attn_mask must not be given with is_causal=True; fold the causal mask into "
                           "attn_mask instead", m)
        if m.dtype.is_float and m.dtype is not q.dtype:
            raise TypeError(f"{OP}: float attn_mask {m.name!r} has dtype {m.dtype.name}, expected the query's "
                            f"{q.dtype.name} (or an integer mask: non-zero = keep)")
        try:
            ok = m.ndim <= len(scores) and tuple(np.broadcast_shapes(m.shape, scores)) == scores
        except ValueError:
            ok = False
        if not ok:
            raise op_error(OP, f"attn_mask must broadcast to the scores' shape {fmt_shape(scores)} "
                           "(*batch, Hq, Lq, Lk)", m, q, k)
    return scores, out, group, (qs, ks, vs)


def _infer(ins, is_causal, scale, enable_gqa):
    _, out, _, _ = _check(ins, is_causal, scale, enable_gqa)
    return out, ins[0].dtype


# -------------------------------------------------------------------------- reference
def _ref(q, k, v, mask=None, *, is_causal, scale, enable_gqa):
    dt = q.dtype
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        g = q.shape[-3] // k.shape[-3]
        k, v = np.repeat(k, g, axis=-3), np.repeat(v, g, axis=-3)
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * dt.type(np.float32(scale))   # f32, as the graph holds it
    if mask is not None:
        s = s + mask.astype(dt) if mask.dtype.kind == "f" else np.where(mask != 0, s, dt.type(NEG_INF))
    if is_causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.tril(np.ones((lq, lk), dtype=bool)), s, dt.type(NEG_INF))
    if s.shape[-1] == 0:                     # no keys: zeros, as torch
        return np.matmul(s, v).astype(dt, copy=False)
    m = np.max(s, axis=-1, keepdims=True)
    full = np.isneginf(m)                    # every position of the row masked
    e = np.exp(s - np.where(full, dt.type(0), m))
    z = np.sum(e, axis=-1, keepdims=True)
    p = e / np.where(full, dt.type(1), z)
    return np.matmul(p, v).astype(dt, copy=False)


# ----------------------------------------------------------------------- graph pieces
def _grouped(x, group):
    """(*b, Hq, L, C) -> (*b, Hkv, G*L, C): consecutive q heads share a kv head."""
    from . import reshape
    if group == 1:
        return x
    return reshape(x, x.shape[:-3] + (x.shape[-3] // group, group * x.shape[-2], x.shape[-1]))


def _probs(q, k, mask, is_causal, scale, group):
    """Attention probabilities, shape (*b, Hq, Lq, Lk)."""
    from . import mm, reshape, safe_softmax, softmax, where
    s = mm(_grouped(q, group), k, tb=True) * scale           # batch dims broadcast in the matmul
    s = reshape(s, s.shape[:-3] + q.shape[-3:-1] + (k.shape[-2],)) if group > 1 else s
    if mask is not None:
        s = s + mask if mask.dtype.is_float else where(mask, s, NEG_INF)
    if is_causal:
        lq, lk = s.shape[-2:]
        # keep[i, j] = j <= i: torch's top-left aligned lower triangle, also for Lq != Lk
        keep = q.graph.constant(np.tril(np.ones((lq, lk), dtype=np.uint32)))
        s = where(keep, s, NEG_INF)
    if s.shape[-1] == 0:                      # no keys: the empty scores make a zero output
        return s
    if mask is None:
        # causal alone always keeps column 0, so no row is fully masked: a plain softmax
        # (one fused row kernel on the GPU)
        return softmax(s, -1)
    return safe_softmax(s, -1)                # a fully masked row gives zeros (one row kernel)


def _decompose(q, k, v, mask=None, *, is_causal, scale, enable_gqa):
    from . import mm, reshape
    _, out, group, _ = _check([q, k, v] + ([mask] if mask is not None else []), is_causal, scale, enable_gqa)
    p = _probs(q, k, mask, is_causal, scale, group)
    o = mm(_grouped(p, group), v)
    return reshape(o, out)


def _grad_parts(q, k, v, ct, mask, is_causal, scale, enable_gqa):
    """The decomposed gradients of q, k, v and the mask (materialising the scores)."""
    from . import mm, reshape, sum
    scores, _, group, (qs, _, _) = _check([q, k, v] + ([mask] if mask is not None else []), is_causal, scale,
                                          enable_gqa)
    # broadcast batch dims: the matmuls broadcast them, unbroadcast sums the gradients back
    p = _grouped(_probs(q, k, mask, is_causal, scale, group), group)    # (*b, Hkv, G*Lq, Lk)
    do = _grouped(ct, group)                                           # (*b, Hkv, G*Lq, Dv)
    dv = mm(p, do, ta=True)                  # contracting G*Lq sums over the group
    dp = mm(do, v, tb=True)
    ds = p * (dp - sum(dp * p, -1, keepdim=True))                      # softmax backward
    qg = _grouped(q, group)
    dq = reshape(mm(ds, k) * scale, qs)
    dk = mm(ds, qg, ta=True) * scale
    grads = [unbroadcast(d, t.shape) for d, t in ((dq, q), (dk, k), (dv, v))]
    if mask is not None:
        # the mask is added after scaling, so its cotangent is dS itself, summed to its shape
        grads.append(unbroadcast(reshape(ds, scores), mask.shape) if mask.dtype.is_float else None)
    return grads


def _group_key(t):
    """The SDPA node and its LSE: one flash kernel writes both."""
    a = t.attrs
    return ("attention", tuple(i.id for i in t.inputs), a["is_causal"], a["scale"], a["enable_gqa"])


def _vjp(ct, out, q, k, v, mask=None, *, is_causal, scale, enable_gqa):
    from . import sum
    ins = [q, k, v] + ([mask] if mask is not None else [])
    attrs = {"is_causal": is_causal, "scale": scale, "enable_gqa": enable_gqa}
    lse = emit(LSE, ins, **attrs)
    delta = sum(ct * out, -1)                     # D = rowsum(dO * O), (*b, Hq, Lq)
    gins = [q, k, v, ct, lse, delta] + ins[3:]
    grads = [emit(GRAD, gins, wrt=w, **attrs) for w in "qkv"]
    if mask is not None:
        # a float mask's cotangent is dS, the scores' gradient: only the decomposition has it
        grads.append(_grad_parts(q, k, v, ct, mask, is_causal, scale, enable_gqa)[3]
                     if mask.dtype.is_float else None)
    return grads


register(OP, _infer, _ref, _vjp, decompose=_decompose, multi_output=_group_key)


# ------------------------------------------------------------- log-sum-exp and gradients
LSE = "attention_lse"
GRAD = "attention_grad"


def _lse_infer(ins, is_causal, scale, enable_gqa):
    scores, _, _, _ = _check(ins, is_causal, scale, enable_gqa)
    return scores[:-1], ins[0].dtype


def _scores_ref(q, k, mask, is_causal, scale, enable_gqa):
    dt = q.dtype
    if enable_gqa and q.shape[-3] != k.shape[-3]:
        k = np.repeat(k, q.shape[-3] // k.shape[-3], axis=-3)
    # the scale rounded to f32, as the graph's constants and the kernels hold it
    s = np.matmul(q, np.swapaxes(k, -1, -2)) * dt.type(np.float32(scale))
    if mask is not None:
        s = s + mask.astype(dt) if mask.dtype.kind == "f" else np.where(mask != 0, s, dt.type(NEG_INF))
    if is_causal:
        lq, lk = s.shape[-2:]
        s = np.where(np.tril(np.ones((lq, lk), dtype=bool)), s, dt.type(NEG_INF))
    return s


def _lse_ref(q, k, v, mask=None, *, is_causal, scale, enable_gqa):
    s = _scores_ref(q, k, mask, is_causal, scale, enable_gqa)
    dt = s.dtype
    if s.shape[-1] == 0:
        return np.full(s.shape[:-1], np.inf, dt)
    m = np.max(s, axis=-1)
    full = np.isneginf(m)
    with np.errstate(divide="ignore"):
        lse = m + np.log(np.sum(np.exp(s - np.where(full, dt.type(0), m)[..., None]), axis=-1))
    return np.where(full, dt.type(np.inf), lse).astype(dt, copy=False)


def _lse_decompose(q, k, v, mask=None, *, is_causal, scale, enable_gqa):
    from . import amax, exp, log, mm, reshape, sum, where
    _, _, group, _ = _check([q, k, v] + ([mask] if mask is not None else []), is_causal, scale, enable_gqa)
    s = mm(_grouped(q, group), k, tb=True) * scale
    s = reshape(s, s.shape[:-3] + q.shape[-3:-1] + (k.shape[-2],)) if group > 1 else s
    if mask is not None:
        s = s + mask if mask.dtype.is_float else where(mask, s, NEG_INF)
    if is_causal:
        lq, lk = s.shape[-2:]
        s = where(q.graph.constant(np.tril(np.ones((lq, lk), dtype=np.uint32))), s, NEG_INF)
    if s.shape[-1] == 0:    # no keys: every row is fully masked (amax refuses an empty axis)
        return q.graph.constant(np.full(s.shape[:-1], np.inf, q.dtype.np))
    m = amax(s, -1, keepdim=True)
    live = m > NEG_INF
    m0 = where(live, m, 0.0)
    lse = m0 + log(sum(exp(s - m0), -1, keepdim=True))
    lse = where(live, lse, float("inf"))
    return reshape(lse, lse.shape[:-1])


def _sum_to(x, shape):
    """``x`` summed over the dims that broadcasting gave it, down to ``shape``."""
    lead = x.ndim - len(shape)
    x = x.sum(axis=tuple(range(lead))) if lead else x
    axes = tuple(i for i, n in enumerate(shape) if n == 1 and x.shape[i] != 1)
    return x.sum(axis=axes, keepdims=True) if axes else x


def _grad_infer(ins, wrt, is_causal, scale, enable_gqa):
    if len(ins) not in (6, 7) or wrt not in ("q", "k", "v"):
        raise ValueError(f"{GRAD}: expected q, k, v, dO, lse, D[, mask] and wrt in q/k/v")
    _, out, _, _ = _check(ins[:3] + ins[6:], is_causal, scale, enable_gqa)
    do, lse, delta = ins[3:6]
    if do.shape != out or lse.shape != out[:-1] or delta.shape != out[:-1]:
        raise op_error(GRAD, f"dO must have the output's shape {fmt_shape(out)}, lse and D its rows' "
                       f"{fmt_shape(out[:-1])}", do, lse, delta)
    return ins["qkv".index(wrt)].shape, ins[0].dtype


def _grad_ref(q, k, v, do, lse, delta, mask=None, *, wrt, is_causal, scale, enable_gqa):
    dt = q.dtype
    x = {"q": q, "k": k, "v": v}[wrt]
    g = q.shape[-3] // k.shape[-3] if enable_gqa else 1
    kk, vv = (np.repeat(t, g, axis=-3) if g > 1 else t for t in (k, v))
    s = _scores_ref(q, k, mask, is_causal, scale, enable_gqa)
    with np.errstate(invalid="ignore"):
        p = np.exp(s - lse[..., None])                      # a fully masked row: lse +inf, zeros
    if wrt == "v":
        d = np.matmul(np.swapaxes(p, -1, -2), do)
    else:
        ds = p * (np.matmul(do, np.swapaxes(vv, -1, -2)) - delta[..., None])
        d = (np.matmul(ds, kk) if wrt == "q" else np.matmul(np.swapaxes(ds, -1, -2), q)) * dt.type(np.float32(scale))
    if wrt != "q" and g > 1:                                # the group's query heads into their kv head
        d = d.reshape(d.shape[:-3] + (d.shape[-3] // g, g) + d.shape[-2:]).sum(axis=-3)
    return _sum_to(d, x.shape).astype(dt, copy=False)


def _grad_decompose(q, k, v, do, lse, delta, mask=None, *, wrt, is_causal, scale, enable_gqa):
    return _grad_parts(q, k, v, do, mask, is_causal, scale, enable_gqa)["qkv".index(wrt)]


def _grad_group(t):
    """The k and v gradients: one kernel walks the queries once for both."""
    a = t.attrs
    if a["wrt"] == "q":
        return None
    return (GRAD, tuple(i.id for i in t.inputs), a["is_causal"], a["scale"], a["enable_gqa"])


def _decomposed_vjp(decompose):
    """Second derivatives: the VJP of the decomposition."""
    def vjp(ct, out, *ins, **attrs):
        from ..autodiff import grad
        return grad(decompose(*ins, **attrs), list(ins), ct)
    return vjp


register(LSE, _lse_infer, _lse_ref, _decomposed_vjp(_lse_decompose), decompose=_lse_decompose,
         multi_output=_group_key)
register(GRAD, _grad_infer, _grad_ref, _decomposed_vjp(_grad_decompose), decompose=_grad_decompose,
         multi_output=_grad_group)


# ---------------------------------------------------------------------------- builder
def _repeat_heads(x, r):
    """torch.repeat_interleave(x, r, dim=-3): each head r times in a row."""
    from . import broadcast_to, reshape, unsqueeze
    if r == 1:
        return x
    lead, (h, l, d) = x.shape[:-3], x.shape[-3:]
    return reshape(broadcast_to(unsqueeze(x, -3), lead + (h, r, l, d)), lead + (h * r, l, d))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """torch.nn.functional.scaled_dot_product_attention (no dropout).

    ``attn_mask``: a float mask added to the scores, or an integer/bool mask (non-zero =
    keep), broadcastable to (*batch, Hq, Lq, Lk); a NumPy array becomes a constant.
    ``scale`` defaults to 1/sqrt(D).
    """
    if dropout_p:
        raise NotImplementedError(f"{OP}: dropout is not supported (dropout_p={dropout_p}); apply it separately")
    for t, what in ((query, "query"), (key, "key"), (value, "value")):
        if not isinstance(t, Tensor):
            raise TypeError(f"{OP}: {what} must be a Tensor, got {type(t).__name__}")
    ins = [query, key, value]
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            arr = np.asarray(attn_mask)
            dt = query.dtype if arr.dtype.kind == "f" else dtype_of(arr.dtype)
            attn_mask = query.graph.constant(arr.astype(dt.np))
        ins.append(attn_mask)
    if scale is None:
        scale = 1.0 / math.sqrt(query.shape[-1]) if query.shape and query.shape[-1] else 1.0
    _check(ins, bool(is_causal), float(scale), bool(enable_gqa))     # errors name the caller's tensors
    if enable_gqa and key.shape[-3] != value.shape[-3]:
        # torch repeats key's heads hq/hk times and value's hq/hv times; repeating each to
        # lcm(hk, hv) heads (which divides hq) gives the same grouping with one kv head count
        h = math.lcm(key.shape[-3], value.shape[-3])
        key, value = ins[1], ins[2] = [_repeat_heads(t, h // t.shape[-3]) for t in (key, value)]
    if key.shape[:-2] != value.shape[:-2]:
        # key and value broadcast against each other: one set of batch dims and heads for
        # both (the fused kernel reads value's heads through key's)
        from . import broadcast_to
        lead = tuple(np.broadcast_shapes(key.shape[:-2], value.shape[:-2]))
        ins[1], ins[2] = broadcast_to(key, lead + key.shape[-2:]), broadcast_to(value, lead + value.shape[-2:])
    return emit(OP, ins, is_causal=bool(is_causal), scale=float(scale), enable_gqa=bool(enable_gqa))
