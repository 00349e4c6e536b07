"""Runs one op Sample on our side and PyTorch's, forward and gradient."""
from __future__ import annotations

import numpy as np
import torch

import meganeura as mg
from meganeura.reference import evaluate

from .opinfo import F


def build(sample):
    """Graph with the op in the middle: inputs pass through an op before it, and the loss
    weights each output element differently (a reduction that ignores its incoming
    gradient fails)."""
    g = mg.Graph()
    arrays = sample.arrays()
    feeds, xs, float_inputs = {}, [], []
    for i, (spec, a) in enumerate(zip(sample.inputs, arrays)):
        dt = mg.f32 if isinstance(spec, F) else (mg.i32 if spec.dtype == "i32" else mg.u32)
        t = g.input(f"x{i}", a.shape, dt)
        feeds[f"x{i}"] = a
        if isinstance(spec, F):
            float_inputs.append((i, t))
            t = t * 1.0
        xs.append(t)
    outs = sample.ours(mg.ops, *xs)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    rng = np.random.default_rng(123)
    weights = [rng.standard_normal(o.shape).astype(np.float32) if o.dtype.is_float else None for o in outs]
    loss = None
    for o, w in zip(outs, weights):
        if w is None:
            continue
        term = mg.ops.sum(o * g.constant(w))
        loss = term if loss is None else loss + term
    return g, feeds, float_inputs, outs, weights, loss


def torch_reference(sample, dtype=torch.float64, with_grads=True):
    """PyTorch outputs and input gradients (float64 unless told)."""
    arrays = sample.arrays()
    ts = []
    for spec, a in zip(sample.inputs, arrays):
        if isinstance(spec, F):
            ts.append(torch.tensor(a, dtype=dtype, requires_grad=sample.grad and with_grads))
        else:
            ts.append(torch.tensor(a.astype(np.int64)))
    outs = sample.theirs(torch, *ts)
    outs = list(outs) if isinstance(outs, (list, tuple)) else [outs]
    rng = np.random.default_rng(123)
    loss, grads = None, None
    ws = [rng.standard_normal(tuple(o.shape)).astype(np.float32) if o.is_floating_point() else None for o in outs]
    if sample.grad and with_grads:
        for o, w in zip(outs, ws):
            if w is not None:
                term = (o * torch.tensor(w, dtype=o.dtype)).sum()
                loss = term if loss is None else loss + term
        loss.backward()
        grads = [t.grad.numpy() if isinstance(spec, F) and t.grad is not None else
                 (np.zeros(t.shape) if isinstance(spec, F) else None) for spec, t in zip(sample.inputs, ts)]
    return [o.detach().numpy() for o in outs], grads


def assert_close(ours, ref, rtol, atol, what):
    ours, ref = np.asarray(ours, np.float64), np.asarray(ref, np.float64)
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} vs reference {ref.shape}"
    scale = max(1.0, float(np.max(np.abs(ref))) if ref.size else 1.0)
    err = np.abs(ours - ref)
    bad = err > atol * scale + rtol * np.abs(ref)
    if bad.any():
        i = np.unravel_index(np.argmax(err - rtol * np.abs(ref)), err.shape)
        raise AssertionError(f"{what}: {int(bad.sum())}/{bad.size} elements differ; worst at {i}: "
                             f"ours {ours[i]!r} vs reference {ref[i]!r} (max abs err {err.max():.3g})")


def finite_difference_check(sample, g, feeds, float_inputs, loss, grads, n_points=24, eps=1e-6):
    """Central differences of the loss (f64 reference) vs our f64 analytic gradients."""
    rng = np.random.default_rng(7)
    base = {k: v.astype(np.float64) if v.dtype.kind == "f" else v for k, v in feeds.items()}
    analytic = evaluate(g, [gr for gr in grads], base, compute=np.float64)
    for (i, t), an in zip(float_inputs, analytic):
        if i in sample.no_grad_inputs:
            continue
        x = base[t.name]
        idxs = [np.unravel_index(k, x.shape) for k in rng.choice(x.size, min(n_points, x.size), replace=False)]
        for idx in idxs:
            plus, minus = x.copy(), x.copy()
            plus[idx] += eps
            minus[idx] -= eps
            lp = evaluate(g, [loss], {**base, t.name: plus}, compute=np.float64)[0]
            lm = evaluate(g, [loss], {**base, t.name: minus}, compute=np.float64)[0]
            fd = (float(lp) - float(lm)) / (2 * eps)
            a = float(an[idx])
            tol = sample.fd_rtol * max(1.0, abs(fd)) + 1e-6
            assert abs(fd - a) <= tol, f"{sample.name}: input {i} at {idx}: finite difference {fd} vs analytic {a}"


def mlp_training_losses(backend, steps=4):
    """The losses of ``steps`` AdamW steps of a small MLP classifier (linear, GELU, layer
    norm, linear, cross-entropy; seeded data and weights) compiled for ``backend``."""
    rng = np.random.default_rng(0)
    xb = rng.standard_normal((32, 40)).astype(np.float32)
    yb = rng.integers(0, 5, 32).astype(np.int32)
    g = mg.Graph()
    x, y = g.input("x", (32, 40)), g.input("y", (32,), mg.i32)
    h = mg.ops.gelu(mg.ops.linear(x, g.parameter("a.weight", (64, 40)), g.parameter("a.bias", (64,))))
    h = mg.ops.layer_norm(h, (64,))
    loss = mg.ops.cross_entropy(mg.ops.linear(h, g.parameter("b.weight", (5, 64))), y)
    with mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend=backend) as s:
        return np.array([s.step({"x": xb, "y": yb}) for _ in range(steps)])


def check_training_graph(label, built, backend, case):
    """A model's training graph (``built.graph``, ``.output``, ``.loss``) against its
    reference ``case`` = (state, feeds, output, loss, gradients): forward, loss (read back
    and as returned) and every parameter gradient, printed and gated
    at 1e-4 (forward, loss) and 1e-3 (gradient norms and the worst full gradient). The
    forward output and the loss are read from the gradient pass (``read_outputs``), so one
    plan is compiled: lavapipe compiles each kernel when it first runs, and the tiny U-Net's
    forward plan alone took it 30 s."""
    from meganeura.bench.gates import backward_check, rel_l2
    state, feeds, ref_out, ref_loss, ref_grads = case
    assert set(built.graph.parameters) == set(state), "parameter names differ from the reference's state_dict"
    sess = mg.compile(built.graph, outputs=[built.output], loss=built.loss, backend=backend, eager=False)
    sess.load_state_dict(state)
    loss_g = sess.compute_grads(feeds)
    out, loss = sess.read_outputs()
    fwd = rel_l2(out, ref_out)
    loss_err = abs(float(loss) - ref_loss) / abs(ref_loss)
    loss_g_err = abs(loss_g - ref_loss) / abs(ref_loss)
    gate = backward_check(sess.grads(), ref_grads)
    total, per_param = gate["total_norm_err"], gate["norms_rel_l2"]
    worst, worst_err = gate["worst_param"], gate["worst_param_rel_l2"]
    print(f"\n{label} [{backend}]: forward rel L2 {fwd:.2e}, loss rel err {loss_err:.2e} "
          f"(returned {loss_g_err:.2e}), total grad norm rel err {total:.2e}, per-parameter grad norm rel L2 "
          f"{per_param:.2e}, worst full gradient rel L2 {worst_err:.2e} ({worst}), {gate['n_params']} parameters")
    assert fwd < 1e-4 and loss_err < 1e-4 and loss_g_err < 1e-4
    assert total < 1e-3 and per_param < 1e-3
    assert not gate["missing"] and worst_err < 1e-3, worst
