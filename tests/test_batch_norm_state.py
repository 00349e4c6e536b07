"""Batch norm's buffers updated by the training step itself (``Graph.update``): running
statistics and ``num_batches_tracked`` against torch.nn.BatchNorm2d after several steps of a
hand-compiled session (no optimizer wrapper), with gradient accumulation, a module called
twice per forward, ``momentum=None``, checkpoints and torch's state-dict names."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura import nn
from meganeura.graph import i32

BACKENDS = ["numpy", "gpu"]
N, C, S, CLASSES = 4, 3, 6, 5


def _build(self, lib, momentum=0.3, twice=False):
    self.conv = lib.Conv2d(C, 4, 3, padding=1)
    self.bn = lib.BatchNorm2d(4, momentum=momentum)
    self.fc = lib.Linear(4 * S * S, CLASSES)
    self.twice = twice


def _forward(self, x):
    h = self.bn(self.conv(x))
    if self.twice:                  # one module, two training calls per forward
        h = self.bn(h)
    return self.fc(h.reshape(h.shape[0], -1))


class TorchNet(torch.nn.Module):
    def __init__(self, **kw):
        super().__init__()
        _build(self, torch.nn, **kw)

    forward = _forward


class OurNet(nn.Module):
    def __init__(self, **kw):
        super().__init__()
        _build(self, nn, **kw)

    forward = _forward


def _models(**kw):
    torch.manual_seed(0)
    t = TorchNet(**kw)
    with torch.no_grad():     # start away from the defaults so the update rule really shows
        t.bn.running_mean.uniform_(-0.5, 0.5)
        t.bn.running_var.uniform_(0.5, 2.0)
        t.bn.num_batches_tracked.fill_(5)
    ours = OurNet(**kw)
    ours.load_state_dict(t.state_dict())
    return t, ours


def _batches(k):
    rng = np.random.default_rng(1)
    return [((rng.standard_normal((N, C, S, S)) * 2 + 1).astype(np.float32),
             rng.integers(0, CLASSES, N).astype(np.int32)) for _ in range(k)]


def _session(ours, backend, optimizer, accumulate=1):
    g = mg.Graph()
    x, y = g.input("x", (N, C, S, S)), g.input("y", (N,), i32)
    loss = mg.ops.cross_entropy(ours(x), y)
    s = mg.compile(g, loss=loss, optimizer=optimizer, backend=backend, accumulate=accumulate)
    s.load_state_dict(ours.state_dict())          # torch's names, counter included
    return s


def _torch_train(t, batches, lr, accumulate=1):
    t.train()
    opt = torch.optim.SGD(t.parameters(), lr=lr)
    for i, (x, y) in enumerate(batches):
        loss = torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y, dtype=torch.long))
        (loss / accumulate).backward()
        if (i + 1) % accumulate == 0:
            opt.step()
            opt.zero_grad()


def _check(state, t, tol=1e-5):
    for k, v in t.state_dict().items():
        if k.endswith("num_batches_tracked"):
            assert int(state[k]) == int(v), (k, int(state[k]), int(v))
        else:
            np.testing.assert_allclose(state[k], v.numpy(), rtol=tol, atol=tol, err_msg=k)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("accumulate", [1, 2])
def test_steps_update_running_stats_like_torch(backend, accumulate):
    t, ours = _models()
    s = _session(ours, backend, mg.optim.SGD(lr=0.1), accumulate)
    batches = _batches(4)
    for x, y in batches:
        s.step({"x": x, "y": y})       # a micro-step moves the statistics too, as torch's forward
    _torch_train(t, batches, 0.1, accumulate)
    st = s.state_dict(include_optimizer=True)
    assert st["bn.num_batches_tracked"].dtype == np.int32 and int(st["bn.num_batches_tracked"]) == 9
    _check(st, t, 1e-4 if accumulate > 1 else 1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_module_called_twice_updates_twice(backend):
    t, ours = _models(twice=True)
    s = _session(ours, backend, mg.optim.SGD(lr=0.05))
    batches = _batches(2)
    for x, y in batches:
        s.step({"x": x, "y": y})
    _torch_train(t, batches, 0.05)
    assert int(t.bn.num_batches_tracked) == 9
    _check(s.state_dict(include_optimizer=True), t)


def test_momentum_none_cumulative_average_in_the_graph():
    """momentum=None: the k-th batch ever counted weighs 1/k, from the counter state (not the host)."""
    t, ours = _models(momentum=None)
    s = _session(ours, "numpy", mg.optim.SGD(lr=0.1))
    batches = _batches(3)
    for x, y in batches:
        s.step({"x": x, "y": y})
    _torch_train(t, batches, 0.1)
    _check(s.state_dict(include_optimizer=True), t)


def test_run_and_compute_grads_leave_the_statistics(tmp_path):
    t, ours = _models()
    s = _session(ours, "numpy", mg.optim.SGD(lr=0.1))
    (x, y), = _batches(1)
    before = s.state_dict(include_optimizer=True)
    s.run({"x": x, "y": y})
    s.compute_grads({"x": x, "y": y})
    after = s.state_dict(include_optimizer=True)
    assert all(np.array_equal(before[k], after[k]) for k in before)
    # checkpoints keep the buffers under torch's names; torch loads them back as they are
    s.step({"x": x, "y": y})
    s.save(tmp_path / "bn.safetensors")
    fresh = _session(OurNet(), "numpy", mg.optim.SGD(lr=0.1))
    fresh.load(tmp_path / "bn.safetensors")
    st = fresh.state_dict(include_optimizer=True)
    assert int(st["bn.num_batches_tracked"]) == 6
    t2 = TorchNet()
    t2.load_state_dict({k: torch.tensor(v) for k, v in st.items()})
    assert int(t2.bn.num_batches_tracked) == 6 and t2.bn.num_batches_tracked.dtype == torch.int64


def test_graph_update_errors():
    g = mg.Graph()
    st = g.state("s", (3,))
    x = g.input("x", (3,))
    p = g.parameter("p", (3,))
    with pytest.raises(ValueError, match="'x'.*is not a state tensor"):
        g.update(x, x)
    with pytest.raises(mg.ShapeError, match=r"update of 's': new value .* \(2,\) f32, the state is \(3,\) f32"):
        g.update(st, g.input("y", (2,)))
    with pytest.raises(ValueError, match="must be a tensor of this graph"):
        g.update(st, mg.Graph().input("z", (3,)))
    g.update(st, st * 0.5 + x)
    assert g.pending(st) is g.updates[st]
    # a state both the graph and the optimizer would write is refused at compile time
    g.update(g.states.get("p.momentum_buffer") or g.state("p.momentum_buffer", (3,)), x)
    with pytest.raises(ValueError, match=r"graph.update and the optimizer both update \['p.momentum_buffer'\]"):
        mg.compile(g, loss=mg.ops.sum(p * x), optimizer=mg.optim.SGD(lr=0.1, momentum=0.9))


@pytest.mark.parametrize("accumulate", [1, 2])
def test_data_parallel_steps_update_running_stats(monkeypatch, accumulate):
    """mg.distributed's step (forward and backward as one phase, the update as another)
    moves the statistics as a plain step does (a world of one: no torchrun)."""
    from meganeura import distributed as dist
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(var, raising=False)
    t, ours = _models()
    g = mg.Graph()
    x, y = g.input("x", (N, C, S, S)), g.input("y", (N,), i32)
    loss = mg.ops.cross_entropy(ours(x), y)
    batches = _batches(4)
    try:
        dist.init()
        with dist.compile(g, loss, mg.optim.SGD(lr=0.1), accumulate=accumulate) as s:
            s.session.load_state_dict(ours.state_dict())
            for xb, yb in batches:
                s.step({"x": xb, "y": yb})
            st = s.state_dict(include_optimizer=True)
    finally:
        dist.shutdown()
    _torch_train(t, batches, 0.1, accumulate)
    assert int(st["bn.num_batches_tracked"]) == 9
    _check(st, t, 1e-4 if accumulate > 1 else 1e-5)
