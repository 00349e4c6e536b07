"""Convolution and pooling beyond the sample table: bad inputs, decompositions against the
op references, im2col/col2im adjointness, max-pool ties and second derivatives vs torch."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.ops import OPS
from meganeura.reference import evaluate, needed_nodes

F = torch.nn.functional


def _graph(**shapes):
    g = mg.Graph()
    return g, {k: g.input(k, s) for k, s in shapes.items()}


# ------------------------------------------------------------------------ bad inputs
def test_channel_mismatch_names_tensors_and_shapes():
    g, t = _graph(x=(1, 3, 5, 5), w=(4, 2, 3, 3))
    with pytest.raises(mg.ShapeError) as e:
        mg.ops.conv2d(t["x"], t["w"])
    msg = str(e.value)
    assert "conv2d" in msg and "3 channels" in msg and "expects 2" in msg
    assert "'x' (1, 3, 5, 5)" in msg and "'w' (4, 2, 3, 3)" in msg


@pytest.mark.parametrize("x_shape,w_shape,what", [
    ((1, 3, 5, 5), (4, 1, 3, 3), "input's 3 channels"),
    ((1, 4, 5, 5), (3, 2, 3, 3), "weight's 3 output channels"),
])
def test_groups_must_divide_channels(x_shape, w_shape, what):
    g, t = _graph(x=x_shape, w=w_shape)
    with pytest.raises(mg.ShapeError, match="groups=2") as e:
        mg.ops.conv2d(t["x"], t["w"], groups=2)
    assert what in str(e.value) and "'x'" in str(e.value) and "'w'" in str(e.value)


def test_conv_other_errors():
    g, t = _graph(x=(1, 2, 4, 4), w=(3, 2, 3, 3), b=(2,), x5=(1, 1, 2, 4, 4), w3=(3, 2, 3))
    with pytest.raises(mg.ShapeError, match=r"bias must have shape \(3,\).*'b' \(2,\)"):
        mg.ops.conv2d(t["x"], t["w"], t["b"])
    with pytest.raises(mg.ShapeError, match=r"larger than the padded input \(4, 4\).*'x' \(1, 2, 4, 4\)"):
        mg.ops.conv2d(t["x"], t["w"], dilation=2)
    with pytest.raises(mg.ShapeError, match=r"3-D \(C, H, W\) or 4-D.*'x5'"):
        mg.ops.conv2d(t["x5"], t["w"])
    with pytest.raises(mg.ShapeError, match=r"weight must be 4-D.*'w3'"):
        mg.ops.conv2d(t["x"], t["w3"])
    with pytest.raises(ValueError, match="'same' needs stride 1"):
        mg.ops.conv2d(t["x"], t["w"], stride=2, padding="same")
    with pytest.raises(ValueError, match="stride must be >= 1"):
        mg.ops.conv2d(t["x"], t["w"], stride=0)
    with pytest.raises(ValueError, match="padding must be"):
        mg.ops.conv2d(t["x"], t["w"], padding="full")
    h = g.input("h", (1, 2, 4, 4), mg.f16)
    with pytest.raises(TypeError, match="dtypes differ"):
        mg.ops.conv2d(h, t["w"])


def test_pool_errors():
    g, t = _graph(x=(1, 2, 4, 4), c=(1, 8, 5))
    with pytest.raises(mg.ShapeError, match=r"padding 2 must be at most half the kernel size 3.*'x'"):
        mg.ops.max_pool2d(t["x"], 3, 1, 2)
    with pytest.raises(mg.ShapeError, match=r"avg_pool2d.*larger than the padded input"):
        mg.ops.avg_pool2d(t["x"], 5)
    assert mg.ops.adaptive_avg_pool2d(t["x"], 3).shape == (1, 2, 3, 3)       # uneven windows, as torch
    with pytest.raises(NotImplementedError, match="scale_factor"):
        mg.ops.upsample_nearest2d(t["x"], 1.5)
    with pytest.raises(mg.ShapeError, match=r"col2im: expected 9 = 3\*3 columns.*'c' \(1, 8, 5\)"):
        mg.ops.fold(t["c"], (4, 4), 2, stride=1)


# ----------------------------------------------------- decompositions vs references
def _feeds(g, rng, ints=False):
    out = {}
    for name, t in g.inputs.items():
        a = rng.integers(-2, 3, t.shape) if ints else rng.standard_normal(t.shape)
        out[name] = a.astype(np.float32)
    return out


def _check_decompose(nodes, feeds):
    """Each node's decomposition equals its reference and uses no composite op."""
    assert nodes
    for t in nodes:
        first_new = len(t.graph.nodes)
        d = OPS[t.op].extra["decompose"](*t.inputs, **t.attrs)
        assert d.shape == t.shape and d.dtype is t.dtype
        composite = {n.op for n in needed_nodes([d])
                     if n.id >= first_new and n.op in OPS and "decompose" in OPS[n.op].extra}
        assert not composite, f"{t.op}'s decomposition uses composite ops {composite}"
        a, b = evaluate(t.graph, [t, d], feeds, compute=np.float64)
        np.testing.assert_allclose(b, a, rtol=1e-10, atol=1e-10, err_msg=t.op)


CONV_CASES = [
    dict(),
    dict(stride=2, padding=1),
    dict(stride=(2, 1), padding=(0, 2), dilation=(2, 1)),
    dict(padding="same", dilation=(1, 2)),
    dict(groups=2, padding=1),
    dict(groups=4, stride=2),
]


@pytest.mark.parametrize("kw", CONV_CASES, ids=[str(k) for k in CONV_CASES])
def test_conv2d_and_grads_decompose(kw):
    g, t = _graph(x=(2, 4, 6, 5), w=(4, 4 // kw.get("groups", 1), 3, 2))
    y = mg.ops.conv2d(t["x"], t["w"], **kw)
    gx, gw = mg.grad(mg.ops.sum(y * y), [t["x"], t["w"]])
    nodes = [n for n in g.nodes if n.op in ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")]
    assert {n.op for n in nodes} == {"conv2d", "conv2d_input_grad", "conv2d_weight_grad"}
    feeds = _feeds(g, np.random.default_rng(0))
    _check_decompose(nodes, feeds)
    # the reference matches torch too (gradients of sum(y^2))
    x, w = (torch.tensor(feeds[k], dtype=torch.float64, requires_grad=True) for k in ("x", "w"))
    yt = F.conv2d(x, w, **kw)
    (yt * yt).sum().backward()
    ours = evaluate(g, [y, gx, gw], feeds, compute=np.float64)
    for o, r in zip(ours, (yt.detach(), x.grad, w.grad)):
        np.testing.assert_allclose(o, r.numpy(), rtol=1e-9, atol=1e-9)


@pytest.mark.parametrize("ints", [False, True], ids=["distinct", "ties"])
@pytest.mark.parametrize("args", [(2,), (3, 2, 1), ((2, 3), 1, (1, 0)), (2, 1, 1, 2)])
def test_pools_decompose(args, ints):
    g, t = _graph(x=(2, 2, 5, 6))
    m = mg.ops.max_pool2d(t["x"], *args[:3], **({"dilation": args[3]} if len(args) > 3 else {}))
    a1 = mg.ops.avg_pool2d(t["x"], *args[:3])
    a2 = mg.ops.avg_pool2d(t["x"], *args[:3], count_include_pad=False)
    loss = mg.ops.sum(m * m) + mg.ops.sum(a1 * a2)
    mg.grad(loss, [t["x"]])
    nodes = [n for n in g.nodes if n.op in ("max_pool2d", "max_pool2d_grad", "avg_pool2d")]
    assert {n.op for n in nodes} == {"max_pool2d", "max_pool2d_grad", "avg_pool2d"}
    _check_decompose(nodes, _feeds(g, np.random.default_rng(1), ints=ints))


def test_im2col_col2im_adjoint():
    g, t = _graph(x=(2, 3, 5, 4))
    cols = mg.ops.unfold(t["x"], (2, 3), dilation=(2, 1), padding=(1, 2), stride=(1, 2))
    c = g.input("c", cols.shape)
    back = mg.ops.fold(c, (5, 4), (2, 3), dilation=(2, 1), padding=(1, 2), stride=(1, 2))
    rng = np.random.default_rng(2)
    feeds = _feeds(g, rng)
    a, b = evaluate(g, [cols, back], feeds, compute=np.float64)
    np.testing.assert_allclose(np.sum(a * feeds["c"]), np.sum(feeds["x"] * b), rtol=1e-12)
    # each is the other's VJP
    gx, = mg.grad(cols, [t["x"]], cotangent=c)
    gc, = mg.grad(back, [c], cotangent=t["x"])
    r1, r2 = evaluate(g, [gx, gc], feeds, compute=np.float64)
    np.testing.assert_allclose(r1, b, rtol=1e-12)
    np.testing.assert_allclose(r2, a, rtol=1e-12)


def test_max_pool_fill_is_minus_inf():
    g, t = _graph(x=(1, 1, 3, 3))
    y = mg.ops.max_pool2d(t["x"], 3, 1, 1)
    x = -np.arange(1, 10, dtype=np.float32).reshape(1, 1, 3, 3)
    out, = evaluate(g, [y], {"x": x})
    np.testing.assert_array_equal(out, F.max_pool2d(torch.tensor(x), 3, 1, 1).numpy())


# -------------------------------------------------------------- ties, double backward
@pytest.mark.parametrize("args", [(2,), (3, 1, 1), (3, 2, 1), ((2, 3), (1, 2), (1, 0))])
def test_max_pool_ties_pick_first_like_torch(args):
    g, t = _graph(x=(2, 2, 5, 6))
    y = mg.ops.max_pool2d(t["x"], *args)
    ct = g.input("ct", y.shape)
    gx, = mg.grad(y, [t["x"]], cotangent=ct)
    rng = np.random.default_rng(3)
    x = rng.integers(0, 2, (2, 2, 5, 6)).astype(np.float32)     # many ties
    c = rng.standard_normal(y.shape).astype(np.float32)
    xt = torch.tensor(x, requires_grad=True)
    F.max_pool2d(xt, *args).backward(torch.tensor(c))
    ours, = evaluate(g, [gx], {"x": x, "ct": c})
    np.testing.assert_allclose(ours, xt.grad.numpy(), rtol=1e-6, atol=1e-6)


def _double_backward(build, theirs, shapes):
    """d/d(inputs) of sum(v * d(sum(w * f))/dx), ours vs torch (f64)."""
    g, t = _graph(**shapes)
    ins = list(t.values())
    y = build(*ins)
    rng = np.random.default_rng(4)
    wy = g.constant(rng.standard_normal(y.shape))
    gx = mg.grad(mg.ops.sum(y * wy), ins)
    vs = [g.constant(rng.standard_normal(a.shape)) for a in gx]
    total = mg.ops.sum(gx[0] * vs[0])
    for a, v in zip(gx[1:], vs[1:]):
        total = total + mg.ops.sum(a * v)
    second = mg.grad(total, ins)
    feeds = _feeds(g, np.random.default_rng(5))
    ours = evaluate(g, second, feeds, compute=np.float64)
    tin = [torch.tensor(feeds[k], dtype=torch.float64, requires_grad=True) for k in t]
    yt = theirs(*tin)
    gt = torch.autograd.grad((yt * torch.tensor(wy.attrs["value"], dtype=torch.float64)).sum(), tin, create_graph=True)
    s = sum((a * torch.tensor(v.attrs["value"], dtype=torch.float64)).sum() for a, v in zip(gt, vs))
    ref = torch.autograd.grad(s, tin, allow_unused=True)
    for o, r in zip(ours, ref):
        np.testing.assert_allclose(o, np.zeros_like(o) if r is None else r.numpy(), rtol=1e-9, atol=1e-9)


def test_conv2d_double_backward():
    _double_backward(lambda x, w: mg.ops.conv2d(x, w, stride=2, padding=1, groups=2),
                     lambda x, w: F.conv2d(x, w, stride=2, padding=1, groups=2),
                     dict(x=(2, 4, 5, 5), w=(2, 2, 3, 3)))


def test_max_pool2d_double_backward():
    _double_backward(lambda x: mg.ops.max_pool2d(x * x, 3, 2, 1), lambda x: F.max_pool2d(x * x, 3, 2, 1),
                     dict(x=(1, 2, 5, 5)))


def test_avg_pool2d_double_backward():
    _double_backward(lambda x: mg.ops.avg_pool2d(x * x, 3, 2, 1, count_include_pad=False),
                     lambda x: F.avg_pool2d(x * x, 3, 2, 1, count_include_pad=False), dict(x=(1, 2, 5, 5)))


def test_f16_conv_runs():
    g = mg.Graph()
    x, w = g.input("x", (1, 2, 4, 4), mg.f16), g.input("w", (2, 2, 3, 3), mg.f16)
    y = mg.ops.conv2d(x, w, padding=1)
    assert y.dtype is mg.f16 and y.shape == (1, 2, 4, 4)
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((1, 2, 4, 4)), "w": rng.standard_normal((2, 2, 3, 3))}
    out, = evaluate(g, [y], feeds)
    ref = F.conv2d(torch.tensor(feeds["x"]), torch.tensor(feeds["w"]), padding=1).numpy()
    np.testing.assert_allclose(out, ref, rtol=2e-2, atol=2e-2)


def test_primitive_index_formulas():
    """The per-element formulas documented on im2col and col2im (what a GPU kernel computes)
    agree with the vectorised references."""
    kh, kw, sh, sw, dh, dw, pt, pb, pl, pr, fill = 2, 3, 2, 1, 1, 2, 1, 0, 2, 1, -7.0
    n, c, h, w = 1, 2, 5, 4
    attrs = dict(kernel=(kh, kw), stride=(sh, sw), padding=((pt, pb), (pl, pr)), dilation=(dh, dw))
    ho, wo = (h + pt + pb - dh * (kh - 1) - 1) // sh + 1, (w + pl + pr - dw * (kw - 1) - 1) // sw + 1
    x = np.random.default_rng(8).standard_normal((n, c, h, w))
    cols = OPS["im2col"].ref(x, fill=fill, **attrs)
    assert cols.shape == (n, c * kh * kw, ho * wo)
    for (b, r, l), v in np.ndenumerate(cols):
        ci, i, j, oh, ow = r // (kh * kw), r // kw % kh, r % kw, l // wo, l % wo
        y, z = oh * sh - pt + i * dh, ow * sw - pl + j * dw
        assert v == (x[b, ci, y, z] if 0 <= y < h and 0 <= z < w else fill)
    back = OPS["col2im"].ref(cols, size=(h, w), **attrs)
    for (b, ci, y, z), v in np.ndenumerate(back):
        acc = 0.0
        for i in range(kh):
            for j in range(kw):
                qh, qw = y + pt - i * dh, z + pl - j * dw
                if qh % sh or qw % sw or not (0 <= qh // sh < ho and 0 <= qw // sw < wo):
                    continue
                acc += cols[b, (ci * kh + i) * kw + j, (qh // sh) * wo + qw // sw]
        assert np.isclose(v, acc, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("kw", [dict(stride=2, padding=1), dict(dilation=(2, 1), padding=(2, 0)), dict()],
                         ids=["stride", "dilation", "plain"])
def test_weight_gradient_folds_the_batch_on_the_gpu(kw):
    """More weights than output positions: one matmul over the whole batch (the columns of
    every image side by side, the cotangent transposed to match) instead of a product per
    image and their sum, on the GPU against the float64 reference."""
    from meganeura.ops.conv import _conv_padding, _pair
    from meganeura.ops.registry import emit
    rng = np.random.default_rng(9)
    x = rng.standard_normal((3, 6, 7, 5)).astype(np.float32)
    w = np.zeros((5, 6, 3, 3), np.float32)
    g = mg.Graph()
    xt = g.input("x", x.shape)
    y_shape = mg.ops.conv2d(xt, g.input("w", w.shape), **kw).shape
    ct = rng.standard_normal(y_shape).astype(np.float32)
    stride, dilation = _pair("t", "s", kw.get("stride", 1), 1), _pair("t", "d", kw.get("dilation", 1), 1)
    attrs = dict(kernel=(3, 3), stride=stride, dilation=dilation, groups=1,
                 padding=_conv_padding(kw.get("padding", 0), (3, 3), stride, dilation))
    dw = emit("conv2d_weight_grad", [xt, g.input("ct", ct.shape)], **attrs)
    s = mg.compile(g, outputs=[dw], backend="gpu")
    (got,) = s.run({"x": x, "ct": ct})
    names = s.executor.plans["run"].names
    assert not any("reduce_sum" in n for n in names) and sum("matmul" in n for n in names) == 1, names
    want = OPS["conv2d_weight_grad"].ref(x.astype(np.float64), ct.astype(np.float64), **attrs)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())
