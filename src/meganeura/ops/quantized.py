"""Weight-only quantized products: a weight kept in GGUF's packed block layout.

A quantized weight of ``out_features`` rows by ``in_features`` columns is the row-major
sequence of its blocks (each row is whole blocks), as a GGUF file stores it, held as u32
words (little-endian, the last word zero-padded): ``weight_words(raw)`` packs the raw
bytes. Blocks, ``d``/``dmin`` as f16 bits:

- ``Q8_0``: 34 bytes per 32 weights: f16 ``d``, 32 int8 ``q``; w = d * q.
- ``Q4_0``: 18 bytes per 32 weights: f16 ``d``, 16 bytes; byte j holds weight j in its low
  nibble and weight j + 16 in its high one; w = d * (q - 8).
- ``Q4_1``: 20 bytes per 32 weights: f16 ``d``, f16 ``m``, nibbles as Q4_0's; w = d * q + m.
- ``Q5_0``: 22 bytes per 32 weights: f16 ``d``, a u32 of high bits (bit j: weight j's),
  16 bytes of low nibbles as Q4_0's; w = d * (q - 16).
- ``Q5_1``: 24 bytes per 32 weights: f16 ``d``, f16 ``m``, then as Q5_0; w = d * q + m.
- ``Q2_K``: 84 bytes per 256 weights: 16 bytes of 4-bit scale (low) and min (high) per 16
  weights, 64 bytes of 2-bit q, f16 ``d``, f16 ``dmin``; weight 128 h + 32 t + j takes bits
  2 t of byte 16 + 32 h + j; w = d * scale * q - dmin * min.
- ``Q3_K``: 110 bytes per 256 weights: 32 bytes of high bits (weight 32 u + j: bit u of
  byte j), 64 bytes of 2-bit q (as Q2_K's), 12 bytes of sixteen 6-bit scales (low nibbles in
  bytes 0..7, scale s in byte s % 8 shifted by 4 (s // 8); high pairs in bytes 8..11, byte
  8 + s % 4 shifted by 2 (s // 4)), f16 ``d``; w = d * (scale - 32) * (q - 4 (1 - high)).
- ``Q4_K``: 144 bytes per 256 weights: f16 ``d``, f16 ``dmin``, 12 bytes of eight 6-bit
  scales and mins, 128 bytes of nibbles; sub-block j (32 weights) has
  w = d * scale_j * q - dmin * min_j, its nibbles the low (j even) or high (j odd) halves of
  bytes 32 (j // 2) .. 32 (j // 2) + 31.
- ``Q5_K``: 176 bytes per 256 weights: as Q4_K with 32 bytes of high bits before the
  nibbles (bit j of byte i: weight 32 j + i's).
- ``Q6_K``: 210 bytes per 256 weights: 128 bytes of low nibbles, 64 of high 2-bit pairs,
  16 int8 scales (one per 16 weights), f16 ``d``; weight 128 h + r (h < 2, r < 128) takes
  its low 4 bits from byte 64 h + r % 64 (shifted by 4 (r // 64)) and its high 2 from byte
  128 + 32 h + r % 32 (shifted by 2 (r // 32)); w = d * scale * (q - 32).

Ops:
- ``quantized_matmul(x, words)``: x (M, K) f32 times the (N, K) weight transposed, (M, N);
  the GPU dequantizes inside the operand loads (``codegen/quantized.py``). The gradient
  flows to x only; the weight is not trainable.
- ``dequantize(words)``: the (N, K) f32 weight itself.
- ``quantized_embedding(ids, words)``: rows of the weight picked by integer ids (a GGUF
  token embedding, which a tied head also reads through ``quantized_matmul``). Ids are
  range-checked by the NumPy reference; the GPU gives a zero row for a bad id.
"""
from __future__ import annotations

import numpy as np

from ..graph import ShapeError, fmt_shape
from .registry import emit, op_error, register

__all__ = ["quantized_linear", "dequantize", "quantized_embedding"]

# name -> (weights per block, bytes per block)
QTYPES = {"Q8_0": (32, 34), "Q4_0": (32, 18), "Q4_1": (32, 20), "Q5_0": (32, 22), "Q5_1": (32, 24),
          "Q2_K": (256, 84), "Q3_K": (256, 110), "Q4_K": (256, 144), "Q5_K": (256, 176), "Q6_K": (256, 210)}


def qtype_name(op, qtype) -> str:
    """``qtype`` as its GGUF name: a string (any case) or an enum with ``.name``
    (``gguf.GGMLQuantizationType.Q8_0``)."""
    name = str(getattr(qtype, "name", qtype)).upper()
    if name not in QTYPES:
        raise ValueError(f"{op}: qtype must be one of {', '.join(repr(q) for q in QTYPES)} "
                         f"(GGUF block types), got {qtype!r}")
    return name


def row_bytes(qtype, in_features) -> int:
    bs, nb = QTYPES[qtype]
    return in_features // bs * nb


def n_words(qtype, out_features, in_features) -> int:
    """u32 words holding an (out_features, in_features) weight of ``qtype``."""
    return -(-out_features * row_bytes(qtype, in_features) // 4)


def weight_words(raw) -> np.ndarray:
    """The raw block bytes of a quantized weight (any shape, uint8, as a GGUF reader gives
    them) as the u32 words the ops read: little-endian, the last word zero-padded."""
    b = np.ascontiguousarray(raw).reshape(-1)
    if b.dtype != np.uint8:
        raise TypeError(f"weight_words: raw blocks must be uint8 bytes, got {b.dtype}")
    pad = -b.size % 4
    if pad:
        b = np.concatenate([b, np.zeros(pad, np.uint8)])
    return b.view("<u4").astype(np.uint32)


def _f16(b, at) -> np.ndarray:
    """The f16 stored at byte ``at`` of each block row of ``b``, as float32."""
    return b[:, at:at + 2].copy().view("<f2").astype(np.float32)[:, 0]


def dequantize_words(words, qtype, out_features, in_features) -> np.ndarray:
    """The (out_features, in_features) float32 weight of packed blocks (our NumPy reading of
    the layout above)."""
    bs, nb = QTYPES[qtype]
    nbytes = out_features * row_bytes(qtype, in_features)
    b = np.ascontiguousarray(words, dtype=np.uint32).view(np.uint8)[:nbytes].reshape(-1, nb)
    if qtype == "Q6_K":
        e = np.arange(256)
        r = e % 128
        lo = (b[:, 64 * (e // 128) + r % 64] >> (4 * (r // 64)).astype(np.uint8)) & 15
        hi = (b[:, 128 + 32 * (e // 128) + r % 32] >> (2 * (r // 32)).astype(np.uint8)) & 3
        q = (lo | (hi << 4)).astype(np.float32) - 32.0
        w = (_f16(b, 208)[:, None] * b[:, 192:208].view(np.int8).astype(np.float32)[:, e // 16]) * q
        return w.reshape(out_features, in_features)
    if qtype in ("Q2_K", "Q3_K"):
        e = np.arange(256)
        ofs = 16 if qtype == "Q2_K" else 32
        q = ((b[:, ofs + 32 * (e // 128) + e % 32] >> (2 * ((e % 128) // 32)).astype(np.uint8)) & 3).astype(np.float32)
        if qtype == "Q2_K":
            sc = b[:, e // 16]
            w = (_f16(b, 80)[:, None] * (sc & 15).astype(np.float32)) * q \
                - _f16(b, 82)[:, None] * (sc >> 4).astype(np.float32)
        else:
            s16 = np.arange(16)
            lo = (b[:, 96 + s16 % 8] >> (4 * (s16 // 8)).astype(np.uint8)) & 15
            hi = (b[:, 104 + s16 % 4] >> (2 * (s16 // 4)).astype(np.uint8)) & 3
            sc = (lo | (hi << 4)).astype(np.float32) - 32.0
            high = (b[:, e % 32] >> (e // 32).astype(np.uint8)) & 1
            w = (_f16(b, 108)[:, None] * sc[:, e // 16]) * (q - 4.0 * (1 - high).astype(np.float32))
        return w.reshape(out_features, in_features)
    d = _f16(b, 0)[:, None]
    if qtype == "Q8_0":
        w = d * b[:, 2:].view(np.int8).astype(np.float32)
    elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        ofs = 2 if qtype in ("Q4_0", "Q5_0") else 4          # after d (and m)
        q = b[:, ofs + 4 * (qtype[1] == "5"):]
        q = np.concatenate([q & 15, q >> 4], axis=1).astype(np.uint32)
        if qtype[1] == "5":
            q |= ((b[:, ofs:ofs + 4].copy().view("<u4") >> np.arange(32, dtype=np.uint32)) & 1) << 4
        q = q.astype(np.float32)
        w = d * (q - (8.0 if qtype == "Q4_0" else 16.0)) if ofs == 2 else d * q + _f16(b, 2)[:, None]
    else:
        dmin = _f16(b, 2)[:, None]
        s = b[:, 4:16].astype(np.uint32)
        lo, mid, hi = s[:, 0:4], s[:, 4:8], s[:, 8:12]
        sc = np.concatenate([lo & 63, (hi & 15) | ((lo >> 6) << 4)], axis=1).astype(np.float32)
        mn = np.concatenate([mid & 63, (hi >> 4) | ((mid >> 6) << 4)], axis=1).astype(np.float32)
        ofs = 16 if qtype == "Q4_K" else 48
        q = b[:, ofs:].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
        q = (q & 15).reshape(-1, 8, 32)
        if qtype == "Q5_K":
            q = q | (((b[:, None, 16:48] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1) << 4)
        q = q.astype(np.float32)
        w = (d[:, :, None] * sc[:, :, None]) * q - (dmin[:, :, None] * mn[:, :, None])
    return w.reshape(out_features, in_features)


# ----------------------------------------------------------------------------- records
def _check_words(op, words, qtype, n, k, *others):
    if words.dtype.name != "u32":
        raise TypeError(f"{op}: weight {words.name!r} has dtype {words.dtype.name}, expected u32 words of "
                        f"{qtype} blocks (mg.ops.quantized.weight_words(raw)); a quantized weight is not trainable")
    want = (n_words(qtype, n, k),)
    if words.shape != want:
        raise op_error(op, f"a ({n}, {k}) {qtype} weight is {n * row_bytes(qtype, k)} bytes: "
                       f"expected {fmt_shape(want)} u32 words", words, *others)


def _qmm_infer(ins, qtype, n, k):
    x, words = ins
    if x.dtype.name != "f32":
        raise TypeError(f"quantized_matmul: {x.name!r} has dtype {x.dtype.name}, expected f32")
    if x.ndim != 2 or x.shape[1] != k:
        raise op_error("quantized_matmul", f"x must be (rows, {k})", x)
    _check_words("quantized_matmul", words, qtype, n, k, x)
    return (x.shape[0], n), x.dtype


def _qmm_ref(x, words, qtype, n, k):
    return x @ dequantize_words(words, qtype, n, k).astype(x.dtype).T


def _qmm_vjp(ct, y, x, words, qtype, n, k):
    from .linalg import mm
    return [mm(ct, emit("dequantize", [words], qtype=qtype, n=n, k=k)), None]


def _deq_infer(ins, qtype, n, k):
    _check_words("dequantize", ins[0], qtype, n, k)
    return (n, k), "f32"


def _qemb_infer(ins, qtype, n, k):
    ids, words = ins
    if ids.dtype.is_float:
        raise TypeError(f"quantized_embedding: ids {ids.name!r} have dtype {ids.dtype.name}, expected i32 or u32")
    _check_words("quantized_embedding", words, qtype, n, k, ids)
    return ids.shape + (k,), "f32"


def _qemb_ref(ids, words, qtype, n, k):
    from .nn import _check_ids
    i = _check_ids("quantized_embedding", ids, n).reshape(-1)
    rb = row_bytes(qtype, k)
    rows = np.ascontiguousarray(words, dtype=np.uint32).view(np.uint8)[:n * rb].reshape(n, rb)[i]
    return dequantize_words(weight_words(rows), qtype, i.size, k).reshape(ids.shape + (k,))


register("quantized_matmul", _qmm_infer, _qmm_ref, _qmm_vjp)
register("quantized_embedding", _qemb_infer, _qemb_ref, differentiable=False)
register("dequantize", _deq_infer, lambda w, qtype, n, k: dequantize_words(w, qtype, n, k),
         differentiable=False)


def _features(op, qtype, out_features, in_features):
    from ..graph import is_int
    for what, v in (("out_features", out_features), ("in_features", in_features)):
        if not is_int(v) or v <= 0:
            raise ValueError(f"{op}: {what} must be a positive int, got {v!r}")
    bs = QTYPES[qtype][0]
    if in_features % bs:
        raise ShapeError(f"{op}: in_features {in_features} is not a multiple of {qtype}'s block of {bs} weights")
    return int(out_features), int(in_features)


def quantized_linear(x, weight, qtype, out_features, in_features, bias=None):
    """F.linear with a weight in GGUF's packed block layout: ``x @ W.T (+ bias)``, W the
    (out_features, in_features) weight whose blocks (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 or Q2_K .. Q6_K)
    ``weight`` holds as u32 words; dequantized inside the product, never stored. Gradient
    to x only."""
    qtype = qtype_name("quantized_linear", qtype)
    n, k = _features("quantized_linear", qtype, out_features, in_features)
    if x.ndim < 1 or x.shape[-1] != k:
        raise op_error("quantized_linear", f"input's last dim must equal in_features {k}", x)
    if bias is not None and bias.shape != (n,):
        raise op_error("quantized_linear", f"bias must have shape ({n},)", bias)
    from .shape import reshape
    lead = x.shape[:-1]
    x2 = x if x.ndim == 2 else reshape(x, (int(np.prod(lead, dtype=np.int64)), k))
    y = emit("quantized_matmul", [x2, weight], qtype=qtype, n=n, k=k)
    if bias is not None:
        y = y + bias
    return y if x.ndim == 2 else reshape(y, lead + (n,))


def dequantize(weight, qtype, out_features, in_features):
    """The (out_features, in_features) f32 weight of GGUF blocks held as u32 words (what
    gguf.quants.dequantize gives from the bytes)."""
    qtype = qtype_name("dequantize", qtype)
    n, k = _features("dequantize", qtype, out_features, in_features)
    return emit("dequantize", [weight], qtype=qtype, n=n, k=k)


def quantized_embedding(input, weight, qtype, num_embeddings, embedding_dim):
    """F.embedding with a weight in GGUF's packed block layout: the rows of the
    (num_embeddings, embedding_dim) weight that ``weight`` holds as blocks (Q8_0, Q4_0,
    Q4_1, Q5_0, Q5_1 or Q2_K .. Q6_K) in u32 words, picked by the integer ``input``. No gradient."""
    qtype = qtype_name("quantized_embedding", qtype)
    n, k = _features("quantized_embedding", qtype, num_embeddings, embedding_dim)
    return emit("quantized_embedding", [input, weight], qtype=qtype, n=n, k=k)
