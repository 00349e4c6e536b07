"""The fused softmax / log_softmax row kernel: short and long rows, rows along a
non-last axis and through a strided (transposed) view, against NumPy in float64."""
import numpy as np
import pytest

import meganeura as mg


@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("shape,dim,transpose", [((5, 7), -1, False), ((3, 300), -1, False),
                                                 ((300, 4), 0, False), ((2, 70, 90), 1, True)])
def test_row_kernel(op, shape, dim, transpose):
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float32) * 4
    g = mg.Graph()
    t = g.input("x", shape)
    if transpose:
        t = t.transpose(-1, -2)
    y = getattr(mg.ops, op)(t, dim)
    sess = mg.compile(g, outputs=[y], backend="gpu")
    plan_out = sess.run({"x": x})[0]
    assert any(n == op for n in sess.executor.plans["run"].names), "not the fused row kernel"
    xd = np.swapaxes(x, -1, -2).astype(np.float64) if transpose else x.astype(np.float64)
    z = xd - xd.max(dim, keepdims=True)
    want = np.exp(z) / np.exp(z).sum(dim, keepdims=True) if op == "softmax" else \
        z - np.log(np.exp(z).sum(dim, keepdims=True))
    np.testing.assert_allclose(plan_out, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("op", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("shape,ns,affine", [((4, 6), (6,), True), ((3, 300), (300,), True),
                                             ((2, 8, 40), (8, 40), False), ((5, 130), (130,), False)])
def test_norm_kernel(op, shape, ns, affine):
    rng = np.random.default_rng(1)
    x = (rng.standard_normal(shape) * 3 + 1).astype(np.float32)
    w, b = rng.standard_normal(ns).astype(np.float32), rng.standard_normal(ns).astype(np.float32)
    g = mg.Graph()
    t = g.input("x", shape)
    tw = g.input("w", ns) if affine else None
    tb = g.input("b", ns) if affine and op == "layer_norm" else None
    y = mg.ops.layer_norm(t, ns, tw, tb, 1e-5) if op == "layer_norm" else mg.ops.rms_norm(t, ns, tw, 1e-6)
    feeds = {"x": x, **({"w": w} if affine else {}), **({"b": b} if tb is not None else {})}
    sess = mg.compile(g, outputs=[y], backend="gpu")
    got = sess.run(feeds)[0]
    assert sess.executor.plans["run"].names == [op], sess.executor.plans["run"].names
    axes = tuple(range(len(shape) - len(ns), len(shape)))
    xd = x.astype(np.float64)
    if op == "layer_norm":
        z = xd - xd.mean(axes, keepdims=True)
        want = z / np.sqrt((z * z).mean(axes, keepdims=True) + 1e-5)
    else:
        want = xd / np.sqrt((xd * xd).mean(axes, keepdims=True) + 1e-6)
    if affine:
        want = want * w
    if tb is not None:
        want = want + b
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-5)
