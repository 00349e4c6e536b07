"""A small MLP classifier and the digits data set it trains on (the main-job demo)."""
from __future__ import annotations

import numpy as np

from .. import nn, ops
from ..graph import Graph, i32


def mlp(n_in, hidden, n_out, depth=2) -> nn.Sequential:
    """Linear/ReLU stack (names ``0.weight``, ``2.weight``...); parameters deferred (see
    ``nn.init.deferred``): torch's Linear rule for weights, zero biases."""
    dims = [n_in] + [hidden] * (depth - 1) + [n_out]
    layers = []
    with nn.init.deferred():
        for k in range(depth):
            layers += [nn.Linear(dims[k], dims[k + 1])] + ([nn.ReLU()] if k < depth - 1 else [])
    return nn.Sequential(*layers)


def build_mlp(batch, n_in, hidden, n_out, depth=2):
    """Graph of ``mlp`` with a cross-entropy loss: (graph, x, labels, logits, loss)."""
    g = Graph()
    x = g.input("x", (batch, n_in))
    labels = g.input("labels", (batch,), i32)
    h = mlp(n_in, hidden, n_out, depth)(x)
    return g, x, labels, h, ops.cross_entropy(h, labels)


def load_digits_split(test_fraction=0.25, seed=0):
    """scikit-learn's bundled 8x8 digits, scaled to [0, 1], split deterministically."""
    from sklearn.datasets import load_digits
    d = load_digits()
    x = (d.data / 16.0).astype(np.float32)
    y = d.target.astype(np.int32)
    order = np.random.default_rng(seed).permutation(len(x))
    n_test = int(len(x) * test_fraction)
    te, tr = order[:n_test], order[n_test:]
    return (x[tr], y[tr]), (x[te], y[te])
