"""The compile path itself: deterministic plans, the binding cap of small adapters, lazy
initial values, eager pipelines."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.runtime.backends import gpu_device
from meganeura import api
from meganeura.bench.dispatches import phase_targets
from meganeura.bench.workloads import make
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.runtime import get_device


def _plan_text(kp):
    return [(d.kernel.name, d.wgsl, d.groups, [(b.kind, b.nbytes) for b in d.bufs]) for d in kp.dispatches]


def test_the_same_graph_compiles_to_the_same_plan():
    # merged launches used to close their dependencies in set order: the launch order of
    # independent kernels changed from one compile to the next
    targets, n_forward, updates = phase_targets(make("whisper", "tiny", device="cpu"), "flb")
    opts = CompileOptions(max_bindings=1 << 16)
    plans = [_plan_text(compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)) for _ in range(3)]
    assert plans[0] == plans[1] == plans[2]


@pytest.mark.parametrize("workload,phase,precision", [("unet", "train_step", "strict"),
                                                      ("smollm2", "flb", "accelerated")])
def test_compiling_leaves_no_cycles_for_the_collector(workload, phase, precision):
    """The compiler's passes free what they drop by reference counting: a lowering step's
    graph copy and recursive helper closures used to leave cycles (U-Net's training plan:
    77k objects) that the cycle collector found when it came back on after the compile."""
    import gc
    from meganeura.compiler import f16_weights
    targets, n_forward, updates = phase_targets(make(workload, "tiny", device="cpu"), phase)
    opts = CompileOptions(max_bindings=1 << 16, precision=precision)
    if precision == "accelerated":
        opts.f16_weights = f16_weights(targets[:n_forward])
    compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)    # imports, caches
    gc.collect()
    gc.set_debug(gc.DEBUG_SAVEALL)
    try:
        kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
        gc.collect()
        left = list(gc.garbage)
    finally:
        gc.set_debug(0)
        gc.garbage.clear()
    assert kp.n_dispatches and not left, sorted({type(o).__name__ for o in left})


def _wide_sum(g, n=8, shape=(3, 5)):
    xs = [g.input(f"x{i}", shape) for i in range(n)]
    acc = xs[0]
    for x in xs[1:n - 2]:
        acc = acc + x
    return xs, acc + xs[n - 2] * xs[n - 1]       # the product is inlined last, when bindings are spent


def test_a_producer_that_finds_no_binding_left_runs_as_its_own_kernel(monkeypatch):
    g = mg.Graph()
    xs, y = _wide_sum(g)
    kp = compile_plan([y], options=CompileOptions(max_bindings=8))     # raised "was not computed" before
    assert kp.n_dispatches == 2 and all(len(d.bufs) <= 8 for d in kp.dispatches)
    # on a device that offers 8 storage buffers per stage (WebGPU's default limit)
    monkeypatch.setitem(gpu_device().limits, "max-storage-buffers-per-shader-stage", 8)
    rng = np.random.default_rng(0)
    feeds = {x.name: rng.standard_normal(x.shape).astype(np.float32) for x in xs}
    out = mg.compile(g, outputs=[y], backend="gpu", plan_cache=False).run(feeds)[0]
    ref = mg.compile(g, outputs=[y], backend="numpy").run(feeds)[0]
    np.testing.assert_allclose(out, ref, rtol=1e-6, atol=1e-6)


def _mlp_graph():
    g = mg.Graph()
    x = g.input("x", (4, 8))
    y = g.input("y", (4,), mg.i32)
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("w1", (16, 8)), g.parameter("b1", (16,))))
    loss = mg.ops.cross_entropy(mg.ops.linear(h, g.parameter("w2", (3, 16))), y)
    return g, loss


def test_initial_values_are_made_only_when_needed(monkeypatch):
    made = []
    real = api.default_init
    monkeypatch.setattr(api, "default_init", lambda t, seed: made.append(t.name) or real(t, seed))
    g, loss = _mlp_graph()
    rng = np.random.default_rng(1)
    weights = {"w1": rng.standard_normal((16, 8)).astype(np.float32), "b1": np.zeros(16, np.float32),
               "w2": rng.standard_normal((3, 16)).astype(np.float32)}
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": np.array([0, 2, 1, 0], np.int32)}
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu")
    s.load_state_dict(weights)
    s.step(feeds)
    assert made == []                                  # loaded before the first step: never drawn
    moments = [n for n in s.state_names if s.values.pending(n) is not None]
    assert moments, "zero-initialised optimizer state was built on the host"
    # a session that is not loaded trains from the default values, as the reference does
    gpu = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu", seed=3)
    ref = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="numpy", seed=3)
    np.testing.assert_allclose(gpu.state_dict()["w1"], ref.state_dict()["w1"])    # read before any step
    for _ in range(2):
        np.testing.assert_allclose(gpu.step(feeds), ref.step(feeds), rtol=1e-5)
    for name, v in ref.state_dict(include_optimizer=True).items():
        np.testing.assert_allclose(gpu.state_dict(include_optimizer=True)[name], v, rtol=1e-4, atol=1e-6,
                                   err_msg=name)


def test_compile_creates_the_pipelines_of_the_main_call():
    g, loss = _mlp_graph()
    dev = gpu_device()
    dev.clear_caches()
    before = dev.stats["pipelines_compiled"]
    s = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="gpu", plan_cache=False)
    plan = s.executor.plans["step"]
    created = dev.stats["pipelines_compiled"] - before
    assert created == len({d.wgsl for d in plan.kernel_plan.dispatches}) > 0   # each distinct kernel once
    s.step({"x": np.ones((4, 8), np.float32), "y": np.zeros(4, np.int32)})
    assert dev.stats["pipelines_compiled"] - before == created                # the first step compiles nothing


@pytest.mark.parametrize("threads", [1, 3])
def test_pipelines_in_parallel_match_one_by_one(threads):
    dev = get_device()
    wgsl = ("@group(0) @binding(0) var<storage, read> a: array<f32>;\n"
            "@group(0) @binding(1) var<storage, read_write> b: array<f32>;\n"
            "@compute @workgroup_size(64) fn main(@builtin(global_invocation_id) i: vec3<u32>) {{\n"
            "  if (i.x < arrayLength(&b)) {{ b[i.x] = a[i.x] * {k}.0; }}\n}}\n")
    from meganeura.compilation.executable import FinalKernel
    texts = [wgsl.format(k=k + 10 * threads) for k in range(4)]
    shaders = [FinalKernel(f"scale{k}", text, text) for k, text in enumerate(texts)] * 2
    pipes = dev.pipelines(shaders, threads=threads)
    assert len(pipes) == 8 and pipes[:4] == pipes[4:] and len(set(map(id, pipes))) == 4
    assert all(p.access == ("read", "rw") for p in pipes)
    assert dev.pipelines(shaders[:1]) == pipes[:1]                # cached


def test_a_phase_compiled_on_first_use_holds_the_collector_off(monkeypatch):
    """compute_grads after mg.compile(eager) compiles its plan then: with the collector held
    off, as mg.compile does, and switched back on after."""
    import gc

    from meganeura.runtime import executor as ex
    g = mg.Graph()
    x = g.input("x", (4, 8))
    w = g.parameter("w", (8, 3))
    s = mg.compile(g, loss=mg.ops.mean((x @ w) ** 2), optimizer=mg.optim.SGD(lr=0.1), backend="gpu")
    seen = []
    real = ex.Plan.__init__

    def spy(self, *a, **k):
        seen.append(gc.isenabled())
        return real(self, *a, **k)
    monkeypatch.setattr(ex.Plan, "__init__", spy)
    s.compute_grads({"x": np.ones((4, 8), np.float32)})
    assert seen == [False] and gc.isenabled()


def test_gc_is_paused_while_compiling_and_restored_after():
    import gc

    from meganeura.compiler import gc_paused
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            pass
        assert not gc.isenabled()              # the outer compile is still running
    assert gc.isenabled()
    with pytest.raises(RuntimeError):
        with gc_paused():
            raise RuntimeError("a failing compile")
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()              # a caller's choice is kept
    finally:
        gc.enable()


@pytest.mark.parametrize("workload,phase,precision", [("smollm2", "train_step", "strict"),
                                                      ("unet", "flb", "accelerated")])
def test_repeated_kernels_render_once_and_bind_their_own_buffers(workload, phase, precision):
    """A kernel whose structure an earlier one had takes that one's text (codegen.fingerprint):
    every dispatch must be what rendering it alone gives, buffers in the same places."""
    from meganeura import codegen
    from meganeura.compiler import f16_weights
    targets, n_forward, updates = phase_targets(make(workload, "tiny", device="cpu"), phase)
    opts = CompileOptions(max_bindings=1 << 16, precision=precision)
    if precision == "accelerated":
        opts.f16_weights = f16_weights(targets[:n_forward])
    kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
    assert kp.stats["rendered_once"] > 0
    for d in kp.dispatches:
        text, bufs, groups = codegen.render(d.kernel)
        assert (d.wgsl, d.groups) == (text, groups), d.kernel.name
        assert [id(b) for b in d.bufs] == [id(b) for b in bufs], d.kernel.name


def test_fingerprints_keep_numbers_types_and_unknown_objects_apart():
    from meganeura.codegen.fingerprint import _Walk

    def fp(x):
        return _Walk().fp(x)
    distinct = [0, 0.0, -0.0, False, 1, 1.0, True, np.float32(1), np.float64(1), np.int32(1), "1",
                np.zeros(3, np.float32), np.zeros(3, np.float16), (1,), [1]]
    keys = [fp(x) for x in distinct]
    assert len(set(keys)) == len(distinct)
    assert fp(object()) != fp(object())
    big = np.zeros(1000, np.float32)        # large arrays are never compared by content
    assert fp(big) != fp(big.copy()) and fp(np.ones(3)) == fp(np.ones(3))


@pytest.mark.parametrize("workload,phase,precision", [("smollm2", "train_step", "strict"),
                                                      ("unet", "train_step", "accelerated"),
                                                      ("resnet50", "train_step", "strict")])
def test_in_place_fusion_passes_keep_their_shared_index_true(workload, phase, precision, monkeypatch):
    """The in-place fusion passes share one use index (``fuse._in_place``): after each, it
    must be the index of the kernels as they are, built afresh."""
    from meganeura.compiler import f16_weights
    from meganeura.passes import fuse
    checked = []

    def checking(name, in_place):
        def run(kernels, uses, max_bindings):
            in_place(kernels, uses, max_bindings)
            fresh = fuse._Uses(kernels)
            for have, want in ((uses.writers, fresh.writers), (uses.readers, fresh.readers)):
                assert {b: sorted(p) for b, p in have.items() if p} == {b: sorted(p) for b, p in want.items() if p}, name
            checked.append(name)
        return run
    for name, fn in list(fuse.FUSION_PASSES.items()):
        if hasattr(fn, "in_place"):
            wrapped = lambda kernels, max_bindings: None     # noqa: E731 (only its in_place is called)
            wrapped.in_place = checking(name, fn.in_place)
            monkeypatch.setitem(fuse.FUSION_PASSES, name, wrapped)
    targets, n_forward, updates = phase_targets(make(workload, "tiny", device="cpu"), phase)
    opts = CompileOptions(max_bindings=1 << 16, precision=precision)
    if precision == "accelerated":
        opts.f16_weights = f16_weights(targets[:n_forward])
    compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
    assert len(checked) == 6, checked


@pytest.mark.parametrize("early", [True, False])
def test_kernels_start_as_their_plan_renders(early, monkeypatch):
    """The compile stage starts finishing each kernel (GLSL, SPIR-V) as ``compile_plan``
    renders it, and streams each finished kernel to the Vulkan runtime, which creates its
    pipeline meanwhile: each streamed once, every one the plan's, and training matches
    NumPy. ``MEGANEURA_EARLY_KERNELS=0`` starts none early (they still stream)."""
    from meganeura.compilation import executable, vulkan
    from meganeura.runtime.backends import get_runtime_device
    from .harness import mlp_training_losses
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")       # every kernel made in this test
    monkeypatch.setenv("MEGANEURA_EARLY_KERNELS", "1" if early else "0")
    vulkan.clear_memory()
    started, streamed = [], []
    real_start, real_put = vulkan.VulkanKernels.start, executable.KernelStream.put
    monkeypatch.setattr(vulkan.VulkanKernels, "start", lambda self, k, text, tree: (started.append(text),
                                                                                  real_start(self, k, text, tree))[1])
    monkeypatch.setattr(executable.KernelStream, "put", lambda self, fk: (streamed.append(fk.key), real_put(self, fk))[1])
    dev = get_runtime_device("vulkan")
    dev.clear_caches()
    losses = mlp_training_losses("vulkan", steps=3)
    np.testing.assert_allclose(losses, mlp_training_losses("numpy", steps=3), rtol=1e-5)
    assert streamed and len(streamed) == len(set(streamed))          # each finished once
    assert all(key in dev._pipelines for key in streamed)             # the runtime made them all
    assert (len(started) > 0) == early


def test_plan_digests_tell_equal_plans_from_different_ones(monkeypatch):
    """``bench/compile_time.py --digests``: compiling again gives the same digests; a plan
    made differently (a fusion pass off) does not."""
    from meganeura.bench import compile_time
    from meganeura.passes import fuse

    def plans():
        return {k: p["digest"] for k, p in compile_time.digests(["whisper"], "tiny", ("strict",)).items()}
    first = plans()
    assert len(first) == 3 and first == plans()
    monkeypatch.delitem(fuse.FUSION_PASSES, "horizontal")
    assert all(d != first[k] for k, d in plans().items())
