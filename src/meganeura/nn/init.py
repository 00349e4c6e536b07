"""Initialisations with torch.nn.init's distributions, drawn from one NumPy generator.

The distributions (bounds, standard deviations, fan computations) equal PyTorch's; the
random streams do not (no torch at run time): seed with ``manual_seed`` for repeatable
models, or load a torch state dict for identical values.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .module import Parameter

_rng = np.random.default_rng(0)


def manual_seed(seed: int):
    """Reseed the generator every layer draws its initial values from."""
    global _rng
    _rng = np.random.default_rng(int(seed))


_DEFER: list = []


@contextlib.contextmanager
def deferred():
    """Layers built inside draw no random values: each parameter is left to the graph it is
    built into (see ``Parameter``), which draws it seeded by its full name. Random
    initialisations keep the graph's default rule (torch's fan-in uniform for weights;
    biases start at zero), ``normal_(p, std=0.02)`` selects its 'normal' rule (Hugging
    Face's ``initializer_range``), ``ones_``/``zeros_`` fill. The model builders use it."""
    _DEFER.append(True)
    try:
        yield
    finally:
        _DEFER.pop()


def deferring() -> bool:
    return bool(_DEFER)


def _left_to_graph(p, rule) -> bool:
    """Inside ``deferred()``, record ``rule`` on a deferred parameter instead of drawing."""
    if _DEFER and p.deferred:
        p.init = rule
        return True
    return False


def draw(shape, rule=None) -> np.ndarray:
    """A value by ``Graph.parameter``'s init rule, from this module's generator."""
    shape = tuple(shape)
    if isinstance(rule, (int, float)) and not isinstance(rule, bool):
        return np.full(shape, rule, np.float32)
    if rule == "ones":
        return np.ones(shape, np.float32)
    if rule == "zeros" or (rule is None and len(shape) < 2):
        return np.zeros(shape, np.float32)
    if rule == "normal":
        return _rng.normal(0.0, 0.02, shape).astype(np.float32)
    if rule is None:
        bound = 1.0 / math.sqrt(max(int(np.prod(shape[1:])), 1))
        return _rng.uniform(-bound, bound, shape).astype(np.float32)
    raise ValueError(f"unknown init rule {rule!r}")


def _calculate_fan_in_and_fan_out(shape):
    if len(shape) < 2:
        raise ValueError(f"fan in/out need a tensor of rank >= 2, got shape {shape}")
    rf = int(np.prod(shape[2:], dtype=np.int64)) if len(shape) > 2 else 1
    return shape[1] * rf, shape[0] * rf


def _set(p: Parameter, values):
    p.data = np.asarray(values, dtype=p.dtype).reshape(p.shape)
    return p


def uniform_(p, a=0.0, b=1.0):
    return p if _left_to_graph(p, None) else _set(p, _rng.uniform(a, b, p.shape))


def normal_(p, mean=0.0, std=1.0):
    if mean == 0.0 and std == 0.02 and _left_to_graph(p, "normal"):
        return p
    return p if _left_to_graph(p, None) else _set(p, _rng.normal(mean, std, p.shape))


def zeros_(p):
    return p if _left_to_graph(p, "zeros") else _set(p, np.zeros(p.shape))


def ones_(p):
    return p if _left_to_graph(p, "ones") else _set(p, np.ones(p.shape))


def constant_(p, val):
    return _set(p, np.full(p.shape, float(val)))


def kaiming_uniform_(p, a=0.0, mode="fan_in", nonlinearity="leaky_relu"):
    """torch.nn.init.kaiming_uniform_: U(-b, b), b = gain * sqrt(3 / fan)."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(p.shape)
    fan = fan_in if mode == "fan_in" else fan_out
    gain = math.sqrt(2.0 / (1 + a * a)) if nonlinearity == "leaky_relu" else \
        {"relu": math.sqrt(2.0), "linear": 1.0, "sigmoid": 1.0, "tanh": 5.0 / 3}[nonlinearity]
    bound = gain * math.sqrt(3.0 / fan) if fan else 0.0
    return uniform_(p, -bound, bound)


def xavier_uniform_(p, gain=1.0):
    """torch.nn.init.xavier_uniform_: U(-b, b), b = gain * sqrt(6 / (fan_in + fan_out))."""
    fan_in, fan_out = _calculate_fan_in_and_fan_out(p.shape)
    bound = gain * math.sqrt(6.0 / (fan_in + fan_out))
    return uniform_(p, -bound, bound)


def default_weight_and_bias(weight: Parameter, bias: Parameter | None):
    """What torch's Linear and ConvNd do in reset_parameters: weight kaiming_uniform with
    a = sqrt(5) (so U(-1/sqrt(fan_in), 1/sqrt(fan_in))), bias U(-1/sqrt(fan_in), ...)."""
    kaiming_uniform_(weight, a=math.sqrt(5))
    if bias is not None:
        fan_in, _ = _calculate_fan_in_and_fan_out(weight.shape)
        bound = 1.0 / math.sqrt(fan_in) if fan_in > 0 else 0.0
        uniform_(bias, -bound, bound)
