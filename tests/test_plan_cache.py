"""The on-disk plan cache: hits and misses, what the key covers, corrupt and foreign
entries, and the switches that turn it off."""
import numpy as np
import pytest

import meganeura as mg
from meganeura import plan_cache
from meganeura.compiler import CompileOptions, compile_plan

ADAPTER = {"name": "test adapter", "description": "driver 1.0", "backend": "Vulkan"}


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEGANEURA_NO_DISK_CACHE", raising=False)
    monkeypatch.delenv("MEGANEURA_NO_PLAN_CACHE", raising=False)
    return tmp_path / "plans"


def mlp(hidden=16, scale=0.5, name="fc1.weight"):
    g = mg.Graph()
    x = g.input("x", (4, 8))
    h = mg.ops.relu(mg.ops.linear(x, g.parameter(name, (hidden, 8)), g.parameter("fc1.bias", (hidden,))))
    return [mg.ops.linear(h, g.parameter("fc2.weight", (3, hidden))) * scale]


def fingerprint(kp):
    return ([(d.kernel.name, d.kernel.archetype, d.wgsl, [(b.kind, b.nbytes) for b in d.bufs], d.groups)
             for d in kp.dispatches], kp.memory.slot_sizes, [loc[1:] for loc in kp.target_locs])


def test_second_compile_is_a_hit_with_the_same_plan(cache):
    opts = CompileOptions()
    first = compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER)
    assert first.stats["cache"] == "stored" and len(list(cache.glob("*.plan"))) == 1
    second = compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER)     # the same graph, built again
    assert second.stats["cache"] == "hit"
    assert fingerprint(second) == fingerprint(first)
    assert [b.name for b in second.bufs if b.kind == "parameter"] == ["fc1.weight", "fc1.bias", "fc2.weight"]
    # without the cache nothing is read or written
    assert "cache" not in compile_plan(mlp(), options=opts).stats


def test_on_compile_runs_before_the_passes_of_a_new_plan_only(cache, monkeypatch):
    """The Vulkan finishing's preparation (glslang's warm-up) runs when the compiler passes
    will run, and not for a plan read from the cache."""
    from meganeura.compilation import vulkan
    from meganeura.compilation.target import Target
    calls = []
    monkeypatch.setattr(vulkan.VulkanKernels, "prepare", lambda self: calls.append(1))
    monkeypatch.setattr(vulkan.VulkanKernels, "finish", lambda self, entries: {t: None for t, _ in entries})
    lava = Target.lavapipe()
    first = compile_plan(mlp(), options=CompileOptions(), cache=True, adapter=ADAPTER, target=lava)
    assert first.plan.stats["cache"] == "stored" and calls == [1]
    second = compile_plan(mlp(), options=CompileOptions(), cache=True, adapter=ADAPTER, target=lava)
    assert second.plan.stats["cache"] == "hit" and calls == [1]
    compile_plan(mlp(), options=CompileOptions(), target=lava)     # no cache: always compiles
    assert calls == [1, 1]


def test_cached_kernels_keep_their_further_outputs(cache):
    """A kernel that writes several values (an AdamW update storing its moments) keeps
    them all in the cached plan: anomaly mode checks every value a kernel writes."""
    g = mg.Graph()
    w = g.parameter("w", (6,))
    m, v = g.state("w.m", (6,)), g.state("w.v", (6,))
    m2, v2 = mg.ops.ema(m, w, 0.9, 0.1), mg.ops.ema_sq(v, w, 0.99, 0.01)
    new_w = mg.ops.adam_step(w, m2, v2, 0.1, 1.0, 1e-8)
    targets, updates = [new_w, m2, v2], {0: "w", 1: "w.m", 2: "w.v"}

    def outs(kp):
        return [[o.buf.name for o in u.outs] for d in kp.dispatches for u in d.kernel.spec.get("parts", [d.kernel])]
    first = compile_plan(targets, options=CompileOptions(), updates=updates, cache=True, adapter=ADAPTER)
    second = compile_plan(targets, options=CompileOptions(), updates=updates, cache=True, adapter=ADAPTER)
    assert second.stats["cache"] == "hit" and outs(second) == outs(first) == [["w.m", "w.v"]]


def test_key_follows_graph_options_adapter_and_switches(monkeypatch):
    def key(targets=None, opts=CompileOptions(), adapter=ADAPTER, n_forward=None, updates=None):
        return plan_cache.plan_key(targets or mlp(), n_forward, opts, updates, adapter)
    base = key()
    assert key() == base                                                # deterministic across graphs
    others = [key(mlp(hidden=32)), key(mlp(scale=0.25)), key(mlp(name="fc1.w")),
              key(opts=CompileOptions(precision="accelerated")), key(opts=CompileOptions(max_bindings=16)),
              key(opts=CompileOptions(disabled=frozenset({"epilogue"}))),
              key(opts=CompileOptions(workgroup_storage=49152)),
              key(adapter={**ADAPTER, "description": "driver 2.0"}), key(n_forward=0), key(updates={0: "fc2.weight"})]
    assert len({base, *others}) == len(others) + 1
    monkeypatch.setenv("MEGANEURA_MATMUL_TILE", "64")                 # a switch the code generators read
    assert key() != base
    monkeypatch.delenv("MEGANEURA_MATMUL_TILE")
    monkeypatch.setenv("MEGANEURA_TRACE", "trace.json")               # one that changes no plan
    assert key() == base
    from meganeura.codegen import attention, flash
    monkeypatch.setattr(attention, "MAX_ROW_WORK", 0)                   # routing constants a benchmark changes
    assert key() != base
    monkeypatch.undo()
    monkeypatch.setattr(flash, "LOOP_BOUND", 0)
    assert key() != base


def test_constant_values_are_part_of_the_key():
    def graph(v):
        g = mg.Graph()
        x = g.input("x", (2, 3))
        return [x + g.constant(np.array([[1.0, 2.0, v]], np.float32))]
    assert plan_cache.graph_digest(graph(3.0)) == plan_cache.graph_digest(graph(3.0))
    assert plan_cache.graph_digest(graph(3.0)) != plan_cache.graph_digest(graph(4.0))


def test_digest_names_the_computation():
    """The graph digest follows what the targets compute (ops, operand order, input names),
    not node ids: unrelated nodes added later leave it, a swapped operand changes it."""
    def graph(swap=False, name="y"):
        g = mg.Graph()
        x, y = g.input("x", (4,)), g.input(name, (4,))
        return g, [mg.ops.relu(y - x if swap else x - y)]
    g, out = graph()
    before = plan_cache.graph_digest(out)
    mg.ops.exp(out[0]) * 2.0                      # more nodes in the same graph
    assert plan_cache.graph_digest(out) == before == plan_cache.graph_digest(graph()[1])
    assert before != plan_cache.graph_digest(graph(swap=True)[1])
    assert before != plan_cache.graph_digest(graph(name="z")[1])


def test_corrupt_and_foreign_entries_are_ignored_and_rewritten(cache):
    opts = CompileOptions()
    good = compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER)
    (entry,) = cache.glob("*.plan")
    entry.write_bytes(b"not a pickle")
    again = compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER)
    assert again.stats["cache"] == "stored" and fingerprint(again) == fingerprint(good)
    assert compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER).stats["cache"] == "hit"
    entry.write_bytes(entry.read_bytes()[:100])                      # truncated
    assert compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER).stats["cache"] == "stored"
    # another graph's entry under this key (a stale file, a hash collision) is not used
    other = compile_plan(mlp(hidden=32), options=opts, cache=True, adapter=ADAPTER)
    other_entry = next(p for p in cache.glob("*.plan") if p != entry)
    entry.write_bytes(other_entry.read_bytes())
    plan = compile_plan(mlp(), options=opts, cache=True, adapter=ADAPTER)
    assert plan.stats["cache"] == "stored" and fingerprint(plan) != fingerprint(other)


def test_unwritable_cache_folder_only_costs_a_compile(tmp_path, monkeypatch):
    blocker = tmp_path / "file"
    blocker.write_text("a file where the cache folder should be")
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(blocker))
    plan = compile_plan(mlp(), options=CompileOptions(), cache=True, adapter=ADAPTER)
    assert plan.n_dispatches > 0


def test_switches_turn_it_off(cache, monkeypatch):
    assert plan_cache.enabled() and not plan_cache.enabled(False) and plan_cache.enabled(True)
    monkeypatch.setenv("MEGANEURA_NO_PLAN_CACHE", "1")
    assert not plan_cache.enabled() and plan_cache.enabled(True)
    monkeypatch.delenv("MEGANEURA_NO_PLAN_CACHE")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    assert not plan_cache.enabled()


def _session(**kw):
    g = mg.Graph()
    x = g.input("x", (4, 8))
    y = g.input("y", (4,), mg.i32)
    logits = mg.ops.linear(mg.ops.relu(mg.ops.linear(x, g.parameter("w1", (16, 8)))), g.parameter("w2", (3, 16)))
    return mg.compile(g, loss=mg.ops.cross_entropy(logits, y), optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu", **kw)


def test_gpu_sessions_read_the_cache_and_train_the_same(cache, monkeypatch):
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": np.array([0, 1, 2, 1], np.int32)}
    losses = []
    for expect in ("stored", "hit"):
        s = _session()
        assert s.executor.plans["step"].kernel_plan.stats["cache"] == expect
        losses.append([s.step(feeds) for _ in range(3)])
        s.close()
    assert losses[0] == losses[1]
    # the option and the environment switch: nothing read, nothing written
    n = len(list(cache.glob("*.plan")))
    assert "cache" not in _session(plan_cache=False).executor.plans["step"].kernel_plan.stats
    monkeypatch.setenv("MEGANEURA_NO_PLAN_CACHE", "1")
    s = _session()
    assert "cache" not in s.executor.plans["step"].kernel_plan.stats
    assert s.step(feeds) == losses[0][0]
    assert len(list(cache.glob("*.plan"))) == n


def _feeds():
    rng = np.random.default_rng(0)
    return {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": np.array([0, 1, 2, 1], np.int32)}


def _train(s, feeds):
    losses = [s.step(feeds) for _ in range(3)]
    loss = s.compute_grads(feeds)
    return losses, loss, s.grads(), s.state_dict(include_optimizer=True)


def test_a_training_session_compiled_before_does_not_differentiate(cache, monkeypatch):
    """The second session of a graph stands up from the first one's manifest: no autodiff,
    no optimizer update built; it trains, reports gradients and keeps optimizer state
    exactly as the first (its phases' plans loaded by key)."""
    from meganeura.api import CachedProgram, Program
    feeds = _feeds()
    first = _session()
    assert type(first.program) is Program
    want = _train(first, feeds)              # compute_grads compiles "grads": noted too
    first.close()
    assert len(list(cache.glob("*.session"))) == 1

    def no_autodiff(*a, **k):
        raise AssertionError("differentiated although the manifest names every phase")
    monkeypatch.setattr(mg.api, "_grad", no_autodiff)
    second = _session()
    assert isinstance(second.program, CachedProgram)
    assert second.executor.plans["step"].kernel_plan.stats["cache"] == "hit"
    got = _train(second, feeds)
    assert got[0] == want[0] and got[1] == want[1]
    assert sorted(got[2]) == sorted(want[2]) and all(np.array_equal(got[2][n], want[2][n]) for n in want[2])
    assert sorted(got[3]) == sorted(want[3]) == ["w1", "w1.exp_avg", "w1.exp_avg_sq", "w2", "w2.exp_avg", "w2.exp_avg_sq"]
    assert all(np.array_equal(got[3][n], want[3][n]) for n in want[3])
    second.close()


def test_a_manifest_whose_plan_is_gone_differentiates_after_all(cache):
    feeds = _feeds()
    first = _session()
    want = [first.step(feeds) for _ in range(2)]
    first.close()
    for p in cache.glob("*.plan"):
        p.unlink()
    from meganeura.api import CachedProgram
    s = _session()
    assert isinstance(s.program, CachedProgram) and s.program._real is not None     # built once the plan was missing
    assert s.executor.plans["step"].kernel_plan.stats["cache"] == "stored"
    assert [s.step(feeds) for _ in range(2)] == want
    s.close()


def test_sessions_outside_the_manifest_differentiate(cache):
    """Gradient accumulation, the plan cache turned off: a plain Program, no manifest."""
    from meganeura.api import Program
    _session().close()
    for kw in ({"accumulate": 2}, {"plan_cache": False}):
        s = _session(**kw)
        assert type(s.program) is Program
        s.close()


def test_session_key_follows_forward_parameters_optimizer_and_options(monkeypatch):
    def key(hidden=16, opt=None, precision="strict", adapter=ADAPTER, opts=None):
        outs = mlp(hidden)
        g = outs[0].graph
        return plan_cache.session_key(outs, list(g.parameters.values()), opt or mg.optim.AdamW(lr=1e-3),
                                      opts or CompileOptions(precision=precision), adapter)
    base = key()
    assert key() == base
    assert key(opt=mg.optim.AdamW(lr=1e-3, schedule=mg.optim.cosine(100))) == base    # fed per step
    assert key(opt=mg.optim.AdamW(lr=3e-4)) == base
    others = [key(hidden=32), key(opt=mg.optim.AdamW(lr=1e-3, weight_decay=0.1)), key(opt=mg.optim.Adam(lr=1e-3)),
              key(opt=mg.optim.AdamW(lr=1e-3, clip_grad_norm=1.0)), key(precision="accelerated"),
              key(adapter={**ADAPTER, "description": "driver 2.0"}), key(opts=CompileOptions(max_bindings=16))]
    assert len({base, *others}) == len(others) + 1
    from meganeura.codegen import attention
    monkeypatch.setattr(attention, "MAX_ROW_WORK", 0)          # a routing constant of the code generators
    assert key() != base

    class Custom(mg.optim.SGD):      # a user's optimizer may bake anything into its update: never keyed
        pass
    assert key(opt=Custom(lr=0.1)) is None


def test_a_checkpointed_session_is_not_the_plain_one_from_the_cache(cache):
    """The same forward graph with its hidden layer checkpointed recomputes it in the backward
    pass: another training program, so another manifest (it had shared the plain one's and
    silently run without recomputation)."""
    def session(checkpointed):
        g = mg.Graph()
        x, y = g.input("x", (4, 8)), g.input("y", (4,), mg.i32)
        w1, w0, w2 = g.parameter("w1", (16, 8)), g.parameter("w0", (16, 16)), g.parameter("w2", (3, 16))

        def hidden(t):
            return mg.ops.tanh(mg.ops.linear(mg.ops.gelu(mg.ops.linear(t, w1)), w0))
        h = mg.nn.checkpoint(hidden, x) if checkpointed else hidden(x)
        loss = mg.ops.cross_entropy(mg.ops.linear(h, w2), y)
        return mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu")

    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": np.array([0, 1, 2, 1], np.int32)}
    seen, losses = [], []
    for checkpointed in (False, True, True):
        s = session(checkpointed)
        losses.append([s.step(feeds) for _ in range(2)])
        seen.append((type(s.program).__name__, s.executor.plans["step"].kernel_plan.stats["cache"]))
        s.close()
    # the checkpointed program is built and its plan stored; only a second checkpointed session hits
    assert seen == [("Program", "stored"), ("Program", "stored"), ("CachedProgram", "hit")], seen
    np.testing.assert_allclose(losses[1], losses[0], rtol=1e-6)
