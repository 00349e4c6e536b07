"""max_pool2d(..., return_indices=True) gives (values, indices) as torch: i32 indices of each
window's first maximum in the flattened input plane, with padding, stride, dilation,
ceil_mode, ties and unbatched (C, H, W) input; on the interpreter and both GPU backends."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.reference import evaluate

BACKENDS = ["numpy", "gpu", "wgpu"]
CASES = [dict(kernel_size=3, stride=2, padding=1), dict(kernel_size=(2, 3), stride=1, dilation=2, ceil_mode=True),
         dict(kernel_size=2, stride=2, ceil_mode=True), dict(kernel_size=(3, 1), stride=(1, 2), padding=(1, 0))]


def run(g, outs, feeds, backend):
    if backend == "numpy":
        return evaluate(g, outs, feeds)
    return mg.compile(g, outputs=outs, backend=backend).run(feeds)


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_and_flat_indices_match_torch(backend):
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 3, 7, 6)).astype(np.float32)
    b = np.round(rng.uniform(-1.4, 1.4, (3, 5, 5))).astype(np.float32)       # unbatched, many ties
    g = mg.Graph()
    x, y = g.input("x", a.shape), g.input("y", b.shape)
    outs = []
    for kw in CASES:
        outs.extend(mg.ops.max_pool2d(x, return_indices=True, **kw))
    outs.extend(mg.ops.max_pool2d(y, 2, 1, return_indices=True))
    assert all(i.dtype == mg.i32 for i in outs[1::2])
    got = run(g, outs, {"x": a, "y": b}, backend)
    want = []
    for kw in CASES:
        want.extend(torch.nn.functional.max_pool2d(torch.from_numpy(a), return_indices=True, **kw))
    want.extend(torch.nn.functional.max_pool2d(torch.from_numpy(b), 2, 1, return_indices=True))
    for k, (o, w) in enumerate(zip(got, want)):
        assert o.shape == tuple(w.shape), k
        np.testing.assert_array_equal(o, w.numpy(), err_msg=f"output {k}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_keep_their_gradient_with_indices(backend):
    rng = np.random.default_rng(1)
    a = rng.standard_normal((1, 2, 6, 6)).astype(np.float32)
    g = mg.Graph()
    x = g.input("x", a.shape)
    v, i = mg.ops.max_pool2d(x, 3, 2, 1, return_indices=True)
    (dx,) = mg.autodiff.grad(mg.ops.sum(v * v), [x])
    got_dx, got_i = run(g, [dx, i], {"x": a}, backend)
    t = torch.from_numpy(a).requires_grad_()
    tv, ti = torch.nn.functional.max_pool2d(t, 3, 2, 1, return_indices=True)
    (tv * tv).sum().backward()
    np.testing.assert_allclose(got_dx, t.grad.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(got_i, ti.numpy())
