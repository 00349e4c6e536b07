"""Rotary position embedding: ``rope`` (one node with a NumPy reference; its VJP is rope by
the opposite angle, and it decomposes into the tables, ``rotate_half`` and pointwise ops
for the GPU backend) and ``rotate_half``."""
from __future__ import annotations

import functools

import numpy as np

from .elementwise import neg
from .registry import emit, op_error, register, require_float

__all__ = ["rope", "rotate_half"]


# ------------------------------------------------------------------------------- rope
def _rope_infer(ins, base, position_offset, inverse):
    x = ins[0]
    require_float("rope", x)
    if x.ndim < 2 or x.shape[-1] % 2:
        raise op_error("rope", "input must be (..., seq, head_dim) with an even head_dim", x)
    return x.shape, x.dtype


@functools.lru_cache(maxsize=64)
def _rope_tables(seq, dim, base, position_offset, inverse):
    """cos and sin (seq, dim), each half repeated, in float64 (sin negated for the inverse),
    read-only: every layer of a model asks for the same ones (SmolLM2's 30 layers, q and k,
    in each of a session's plans took 40 ms of its compile)."""
    inv_freq = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
    ang = np.outer(np.arange(position_offset, position_offset + seq, dtype=np.float64), inv_freq)
    ang = np.concatenate([ang, ang], axis=1)
    cos, sin = np.cos(ang), (-1.0 if inverse else 1.0) * np.sin(ang)
    cos.flags.writeable = sin.flags.writeable = False
    return cos, sin


def _rope_ref(x, base, position_offset, inverse):
    cos, sin = (t.astype(x.dtype) for t in _rope_tables(x.shape[-2], x.shape[-1], base, position_offset, inverse))
    h = x.shape[-1] // 2
    rot = np.concatenate([-x[..., h:], x[..., :h]], axis=-1)
    return x * cos + rot * sin


def _rope_graph(x, base, position_offset, inverse):
    cos, sin = (x.graph.constant(t.astype(x.dtype.np))
                for t in _rope_tables(x.shape[-2], x.shape[-1], base, position_offset, inverse))
    return x * cos + rotate_half(x) * sin


def _rotate_half_infer(ins):
    x = ins[0]
    require_float("rotate_half", x)
    if x.ndim < 1 or x.shape[-1] % 2:
        raise op_error("rotate_half", "the last dim must be even", x)
    return x.shape, x.dtype


def _rotate_half_ref(x):
    h = x.shape[-1] // 2
    return np.concatenate([-x[..., h:], x[..., :h]], axis=-1)


# A pointwise op whose operand is read at another index (j + h mod 2h): the GPU evaluates
# it inside the consuming kernel, so RoPE is one kernel. Its transpose is its negation.
register("rotate_half", _rotate_half_infer, _rotate_half_ref,
         lambda ct, y, x: [neg(rotate_half(ct))], pointwise=True)


def rotate_half(x):
    """concat(-x2, x1) over the last dim (halves x1, x2): Llama's RoPE rotation."""
    return emit("rotate_half", [x])


# rotation by -angle is the transpose of rotation by angle
register("rope", _rope_infer, _rope_ref,
         lambda ct, y, x, base, position_offset, inverse: [
             emit("rope", [ct], base=base, position_offset=position_offset, inverse=not inverse)],
         decompose=_rope_graph)


def rope(x, base=10000.0, position_offset=0):
    """Rotary position embedding, Llama's rotate-half convention, on (batch, heads, seq,
    head_dim) (any (..., seq, head_dim)): position p = position_offset + s,
    angle_i = p * base^(-2i/head_dim), out = x*cos + concat(-x2, x1)*sin."""
    return emit("rope", [x], base=float(base), position_offset=int(position_offset), inverse=False)
