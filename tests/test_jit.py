"""mg.jit (one compiled program per input signature, shared weights and optimizer state)
and learning-rate schedules, against torch."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura import nn


def _torch_twin(ours):
    t = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))
    t.load_state_dict({k: torch.tensor(v) for k, v in ours.state_dict().items()})
    return t


def _model():
    nn.init.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3))


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_jit_three_batch_sizes_three_plans_shared_weights(backend):
    model = _model()
    t = _torch_twin(model)
    predict = mg.jit(model, backend=backend)
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((b, 5)).astype(np.float32) for b in (4, 9, 1)]
    for x in xs:
        np.testing.assert_allclose(predict(x), t(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-6)
    assert len(predict.sessions) == 3
    sess = list(predict.sessions.values())
    assert all(s.values is sess[0].values for s in sess)              # one store of weights
    if backend == "gpu":
        assert all(s.executor.buffers is sess[0].executor.buffers for s in sess)
    predict(xs[1] * 2)                                                # same shape: a cache hit
    assert len(predict.sessions) == 3
    # loading new weights once changes what every program computes
    new = {k: v * 0.5 for k, v in model.state_dict().items()}
    predict.load_state_dict(new)
    t.load_state_dict({k: torch.tensor(v) for k, v in new.items()})
    for x in xs:
        np.testing.assert_allclose(predict(x), t(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_jit_training_across_batch_sizes_matches_torch_adamw(backend):
    """AdamW steps at batch sizes 4, 8, 3, 8: three programs, one set of weights and moments,
    one step count (bias correction continues), equal to torch doing the same steps."""
    model = _model()
    t = _torch_twin(model)
    opt_t = torch.optim.AdamW(t.parameters(), lr=0.05, weight_decay=0.01)
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=mg.optim.AdamW(lr=0.05),
                  backend=backend)
    predict = mg.jit(model, share_with=step, backend=backend)
    rng = np.random.default_rng(1)
    for b in (4, 8, 3, 8):
        x = rng.standard_normal((b, 5)).astype(np.float32)
        y = rng.integers(0, 3, b).astype(np.int32)
        loss = step(x, y)
        opt_t.zero_grad()
        lt = torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y, dtype=torch.long))
        lt.backward()
        opt_t.step()
        assert abs(loss - float(lt.detach())) < 1e-4
    assert len(step.sessions) == 3 and step.steps_done == 4
    got = step.state_dict(include_optimizer=True)
    for k, v in t.state_dict().items():
        np.testing.assert_allclose(got[k], v.numpy(), rtol=1e-4, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(got[k + ".exp_avg_sq"], opt_t.state[dict(t.named_parameters())[k]]["exp_avg_sq"],
                                   rtol=1e-4, atol=1e-9, err_msg=k)
    x = rng.standard_normal((2, 5)).astype(np.float32)
    np.testing.assert_allclose(predict(x), t(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-6)


def test_jit_structured_outputs_and_static_arguments():
    f = mg.jit(lambda x, scale: {"a": x * scale, "b": (mg.ops.sum(x), x)})
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    out = f(x, 2.0)
    np.testing.assert_array_equal(out["a"], x * 2)
    assert float(out["b"][0]) == 15.0 and isinstance(out["b"], tuple)
    f(x, 3.0)
    assert len(f.sessions) == 2        # a different static value is a different program
    with pytest.raises(TypeError, match="scalar loss"):
        mg.jit(lambda x: x, optimizer=mg.optim.SGD(lr=0.1))(x)


def _train_with_schedule(opt, sched_t, backend, steps=12):
    model = _model()
    t = _torch_twin(model)
    opt_t = torch.optim.AdamW(t.parameters(), lr=0.1, weight_decay=0.0) if sched_t[0] == "adamw" else \
        torch.optim.SGD(t.parameters(), lr=0.1, momentum=0.9)
    sched = sched_t[1](opt_t)
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=opt, backend=backend)
    rng = np.random.default_rng(2)
    x = rng.standard_normal((6, 5)).astype(np.float32)
    y = rng.integers(0, 3, 6).astype(np.int32)
    for _ in range(steps):
        step(x, y)
        opt_t.zero_grad()
        torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y, dtype=torch.long)).backward()
        opt_t.step()
        sched.step()
    got = step.state_dict()
    for k, v in t.state_dict().items():
        np.testing.assert_allclose(got[k], v.numpy(), rtol=2e-4, atol=1e-6, err_msg=k)
    return step


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_cosine_schedule_with_warmup_matches_transformers(backend):
    from transformers import get_cosine_schedule_with_warmup
    opt = mg.optim.AdamW(lr=0.1, weight_decay=0.0, schedule=mg.optim.cosine(total_steps=12, warmup_steps=3))
    step = _train_with_schedule(opt, ("adamw", lambda o: get_cosine_schedule_with_warmup(o, 3, 12)), backend)
    if backend == "gpu":        # the lr is a fed scalar: 12 different rates, one compiled plan
        (sess,) = step.sessions.values()
        assert list(sess.executor.plans) == ["step"]


def test_linear_schedule_matches_transformers():
    from transformers import get_linear_schedule_with_warmup
    opt = mg.optim.AdamW(lr=0.1, weight_decay=0.0, schedule=mg.optim.linear(total_steps=10, warmup_steps=2))
    _train_with_schedule(opt, ("adamw", lambda o: get_linear_schedule_with_warmup(o, 2, 10)), "numpy")


def test_step_decay_matches_torch_steplr():
    opt = mg.optim.SGD(lr=0.1, momentum=0.9, schedule=mg.optim.step_decay(4, gamma=0.5))
    _train_with_schedule(opt, ("sgd", lambda o: torch.optim.lr_scheduler.StepLR(o, 4, gamma=0.5)), "numpy")


def test_schedule_values_and_errors():
    f = mg.optim.cosine(total_steps=10, warmup_steps=2, min_factor=0.1)
    assert f(0) == 0.0 and f(1) == 0.5 and f(2) == pytest.approx(1.0) and f(10) == pytest.approx(0.1)
    assert mg.optim.AdamW(lr=2.0, schedule=f).lr_at(2) == 1.0
    with pytest.raises(ValueError, match="warmup_steps"):
        mg.optim.linear(total_steps=5, warmup_steps=6)
    with pytest.raises(TypeError, match="schedule must be a function"):
        mg.optim.SGD(lr=0.1, schedule=0.5)
