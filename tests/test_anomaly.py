"""Anomaly mode (as torch.autograd.detect_anomaly): the first kernel producing NaN or Inf
in a step is named, by its trace name and the value it wrote."""
import numpy as np
import pytest

import meganeura as mg


def _mlp():
    g = mg.Graph()
    x = g.input("x", (4, 6))
    labels = g.input("labels", (4,), mg.i32)
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("fc1.weight", (8, 6)), g.parameter("fc1.bias", (8,))))
    h = mg.ops.log(h + 1.0)           # finite for any finite relu output
    logits = mg.ops.linear(h, g.parameter("fc2.weight", (3, 8)), g.parameter("fc2.bias", (3,)))
    return g, logits, mg.ops.cross_entropy(logits, labels)


FEEDS = {"x": np.linspace(-1, 1, 24, dtype=np.float32).reshape(4, 6), "labels": np.array([0, 1, 2, 1], np.int32)}


def test_anomaly_names_first_kernel():
    g, logits, loss = _mlp()
    s = mg.compile(g, outputs=[logits], loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="gpu",
                   detect_anomaly=True)
    # a clean step runs and matches the same step without anomaly mode
    plain = mg.compile(g, outputs=[logits], loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="gpu")
    np.testing.assert_allclose(s.step(FEEDS), plain.step(FEEDS), rtol=1e-6)
    # an Inf in the input: the first layer's fused matmul kernel is the first to make NaN/Inf
    bad = {**FEEDS, "x": FEEDS["x"].copy()}
    bad["x"][2, 3] = np.inf
    first = next(n for n in s.executor.plans["step"].names if n.startswith(("gemv", "matmul")))
    with pytest.raises(FloatingPointError, match=rf"anomaly: kernel \d+ '{first.replace('+', '[+]')}' wrote "
                                                 r"\d+ non-finite value\(s\) \(inf, \.\.\.\) into '\w+' \(4, 8\)"):
        s.step(bad)
    assert first == "gemv+add+relu"     # the first layer: its bias add and relu ride in the epilogue


def test_anomaly_env_switch(monkeypatch):
    g = mg.Graph()
    x = g.input("x", (5,))
    y = mg.ops.sqrt(x * 2.0 - 1.0)       # NaN for x < 0.5
    z = mg.ops.sum(y * 3.0)
    s = mg.compile(g, outputs=[z], backend="gpu")
    bad = {"x": np.array([1, 2, 0.1, 3, 4], np.float32)}
    assert np.isnan(s.run(bad)[0])               # default: no check, the NaN comes out
    monkeypatch.setenv("MEGANEURA_DETECT_ANOMALY", "1")
    with pytest.raises(FloatingPointError, match=r"anomaly: kernel \d+ '[^']*sqrt[^']*' wrote 1 non-finite value"):
        s.run(bad)
    np.testing.assert_allclose(s.run({"x": np.ones(5, np.float32)})[0], 15.0)
