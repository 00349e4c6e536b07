"""Sessions under stress: several threads, close(), bounded device caches, compiles that
share a graph, device limits found at compile time, hyper-parameters and the trace switch."""
import gc
import subprocess
import sys
import threading
import textwrap

import numpy as np
import pytest

import meganeura as mg
from meganeura.runtime.backends import get_runtime_device, gpu_device


def _regression(optimizer=None, n_in=8, n_out=16, batch=4, g=None):
    g = g or mg.Graph()
    x, y = g.input("x", (batch, n_in)), g.input("y", (batch, n_out))
    w = g.parameter("w", (n_out, n_in))
    loss = mg.ops.mse_loss(mg.ops.linear(x, w), y)
    return g, loss


def _feeds(batch=4, n_in=8, n_out=16, seed=0):
    rng = np.random.default_rng(seed)
    return {"x": rng.standard_normal((batch, n_in)).astype(np.float32),
            "y": rng.standard_normal((batch, n_out)).astype(np.float32)}


# ----------------------------------------------------------------------- threads
def test_two_sessions_save_and_read_back_from_two_threads(tmp_path):
    """Readback staging buffers were shared by size across the process: a second thread
    copied into a buffer the first had mapped (a Rust panic aborting the process, or
    'Buffer is already mapped'). Run in a child process so an abort shows as a failure."""
    script = textwrap.dedent(f"""
        import threading, numpy as np, meganeura as mg
        def session(seed):
            g = mg.Graph()
            x, y = g.input("x", (4, 8)), g.input("y", (4, 16))
            loss = mg.ops.mse_loss(mg.ops.linear(x, g.parameter("w", (16, 8))), y)
            return mg.compile(g, loss=loss, optimizer=mg.optim.Adam(lr=0.1), backend="gpu", seed=seed)
        sessions = [session(0), session(1)]
        errors = []
        def work(k, s):
            try:
                for i in range(25):
                    s.save(r"{tmp_path}" + f"/s{{k}}.safetensors")
                    s.state_dict(include_optimizer=True)
            except Exception as e:
                errors.append(repr(e))
        threads = [threading.Thread(target=work, args=(k, s)) for k, s in enumerate(sessions)]
        [t.start() for t in threads]
        [t.join() for t in threads]
        print("errors:", errors)
        assert not errors
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, (r.returncode, r.stdout[-2000:], r.stderr[-2000:])
    assert "errors: []" in r.stdout


def test_one_session_from_two_threads_serialises_and_loses_no_step():
    g, loss = _regression()
    feeds = _feeds()
    shared = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.05, momentum=0.9), backend="gpu")
    errors = []

    def work():
        try:
            for _ in range(15):
                shared.step(feeds)
                shared.state_dict()
        except Exception as e:   # noqa: BLE001 - reported below
            errors.append(repr(e))

    threads = [threading.Thread(target=work) for _ in range(2)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors
    assert shared.steps_done == 30
    alone = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.05, momentum=0.9), backend="gpu")
    for _ in range(30):
        alone.step(feeds)
    np.testing.assert_allclose(shared.state_dict()["w"], alone.state_dict()["w"], rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------------- close
def _rss_mib():
    # memory freed to glibc may stay in its heap (its mmap threshold grows with earlier
    # large frees): trimming first measures what is still allocated
    import ctypes
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096 / 2 ** 20


def test_close_frees_device_buffers_and_refuses_later_calls():
    def cycle():
        g = mg.Graph()
        x = g.input("x", (1, 2048))
        w = g.parameter("w", (4096, 2048))
        with mg.compile(g, outputs=[mg.ops.linear(x, w)], backend="gpu") as s:
            s.load_state_dict({"w": np.full((4096, 2048), 0.5, np.float32)})   # 32 MiB on the device, 32 on the host
            s.run({"x": np.ones((1, 2048), np.float32)})
        gc.collect()
        gpu_device().sync()
        return s

    closed = [cycle()]          # kept alive: only close() may free their memory
    first = _rss_mib()          # allocators keep some freed memory: compare later cycles with the first
    closed += [cycle() for _ in range(3)]
    grown = _rss_mib() - first
    s = closed[-1]
    assert grown < 24, f"3 sessions of 64 MiB each, closed, left {grown:.1f} MiB behind"
    assert s.closed
    with pytest.raises(RuntimeError, match="run: this session is closed"):
        s.run({"x": np.ones((1, 2048), np.float32)})
    with pytest.raises(RuntimeError, match="state_dict: this session is closed"):
        s.state_dict()
    s.close()   # twice is harmless


def test_close_keeps_shared_parameters_for_the_other_session():
    g1, g2 = mg.Graph(), mg.Graph()
    y1 = mg.ops.linear(g1.input("x", (2, 3)), g1.parameter("w", (4, 3)))
    y2 = mg.ops.linear(g2.input("x", (1, 3)), g2.parameter("w", (4, 3)))
    a = mg.compile(g1, outputs=[y1], backend="gpu")
    b = mg.compile(g2, outputs=[y2], backend="gpu", share_with=a)
    w = np.arange(12, dtype=np.float32).reshape(4, 3)
    a.load_state_dict({"w": w})
    a.close()
    np.testing.assert_allclose(b.run({"x": np.ones((1, 3), np.float32)})[0], np.ones((1, 3)) @ w.T)
    b.close()


@pytest.mark.parametrize("backend", ["wgpu", "vulkan"])
def test_device_caches_are_bounded_and_clearable(backend):
    if backend == "vulkan":
        pytest.importorskip("vulkan", reason="the vulkan extra")
    dev = get_runtime_device(backend)
    old = dev.pipeline_cache_size
    dev.pipeline_cache_size = 4
    evicted = dev.stats["pipelines_evicted"]
    try:
        for n in range(3, 11):                     # distinct shapes: distinct kernels
            g = mg.Graph()
            x = g.input("x", (n,))
            s = mg.compile(g, outputs=[mg.ops.exp(x) * 2.0 + 1.0], backend=backend)
            np.testing.assert_allclose(s.run({"x": np.zeros(n, np.float32)})[0], 3.0)
            s.close()
        assert dev.cache_info()["pipelines"] <= 4
        assert dev.stats["pipelines_evicted"] > evicted
    finally:
        dev.pipeline_cache_size = old
    buf = dev.create_buffer(1024)
    for n in (64, 128, 256, 512, 1024):
        dev.readback(buf, n)
    if backend == "wgpu":                          # readbacks through a pool of staging buffers
        assert dev.cache_info()["staging_bytes"] <= dev.staging_pool_bytes
    dev.clear_caches()
    assert dev.cache_info() == {"pipelines": 0, "staging_buffers": 0, "staging_bytes": 0}


def test_second_compile_with_another_optimizer_keeps_the_first_session_working(tmp_path):
    g, loss = _regression()
    feeds = _feeds()
    sgd = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1, momentum=0.9), backend="gpu")
    sgd.step(feeds)
    adam = mg.compile(g, loss=loss, optimizer=mg.optim.Adam(lr=0.1), backend="gpu")
    adam.step(feeds)
    assert sorted(sgd.state_dict(include_optimizer=True)) == ["w", "w.momentum_buffer"]
    assert sorted(adam.state_dict(include_optimizer=True)) == ["w", "w.exp_avg", "w.exp_avg_sq"]
    sgd.save(tmp_path / "sgd.safetensors")
    adam.save(tmp_path / "adam.safetensors")
    again = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1, momentum=0.9), backend="gpu")
    again.load(tmp_path / "sgd.safetensors")
    assert again.steps_done == 1
    np.testing.assert_array_equal(again.state_dict(True)["w.momentum_buffer"],
                                  sgd.state_dict(True)["w.momentum_buffer"])


# ---------------------------------------------------------------- device limits
def test_tensor_over_the_binding_limit_is_refused_at_compile_naming_it():
    dev = gpu_device()
    limit = min(dev.limits["max-storage-buffer-binding-size"], dev.limits["max-buffer-size"])
    n = limit // 4 + 1
    g = mg.Graph()
    x = g.input("big_input", (n,))
    with pytest.raises(mg.DeviceLimitError, match=rf"'big_input' \(input\) \({n},\) f32: {4 * n} bytes"):
        mg.compile(g, outputs=[x * 2.0], backend="gpu")
    # a parameter too: refused before its initial value is even made on the host
    g = mg.Graph()
    w = g.parameter("huge.weight", (2, n // 2 + 1))
    with pytest.raises(mg.DeviceLimitError, match=r"'huge.weight' \(parameter\)"):
        mg.compile(g, outputs=[w * 2.0], backend="gpu")


# --------------------------------------------------------------- hyper-parameters
@pytest.mark.parametrize("make,match", [
    (lambda: mg.optim.SGD(lr=float("nan")), "SGD: lr .* must be a finite number, got nan"),
    (lambda: mg.optim.SGD(lr=float("inf")), "finite number, got inf"),
    (lambda: mg.optim.SGD(lr=-0.1), "must be > 0"),
    (lambda: mg.optim.SGD(lr="0.1"), "finite number, got '0.1'"),
    (lambda: mg.optim.SGD(lr=0.1, momentum=-0.5), "momentum must be >= 0"),
    (lambda: mg.optim.SGD(lr=0.1, weight_decay=float("nan")), "weight_decay must be a finite number"),
    (lambda: mg.optim.SGD(lr=0.1, clip_grad_norm=0.0), "clip_grad_norm must be > 0"),
    (lambda: mg.optim.Adam(betas=(0.9, 1.0)), r"betas\[1\] must be < 1"),
    (lambda: mg.optim.Adam(betas=(float("nan"), 0.99)), r"betas\[0\] must be a finite number"),
    (lambda: mg.optim.AdamW(eps=-1e-8), "eps must be >= 0"),
    (lambda: mg.optim.AdamW(weight_decay=float("inf")), "weight_decay must be a finite number"),
    (lambda: mg.optim.AdamW(betas=0.9), "betas must be a pair"),
])
def test_bad_optimizer_hyper_parameters_are_refused(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_learning_rate_set_to_nan_later_is_refused_before_the_update():
    g, loss = _regression()
    opt = mg.optim.SGD(lr=0.1)
    s = mg.compile(g, loss=loss, optimizer=opt, backend="numpy")
    before = s.state_dict()["w"].copy()
    opt.lr = float("nan")
    with pytest.raises(ValueError, match="lr .* finite number"):
        s.step(_feeds())
    np.testing.assert_array_equal(s.state_dict()["w"], before)
    assert s.steps_done == 0


# ------------------------------------------------------------------------- trace
def test_unwritable_trace_path_fails_before_the_update(tmp_path, monkeypatch):
    blocker = tmp_path / "not_a_folder"
    blocker.write_text("")
    monkeypatch.setenv("MEGANEURA_TRACE", str(blocker / "trace.json"))
    g, loss = _regression()
    s = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="gpu")
    before = s.state_dict()["w"].copy()
    with pytest.raises(OSError, match=r"MEGANEURA_TRACE=.*trace.json.*cannot write the trace file.*nothing was run"):
        s.step(_feeds())
    np.testing.assert_array_equal(s.state_dict()["w"], before)
    assert s.steps_done == 0
    monkeypatch.delenv("MEGANEURA_TRACE")
    s.step(_feeds())
    assert s.steps_done == 1


# --------------------------------------------------------------- switches
@pytest.mark.parametrize("var,value,match", [
    ("MEGANEURA_MATMUL_TILE", "4096", r"MEGANEURA_MATMUL_TILE='4096': must be one of \[32, 64, 128\]"),
    ("MEGANEURA_MATMUL_TILE", "96", r"MEGANEURA_MATMUL_TILE='96'"),
    ("MEGANEURA_MATMUL_TILE", "big", r"MEGANEURA_MATMUL_TILE='big'"),
    ("MEGANEURA_MATMUL_SPLIT", "-2", r"MEGANEURA_MATMUL_SPLIT='-2': must be a non-negative integer"),
])
def test_bad_matmul_switches_are_refused_before_compiling(monkeypatch, var, value, match):
    monkeypatch.setenv(var, value)
    g, loss = _regression()
    with pytest.raises(ValueError, match=match):
        mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="gpu")


def test_a_valid_matmul_tile_switch_still_works(monkeypatch):
    monkeypatch.setenv("MEGANEURA_MATMUL_TILE", "32")
    g = mg.Graph()
    a, b = g.input("a", (40, 24)), g.input("b", (24, 36))
    rng = np.random.default_rng(0)
    feeds = {"a": rng.standard_normal((40, 24)).astype(np.float32), "b": rng.standard_normal((24, 36)).astype(np.float32)}
    out = mg.compile(g, outputs=[a @ b], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(out, feeds["a"] @ feeds["b"], rtol=1e-5, atol=1e-5)


def test_trace_keeps_every_step_up_to_its_cap(tmp_path, monkeypatch):
    from meganeura.runtime.profiler import close_traces, load_trace, trace_writer
    path = tmp_path / "t.json"
    monkeypatch.setenv("MEGANEURA_TRACE", str(path))
    g, loss = _regression()
    s = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="gpu")
    s.step(_feeds())
    per_step = len([e for e in load_trace(path) if e.get("ph") == "X"])
    trace_writer(path).max_events = 3 * per_step
    with pytest.warns(UserWarning, match="later steps are not traced"):
        for _ in range(4):
            s.step(_feeds())
    close_traces()
    steps = [e["args"]["step"] for e in load_trace(path) if e.get("ph") == "X"]
    assert sorted(set(steps)) == [0, 1, 2] and s.steps_done == 5


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_run_without_fetch_keeps_outputs_on_the_device(backend):
    g = mg.Graph()
    x = g.input("x", (3, 4))
    y = mg.ops.tanh(x) * 2.0
    s = mg.compile(g, outputs=[y], backend=backend)
    feeds = {"x": np.arange(12, dtype=np.float32).reshape(3, 4) / 7}
    assert s.run(feeds, fetch=False) is None
    np.testing.assert_allclose(s.read_outputs()[0], np.tanh(feeds["x"]) * 2.0, rtol=1e-6)
    np.testing.assert_array_equal(s.read_outputs()[0], s.run(feeds)[0])
