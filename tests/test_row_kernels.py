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
