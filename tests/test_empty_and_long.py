"""Empty tensors and long chains on every backend, against torch's rules: reductions over
an empty axis give the value of no elements (0 for sum, NaN for mean and var, the mean
cross-entropy of no rows NaN), a masked (-inf) logit that is not the target adds nothing
to cross_entropy, and long elementwise chains build and compile without recursion."""
import numpy as np
import pytest

import meganeura as mg

BACKENDS = ["numpy", "gpu", "wgpu"]
NAN, INF = float("nan"), float("inf")


def run(backend, build, feeds, dtypes=None):
    g = mg.Graph()
    xs = {k: g.input(k, v.shape, (dtypes or {}).get(k, mg.f32)) for k, v in feeds.items()}
    outs = build(**xs)
    return mg.compile(g, outputs=outs, backend=backend).run(feeds)


@pytest.mark.parametrize("backend", BACKENDS)
def test_merged_reductions_over_an_empty_axis(backend):
    """Two reductions of a (0, 5) input in one launch: the sum of nothing is 0 everywhere
    (the output count is the kept axes' product, not size // row = 0)."""
    x = np.zeros((0, 5), np.float32)
    a, b = run(backend, lambda x: [mg.ops.sum(x * 1.0) + 2.0, mg.ops.sum(x * 1.0, 0) + 1.0], {"x": x})
    np.testing.assert_array_equal(a, 2.0)
    np.testing.assert_array_equal(b, np.ones(5, np.float32))


@pytest.mark.parametrize("backend", BACKENDS)
def test_mean_var_std_over_an_empty_axis_are_nan(backend):
    x = np.zeros((0, 3), np.float32)
    outs = run(backend, lambda x: [mg.ops.mean(x * 1.0, 0), mg.ops.var(x * 1.0, 0), mg.ops.std(x * 1.0, 0),
                                   mg.ops.mean(x * 1.0), mg.ops.sum(x * 1.0, 1)], {"x": x})
    for o in outs[:4]:
        assert np.isnan(o).all(), o
    assert outs[0].shape == (3,) and outs[3].shape == () and outs[4].shape == (0,)


def test_max_over_an_empty_axis_is_refused_as_torch_does():
    g = mg.Graph()
    x = g.input("x", (0, 3))
    with pytest.raises(mg.ShapeError, match="amax: cannot reduce over an empty axis"):
        mg.ops.amax(x, 0)
    assert mg.ops.amax(x, 1).shape == (0,)       # rows of three: nothing to refuse


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_of_an_empty_batch(backend):
    """Mean over no rows: NaN (torch); sum: 0; none: an empty vector."""
    feeds = {"x": np.zeros((0, 4), np.float32), "y": np.zeros(0, np.int32)}
    outs = run(backend, lambda x, y: [mg.ops.cross_entropy(x * 1.0, y), mg.ops.cross_entropy(x * 1.0, y, reduction="sum"),
                                      mg.ops.cross_entropy(x * 1.0, y, reduction="none")], feeds, {"y": mg.i32})
    assert np.isnan(outs[0]) and outs[1] == 0.0 and outs[2].shape == (0,)


@pytest.mark.parametrize("backend", BACKENDS)
def test_layer_norm_gradients_over_an_empty_batch_are_zero(backend):
    """The weight and bias gradients sum over no rows: zeros, beside a norm over real rows
    whose kernels share the launch."""
    rng = np.random.default_rng(0)
    g = mg.Graph()
    x, z = g.input("x", (0, 6)), g.input("z", (5, 6))
    w, b, w2 = (g.input(n, (6,)) for n in ("w", "b", "w2"))
    loss = mg.ops.sum(mg.ops.layer_norm(x * 1.0, (6,), w, b) ** 2) + mg.ops.sum(mg.ops.layer_norm(z * 1.5, (6,), w2) ** 3)
    grads = mg.grad(loss, [w, b, w2])
    feeds = {"x": np.zeros((0, 6), np.float32), "z": rng.standard_normal((5, 6)).astype(np.float32),
             **{n: rng.uniform(0.5, 1.5, 6).astype(np.float32) for n in ("w", "b", "w2")}}
    gw, gb, gw2 = mg.compile(g, outputs=grads, backend=backend).run(feeds)
    np.testing.assert_array_equal(gw, 0.0)
    np.testing.assert_array_equal(gb, 0.0)
    assert np.abs(gw2).max() > 0


MASKED = np.array([[-INF, 0, 1, 2], [0.5, -INF, .1, .2]], np.float32)
LABELS = np.array([1, 0], np.int32)
# torch.nn.functional.cross_entropy(MASKED, LABELS) and its gradient
TORCH_LOSS = 1.6438525
TORCH_GRAD = np.array([[0.0, -0.45498472, 0.12236423, 0.33262047], [-0.29262906, 0.0, 0.13900489, 0.15362416]],
                      np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_with_a_masked_logit_that_is_not_the_target(backend):
    """A -inf logit adds 0 (not 0 * -inf = NaN) to the loss, and its softmax, so its
    gradient, is 0; the class weights path too."""
    def build(x, y):
        loss = mg.ops.cross_entropy(x * 1.0, y)
        weighted = mg.ops.cross_entropy(x * 1.0, y, weight=np.ones(4, np.float32))
        return [loss, weighted, mg.grad(loss, [x])[0]]
    loss, weighted, grad = run(backend, build, {"x": MASKED, "y": LABELS}, {"y": mg.i32})
    np.testing.assert_allclose(loss, TORCH_LOSS, rtol=1e-6)
    np.testing.assert_allclose(weighted, TORCH_LOSS, rtol=1e-6)
    np.testing.assert_allclose(grad, TORCH_GRAD, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_cross_entropy_with_a_masked_target_is_inf(backend):
    """The target's own logit -inf: an infinite loss, as torch gives."""
    labels = np.array([0, 0], np.int32)
    loss, = run(backend, lambda x, y: [mg.ops.cross_entropy(x * 1.0, y, reduction="none")],
                {"x": MASKED, "y": labels}, {"y": mg.i32})
    assert loss[0] == INF and np.isfinite(loss[1])


def _affine_chain(x, n):
    y = x
    for _ in range(n):
        y = y * 1.001 + 0.001
    return y


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_a_chain_of_150_affine_steps_matches_the_interpreter(backend):
    """150 ``y = y * 1.001 + 0.001``: one elementwise chain, fused (it raised RecursionError)."""
    x = np.linspace(-1, 1, 8).astype(np.float32)
    got = run(backend, lambda x: [_affine_chain(x, 150)], {"x": x})[0]
    want = run("numpy", lambda x: [_affine_chain(x, 150)], {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=1e-5)


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_a_chain_of_10000_steps_compiles_runs_and_differentiates(backend):
    """10,000 steps of ``y * 1.001 + 0.001`` (20,000 ops) and their gradient: built,
    scheduled into kernels of a bounded depth (``schedule.MAX_INLINE_DEPTH``, alike and
    rendered once), compiled and run in seconds, as the interpreter computes them."""
    import time
    from meganeura.schedule import MAX_INLINE_DEPTH, expr_depth
    x = np.linspace(-1, 1, 8).astype(np.float32)

    def build(x):
        y = _affine_chain(x, 10000)
        loss = mg.ops.sum(y)
        return [y, mg.grad(loss, [x])[0]]
    t = time.perf_counter()
    got = run(backend, build, {"x": x})
    assert time.perf_counter() - t < 20
    want = run("numpy", build, {"x": x})
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-4)
    g = mg.Graph()
    plan = mg.compiler.compile_plan([_affine_chain(g.input("x", (8,)), 10000)])
    assert max(expr_depth(d.kernel.spec.get("expr")) for d in plan.dispatches) <= MAX_INLINE_DEPTH


# torch.var / torch.std overloads: (ours, torch's) on one (3, 4) input
VAR_CALLS = [
    ("var_unbiased_positional", lambda o, x: o.var(x, True), lambda t, x: t.var(x, True)),
    ("var_biased_positional", lambda o, x: o.var(x, False), lambda t, x: t.var(x, False)),
    ("std_unbiased_positional", lambda o, x: o.std(x, True), lambda t, x: t.std(x, True)),
    ("var_dim_unbiased_keepdim", lambda o, x: o.var(x, 1, False, True), lambda t, x: t.var(x, 1, False, True)),
    ("var_correction_none", lambda o, x: o.var(x, 0, correction=None), lambda t, x: t.var(x, 0, correction=None)),
    ("std_keywords", lambda o, x: o.std(x, dim=(0, 1), correction=2, keepdim=True),
     lambda t, x: t.std(x, dim=(0, 1), correction=2, keepdim=True)),
    ("var_unbiased_keyword", lambda o, x: o.var(x, dim=0, unbiased=False), lambda t, x: t.var(x, dim=0, unbiased=False)),
    # n - correction <= 0: inf (the deviations are not all 0), as torch
    ("var_correction_past_n", lambda o, x: o.var(x, 0, correction=3), lambda t, x: t.var(x, 0, correction=3)),
]


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
@pytest.mark.parametrize("name,ours,theirs", VAR_CALLS, ids=[c[0] for c in VAR_CALLS])
def test_var_and_std_read_arguments_as_torch(name, ours, theirs, backend):
    import torch
    x = np.random.default_rng(3).standard_normal((3, 4)).astype(np.float32)
    want = theirs(torch, torch.tensor(x)).numpy()
    got = run(backend, lambda x: [ours(mg.ops, x * 1.0)], {"x": x})[0]
    assert got.shape == want.shape, (got.shape, want.shape)
    np.testing.assert_allclose(got, want, rtol=1e-5)


def test_var_refuses_unbiased_twice():
    g = mg.Graph()
    x = g.input("x", (3,))
    with pytest.raises(TypeError, match="var: give correction= or unbiased="):
        mg.ops.var(x, 0, correction=1, unbiased=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_float64_feed_that_overflows_f32_is_refused_by_name(backend):
    """1e39 has no f32: a clear error naming the input and the value, not a silent inf;
    an inf that is fed stays inf."""
    g = mg.Graph()
    s = mg.compile(g, outputs=[g.input("x", (3,)) * 2.0], backend=backend)
    with pytest.raises(ValueError, match=r"input 'x': value 1e\+39 overflows f32"):
        s.run({"x": np.array([1.0, 1e39, 2.0])})
    np.testing.assert_array_equal(s.run({"x": np.array([1.0, INF, 3e38 / 2])})[0], [2.0, INF, np.float32(3e38)])


@pytest.mark.parametrize("backend", BACKENDS)
def test_softmax_over_an_empty_axis_is_empty(backend):
    """(3, 0) along its empty axis: an empty result (the interpreter raised on the maximum
    of nothing), and its gradient."""
    def build(x):
        y = mg.ops.log_softmax(x * 1.0, 1) + mg.ops.softmax(x * 1.0, 1) + mg.ops.safe_softmax(x * 1.0, 1)
        return [y, mg.grad(mg.ops.sum(y), [x])[0]]
    y, gx = run(backend, build, {"x": np.zeros((3, 0), np.float32)})
    assert y.shape == gx.shape == (3, 0)


def _z(*shape):
    return np.zeros(shape, np.float32)


# empty shapes as torch defines them: (name, build, feeds, expected shapes)
EMPTY_SHAPES = [
    ("batch_norm_train_empty_batch", lambda x, w: [mg.ops.batch_norm(x, None, None, w, training=True)]
     + mg.grad(mg.ops.sum(mg.ops.batch_norm(x, None, None, w, training=True)), [x, w]),
     {"x": _z(0, 3, 2), "w": np.ones(3, np.float32)}, [(0, 3, 2), (0, 3, 2), (3,)]),
    ("batch_norm_eval_empty_batch", lambda x, m: [mg.ops.batch_norm(x, m, m + 1.0)], {"x": _z(0, 3), "m": _z(3)},
     [(0, 3)]),
    ("gather_empty_index", lambda x, i: [mg.ops.gather(x * 1.0, 0, i), mg.grad(mg.ops.sum(mg.ops.gather(x, 0, i)), [x])[0]],
     {"x": _z(5), "i": np.zeros(0, np.int32)}, [(0,), (5,)]),
    ("gather_from_an_empty_axis", lambda x, i: [mg.ops.gather(x * 1.0, 0, i)], {"x": _z(0), "i": np.zeros(0, np.int32)},
     [(0,)]),
    ("gather_empty_rows", lambda x, i: [mg.ops.gather(x * 1.0, 1, i)], {"x": _z(0, 4), "i": np.zeros((0, 2), np.int32)},
     [(0, 2)]),
    ("cat_skips_a_legacy_empty_vector", lambda a, b: [mg.ops.cat([a * 1.0, b * 1.0]), mg.ops.cat([b * 1.0, a * 1.0], 1)],
     {"a": _z(0), "b": np.ones((2, 3), np.float32)}, [(2, 3), (2, 3)]),
    ("cat_of_empty_parts", lambda a, b: [mg.ops.cat([a * 1.0, b * 1.0], 1)] + mg.grad(mg.ops.sum(mg.ops.cat([a, b], 1) ** 2), [a, b]),
     {"a": _z(2, 0), "b": np.ones((2, 3), np.float32)}, [(2, 3), (2, 0), (2, 3)]),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,build,feeds,shapes", EMPTY_SHAPES, ids=[e[0] for e in EMPTY_SHAPES])
def test_empty_shapes_in_batch_norm_gather_and_cat(name, build, feeds, shapes, backend):
    """torch gives these shapes (and zero gradients); batch_norm refused an empty training
    batch, gather an empty axis, and cat a 1-D empty tensor beside 2-D ones."""
    dtypes = {k: mg.i32 for k, v in feeds.items() if v.dtype == np.int32}
    outs = run(backend, build, feeds, dtypes)
    assert [o.shape for o in outs] == shapes
    for o in outs:
        if o.size and name != "cat_skips_a_legacy_empty_vector" and name != "cat_of_empty_parts":
            np.testing.assert_array_equal(o, 0.0)      # gradients of nothing gathered or normalised
    if name == "cat_of_empty_parts":
        np.testing.assert_array_equal(outs[2], 2.0)
