"""Data-dependent indices on the GPU: in checked mode an out-of-range embedding id,
cross-entropy label or one_hot label raises an error naming the op and the tensor; in
trusted mode it never reads out of bounds (a zero row)."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.runtime import device
from meganeura.runtime.device import Device


@pytest.fixture(scope="module")
def checked_device():
    return Device(checked=True)


@pytest.fixture(params=["wgpu", "vulkan"])
def checked(request, monkeypatch, checked_device):
    """Checked mode on each GPU backend (backend="gpu" follows MEGANEURA_BACKEND)."""
    monkeypatch.setenv("MEGANEURA_BACKEND", request.param)
    if request.param == "wgpu":
        monkeypatch.setattr(device, "_device", checked_device)
    else:
        pytest.importorskip("vulkan", reason="the vulkan extra")
        from meganeura.runtime.vulkan import backend
        monkeypatch.setattr(backend, "_runtime", backend.VulkanRuntime(checked=True))


def _session():
    g = mg.Graph()
    ids, lab = g.input("ids", (4,), mg.i32), g.input("labels", (4,), mg.i32)
    logits = g.input("logits", (4, 5))
    w = g.parameter("emb.weight", (10, 3))
    outs = [mg.ops.embedding(ids, w), mg.ops.cross_entropy(logits, lab),
            mg.ops.cross_entropy(logits, lab, ignore_index=2, reduction="none"), mg.ops.one_hot(lab, 5)]
    return mg.compile(g, outputs=outs, backend="gpu"), w


GOOD = {"ids": np.array([1, 2, 3, 9], np.int32), "labels": np.array([0, 1, 2, 4], np.int32),
        "logits": np.linspace(-1, 1, 20, dtype=np.float32).reshape(4, 5)}


def test_checked_mode_names_op_and_tensor(checked):
    s, _ = _session()
    want = s.run(GOOD)
    with pytest.raises(IndexError, match=r"embedding: id 1073741824 in 'ids' is out of range for 10 rows"):
        s.run({**GOOD, "ids": np.array([1, 2**30, 3, 4], np.int32)})
    with pytest.raises(IndexError, match=r"embedding: id -1 in 'ids'"):
        s.run({**GOOD, "ids": np.array([-1, 2, 3, 4], np.int32)})
    assert want[2][2] == 0 and want[2][0] > 0     # label 2 is the second loss's ignore_index
    with pytest.raises(IndexError, match=r"cross_entropy: label 5 in 'labels' is out of range for 5 classes"):
        s.run({**GOOD, "labels": np.array([0, 1, 5, 4], np.int32)})
    # the flags are cleared: a good step after a bad one runs and gives the same values
    again = s.run(GOOD)
    for a, b in zip(again, want):
        np.testing.assert_array_equal(a, b)


def test_checked_ignored_label_is_no_error(checked):
    g = mg.Graph()
    lab, logits = g.input("labels", (3,), mg.i32), g.input("logits", (3, 4))
    s = mg.compile(g, outputs=[mg.ops.cross_entropy(logits, lab, reduction="sum")], backend="gpu")
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    got = s.run({"labels": np.array([0, -100, 3], np.int32), "logits": x})[0]
    logp = x - np.log(np.exp(x).sum(1, keepdims=True))
    np.testing.assert_allclose(got, -(logp[0, 0] + logp[2, 3]), rtol=1e-5)


def test_checked_one_hot(checked):
    g = mg.Graph()
    lab = g.input("classes", (3,), mg.i32)
    s = mg.compile(g, outputs=[mg.ops.one_hot(lab, 4)], backend="gpu")
    np.testing.assert_array_equal(s.run({"classes": np.array([0, 3, 1], np.int32)})[0], np.eye(4)[[0, 3, 1]])
    with pytest.raises(IndexError, match=r"one_hot: label 7 in 'classes'"):
        s.run({"classes": np.array([0, 7, 1], np.int32)})


def test_trusted_mode_bad_ids_read_nothing():
    """An id past the table (2**30 used to come back as row 0) or negative gives a zero row;
    the embedding gradient drops it and keeps the others."""
    g = mg.Graph()
    ids = g.input("ids", (4,), mg.i32)
    w = g.input("w", (10, 3))
    e = mg.ops.embedding(ids, w * 1.0)
    loss = mg.ops.sum(e * g.constant(np.arange(12, dtype=np.float32).reshape(4, 3)))
    (gw,) = mg.grad(loss, [w])
    s = mg.compile(g, outputs=[e, gw], backend="gpu")
    wv = np.arange(1, 31, dtype=np.float32).reshape(10, 3)
    got, grad = s.run({"ids": np.array([2**30, 2, -7, 9], np.int32), "w": wv})
    np.testing.assert_array_equal(got, np.stack([np.zeros(3), wv[2], np.zeros(3), wv[9]]))
    want = np.zeros((10, 3), np.float32)
    want[2], want[9] = [3, 4, 5], [9, 10, 11]
    np.testing.assert_array_equal(grad, want)
