"""Matrix products: batched matmul (with transposed-operand flags) and linear."""
from __future__ import annotations

import numpy as np

from .registry import emit, op_error, register, require_float, same_dtype, unbroadcast


def _mm_dims(t, trans):
    m, k = t.shape[-2:]
    return (k, m) if trans else (m, k)


def _matmul_infer(ins, ta, tb, out_dtype=None, f16_round=None):
    a, b = ins
    require_float("matmul", a, b)
    if f16_round:
        if out_dtype != "f32" or not any(f16_round) or any(
                x.dtype.name != ("f32" if r else "f16") for x, r in zip(ins, f16_round)):
            raise TypeError("matmul: f16_round takes f32 operands where it is set, f16 elsewhere, and "
                            f"out_dtype f32; got {a.name!r} {a.dtype.name}, {b.name!r} {b.dtype.name}, "
                            f"f16_round={tuple(f16_round)}, out_dtype={out_dtype}")
        dt = a.dtype
    else:
        dt = same_dtype("matmul", a, b)
    if a.ndim < 2 or b.ndim < 2:
        raise op_error("matmul", "operands must have rank >= 2 here", a, b)
    m, k = _mm_dims(a, ta)
    k2, n = _mm_dims(b, tb)
    if k != k2:
        raise op_error("matmul", f"inner dimensions differ: {k} vs {k2}" + (" (b is transposed: PyTorch weight layout [out, in])" if tb else ""), a, b)
    try:
        batch = tuple(np.broadcast_shapes(a.shape[:-2], b.shape[:-2]))
    except ValueError:
        raise op_error("matmul", "batch dimensions cannot be broadcast", a, b) from None
    return batch + (m, n), (out_dtype or dt)


def _t(x, trans):
    return np.swapaxes(x, -1, -2) if trans else x


def round_f16_precision(x):
    """``x`` (f32) rounded to f16's 11 significant bits, to nearest even, keeping f32's
    exponent range: what an f16 operand holds once scaled into f16's range by a power of two
    (``f16_round``). Infinities and NaNs stay."""
    bits = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    bits = (bits + np.uint32(0xFFF) + ((bits >> np.uint32(13)) & np.uint32(1))) & np.uint32(0xFFFFE000)
    return np.where(np.isfinite(x), bits.view(np.float32), x)


def _matmul_ref(a, b, ta, tb, out_dtype=None, f16_round=None):
    # out_dtype: f16 operands accumulated and returned in f32 (accelerated precision);
    # f16_round: (a, b) flags of f32 operands rounded to f16 precision (scaled into f16's range)
    if f16_round:
        a, b = (round_f16_precision(x) if r else x.astype(np.float32) for x, r in zip((a, b), f16_round))
    return np.matmul(_t(a, ta), _t(b, tb))


def _matmul_vjp(ct, y, a, b, ta, tb, out_dtype=None, f16_round=None):
    da = mm(b, ct, ta=tb, tb=True) if ta else mm(ct, b, tb=not tb)
    db = mm(ct, a, ta=True, tb=ta) if tb else mm(a, ct, ta=not ta)
    return [unbroadcast(da, a.shape), unbroadcast(db, b.shape)]


register("matmul", _matmul_infer, _matmul_ref, _matmul_vjp)


def mm(a, b, ta=False, tb=False):
    """op(a) @ op(b) for rank >= 2 operands, op = transpose of the last two axes when flagged."""
    return emit("matmul", [a, b], ta=bool(ta), tb=bool(tb))


def matmul(a, b):
    """torch.matmul: 1-D operands are promoted and the added axis removed afterwards."""
    from . import reshape
    from .elementwise import _pair
    a, b = _pair(a, b)
    if a.ndim == 0 or b.ndim == 0:
        raise op_error("matmul", "both operands need rank >= 1", a, b)
    a2 = reshape(a, (1,) + a.shape) if a.ndim == 1 else a
    b2 = reshape(b, b.shape + (1,)) if b.ndim == 1 else b
    out = mm(a2, b2)
    if a.ndim == 1:
        out = reshape(out, out.shape[:-2] + out.shape[-1:])
    if b.ndim == 1:
        out = reshape(out, out.shape[:-1])
    return out


def linear(x, weight, bias=None):
    """torch.nn.functional.linear: x @ weight.T + bias, weight of shape [out, in]."""
    if weight.ndim != 2:
        raise op_error("linear", "weight must be 2-D [out_features, in_features]", weight)
    if x.ndim < 1 or x.shape[-1] != weight.shape[1]:
        raise op_error("linear", f"input's last dim must equal weight's in_features {weight.shape[1]}", x, weight)
    if bias is not None and bias.shape != (weight.shape[0],):
        raise op_error("linear", f"bias must have shape ({weight.shape[0]},)", bias)
    from . import reshape
    x2 = reshape(x, (1, x.shape[0])) if x.ndim == 1 else x
    y = mm(x2, weight, tb=True)
    if bias is not None:
        y = y + bias
    return reshape(y, (weight.shape[0],)) if x.ndim == 1 else y
