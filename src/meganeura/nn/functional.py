"""``mg.nn.functional``: torch.nn.functional's names. Everything of mg.ops, plus dropout."""
from __future__ import annotations

from ..ops import *  # noqa: F401,F403
from ..ops import conv1d, conv2d, cross_entropy, linear, mse_loss, relu  # noqa: F401


def dropout(input, p=0.5, training=True, inplace=False, name="dropout.mask"):
    """torch.nn.functional.dropout. In training, ``input`` times a keep-mask scaled by
    1/(1-p); the mask is a graph input (named ``name``) that mg.jit feeds with fresh random
    values every call (``mg.nn.random_feeds`` gives them to a hand-made session)."""
    from .module import random_input
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout: p must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input * 0.0
    return input * random_input(input, name, 1.0 - p)
