"""Accelerated precision runs large backward matmuls on f16 operands too. Gradients are
often far below f16's range, so each gradient operand is scaled by its largest magnitude
before the cast and the product unscaled after; forward values are cast as in the forward
pass. Checked against the strict session on the device, with gradients scaled down to
where unscaled f16 would flush them to zero."""
import numpy as np
import pytest

import meganeura as mg
from meganeura import compiler

B, D, H = 16, 32, 64


def _session(precision, loss_scale):
    g = mg.Graph()
    x = g.input("x", (B, D))
    h = mg.ops.gelu(mg.ops.linear(x, g.parameter("w1", (H, D)), g.parameter("b1", (H,))))
    y = mg.ops.linear(h, g.parameter("w2", (D, H)))
    loss = mg.ops.mean(y * y) * loss_scale
    return mg.compile(g, loss=loss, precision=precision, seed=3, backend="gpu")


def _grads(precision, loss_scale):
    feeds = {"x": np.random.default_rng(0).standard_normal((B, D)).astype(np.float32)}
    with _session(precision, loss_scale) as s:
        s.compute_grads(feeds)
        names = list(s.executor.plans["grads"].names)
        return s.grads(), names


# 1e37: gradients near 1e34, where scaling up before dividing by the peak would overflow f32
@pytest.mark.parametrize("loss_scale", [1.0, 1e-9, 1e37])
def test_backward_matmuls_on_f16_match_strict(monkeypatch, loss_scale):
    monkeypatch.setattr(compiler, "BACKWARD_F16_MIN_MACS", 0)      # every backward matmul
    want, _ = _grads("strict", loss_scale)
    got, names = _grads("accelerated", loss_scale)
    # the gradient operands were scaled (a max reduction) and the matmuls read f16; the
    # cast and the products' epilogues read the peak itself: no launch of a scalar between
    assert any("reduce_max" in n for n in names), names
    assert any(n.endswith("+cast") and "div" in n for n in names), names
    assert not any(part in ("div", "mul") for n in names for part in n.split("|")), names
    for name, w in want.items():
        assert np.abs(w).max() > 0, name
        if loss_scale < 1:      # unscaled f16 would hold none of these values
            assert np.abs(w).max() < 6e-8 * 2 ** 10, name
        g64, w64 = got[name].astype(np.float64), w.astype(np.float64)      # norms of 1e35 overflow f32
        err = np.linalg.norm(g64 - w64) / np.linalg.norm(w64)
        assert err < 2e-3, (name, err)


def test_small_backward_matmuls_stay_f32():
    # below BACKWARD_F16_MIN_MACS a scaled cast costs more launches than it saves
    want, _ = _grads("strict", 1.0)
    got, names = _grads("accelerated", 1.0)
    assert not any("reduce_max" in n for n in names), names
    for name, w in want.items():
        # only the forward matmuls round to f16
        np.testing.assert_allclose(got[name], w, rtol=0, atol=2e-3 * np.abs(w).max(), err_msg=name)


def test_only_the_autodiffs_matmuls_count_as_backward(monkeypatch):
    """A matmul that only a state update reads (not on the loss's path, not made by the
    autodiff) keeps f32 operands, and its operands are not taken for gradients."""
    from meganeura.compiler import CompileOptions, compile_plan
    monkeypatch.setattr(compiler, "BACKWARD_F16_MIN_MACS", 0)
    g = mg.Graph()
    x = g.input("x", (B, D))
    h = x @ g.parameter("w", (D, H))
    loss = mg.ops.mean(h * h)
    stat = mg.ops.mm(mg.ops.relu(h) * 1e-3, h, ta=True)      # a statistic for a state update
    (gw,) = mg.autodiff.grad(loss, [g.parameters["w"]])
    kp = compile_plan([loss, stat, gw], n_forward=1, options=CompileOptions("accelerated"))
    # one gradient scaled (the weight gradient's dh), not the statistic's operands
    assert sum(n.count("reduce_max") for n in kp.names) == 1, kp.names
    for d in kp.dispatches:
        for u in d.kernel.spec.get("parts", [d.kernel]):
            if u.archetype == "matmul" and u.out.shape == (H, H):
                assert [v.dtype.name for v in u.reads[:2]] == ["f32", "f32"], u.name
