"""The memory plan: no two values that share a buffer are ever live at once (checked over
real plans and shown to catch a bad one), targets outlive the call, in-place optimizer
updates, outputs written over dying operands and recomputed forward values give the same
results as without them, a step keeps no gradients, sessions share weights once, and the
device-free memory report runs."""
import json

import numpy as np
import pytest

import meganeura as mg
from meganeura.bench.dispatches import phase_targets
from meganeura.bench.workloads import make
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.memplan import check_plan, plan_memory
from meganeura.schedule import Buf


def _kernels(kp):
    return [(d.kernel.written_bufs(), d.bufs) for d in kp.dispatches]


def _tiny_attention_loss(B=2, L=8, D=32, H=4):
    g = mg.Graph()
    x = g.input("x", (B, L, D))
    n = mg.ops.layer_norm(x, (D,), g.parameter("ln.weight", (D,), init="ones"))
    q, k, v = (mg.ops.linear(n, g.parameter(f"{p}.weight", (D, D))).reshape(B, L, H, D // H).transpose(1, 2)
               for p in "qkv")
    a = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, L, D)
    h = x + mg.ops.linear(a, g.parameter("o.weight", (D, D)))
    g.hidden = h
    return g, mg.ops.mean(h * h)


def _tiny_bn_loss():
    """conv -> batch norm -> relu -> max pool -> conv: batch norm's centred input and the
    pool's windows are the values recomputed in backward. 20 x 20 images: the second
    convolution has more positions (100) than weights per output channel (72), so its weight
    gradient keeps a product per image (a folded batch would transpose the cotangent and
    move the peak off the recomputed values)."""
    g = mg.Graph()
    x = g.input("x", (2, 3, 20, 20))
    h = mg.ops.conv2d(x, g.parameter("c1.weight", (8, 3, 3, 3), init="normal"), padding=1)
    h = mg.ops.batch_norm(h, None, None, g.parameter("bn.weight", (8,), init=1.2), g.parameter("bn.bias", (8,), init=0.1),
                          training=True)
    h = mg.ops.max_pool2d(mg.ops.relu(h), 3, 2, 1)
    y = mg.ops.conv2d(h, g.parameter("c2.weight", (4, 8, 3, 3), init="normal"), padding=1)
    return g, mg.ops.mean(y * y)


@pytest.mark.parametrize("name", ["smollm2", "whisper", "resnet50", "unet", "smolvla"])
def test_planner_never_overlaps_live_values_in_workload_plans(name):
    w = make(name, size="tiny", device="cpu")
    for phase in ("flb", "train_step"):
        targets, n_fwd, updates = phase_targets(w, phase)
        kp = compile_plan(targets, n_forward=n_fwd, options=CompileOptions(max_bindings=64), updates=updates)
        check_plan(kp.memory, _kernels(kp))
        m = kp.memory
        # every target lives to the end of the call; the slots hold at least the live peak
        assert all(m.intervals[b][1] == len(kp.dispatches) for b in kp.bufs if b.kind == "target")
        assert m.live_peak <= m.bytes_with <= m.bytes_without
        if phase == "train_step":
            assert len(targets) == n_fwd + len(updates), "a step keeps no gradients"


def test_plan_checker_finds_overlapping_values():
    a, b, c = Buf(64, "temp", "a"), Buf(64, "temp", "b"), Buf(32, "temp", "c")
    kernels = [([a], []), ([b], [a]), ([c], [b]), ([], [c])]
    plan = plan_memory(kernels, [a, b, c])
    check_plan(plan, kernels)
    assert plan.slot_of[a] != plan.slot_of[b] and plan.slot_of[c] == plan.slot_of[a]   # c reuses a's buffer
    assert plan.bytes_with == 128 and plan.live_peak == 128
    plan.slot_of[b] = plan.slot_of[a]             # a and b are both live at launch 1
    with pytest.raises(AssertionError, match="overlaps"):
        check_plan(plan, kernels)
    plan.slot_of[b] = plan.slot_of[c] = len(plan.slot_sizes)
    plan.slot_sizes.append(32)                     # b does not fit
    with pytest.raises(AssertionError, match="does not fit"):
        check_plan(plan, kernels)


def test_targets_live_to_the_end_and_survive_other_calls():
    g, loss = _tiny_attention_loss()
    out = g.hidden             # an intermediate of the loss
    s = mg.compile(g, outputs=[out], loss=loss, backend="gpu")
    ref = mg.compile(g, outputs=[out], loss=loss, backend="numpy")
    ref.load_state_dict(s.state_dict())
    feeds = {"x": np.random.default_rng(0).standard_normal((2, 8, 32)).astype(np.float32)}
    s.run(feeds, fetch=False)
    s.compute_grads(feeds)             # another plan runs in between
    want = ref.run(feeds)
    for got, exp in zip(s.read_outputs(), want):
        np.testing.assert_allclose(got, exp, rtol=1e-4, atol=1e-5)
    grads = s.grads()
    s.run(feeds)                       # gradients stay readable after an inference call
    ref.compute_grads(feeds)
    for k, v in ref.grads().items():
        np.testing.assert_allclose(s.grads()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
        np.testing.assert_array_equal(grads[k], s.grads()[k])


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_step_keeps_no_gradients(backend):
    g, loss = _tiny_attention_loss()
    s = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    feeds = {"x": np.ones((2, 8, 32), np.float32)}
    s.compute_grads(feeds)
    s.step(feeds)
    with pytest.raises(RuntimeError, match="compute_grads"):
        s.grads()
    if backend == "gpu":
        assert not s.executor.plans["step"].grad_locs


def test_grads_and_step_share_their_slots():
    """compute_grads and step run one after the other and share one set of slot buffers:
    gradients and losses in any order of calls match the NumPy reference."""
    g, loss = _tiny_attention_loss()
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu", seed=3)
    ref = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="numpy", seed=3)
    ref.load_state_dict(s.state_dict())
    rng = np.random.default_rng(5)
    feeds = [{"x": rng.standard_normal((2, 8, 32)).astype(np.float32)} for _ in range(3)]
    for f in feeds:
        for sess in (s, ref):
            sess.compute_grads(f)
        for k, v in ref.grads().items():
            np.testing.assert_allclose(s.grads()[k], v, rtol=1e-4, atol=1e-5, err_msg=k)
        np.testing.assert_allclose(s.step(f), ref.step(f), rtol=1e-5)
    grads, step = (s.executor.plans[p] for p in ("grads", "step"))
    pool = {id(b) for b in s.executor.slot_pool}
    # step compiles with the session, grads on the first compute_grads: the later plan's
    # slots are all in the pool (the earlier one keeps any it outgrew)
    assert {id(b) for b in grads.slots} <= pool
    # the gradient plan's slots are the step's (largest to largest) wherever those are big enough
    big_enough = sum(a >= b for a, b in zip(sorted(step.memory.slot_sizes, reverse=True),
                                            sorted(grads.memory.slot_sizes, reverse=True)))
    assert len({id(b) for b in grads.slots} & {id(b) for b in step.slots}) >= big_enough > 0


def test_a_call_that_overwrites_shared_slots_forgets_what_they_held():
    """grads() and read_outputs() raise, rather than return what a later call left in the
    slots the plans share: after a profiled step, and after a step that failed."""
    g, loss = _tiny_attention_loss()
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu", seed=3)
    f = {"x": np.ones((2, 8, 32), np.float32)}
    s.compute_grads(f)
    s.grads()
    s.executor.profile(f, "step")
    with pytest.raises(RuntimeError, match="compute_grads"):
        s.grads()
    with pytest.raises(RuntimeError, match="overwrote"):
        s.read_outputs()
    s.compute_grads(f)
    want = s.grads()

    def fail(*a, **k):
        raise FloatingPointError("the step failed after it ran")
    plan = s.executor.plans["step"]
    plan.check_indices = fail
    with pytest.raises(FloatingPointError):
        s.step(f)
    with pytest.raises(RuntimeError, match="compute_grads"):
        s.grads()
    del plan.check_indices
    s.compute_grads(f)                 # readable again (the failed step did update the weights)
    got = s.grads()
    assert set(got) == set(want) and all(np.isfinite(v).all() for v in got.values())


def _steps(g, loss, opt, backend, monkeypatch, disabled, n=3):
    monkeypatch.setenv("MEGANEURA_NO_FUSE", disabled)
    s = mg.compile(g, loss=loss, optimizer=opt(), backend=backend, seed=4)
    rng = np.random.default_rng(2)
    feeds = [{"x": rng.standard_normal(g.inputs["x"].shape).astype(np.float32)} for _ in range(n)]
    losses = [s.step(f) for f in feeds]
    out = s.state_dict(include_optimizer=True)
    stats = dict(s.executor.plans["step"].kernel_plan.stats) if backend == "gpu" else {}
    stats["updates"] = len(s.program.updates["step"])
    return losses, out, stats


@pytest.mark.parametrize("opt", [lambda: mg.optim.AdamW(lr=1e-2), lambda: mg.optim.SGD(lr=0.05, momentum=0.9)],
                         ids=["adamw", "sgd_momentum"])
def test_in_place_updates_and_overwrites_give_the_same_training(opt, monkeypatch):
    g, loss = _tiny_attention_loss()
    ref_losses, ref, _ = _steps(g, loss, opt, "numpy", monkeypatch, "")
    plain_losses, plain, off = _steps(g, loss, opt, "gpu", monkeypatch, "inplace")
    losses, got, on = _steps(g, loss, opt, "gpu", monkeypatch, "")
    assert off["in_place"] == 0 and off["written_over_operands"] == 0
    assert on["in_place"] == on["updates"], on        # every parameter and moment
    assert on["written_over_operands"] > 0, on
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    for k in ref:
        np.testing.assert_allclose(got[k], ref[k], rtol=1e-4, atol=1e-5, err_msg=k)
        np.testing.assert_allclose(got[k], plain[k], rtol=1e-5, atol=1e-6, err_msg=k)
    np.testing.assert_allclose(losses, plain_losses, rtol=1e-5)


def test_recomputed_forward_values_give_the_same_gradients_in_less_memory(monkeypatch):
    g, loss = _tiny_bn_loss()
    ref = mg.compile(g, loss=loss, backend="numpy", seed=1)
    feeds = {"x": np.random.default_rng(5).standard_normal((2, 3, 20, 20)).astype(np.float32)}
    ref.compute_grads(feeds)
    plans = {}
    for disabled in ("remat", ""):
        monkeypatch.setenv("MEGANEURA_NO_FUSE", disabled)
        s = mg.compile(g, loss=loss, backend="gpu", seed=1)
        s.compute_grads(feeds)
        for k, v in ref.grads().items():
            np.testing.assert_allclose(s.grads()[k], v, rtol=1e-4, atol=1e-5, err_msg=f"{k} (off: {disabled!r})")
        plans[disabled] = s.executor.plans["grads"].kernel_plan
        check_plan(plans[disabled].memory, _kernels(plans[disabled]))
    assert any(".remat" in b.name for b in plans[""].bufs) or \
        any(".remat" in n for d in plans[""].dispatches for n in [d.kernel.name])
    assert plans[""].memory.live_peak < plans["remat"].memory.live_peak


def test_jit_sessions_share_weights_once():
    from meganeura import nn
    rng = np.random.default_rng(0)
    model = nn.Sequential(nn.Linear(16, 8), nn.ReLU(), nn.Linear(8, 4))
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu")
    predict = mg.jit(model, share_with=step, backend="gpu")
    x, y = rng.standard_normal((6, 16)).astype(np.float32), rng.integers(0, 4, 6).astype(np.int32)
    step(x, y)
    step(x[:3], y[:3])
    predict(x[:2])
    sessions = list(step.sessions.values()) + list(predict.sessions.values())
    assert len(sessions) == 3
    names = [n for n in sessions[0].executor.buffers if not n.startswith("optim.")]
    for n in names:
        assert len({id(s.executor.buffers[n]) for s in sessions}) == 1, n
    assert all(s.executor.buffers is sessions[0].executor.buffers for s in sessions)


def test_memory_report_runs_device_free(tmp_path, capsys):
    from meganeura.bench.memory import main
    out = tmp_path / "memory.json"
    main(["--size", "tiny", "--workloads", "whisper", "--phases", "flb,train_step", "--detail", "3",
          "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["phase"] for r in rows] == ["flb", "train_step"]
    for r in rows:
        assert r["peak"] == r["persistent"] + r["planned"] and r["live_peak"] <= r["peak"]
        assert len(r["detail"]["largest_live"]) == 3
    assert "train_step" in capsys.readouterr().out
