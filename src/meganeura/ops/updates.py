"""Elementwise ops the optimizers build their updates from: one node per parameter where
the same arithmetic as separate ops took several (an Adam update was 14 nodes per
parameter, so a 300-parameter model's step graph carried thousands of nodes that every
compile built, hashed and lowered). Each template is the expression the separate ops
spelled, operand for operand and in the same order, so the kernels compute what they did.
Not differentiable: they run after the backward pass."""
from __future__ import annotations

import numpy as np

from ..graph import Tensor
from .registry import as_tensor, broadcast_shapes, emit, register, require_float, same_dtype


def _infer(name):
    def infer(ins):
        require_float(name, *ins)
        return broadcast_shapes(name, *ins), same_dtype(name, *ins)
    return infer


# ``ops``: how many elementwise ops each stands for, which fusion weighs as it weighed them
# (a producer of at most three is recomputed in its reader rather than stored and read)
register("ema", _infer("ema"), lambda x, g, b, c: x * b + g * c, differentiable=False,
         pointwise=True, ops=3)
register("ema_sq", _infer("ema_sq"), lambda v, g, b, c: v * b + g * g * c, differentiable=False,
         pointwise=True, ops=4)
register("adam_step", _infer("adam_step"), lambda p, m, v, s, i, e: p - s * m / (np.sqrt(v) * i + e),
         differentiable=False, pointwise=True, ops=6)


def _tensors(*xs):
    like = next(x for x in xs if isinstance(x, Tensor))
    return [as_tensor(x, like) for x in xs]


def ema(x, g, beta, one_minus_beta):
    """x * beta + g * one_minus_beta (a moment's running average)."""
    return emit("ema", _tensors(x, g, beta, one_minus_beta))


def ema_sq(v, g, beta, one_minus_beta):
    """v * beta + g * g * one_minus_beta (a second moment's running average)."""
    return emit("ema_sq", _tensors(v, g, beta, one_minus_beta))


def adam_step(base, m, v, step_size, inv_sqrt_bc2, eps):
    """base - step_size * m / (sqrt(v) * inv_sqrt_bc2 + eps): Adam's parameter update."""
    return emit("adam_step", _tensors(base, m, v, step_size, inv_sqrt_bc2, eps))
