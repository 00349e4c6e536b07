"""The executable: ``compile_plan(..., target=...)`` finishes every kernel for a ``Target``
with no device (Vulkan: SPIR-V, variants chosen), the runtime compiles nothing, and an
executable saved by one process runs in another with no compile step."""
import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import meganeura as mg
from meganeura.compilation import executable
from meganeura.compilation.target import Target
from meganeura.compiler import CompileOptions, compile_plan

SRC = pathlib.Path(mg.__file__).parent
SPIRV_MAGIC = b"\x03\x02\x23\x07"


def _mlp(batch=4, n_in=8, hidden=16, n_out=5):
    """A tiny MLP (two matmuls, a bias, ReLU, softmax) with its weights, seeded."""
    rng = np.random.default_rng(0)
    values = {"w1": rng.standard_normal((hidden, n_in)).astype(np.float32) * 0.3,
              "b1": rng.standard_normal(hidden).astype(np.float32) * 0.1,
              "w2": rng.standard_normal((n_out, hidden)).astype(np.float32) * 0.3}
    g = mg.Graph()
    x = g.input("x", (batch, n_in))
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("w1", (hidden, n_in)), g.parameter("b1", (hidden,))))
    y = mg.ops.softmax(mg.ops.linear(h, g.parameter("w2", (n_out, hidden))))
    feeds = {"x": rng.standard_normal((batch, n_in)).astype(np.float32)}
    hh = np.maximum(feeds["x"] @ values["w1"].T + values["b1"], 0) @ values["w2"].T
    e = np.exp(hh - hh.max(-1, keepdims=True))
    return y, values, feeds, e / e.sum(-1, keepdims=True)


def _lavapipe_executable(y, disk=False, monkeypatch=None):
    if not disk and monkeypatch is not None:
        monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    lava = Target.lavapipe()
    return compile_plan([y], n_forward=1, options=CompileOptions.for_target(lava), target=lava)


def _need_glslang():
    from meganeura.compilation import glslang
    try:
        glslang.glslang_version()
    except glslang.GlslangUnavailable as e:
        pytest.skip(str(e))


def test_the_runtime_renders_translates_and_compiles_nothing():
    """No kernel rendering, GLSL translation, glslang or plan compile in ``runtime/``, and the
    executor probes its device for no attribute (``runtime.protocol.RuntimeDevice``)."""
    bad = re.compile(r"to_glsl|compile_glsl|compile_plan|render\(")
    hits = [f"{p.relative_to(SRC)}:{i}" for p in sorted((SRC / "runtime").rglob("*.py"))
            for i, line in enumerate(p.read_text().splitlines(), 1) if bad.search(line)]
    assert hits == []
    assert "getattr(dev" not in (SRC / "runtime" / "executor.py").read_text()


def test_both_runtimes_meet_the_device_protocol():
    from meganeura.runtime.device import Device
    from meganeura.runtime.protocol import RuntimeDevice
    from meganeura.runtime.vulkan.backend import VulkanRuntime
    for cls in (Device, VulkanRuntime):
        missing = [m for m in ("target", "pipelines", "pipelines_from", "bind_group", "create_buffer", "upload",
                               "upload_input", "readback", "read_staging", "sync") if not callable(getattr(cls, m, None))]
        assert missing == [], (cls.__name__, missing)
    assert RuntimeDevice is not None


def test_targets_round_trip_and_refuse_unknown_fields():
    for t in (Target.lavapipe(), Target.h200()):
        assert Target.from_dict(json.loads(json.dumps(t.to_dict()))) == t
    with pytest.raises(ValueError, match="unknown field"):
        Target.from_dict({**Target.lavapipe().to_dict(), "colour": "red"})
    assert Target.h200().tensor_cores("accelerated") is False and Target.h200().tensor_cores("strict") is None
    assert Target.lavapipe().tensor_cores("accelerated") is None       # no cooperative matrices


def test_lavapipe_target_is_what_the_driver_reports():
    """``Target.lavapipe()`` (device-free) describes the lavapipe this suite runs on."""
    pytest.importorskip("vulkan")
    from meganeura.runtime.backends import get_runtime_device
    try:
        live = get_runtime_device("vulkan").target()
    except Exception as e:      # noqa: BLE001 - no Vulkan device
        pytest.skip(f"no Vulkan device: {e}")
    if not live.software:
        pytest.skip(f"not lavapipe: {live.adapter.get('name')}")
    lava = Target.lavapipe()
    for f in ("limits", "features", "subgroup", "coop_shapes", "vulkan", "software", "unroll"):
        assert getattr(live, f) == getattr(lava, f), f


def test_a_vulkan_executable_is_built_device_free_with_spirv_for_every_kernel(monkeypatch):
    _need_glslang()
    y, _, _, _ = _mlp()
    exe = _lavapipe_executable(y, monkeypatch=monkeypatch)
    assert exe.n_dispatches == len(exe.steps) > 0
    assert all(s.kernel.spirv[:4] == SPIRV_MAGIC and s.kernel.info["bindings"] for s in exe.steps)
    assert [s.groups for s in exe.steps] == [d.groups for d in exe.dispatches]
    # without a target: the logical plan, same dispatches
    plan = compile_plan([y], n_forward=1, options=CompileOptions.for_target(Target.lavapipe()))
    assert [d.wgsl for d in plan.dispatches] == [d.wgsl for d in exe.dispatches]


def test_checked_mode_is_a_compile_option():
    """Checked mode renders the kernels that index with data with their index reports, into
    one error buffer the executable names; without it the kernels are as in the plan."""
    g = mg.Graph()
    ids = g.input("ids", (6,), "i32")
    y = mg.ops.embedding(ids, g.parameter("table", (10, 4)))
    wgpu = Target("wgpu", limits={"max-storage-buffers-per-shader-stage": 8})
    plain = compile_plan([y], n_forward=1, options=CompileOptions(), target=wgpu)
    checked = compile_plan([y], n_forward=1, options=CompileOptions(checked=True), target=wgpu)
    assert plain.checks == [] and plain.error_buf is None
    assert checked.checks and checked.error_buf is not None and checked.error_buf.nbytes == 8 * len(checked.checks)
    assert any(checked.error_buf in s.bufs for s in checked.steps)
    assert [s.kernel.text for s in plain.steps] == [d.wgsl for d in plain.dispatches]
    assert [s.kernel.text for s in checked.steps] != [d.wgsl for d in checked.dispatches]


RUN_SAVED = textwrap.dedent("""
    import json, sys, numpy as np
    import meganeura.codegen as codegen
    def refuse(*a, **k):
        raise AssertionError("a renderer ran")
    codegen.render = refuse
    from meganeura.compilation import executable
    from meganeura.runtime.executor import ExecutableRunner
    exe = executable.load(sys.argv[1])
    values = dict(np.load(sys.argv[2]))
    feeds = {"x": values.pop("x")}
    out = ExecutableRunner(exe, values).run(feeds)[0]
    np.save(sys.argv[3], out)
    names = ("meganeura.compilation.glslang", "meganeura.compilation.vulkan")
    print(json.dumps({"imported": [n for n in names if n in sys.modules]}))
""")


def test_a_saved_executable_runs_in_a_fresh_process_with_no_compile_step(tmp_path, monkeypatch):
    """Built and saved with no device, loaded by a fresh process that runs it on lavapipe:
    no renderer, translator or glslang is called (their modules are never imported) and the
    result is the in-process run's, and NumPy's."""
    _need_glslang()
    pytest.importorskip("vulkan")
    from meganeura.runtime.backends import vulkan_unavailable_reason
    if vulkan_unavailable_reason() is not None:
        pytest.skip(vulkan_unavailable_reason())
    y, values, feeds, want = _mlp()
    exe = _lavapipe_executable(y, monkeypatch=monkeypatch)
    path = tmp_path / "mlp.exe"
    exe.save(path)
    np.savez(tmp_path / "values.npz", **values, **feeds)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC.parent)] + sys.path))
    r = subprocess.run([sys.executable, "-c", RUN_SAVED, str(path), str(tmp_path / "values.npz"),
                        str(tmp_path / "out.npy")], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == {"imported": []}
    got = np.load(tmp_path / "out.npy")
    from meganeura.runtime.executor import ExecutableRunner
    here = ExecutableRunner(executable.load(path), values).run(feeds)[0]
    np.testing.assert_array_equal(got, here)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-6)


def test_a_file_that_is_not_an_executable_is_refused(tmp_path):
    import pickle
    bad = tmp_path / "bad.exe"
    bad.write_bytes(pickle.dumps(("something else", 1, None)))
    with pytest.raises(ValueError, match="not a saved meganeura executable"):
        executable.load(bad)
