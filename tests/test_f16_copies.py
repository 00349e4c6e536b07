"""Accelerated precision keeps an f16 copy of every weight that a forward matmul reads,
on the device: written when the weight is set (initial values, load_state_dict, load),
by the optimizer's update kernel beside the f32 master, and refreshed after a session that
shares the weights without copies (a strict one) changed them. Checkpoints and state
dicts hold the f32 masters only; strict sessions never get copies."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.bench.dispatches import phase_targets
from meganeura.bench.workloads import make
from meganeura.compiler import F16_COPY, CompileOptions, compile_plan, f16_weights

D, B = 16, 4
WEIGHTS = ("w1", "w2")


def _graph():
    g = mg.Graph()
    x = g.input("x", (B, D))
    h = mg.ops.silu(mg.ops.linear(mg.ops.rms_norm(x, (D,), g.parameter("n", (D,), init="ones"), 1e-5),
                                  g.parameter("w1", (2 * D, D))))
    y = mg.ops.linear(h, g.parameter("w2", (D, 2 * D)), g.parameter("b2", (D,)))
    return g, y, mg.ops.mean(y * y)


def _feeds(seed=0):
    return {"x": np.random.default_rng(seed).standard_normal((B, D)).astype(np.float32)}


def _copies(sess) -> dict:
    """The f16 copies on the device, by weight name."""
    ex = sess.executor
    out = {}
    for name, buf in ex.buffers.items():
        if name.endswith(F16_COPY):
            w = name[:-len(F16_COPY)]
            t = ex._dtypes[w]
            out[w] = ex.dev.readback(buf, t.size * 2, np.float16, t.shape)
    return out


def _assert_copies_track(sess):
    copies = _copies(sess)
    assert sorted(copies) == list(WEIGHTS)
    for name, c in copies.items():
        np.testing.assert_array_equal(c, sess.executor.get_value(name).astype(np.float16), err_msg=name)


def _random_state(seed):
    rng = np.random.default_rng(seed)
    return {"n": np.ones(D, np.float32), "w1": rng.uniform(-.3, .3, (2 * D, D)).astype(np.float32),
            "w2": rng.uniform(-.3, .3, (D, 2 * D)).astype(np.float32), "b2": rng.uniform(-.1, .1, D).astype(np.float32)}


def test_only_matmul_weights_get_copies_and_the_plan_casts_no_weight():
    g, y, _ = _graph()
    assert f16_weights([y]) == frozenset(WEIGHTS)        # not the norm weight, not the bias
    on = CompileOptions("accelerated", f16_weights=f16_weights([y]))
    kp = compile_plan([y], n_forward=1, options=on)
    casts = [d for d in kp.dispatches for u in d.kernel.spec.get("parts", [d.kernel])
             if u.archetype == "pointwise" and any(v.buf.kind == "parameter" for v in u.reads)]
    assert not casts, [d.kernel.name for d in casts]
    assert {b.name for b in kp.bufs if b.kind == "state"} == {w + F16_COPY for w in WEIGHTS}
    per_call = compile_plan([y], n_forward=1, options=CompileOptions("accelerated"))
    assert kp.n_dispatches < per_call.n_dispatches


def test_strict_session_never_gets_copies():
    g, y, loss = _graph()
    s = mg.compile(g, outputs=[y], loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu")
    s.step(_feeds())
    s.run(_feeds())
    assert s.executor.f16_weights == frozenset() and not _copies(s)
    assert not any(n.endswith(F16_COPY) for p in s.executor.plans.values() for n in p.kernel_plan.copy_updates)


def test_copies_follow_initial_values_loads_and_sets(tmp_path):
    g, y, _ = _graph()
    s = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated")
    s.run(_feeds())
    _assert_copies_track(s)
    s.load_state_dict(_random_state(1))
    _assert_copies_track(s)
    np.testing.assert_array_equal(_copies(s)["w1"], _random_state(1)["w1"].astype(np.float16))
    s.assign({"w2": _random_state(2)["w2"]})
    _assert_copies_track(s)
    # the output uses the copies that were just written: it equals a fresh session's
    out = s.run(_feeds())[0]
    fresh = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated")
    fresh.load_state_dict({**_random_state(1), "w2": _random_state(2)["w2"]})
    np.testing.assert_array_equal(out, fresh.run(_feeds())[0])
    # checkpoints and state dicts hold the f32 weights only
    s.save(tmp_path / "c.safetensors")
    from safetensors.numpy import load_file
    assert sorted(load_file(tmp_path / "c.safetensors")) == ["b2", "n", "w1", "w2"]
    assert sorted(s.state_dict(include_optimizer=True)) == ["b2", "n", "w1", "w2"]
    other = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated")
    other.load(tmp_path / "c.safetensors")
    _assert_copies_track(other)
    np.testing.assert_array_equal(other.run(_feeds())[0], out)


@pytest.mark.parametrize("optimizer", [mg.optim.AdamW(lr=3e-2), mg.optim.SGD(lr=0.1, momentum=0.9)],
                         ids=["adamw", "sgd"])
def test_training_step_writes_master_and_copy_in_one_kernel(optimizer):
    g, y, loss = _graph()
    s = mg.compile(g, outputs=[y], loss=loss, optimizer=optimizer, backend="gpu", precision="accelerated")
    before = s.executor.get_value("w1").copy()
    for i in range(3):
        s.step(_feeds(i))
        _assert_copies_track(s)
    assert not np.array_equal(before, s.executor.get_value("w1"))
    plan = s.executor.plans["step"]
    assert sorted(plan.kernel_plan.copy_updates) == [w + F16_COPY for w in WEIGHTS]
    # no launch of its own for the copies: the update kernels store them
    assert not any("cast" in n for n in plan.names if "parameter" not in n and F16_COPY in n)
    stores = [u for d in plan.kernel_plan.dispatches for u in d.kernel.spec.get("parts", [d.kernel])
              if u.spec.get("stores")]
    # (activations' f16 copies are second stores of their writers too)
    assert sorted(v.buf.name for u in stores for v in u.spec["stores"] if v.buf.kind != "temp") == \
        [w + F16_COPY for w in WEIGHTS]
    assert not s.executor.stale


def test_shared_sessions_see_updated_copies():
    g, y, loss = _graph()
    # a strict trainer and an accelerated predictor on one set of weights: the trainer's
    # steps leave the predictor's copies stale, refreshed before its next call
    train = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=3e-2), backend="gpu")
    pred = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated", share_with=train)
    pred.run(_feeds())
    train.step(_feeds(1))
    assert train.executor.stale == {"w1", "w2"}
    out = pred.run(_feeds())[0]
    _assert_copies_track(pred)
    fresh = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated")
    fresh.load_state_dict(train.state_dict())
    np.testing.assert_array_equal(out, fresh.run(_feeds())[0])
    assert not _copies(train) or train.executor.buffers is pred.executor.buffers
    # an accelerated trainer writes the copies itself: the predictor reads them as they are
    g2, y2, loss2 = _graph()
    train2 = mg.compile(g2, loss=loss2, optimizer=mg.optim.AdamW(lr=3e-2), backend="gpu", precision="accelerated")
    pred2 = mg.compile(g2, outputs=[y2], backend="gpu", precision="accelerated", share_with=train2)
    train2.step(_feeds(1))
    assert not train2.executor.stale
    out2 = pred2.run(_feeds())[0]
    fresh.load_state_dict(train2.state_dict())
    np.testing.assert_array_equal(out2, fresh.run(_feeds())[0])


def test_accelerated_session_sharing_strict_values_copies_them():
    g, y, loss = _graph()
    strict = mg.compile(g, outputs=[y], backend="gpu")
    strict.load_state_dict(_random_state(3))
    strict.run(_feeds())
    fast = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated", share_with=strict)
    fast.run(_feeds())
    _assert_copies_track(fast)
    np.testing.assert_array_equal(_copies(fast)["w2"], _random_state(3)["w2"].astype(np.float16))


def test_smollm2_step_refreshes_every_copy_without_a_launch():
    w = make("smollm2", size="tiny")
    targets, n_fwd, updates = phase_targets(w, "train_step")
    names = f16_weights(targets[:n_fwd])
    kp = compile_plan(targets, n_forward=n_fwd, options=CompileOptions("accelerated", f16_weights=names),
                      updates=updates)
    per_call = compile_plan(targets, n_forward=n_fwd, options=CompileOptions("accelerated"), updates=updates)
    assert sorted(kp.copy_updates) == sorted(n + F16_COPY for n in names)
    written = {b.name for d in kp.dispatches for b in d.kernel.written_bufs()}
    assert written >= set(kp.copy_updates)
    assert kp.n_dispatches <= per_call.n_dispatches


def test_decode_norm_runs_in_the_gemv_that_reads_it():
    """Accelerated decoding keeps strict's launch count: a norm stored as f16 for GEMVs
    moves into their loads (the GEMV reads the normalised value unrounded)."""
    w = make("smollm2", size="tiny")
    targets, n_fwd, updates = phase_targets(w, "minimal")
    names = f16_weights(targets[:n_fwd])
    fast = compile_plan(targets, n_forward=n_fwd, options=CompileOptions("accelerated", f16_weights=names),
                        updates=updates)
    strict = compile_plan(targets, n_forward=n_fwd, options=CompileOptions(), updates=updates)
    assert fast.n_dispatches == strict.n_dispatches
    assert not any(d.kernel.archetype == "norm" for d in fast.dispatches)
    g = mg.Graph()
    x = g.input("x", (1, D))
    y = mg.ops.linear(mg.ops.rms_norm(x, (D,), g.parameter("n", (D,), init="ones"), 1e-5), g.parameter("w1", (D, D)))
    ref = mg.compile(g, outputs=[y], backend="numpy")
    s = mg.compile(g, outputs=[y], backend="gpu", precision="accelerated")
    s.load_state_dict(ref.state_dict())
    assert any(n.startswith("rms_norm>gemv") for n in s.executor.plan("run").names)
    feeds = {"x": _feeds()["x"][:1]}
    want, got = ref.run(feeds)[0], s.run(feeds)[0]
    err = np.linalg.norm(got - want) / np.linalg.norm(want)
    assert 0 < err < 2e-3, err
