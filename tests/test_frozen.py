"""Frozen parameters (requires_grad=False) and optimizer parameter groups, against torch."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura import nn

BACKENDS = ["numpy", "gpu"]


def _model():
    nn.init.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.LayerNorm(8), nn.Tanh(), nn.Linear(8, 3))


def _data(seed=0, b=5):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((b, 6)).astype(np.float32), rng.integers(0, 3, b).astype(np.int32)


def _loss(model):
    return lambda x, y: mg.ops.cross_entropy(model(x), y)


@pytest.mark.parametrize("backend", BACKENDS)
def test_frozen_parameter_is_bit_identical_after_100_steps(backend):
    model = _model()
    model[0].requires_grad_(False)                       # the whole first layer
    model[3].bias.requires_grad_(False)
    before = model.state_dict()
    step = mg.jit(_loss(model), optimizer=mg.optim.AdamW(lr=0.05), backend=backend)
    x, y = _data()
    for _ in range(100):
        step(x, y)
    after = step.state_dict(include_optimizer=True)
    for name in ("0.weight", "0.bias", "3.bias"):
        assert after[name].tobytes() == before[name].tobytes(), name
        assert f"{name}.exp_avg" not in after and f"{name}.exp_avg_sq" not in after    # no optimizer state
    for name in ("1.weight", "3.weight"):
        assert not np.array_equal(after[name], before[name]), name
        assert f"{name}.exp_avg" in after


def test_frozen_at_creation_and_graph_parameter():
    p = nn.Parameter(np.ones((2, 2), np.float32), requires_grad=False)
    assert p.requires_grad is False and p.requires_grad_() is p and p.requires_grad
    g = mg.Graph()
    x = g.input("x", (3, 2))
    w = g.parameter("w", (2, 2), requires_grad=False)
    b = g.parameter("b", (2,))
    loss = mg.ops.sum(mg.ops.tanh(x @ w + b))
    s = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="numpy")
    w0 = s.state_dict()["w"].copy()
    s.step({"x": np.ones((3, 2), np.float32)})
    assert np.array_equal(s.state_dict()["w"], w0) and set(s.program.grads) == {"b"}


def test_frozen_weights_have_no_gradient_kernels():
    """The step of a model whose first layer is frozen dispatches fewer kernels: no weight
    gradient for it, and no gradient at all for the input-side layer's inputs."""
    x, y = _data()
    counts = {}
    for frozen in (False, True):
        model = _model()
        model[0].requires_grad_(not frozen)
        step = mg.jit(_loss(model), optimizer=mg.optim.AdamW(lr=0.01), backend="gpu")
        step(x, y)
        sess = next(iter(step.sessions.values()))
        counts[frozen] = sum(p.n_dispatches for p in sess.executor.plans.values())
    print("dispatches per step: trainable", counts[False], "first layer frozen", counts[True])
    assert counts[True] < counts[False]


def test_jit_retraces_when_a_parameter_is_frozen_later():
    model = _model()
    step = mg.jit(_loss(model), optimizer=mg.optim.SGD(lr=0.1), backend="numpy")
    x, y = _data()
    step(x, y)
    w = step.state_dict()["0.weight"].copy()
    model[0].weight.requires_grad_(False)
    step(x, y)
    assert len(step._entries[next(iter(step._entries))]) == 2
    assert np.array_equal(step.state_dict()["0.weight"], w)


def _torch_twin(model):
    t = torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    t.load_state_dict({k: torch.tensor(v) for k, v in model.state_dict().items()})
    return t


def _groups(named, lr_decay=0.03):
    """No weight decay for norms and biases; the rest decays at 0.1 with its own lr."""
    decay = [p for n, p in named if n.endswith("weight") and not n.startswith("1.")]
    rest = [p for n, p in named if not (n.endswith("weight") and not n.startswith("1."))]
    return [{"params": decay, "weight_decay": 0.1, "lr": lr_decay}, {"params": rest, "weight_decay": 0.0}]


@pytest.mark.parametrize("backend", BACKENDS)
def test_parameter_groups_match_torch_adamw(backend):
    model = _model()
    t = _torch_twin(model)
    opt_t = torch.optim.AdamW(_groups(list(t.named_parameters())), lr=0.05)
    opt = mg.optim.AdamW(_groups(list(model.named_parameters())), lr=0.05)
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    step = mg.jit(_loss(model), optimizer=opt, backend=backend)
    for i in range(4):
        x, y = _data(i)
        if i == 2:        # a group's learning rate changed between steps, as torch users do
            opt.param_groups[1]["lr"] = opt_t.param_groups[1]["lr"] = 0.02
        loss = step(x, y)
        opt_t.zero_grad()
        lt = torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y, dtype=torch.long))
        lt.backward()
        opt_t.step()
        assert abs(loss - lt.item()) <= 1e-5 * abs(lt.item())
    ours = step.state_dict()
    for n, v in t.state_dict().items():
        np.testing.assert_allclose(ours[n], v.numpy(), rtol=1e-5, atol=1e-7, err_msg=n)


def test_params_list_trains_only_what_it_names():
    model = _model()
    opt = mg.optim.SGD(model[3].parameters(), lr=0.1)
    step = mg.jit(_loss(model), optimizer=opt, backend="numpy")
    before = model.state_dict()
    step(*_data())
    after = step.state_dict()
    assert np.array_equal(after["0.weight"], before["0.weight"])
    assert not np.array_equal(after["3.weight"], before["3.weight"])


def test_parameter_group_errors_name_the_problem():
    model = _model()
    with pytest.raises(ValueError, match="group 0 sets \\['momentum'\\]"):
        mg.optim.AdamW([{"params": model.parameters(), "momentum": 0.9}])
    with pytest.raises(ValueError, match="weight_decay"):
        mg.optim.AdamW([{"params": model.parameters(), "weight_decay": -1.0}])
    with pytest.raises(TypeError, match="lr="):
        mg.optim.AdamW(1e-3)
    with pytest.raises(ValueError, match="empty"):
        mg.optim.SGD([])
