"""One table of op samples drives every op test (forward, gradient, each backend).

A ``Sample`` builds the op on our side (``ours(ops, *tensors)``) and on PyTorch's
(``theirs(torch, *tensors)``) from the same inputs. Adding an op means adding rows; the
sample files (samples_*.py) each export a list ``SAMPLES``.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np


@dataclass
class F:
    """A float input: normal values, or ``low``..``high`` uniform, or strictly positive."""
    shape: tuple
    positive: bool = False
    low: float | None = None
    high: float | None = None

    def make(self, rng):
        if self.low is not None:
            return rng.uniform(self.low, self.high, self.shape).astype(np.float32)
        x = rng.standard_normal(self.shape).astype(np.float32)
        return np.asarray(np.abs(x) + 0.5, np.float32) if self.positive else x    # stays an array when 0-d


@dataclass
class I:
    """An integer input in [low, high)."""
    shape: tuple
    high: int
    low: int = 0
    dtype: str = "i32"

    def make(self, rng):
        return rng.integers(self.low, self.high, self.shape).astype(np.int32 if self.dtype == "i32" else np.uint32)


@dataclass
class Sample:
    name: str
    ours: Callable
    theirs: Callable
    inputs: list
    grad: bool = True                 # check gradients (float inputs only)
    rtol: float = 1e-4
    atol: float = 1e-5
    fd_rtol: float = 1e-4             # finite differences vs our f64 analytic gradient
    no_grad_inputs: tuple = ()        # float inputs whose gradient is not checked
    fd: bool = True                   # False where the gradient is not the derivative (stop_gradient)
    tags: tuple = field(default_factory=tuple)
    gpu_bug: str = ""                 # a known GPU compiler bug: the GPU test is a strict xfail naming it

    def arrays(self, seed=0):
        rng = np.random.default_rng([seed, sum(map(ord, self.name))])
        return [spec.make(rng) for spec in self.inputs]


def all_samples():
    from . import (samples_added, samples_core, samples_nn, samples_attention, samples_conv, samples_torchlike,
                   samples_edges, samples_edges_nn)
    out = []
    for m in (samples_core, samples_nn, samples_attention, samples_conv, samples_torchlike, samples_edges,
              samples_edges_nn, samples_added):
        out.extend(m.SAMPLES)
    names = [s.name for s in out]
    dup = {n for n in names if names.count(n) > 1}
    assert not dup, f"duplicate sample names {dup}"
    return out
