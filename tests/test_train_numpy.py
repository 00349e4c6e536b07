"""The numpy backend trains an MLP on scikit-learn's bundled digits to >= 95% accuracy,
and its optimizers match torch.optim."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.models.mlp import build_mlp, load_digits_split


def test_digits_mlp_trains_to_95_percent_numpy():
    (xtr, ytr), (xte, yte) = load_digits_split()
    g, x, labels, logits, loss = build_mlp(batch=64, n_in=64, hidden=64, n_out=10)
    tr = mg.compile(g, outputs=[logits], loss=loss, optimizer=mg.optim.Adam(lr=3e-3), backend="numpy")
    rng = np.random.default_rng(0)
    for epoch in range(12):
        order = rng.permutation(len(xtr))
        for k in range(0, len(order) - 63, 64):
            idx = order[k:k + 64]
            tr.step({"x": xtr[idx], "labels": ytr[idx]})
    gi, xi, _, logits_i, _ = build_mlp(batch=len(xte), n_in=64, hidden=64, n_out=10)
    inf = mg.compile(gi, outputs=[logits_i], backend="numpy")
    inf.load_state_dict(tr.state_dict())
    acc = float((inf.run({"x": xte})[0].argmax(1) == yte).mean())
    assert acc >= 0.95, acc


OPTIMIZERS = [
    ("sgd", lambda: mg.optim.SGD(lr=0.1), lambda p: torch.optim.SGD(p, lr=0.1)),
    ("sgd_momentum_wd", lambda: mg.optim.SGD(lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01),
     lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1, weight_decay=0.01)),
    ("sgd_nesterov", lambda: mg.optim.SGD(lr=0.05, momentum=0.9, nesterov=True),
     lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True)),
    ("adam", lambda: mg.optim.Adam(lr=0.01, weight_decay=0.01), lambda p: torch.optim.Adam(p, lr=0.01, weight_decay=0.01)),
    ("adamw", lambda: mg.optim.AdamW(lr=0.01, betas=(0.8, 0.99)), lambda p: torch.optim.AdamW(p, lr=0.01, betas=(0.8, 0.99))),
    ("adamw_clip", lambda: mg.optim.AdamW(lr=0.01, clip_grad_norm=0.5), lambda p: torch.optim.AdamW(p, lr=0.01)),
]


def optimizer_run(backend, make_ours, make_theirs, clip=None, steps=10):
    """10 steps of ours and torch.optim on one tiny regression; returns both weights."""
    rng = np.random.default_rng(1)
    X = rng.standard_normal((8, 5)).astype(np.float32)
    Y = rng.standard_normal((8, 3)).astype(np.float32)
    g = mg.Graph()
    x, y = g.input("x", (8, 5)), g.input("y", (8, 3))
    w, b = g.parameter("w", (3, 5)), g.parameter("b", (3,), init=0.1)
    loss = mg.ops.mean((mg.ops.tanh(mg.ops.linear(x, w, b)) - y) ** 2)
    tr = mg.compile(g, loss=loss, optimizer=make_ours(), backend=backend)
    w0 = tr.state_dict()
    tw = torch.tensor(w0["w"], requires_grad=True)
    tb = torch.tensor(w0["b"], requires_grad=True)
    opt = make_theirs([tw, tb])
    for _ in range(steps):
        tr.step({"x": X, "y": Y})
        opt.zero_grad()
        tl = ((torch.tanh(torch.tensor(X) @ tw.T + tb) - torch.tensor(Y)) ** 2).mean()
        tl.backward()
        if clip is not None:
            torch.nn.utils.clip_grad_norm_([tw, tb], clip)
        opt.step()
    return tr.state_dict(), {"w": tw.detach().numpy(), "b": tb.detach().numpy()}


@pytest.mark.parametrize("name,ours,theirs", OPTIMIZERS, ids=[o[0] for o in OPTIMIZERS])
def test_optimizer_matches_torch_numpy(name, ours, theirs):
    a, b = optimizer_run("numpy", ours, theirs, clip=0.5 if name.endswith("clip") else None)
    for k in ("w", "b"):
        np.testing.assert_allclose(a[k], b[k], rtol=1e-5, atol=1e-6)
