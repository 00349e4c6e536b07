"""nn ops beyond the sample table: bad-input errors, decompositions vs the fused
reference, index edge cases."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.graph import SOURCE_OPS
from meganeura.ops import OPS
from meganeura.reference import evaluate, needed_nodes

from .harness import build
from .samples_nn import SAMPLES

ops = mg.ops


# composites a decomposition may use (the lowering decomposes to a fixpoint): group_norm and
# batch_norm are layer norms over (sample, group) or transposed (channel) rows, so the GPU
# runs each as one row kernel
NESTED = {"group_norm": {"layer_norm"}, "batch_norm": {"layer_norm"}}


def _composite(t):
    return t.op not in SOURCE_OPS and "decompose" in OPS[t.op].extra


# ------------------------------------------------------------------ decompositions
@pytest.mark.parametrize("sample", SAMPLES, ids=[s.name for s in SAMPLES])
def test_decompose_matches_reference(sample):
    """Every composite node of the sample, forward and backward, equals its decomposition,
    and the decomposition uses primitives only."""
    g, feeds, float_inputs, outs, _, loss = build(sample)
    forward_composites = {t.id for t in g.nodes if _composite(t)}
    if sample.grad:
        mg.grad(loss, [t for _, t in float_inputs])
        # backward graphs are primitive, except rope's (rope by the opposite angle) and a
        # norm's statistics (norm_stat: stored by the forward's norm kernel on the GPU)
        assert all(t.op in ("rope", "norm_stat") for t in g.nodes if _composite(t) and t.id not in forward_composites)
    for y in [t for t in g.nodes if _composite(t)]:
        first_new = len(g.nodes)
        d = OPS[y.op].extra["decompose"](*y.inputs, **y.attrs)
        assert d.shape == y.shape and d.dtype is y.dtype, y.op
        nested = {t.op for t in needed_nodes([d]) if t.id >= first_new and _composite(t)}
        assert nested <= NESTED.get(y.op, set()), (y.op, nested)
        for compute in (np.float32, np.float64):
            a, b = evaluate(g, [y, d], {k: v for k, v in feeds.items() if k in g.inputs}, compute=compute)
            tol = 1e-5 if compute is np.float32 else 1e-7  # graph constants stay f32 in f64 runs
            np.testing.assert_allclose(b, a, rtol=tol, atol=tol, err_msg=f"{sample.name}: {y.op} ({y.name})")


def test_composites_have_decompositions():
    for name in ("softmax", "log_softmax", "cross_entropy", "layer_norm", "rms_norm", "group_norm",
                 "batch_norm", "rope"):
        assert callable(OPS[name].extra.get("decompose")), name
    for name in ("embedding", "embedding_grad", "one_hot"):
        assert "decompose" not in OPS[name].extra, name


# ------------------------------------------------------------------------- errors
def test_layer_norm_weight_wrong_shape():
    g = mg.Graph()
    x, w = g.input("x", (2, 5)), g.input("w", (4,))
    with pytest.raises(mg.ShapeError, match=r"layer_norm: weight must have shape \(5,\).*'w' \(4,\)"):
        ops.layer_norm(x, (5,), w)


def test_layer_norm_normalized_shape_mismatch():
    g = mg.Graph()
    x = g.input("x", (2, 5))
    with pytest.raises(mg.ShapeError, match=r"normalized_shape \(4,\).*'x' \(2, 5\)"):
        ops.layer_norm(x, 4)
    with pytest.raises(mg.ShapeError, match=r"'x' \(2, 5\)"):
        ops.rms_norm(x, (3, 2, 5))


def test_cross_entropy_labels_wrong_shape():
    g = mg.Graph()
    x, y = g.input("logits", (4, 3)), g.input("labels", (3,), mg.i32)
    with pytest.raises(mg.ShapeError, match=r"target must have shape \(4,\).*'labels' \(3,\)"):
        ops.cross_entropy(x, y)
    x3, y3 = g.input("logits3", (2, 3, 5)), g.input("labels3", (2, 3), mg.i32)
    with pytest.raises(mg.ShapeError, match=r"target must have shape \(2, 5\).*'labels3' \(2, 3\)"):
        ops.cross_entropy(x3, y3)


def test_cross_entropy_float_labels():
    # float targets are class probabilities (torch's rule): they must have the input's shape
    g = mg.Graph()
    x, y = g.input("logits", (4, 3)), g.input("probs", (4,))
    with pytest.raises(mg.ShapeError, match=r"probability targets must have the input's shape.*'probs' \(4,\)"):
        ops.cross_entropy(x, y)


def test_cross_entropy_bad_arguments():
    g = mg.Graph()
    x, y = g.input("logits", (4, 3)), g.input("labels", (4,), mg.i32)
    with pytest.raises(ValueError, match="reduction"):
        ops.cross_entropy(x, y, reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        ops.cross_entropy(x, y, label_smoothing=1.5)
    with pytest.raises(mg.ShapeError, match=r"weight must have shape \(3,\).*'cw' \(4,\)"):
        ops.cross_entropy(x, y, weight=g.input("cw", (4,)))


def test_embedding_errors():
    g = mg.Graph()
    w = g.input("w", (5, 3))
    with pytest.raises(TypeError, match=r"'ids' has dtype f32, expected an integer"):
        ops.embedding(g.input("ids", (2,)), w)
    ids = g.input("ids_i", (2,), mg.i32)
    with pytest.raises(mg.ShapeError, match=r"weight must be 2-D.*'w3' \(5, 3, 1\)"):
        ops.embedding(ids, g.input("w3", (5, 3, 1)))
    with pytest.raises(mg.ShapeError, match=r"padding_idx 7"):
        ops.embedding(ids, w, padding_idx=7)
    with pytest.raises(mg.ShapeError, match=r"embedding_grad: .*'ct' \(3, 3\)"):
        ops.embedding_grad(ids, g.input("ct", (3, 3)), 5)


def test_group_and_batch_norm_errors():
    g = mg.Graph()
    x = g.input("x", (2, 6, 3))
    with pytest.raises(mg.ShapeError, match=r"6 channels cannot be split into 4 groups.*'x' \(2, 6, 3\)"):
        ops.group_norm(x, 4)
    with pytest.raises(mg.ShapeError, match=r"bias must have shape \(6,\).*'b' \(3,\)"):
        ops.group_norm(x, 3, bias=g.input("b", (3,)))
    with pytest.raises(mg.ShapeError, match=r"running_mean must have shape \(6,\).*'rm' \(2,\)"):
        ops.batch_norm(x, g.input("rm", (2,)), g.input("rv", (6,)))
    with pytest.raises(mg.ShapeError, match=r"more than 1 value per channel.*'one' \(1, 3\)"):
        ops.batch_norm(g.input("one", (1, 3)), None, None, training=True)
    with pytest.raises(ValueError, match="running_mean and running_var"):
        ops.batch_norm(x, None, None)


def test_rope_and_softmax_errors():
    g = mg.Graph()
    with pytest.raises(mg.ShapeError, match=r"even head_dim.*'odd' \(1, 2, 3, 5\)"):
        ops.rope(g.input("odd", (1, 2, 3, 5)))
    with pytest.raises(TypeError, match=r"'ints' has dtype i32, expected a float"):
        ops.softmax(g.input("ints", (3,), mg.i32))
    with pytest.raises(mg.ShapeError, match=r"dim 2 out of range"):
        ops.log_softmax(g.input("m", (3, 4)), 2)
    with pytest.raises(mg.ShapeError, match="num_classes"):
        ops.one_hot(g.input("lab", (3,), mg.i32))


# ---------------------------------------------------------------- runtime semantics
def test_out_of_range_ids_raise_in_reference():
    g = mg.Graph()
    ids, w = g.input("ids", (3,), mg.i32), g.input("w", (4, 2))
    y = ops.embedding(ids, w)
    with pytest.raises(RuntimeError, match="id 4 is out of range for 4 embeddings"):
        evaluate(g, [y], {"ids": np.array([0, 4, 1], np.int32), "w": np.zeros((4, 2), np.float32)})
    x, lab = g.input("x", (3, 4)), g.input("lab", (3,), mg.i32)
    loss = ops.cross_entropy(x, lab)
    with pytest.raises(RuntimeError, match="label 7 is out of range for 4 classes"):
        evaluate(g, [loss], {"x": np.zeros((3, 4), np.float32), "lab": np.array([0, 7, 1], np.int32)})


def test_one_hot_out_of_range_gives_zero_row():
    g = mg.Graph()
    lab = g.input("lab", (4,), mg.i32)
    (oh,) = evaluate(g, [ops.one_hot(lab, 3)], {"lab": np.array([2, -100, 3, 0], np.int32)})
    np.testing.assert_array_equal(oh, [[0, 0, 1], [0, 0, 0], [0, 0, 0], [1, 0, 0]])
    assert oh.dtype == np.float32


def test_cross_entropy_all_ignored_matches_torch():
    """Mean over zero rows is nan (torch); the gradient is zero, also as torch."""
    g = mg.Graph()
    x, lab = g.input("x", (3, 4)), g.input("lab", (3,), mg.i32)
    loss = ops.cross_entropy(x, lab)
    (dx,) = mg.grad(loss, [x])
    dec = OPS["cross_entropy"].extra["decompose"](*loss.inputs, **loss.attrs)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32),
             "lab": np.full(3, -100, np.int32)}
    with np.errstate(invalid="ignore", divide="ignore"):
        val, grad, dval = evaluate(g, [loss, dx, dec], feeds)
    xt = torch.tensor(feeds["x"], requires_grad=True)
    ref = torch.nn.functional.cross_entropy(xt, torch.full((3,), -100))
    ref.backward()
    assert np.isnan(val) and torch.isnan(ref) and np.isnan(dval)
    np.testing.assert_array_equal(grad, xt.grad.numpy())


def test_embedding_padding_gradient_matches_torch():
    g = mg.Graph()
    ids, w = g.input("ids", (5,), mg.i32), g.input("w", (4, 3))
    ct = np.random.default_rng(1).standard_normal((5, 3)).astype(np.float32)
    y = ops.embedding(ids, w, padding_idx=2)
    (dw,) = mg.grad(ops.sum(y * g.constant(ct)), [w])
    idv = np.array([2, 3, 3, 0, 2], np.int32)
    wv = np.random.default_rng(2).standard_normal((4, 3)).astype(np.float32)
    (ours,) = evaluate(g, [dw], {"ids": idv, "w": wv})
    wt = torch.tensor(wv, requires_grad=True)
    (torch.nn.functional.embedding(torch.tensor(idv, dtype=torch.int64), wt, padding_idx=2)
     * torch.tensor(ct)).sum().backward()
    np.testing.assert_allclose(ours, wt.grad.numpy(), rtol=1e-6, atol=1e-6)
    assert not ours[2].any()


def test_rms_norm_default_eps_is_f32_epsilon():
    g = mg.Graph()
    y = ops.rms_norm(g.input("x", (2, 4)), (4,))
    assert y.attrs["eps"] == float(np.finfo(np.float32).eps) == torch.finfo(torch.float32).eps
    y16 = ops.rms_norm(g.input("h", (2, 4), mg.f16), (4,))
    assert y16.attrs["eps"] == y.attrs["eps"]  # torch takes it from the f32 compute type


def test_batch_norm_stats_match_torch_running_update():
    """One torch training step's running statistics follow from batch_norm_stats."""
    g = mg.Graph()
    x = g.input("x", (4, 3, 2))
    m, v = ops.batch_norm_stats(x)
    xv = np.random.default_rng(3).standard_normal((4, 3, 2)).astype(np.float32)
    mv, vv = evaluate(g, [m, v], {"x": xv})
    rm, rv = torch.zeros(3), torch.ones(3)
    torch.nn.functional.batch_norm(torch.tensor(xv), rm, rv, training=True, momentum=0.1)
    np.testing.assert_allclose(0.9 * 0 + 0.1 * mv, rm.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(0.9 * 1 + 0.1 * vv, rv.numpy(), rtol=1e-5, atol=1e-6)


def test_rope_inverse_undoes_rope():
    g = mg.Graph()
    x = g.input("x", (1, 2, 3, 8))
    y = ops.rope(x, position_offset=7)
    back = mg.ops.emit("rope", [y], base=y.attrs["base"], position_offset=7, inverse=True)
    xv = np.random.default_rng(4).standard_normal((1, 2, 3, 8)).astype(np.float32)
    (bv,) = evaluate(g, [back], {"x": xv})
    np.testing.assert_allclose(bv, xv, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kind", ["layer_norm", "group_norm", "batch_norm"])
def test_long_row_norms_on_the_gpu_hold_far_from_zero(kind):
    """Rows long enough for a workgroup each, with a mean 3000 standard deviations from
    zero: the one-pass statistics (Welford's, merged across the workgroup) keep the
    variance where a sum-of-squares formula would lose it to cancellation."""
    rng = np.random.default_rng(21)
    xv = (1e3 + rng.standard_normal((2, 8, 24, 20)) * 0.3).astype(np.float32)
    g = mg.Graph()
    x = g.input("x", xv.shape)
    xt = torch.tensor(xv, dtype=torch.float64)
    if kind == "layer_norm":
        y = ops.layer_norm(x, (24, 20))
        want = torch.nn.functional.layer_norm(xt, (24, 20))
    elif kind == "group_norm":
        y = ops.group_norm(x, 2)
        want = torch.nn.functional.group_norm(xt, 2)
    else:
        y = ops.batch_norm(x, g.state("rm", (8,)), g.state("rv", (8,), init=1.0), training=True)
        want = torch.nn.functional.batch_norm(xt, torch.zeros(8, dtype=torch.float64),
                                              torch.ones(8, dtype=torch.float64), training=True)
    with mg.compile(g, outputs=[y], backend="gpu") as s:
        got = s.run({"x": xv})[0]
    # the inputs' own f32 rounding (1e3 in f32 keeps ~6e-5 absolute) bounds the agreement
    np.testing.assert_allclose(got, want.numpy(), rtol=0, atol=2e-3)
