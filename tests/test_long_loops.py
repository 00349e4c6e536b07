"""Kernels never loop past a bound per invocation (software drivers stop shader loops at
65535 iterations and return wrong results silently): long reductions run in chunks."""
import numpy as np

import meganeura as mg
from meganeura.compiler import CompileOptions, compile_plan


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


def _gemv_case(x_shape, w_shape, build):
    rng = np.random.default_rng(1)
    x = rng.standard_normal(x_shape).astype(np.float32)
    w = rng.standard_normal(w_shape).astype(np.float32)
    g = mg.Graph()
    xi, wi = g.input("x", x.shape), g.input("w", w.shape)
    out = build(xi, wi)
    return compile_plan([out]), mg.compile(g, outputs=[out], backend="gpu").run({"x": x, "w": w})[0], x, w


def test_gemv_over_long_k_is_split():
    """One-row products whose threads would loop past the bound: B plain (one thread walks
    K = 100000) and B transposed (128 lanes over K = 2**23 + 1000: 65544 steps each) split K
    across workgroups and sum the partials."""
    kp, got, x, w = _gemv_case((1, 100_000), (100_000, 3), mg.ops.matmul)
    assert kp.names == ["gemv", "matmul.splitk_sum"]
    np.testing.assert_allclose(got, x.astype(np.float64) @ w, rtol=1e-4, atol=1e-2)
    k = (1 << 23) + 1000
    kp, got, x, w = _gemv_case((1, k), (2, k), mg.ops.linear)
    assert kp.names == ["gemv", "matmul.splitk_sum"]
    np.testing.assert_allclose(got, x.astype(np.float64) @ w.T.astype(np.float64), rtol=1e-4, atol=5e-2)


def test_tiled_matmul_k_loop_is_bounded():
    """The tiled kernel's K loop (steps of 8 per split) stays within the bound: K = 2**24
    with 16 splits would take 131072 steps per workgroup. Device-free (the WGSL's bound)."""
    import re
    from meganeura.codegen.common import LOOP_BOUND
    g = mg.Graph()
    out = mg.ops.matmul(g.input("a", (64, 1 << 24)), g.input("b", (1 << 24, 64)))
    kp = compile_plan([out])
    wgsl = [d.wgsl for d in kp.dispatches if d.kernel.archetype == "matmul"]
    # steps of the K loop: t = 0..nk (one loop), or t = 1..nk-1 (first and last peeled off)
    loops = [int(n) + 1 for w in wgsl for n in re.findall(r"t <= (\d+)u", w)]
    loops += [int(n) - 1 for w in wgsl for n in re.findall(r"var t = 1u; t < (\d+)u", w)]
    assert loops and max(loops) <= LOOP_BOUND


def test_short_rows_with_few_outputs_take_several_lanes_each():
    """Rows of 8-63 elements with few outputs (a global average pool at batch 1) reduce
    with 32 threads per row, 8 rows a workgroup (a ragged last one here): sums, means and
    maxima (a NaN in a row gives NaN) equal NumPy's; long and short rows keep their forms."""
    from meganeura.codegen import reduce
    g = mg.Graph()
    x = g.input("x", (1, 37, 7, 7))
    outs = [mg.ops.mean(mg.ops.relu(x), (2, 3)), mg.ops.sum(x, (3,)), mg.ops.amax(x, 2)]
    kp = compile_plan(outs, options=CompileOptions(disabled=frozenset({"horizontal"})))
    groups = {d.kernel.name: d.groups[0] for d in kp.dispatches}
    assert groups == {"relu>reduce_mean": -(-37 // (256 // reduce.LANES)), "reduce_sum": 2, "reduce_max": 2}, groups
    for shape, want in (((8192, 128), 32), ((8192, 40), 32), ((100, 128), 100)):   # the other forms keep theirs
        g2 = mg.Graph()
        only = compile_plan([mg.ops.sum(g2.input("y", shape), (1,))])
        assert [d.groups[0] for d in only.dispatches] == [want], (shape, only.names)
    rng = np.random.default_rng(3)
    xv = rng.standard_normal((1, 37, 7, 7)).astype(np.float32)
    xv[0, 5, 3, 2] = np.nan
    mean, total, mx = mg.compile(g, outputs=outs, backend="gpu").run({"x": xv})
    x64 = xv.astype(np.float64)
    np.testing.assert_allclose(mean, np.maximum(x64, 0).mean((2, 3)), rtol=1e-5)
    np.testing.assert_allclose(total, x64.sum(3), rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.isnan(mx), np.isnan(x64).any(2))
    np.testing.assert_allclose(mx[~np.isnan(mx)], x64.max(2)[~np.isnan(mx)], rtol=0)
