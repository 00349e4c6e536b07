"""torch.max / torch.min along a dim give the named tuple (values, indices), as torch:
the indices of the first extreme (i32), keepdim, negative dims, ties; on the interpreter
and both GPU backends, and through mg.from_torch (aten.max.dim)."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.reference import evaluate

BACKENDS = ["numpy", "gpu", "wgpu"]


def run(g, outs, feeds, backend):
    if backend == "numpy":
        return evaluate(g, outs, feeds)
    return mg.compile(g, outputs=outs, backend=backend).run(feeds)


def test_named_tuple_like_torch_return_types():
    g = mg.Graph()
    x = g.input("x", (3, 4), mg.f32)
    r = mg.ops.max(x, 1)
    values, indices = r
    assert r._fields == ("values", "indices") and type(r).__name__ == "max"
    assert r[0] is r.values is values and r[1] is r.indices is indices
    assert values.shape == (3,) and values.dtype == mg.f32
    assert indices.shape == (3,) and indices.dtype == mg.ops.argmax(x, 1).dtype == mg.i32
    m = mg.ops.min(x, -1, keepdim=True)
    assert type(m).__name__ == "min" and m.values.shape == m.indices.shape == (3, 1)
    assert isinstance(mg.ops.max(x), mg.Tensor) and mg.ops.max(x).shape == ()      # no dim: a value
    assert isinstance(mg.ops.min(x, x), mg.Tensor)                                # elementwise
    with pytest.raises(TypeError, match=r"max: dim must be one int.*\(3, 4\)"):
        mg.ops.max(x, (0, 1))


@pytest.mark.parametrize("backend", BACKENDS)
def test_values_and_first_indices_match_torch(backend):
    rng = np.random.default_rng(0)
    a = np.round(rng.uniform(-1.4, 1.4, (2, 5, 6))).astype(np.float32)     # many ties
    a[0, 0, :] = -np.inf
    a[1, 2, 3] = np.inf
    g = mg.Graph()
    x = g.input("x", a.shape, mg.f32)
    cases = [("max", 1, False), ("max", -1, True), ("min", 0, False), ("min", -2, True), ("max", 2, False)]
    outs = []
    for op, dim, keep in cases:
        outs.extend(getattr(mg.ops, op)(x, dim, keepdim=keep))
    got = run(g, outs, {"x": a}, backend)
    t = torch.from_numpy(a)
    for k, (op, dim, keep) in enumerate(cases):
        want = getattr(torch, op)(t, dim, keepdim=keep)
        v, i = got[2 * k], got[2 * k + 1]
        assert i.dtype == np.int32, (op, dim)
        np.testing.assert_array_equal(v, want.values.numpy(), err_msg=f"{op} dim {dim} values")
        np.testing.assert_array_equal(i, want.indices.numpy(), err_msg=f"{op} dim {dim} indices")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_goes_to_the_first_extreme_as_torch(backend):
    a = np.array([[1.0, 3.0, 3.0, 0.0], [2.0, 2.0, 2.0, 2.0], [-1.0, 5.0, 4.0, 5.0]], np.float32)
    w = np.array([0.5, -2.0, 3.0], np.float32)
    g = mg.Graph()
    x = g.input("x", a.shape, mg.f32)
    y = x * 1.0
    loss = mg.ops.sum(mg.ops.max(y, 1).values * g.constant(w)) + mg.ops.sum(mg.ops.min(y, 0).values)
    (gx,) = mg.grad(loss, [x])
    got = run(g, [gx], {"x": a}, backend)[0]
    t = torch.from_numpy(a).requires_grad_()
    ((torch.max(t, 1).values * torch.from_numpy(w)).sum() + torch.min(t, 0).values.sum()).backward()
    np.testing.assert_allclose(got, t.grad.numpy(), rtol=1e-6)


class MaxDim(torch.nn.Module):
    def forward(self, x):
        v, i = torch.max(x, dim=1)
        m = torch.min(x, -1, keepdim=True)
        return v * 2.0 + torch.max(x), i, m.values, m.indices


@pytest.mark.parametrize("backend", BACKENDS)
def test_from_torch_maps_aten_max_dim(backend):
    torch.manual_seed(0)
    x = torch.randn(3, 5)
    imported = mg.from_torch(MaxDim(), (x,))
    outs = imported.compile(backend=backend).run(imported.feeds(x))
    want = MaxDim()(x)
    assert len(outs) == len(want)
    for ours, theirs in zip(outs, want):
        np.testing.assert_allclose(ours, theirs.numpy(), rtol=1e-6)
