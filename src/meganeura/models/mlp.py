"""A small MLP classifier and the digits data set it trains on (the main-job demo)."""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import Graph, i32


def build_mlp(batch, n_in, hidden, n_out, depth=2):
    """Linear/ReLU stack with names like torch.nn.Sequential (``0.weight``, ``2.weight``...)."""
    g = Graph()
    x = g.input("x", (batch, n_in))
    labels = g.input("labels", (batch,), i32)
    h, dims = x, [n_in] + [hidden] * (depth - 1) + [n_out]
    for k in range(depth):
        w = g.parameter(f"{2 * k}.weight", (dims[k + 1], dims[k]))
        b = g.parameter(f"{2 * k}.bias", (dims[k + 1],))
        h = ops.linear(h, w, b)
        if k < depth - 1:
            h = ops.relu(h)
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
