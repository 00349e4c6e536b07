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


def _bn_model():
    nn.init.manual_seed(1)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 3))


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_module_state_dict_holds_trained_weights_without_write_back(backend, tmp_path):
    model = _bn_model()
    before = model.state_dict()
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=mg.optim.AdamW(lr=0.05), backend=backend)
    rng = np.random.default_rng(3)
    x, y = rng.standard_normal((8, 5)).astype(np.float32), rng.integers(0, 3, 8).astype(np.int32)
    for _ in range(3):
        step(x, y)
    trained, ours = step.state_dict(), model.state_dict()
    assert set(ours) == set(before)
    for k in ours:
        np.testing.assert_array_equal(ours[k], trained[k], err_msg=k)
    assert not np.array_equal(ours["0.weight"], before["0.weight"])
    assert not np.array_equal(ours["1.running_mean"], before["1.running_mean"]) and int(ours["1.num_batches_tracked"]) == 3
    np.testing.assert_array_equal(model[3].weight.data, trained["3.weight"])
    # Module.save / load and Jit.save / load
    model.save(tmp_path / "m.safetensors")
    fresh = _bn_model()
    fresh.load(tmp_path / "m.safetensors")
    for k, v in fresh.state_dict().items():
        np.testing.assert_array_equal(v, ours[k], err_msg=k)
    step.save(tmp_path / "j.safetensors")
    step(x, y)
    step.load(tmp_path / "j.safetensors")
    assert step.steps_done == 3
    for k, v in step.state_dict(include_optimizer=True).items():
        np.testing.assert_array_equal(v, model.state_dict().get(k, v), err_msg=k)
    np.testing.assert_array_equal(model.state_dict()["0.weight"], ours["0.weight"])
    # values assigned to the module after training reach the program
    model.load_state_dict({k: v * 0 for k, v in before.items() if k.endswith("weight")}, strict=False)
    model.eval()
    predict = mg.jit(model, share_with=step, backend=backend)
    np.testing.assert_allclose(predict(x), np.broadcast_to(model.state_dict()["3.bias"], (8, 3)), atol=1e-6)


def test_load_state_dict_of_a_list_names_what_it_expects():
    model = _model()
    values = list(model.state_dict().values())
    with pytest.raises(TypeError, match="expected a dict of name -> array.*got list"):
        model.load_state_dict(values)
    step = mg.jit(model, backend="numpy")
    step(np.ones((2, 5), np.float32))
    with pytest.raises(TypeError, match="Jit.load_state_dict: expected a dict"):
        step.load_state_dict(values)
    with pytest.raises(TypeError, match="Session.load_state_dict: expected a dict"):
        next(iter(step.sessions.values())).load_state_dict(values)
    with pytest.raises(TypeError, match="load a file with .load"):
        model.load_state_dict("weights.safetensors")


def test_default_backend_is_gpu_on_hardware_only(monkeypatch):
    from meganeura import api
    from meganeura.runtime import backends

    class Dev:
        is_software = False
    monkeypatch.delenv("MEGANEURA_BACKEND", raising=False)
    for software, want in ((False, "gpu"), (True, "numpy")):
        Dev.is_software = software
        monkeypatch.setattr(backends, "gpu_device", lambda: Dev())
        api.default_backend.cache_clear()
        assert api.default_backend() == want
    monkeypatch.setattr(backends, "gpu_device", lambda: (_ for _ in ()).throw(RuntimeError("no adapter")))
    api.default_backend.cache_clear()
    assert api.default_backend() == "numpy"
    monkeypatch.setenv("MEGANEURA_BACKEND", "vulkan")
    api.default_backend.cache_clear()
    assert api.default_backend() == "gpu"
    api.default_backend.cache_clear()
    monkeypatch.delenv("MEGANEURA_BACKEND")
    assert mg.jit(_model()).backend == api.default_backend()
