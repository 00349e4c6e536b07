"""Initialisations with torch.nn.init's distributions, drawn from one NumPy generator.

The distributions (bounds, standard deviations, fan computations) equal PyTorch's; the
random streams do not (no torch at run time): seed with ``manual_seed`` for repeatable
models, or load a torch state dict for identical values.
"""
from __future__ import annotations

import math

import numpy as np

from .module import Parameter

_rng = np.random.default_rng(0)


def manual_seed(seed: int):
    """Reseed the generator every layer draws its initial values from."""
    global _rng
    _rng = np.random.default_rng(int(seed))


def _calculate_fan_in_and_fan_out(shape):
    if len(shape) < 2:
        raise ValueError(f"fan in/out need a tensor of rank >= 2, got shape {shape}")
    rf = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[1] * rf, shape[0] * rf


def _set(p: Parameter, values):
    p.data = np.asarray(values, dtype=p.data.dtype).reshape(p.data.shape)
    return p


def uniform_(p, a=0.0, b=1.0):
    return _set(p, _rng.uniform(a, b, p.data.shape))


def normal_(p, mean=0.0, std=1.0):
    return _set(p, _rng.normal(mean, std, p.data.shape))


def zeros_(p):
    return _set(p, np.zeros(p.data.shape))


def ones_(p):
    return _set(p, np.ones(p.data.shape))


def constant_(p, val):
    return _set(p, np.full(p.data.shape, float(val)))


def kaiming_uniform_(p, a=0.0, mode="fan_in", nonlinearity="leaky_relu"):
    """torch.nn.init.kaiming_uniform_: U(-b, b), b = gain * sqrt(3 / fan)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(p.data.shape)
    fan = fan_in if mode == "fan_in" else fan_out
    gain = math.sqrt(2.0 / (1 + a * a)) if nonlinearity == "leaky_relu" else \
        {"relu": math.sqrt(2.0), "linear": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3}[nonlinearity]
    bound = gain * math.sqrt(3.0 / fan) if fan else 0.0
    return uniform_(p, -bound, bound)


def xavier_uniform_(p, gain=1.0):
    """torch.nn.init.xavier_uniform_: U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(p.data.shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(p, -bound, bound)


def default_weight_and_bias(weight: Parameter, bias: Parameter | None):
    """What torch's Linear and ConvNd do in reset_parameters: weight kaiming_uniform with
    a = sqrt(5) (so U(-1/sqrt(fan_in), 1/sqrt(fan_in))), bias U(-1/sqrt(fan_in), ...)."""
    kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = _calculate_fan_in_and_fan_out(weight.data.shape)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        uniform_(bias, -bound, bound)
