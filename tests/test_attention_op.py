"""scaled_dot_product_attention beyond the sample table: shape/dtype errors, the
decomposition against the reference, and the VJP against autodiff of the decomposition."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.graph import ShapeError
from meganeura.ops.registry import OPS
from meganeura.reference import evaluate

from .harness import build
from .samples_attention import SAMPLES

OP = "scaled_dot_product_attention"
sdpa = mg.ops.scaled_dot_product_attention


def _qkv(qs, ks, vs, dtype=mg.f32):
    g = mg.Graph()
    return g, g.input("q", qs, dtype), g.input("k", ks, dtype), g.input("v", vs, dtype)


# ------------------------------------------------------------------------------ errors
@pytest.mark.parametrize("qs, ks, vs, kw, words", [
    ((1, 3, 2, 4), (1, 2, 2, 4), (1, 2, 2, 4), dict(enable_gqa=True), ["multiple", "(1, 3, 2, 4)", "'k'"]),
    ((1, 4, 2, 4), (1, 2, 2, 4), (1, 2, 2, 4), {}, ["enable_gqa=True", "'q'", "(1, 2, 2, 4)"]),
    ((1, 2, 3, 4), (1, 2, 3, 3), (1, 2, 3, 4), {}, ["embedding sizes differ: 4 vs 3", "'k' (1, 2, 3, 3)"]),
    ((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 5, 4), {}, ["key and value", "'v' (1, 2, 5, 4)"]),
    ((2, 2, 3, 4), (3, 2, 3, 4), (1, 2, 3, 4), {}, ["do not broadcast: (2, 2) vs (3, 2) vs (1, 2)",
                                                    "'q' (2, 2, 3, 4)"]),
    ((1, 2, 3, 4), (3, 3, 4), (3, 3, 4), {}, ["do not broadcast", "'k' (3, 3, 4)"]),
    ((2, 4, 3, 4), (3, 2, 3, 4), (3, 2, 3, 4), dict(enable_gqa=True), ["batch dims do not broadcast: (2,) vs (3,)"]),
    # key and value head counts may differ (torch repeats each), but each must divide the query heads
    ((1, 6, 3, 4), (1, 2, 3, 4), (1, 4, 3, 4), dict(enable_gqa=True), ["multiple of value heads (4)", "'v'"]),
    ((3, 4), (3, 4), (3, 4), dict(enable_gqa=True), ["head axis", "'q' (3, 4)"]),
    ((4,), (4,), (4,), {}, ["rank >= 2", "'q' (4,)"]),
])
def test_shape_errors(qs, ks, vs, kw, words):
    g, q, k, v = _qkv(qs, ks, vs)
    with pytest.raises(ShapeError) as e:
        sdpa(q, k, v, **kw)
    msg = str(e.value)
    assert msg.startswith(OP)
    for w in words:
        assert w in msg, msg


@pytest.mark.parametrize("mshape", [(3, 3), (2, 1, 3, 5), (1, 1, 1, 2, 3, 5), (4, 5)])
def test_mask_not_broadcastable(mshape):
    g, q, k, v = _qkv((1, 2, 3, 4), (1, 2, 5, 4), (1, 2, 5, 4))
    m = g.input("m", mshape)
    with pytest.raises(ShapeError) as e:
        sdpa(q, k, v, attn_mask=m)
    msg = str(e.value)
    assert "(1, 2, 3, 5)" in msg and f"'m' {mg.graph.fmt_shape(mshape)}" in msg, msg


def test_mask_with_causal_is_refused():
    g, q, k, v = _qkv((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    with pytest.raises(ShapeError, match="is_causal"):
        sdpa(q, k, v, attn_mask=g.input("m", (3, 3)), is_causal=True)


def test_dtype_errors():
    g, q, k, v = _qkv((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    with pytest.raises(TypeError, match="'m16' has dtype f16.*f32"):
        sdpa(q, k, v, attn_mask=g.input("m16", (3, 3), mg.f16))
    with pytest.raises(TypeError, match="'kh' f16"):
        sdpa(q, g.input("kh", (1, 2, 3, 4), mg.f16), v)
    with pytest.raises(TypeError, match="'qi' has dtype i32"):
        sdpa(g.input("qi", (1, 2, 3, 4), mg.i32), k, v)


def test_dropout_refused():
    g, q, k, v = _qkv((1, 2, 3, 4), (1, 2, 3, 4), (1, 2, 3, 4))
    with pytest.raises(NotImplementedError, match="dropout"):
        sdpa(q, k, v, dropout_p=0.1)
    assert sdpa(q, k, v, dropout_p=0.0).shape == (1, 2, 3, 4)


def test_output_shapes():
    g, q, k, v = _qkv((2, 4, 3, 2), (2, 2, 5, 2), (2, 2, 5, 3))
    y = sdpa(q, k, v, enable_gqa=True)
    assert y.shape == (2, 4, 3, 3) and y.op == OP and y.attrs["scale"] == pytest.approx(2 ** -0.5)


# ------------------------------------------------------- decomposition and VJP checks
def _op_nodes(sample):
    g, feeds, _, outs, _, _ = build(sample)
    nodes = [t for t in g.nodes if t.op == OP]
    assert nodes, f"{sample.name}: no {OP} node"
    return g, feeds, nodes


# softmax is a composite with a fused row kernel of its own on the GPU
ALLOWED = {"matmul", "mul", "add", "sub", "div", "exp", "reduce_max", "reduce_sum", "where", "gt", "reshape",
           "constant", "softmax", "safe_softmax"}


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_decompose_equals_ref(sample):
    g, feeds, nodes = _op_nodes(sample)
    first = len(g.nodes)
    decs = [OPS[OP].extra["decompose"](*t.inputs, **t.attrs) for t in nodes]
    used = {t.op for t in g.nodes[first:]}
    assert used <= ALLOWED, f"decomposition uses {used - ALLOWED}"   # gqa by reshape: no copies
    # f64 still differs ~1e-8: graph constants (the scale) are stored in f32
    for compute, tol in ((np.float32, 1e-5), (np.float64, 1e-6)):
        f64 = {n: a.astype(compute) if a.dtype.kind == "f" else a for n, a in feeds.items()}
        vals = evaluate(g, nodes + decs, f64, compute=compute)
        for a, b in zip(vals[:len(nodes)], vals[len(nodes):]):
            assert a.shape == b.shape and not np.isnan(a).any()
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol)


@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_vjp_equals_autodiff_of_decomposition(sample):
    g, feeds, nodes = _op_nodes(sample)
    t = nodes[0]
    dec = OPS[OP].extra["decompose"](*t.inputs, **t.attrs)
    ct = g.constant(np.random.default_rng(3).standard_normal(t.shape).astype(np.float32))
    wrt = [x for x in t.inputs if x.dtype.is_float]
    ours = mg.grad(t, wrt, cotangent=ct)
    theirs = mg.grad(dec, wrt, cotangent=ct)
    f64 = {n: a.astype(np.float64) if a.dtype.kind == "f" else a for n, a in feeds.items()}
    vals = evaluate(g, ours + theirs, f64, compute=np.float64)
    for a, b in zip(vals[:len(wrt)], vals[len(wrt):]):
        np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10)


def test_fully_masked_rows_are_zero_not_nan():
    g, q, k, v = _qkv((1, 1, 2, 2), (1, 1, 3, 2), (1, 1, 3, 2))
    m = g.input("m", (2, 3), mg.u32)
    y = sdpa(q, k, v, attn_mask=m)
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             (("q", (1, 1, 2, 2)), ("k", (1, 1, 3, 2)), ("v", (1, 1, 3, 2)))}
    feeds["m"] = np.array([[1, 0, 1], [0, 0, 0]], np.uint32)
    (dq,) = mg.grad(mg.ops.sum(y), [q])
    out, grad = evaluate(g, [y, dq], feeds)
    assert not np.isnan(out).any() and not np.isnan(grad).any()
    assert (out[0, 0, 1] == 0).all() and (grad[0, 0, 1] == 0).all()
