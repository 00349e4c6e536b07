"""Kernels never loop past a bound per invocation (software drivers stop shader loops at
65535 iterations and return wrong results silently): long reductions run in chunks."""
import numpy as np

import meganeura as mg
from meganeura.compiler import compile_plan


def _run(build, shapes):
    g = mg.Graph()
    xs = [g.input(f"x{i}", s) for i, s in enumerate(shapes)]
    outs = build(*xs)
    rng = np.random.default_rng(0)
    feeds = {f"x{i}": (rng.standard_normal(s) + 1.0).astype(np.float32) for i, s in enumerate(shapes)}
    return compile_plan(outs), mg.compile(g, outputs=outs, backend="gpu").run(feeds), feeds


def test_long_reductions_are_chunked_and_exact():
    n = (1 << 24) + 4096   # one workgroup of 256 threads would loop 65552 times each, past the bound
    kp, (total, mean_rows, mx, loss), f = _run(
        lambda a, b: [mg.ops.sum(a), mg.ops.mean(b, 1), mg.ops.amax(b, 1), mg.ops.mse_loss(a, a * 0.0)],
        [(n,), (3, 300_000)])
    a, b = f["x0"].astype(np.float64), f["x1"].astype(np.float64)
    assert any(name.endswith(".partial") for name in kp.names)
    np.testing.assert_allclose(total, a.sum(), rtol=2e-5)
    np.testing.assert_allclose(mean_rows, b.mean(1), rtol=2e-5)
    np.testing.assert_allclose(mx, b.max(1), rtol=0)
    np.testing.assert_allclose(loss, (a * a).mean(), rtol=2e-5)
