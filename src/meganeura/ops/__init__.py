"""``mg.ops``: every op of the registry, with PyTorch-style signatures.

Each submodule registers its ops (see registry.py for what a record holds) and exports
the functions that build them.
"""
from .registry import OPS, OpDef, emit, register  # noqa: F401
from .elementwise import (abs, add, cast, clamp, clip, detach, div, eq, erf, exp, ge, gelu, gt, le, log, lt, maximum,  # noqa: F401
                          minimum, mul, ne, neg, pow, relu, rsqrt, sigmoid, sign, silu, sqrt, square,
                          stop_gradient, sub, tanh, where)
from .reduce import amax, amin, max, mean, min, reduce_sum, std, sum, var  # noqa: F401
from .shape import (broadcast_tensors, broadcast_to, cat, chunk, concat, expand, flatten, gather,  # noqa: F401
                    getitem, index_select, permute, reshape, slice, split, squeeze, stack, transpose, unsqueeze)
from .linalg import linear, matmul, mm  # noqa: F401
from .updates import adam_step, ema, ema_sq  # noqa: F401
from .nn import *  # noqa: F401,F403
from .attention import *  # noqa: F401,F403
from .conv import *  # noqa: F401,F403
