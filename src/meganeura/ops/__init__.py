"""``mg.ops``: every op of the registry, with PyTorch-style signatures.

Each submodule registers its ops (see registry.py for what a record holds) and exports
the functions that build them.
"""
from .registry import OPS, OpDef, emit, register  # noqa: F401
from .elementwise import (abs, add, cast, ceil, clamp, clamp_max, clamp_min, clip, cos, detach, div, eq, erf,  # noqa: F401
                          exp, expm1, floor, ge, gelu, gt, hardsigmoid, hardswish, le, leaky_relu, log, log1p, lt, masked_fill, maximum,
                          minimum, mul, ne, neg, pow, reciprocal, relu, round, rsqrt, sigmoid, sign, silu, sin,
                          softplus, sqrt, square, stop_gradient, sub, tanh, trunc, where)
from .reduce import amax, amin, max, mean, min, reduce_sum, std, sum, var  # noqa: F401
from .shape import (broadcast_tensors, broadcast_to, cat, chunk, concat, expand, flatten, flip, gather,  # noqa: F401
                    getitem, index_select, pad, permute, repeat, reshape, roll, slice, split, squeeze, stack,
                    transpose, tril, triu, unsqueeze)
from .scan import argmax, argmin, cumsum, logsumexp, prod  # noqa: F401
from .linalg import linear, matmul, mm  # noqa: F401
from .updates import adam_step, ema, ema_sq  # noqa: F401
from .nn import *  # noqa: F401,F403
from .normalization import *  # noqa: F401,F403
from .rotary import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
from .quantized import *  # noqa: F401,F403
from .interpolate import upsample_bilinear2d  # noqa: F401,E402
