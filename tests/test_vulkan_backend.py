"""The executor on the direct Vulkan backend: staged memory (a discrete GPU's path: uploads
deferred into the step's command buffer), dependency levels against a barrier per
dispatch, and reported barriers. Results are compared with the reference interpreter."""
import numpy as np
import pytest

import meganeura as mg

pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
from meganeura.runtime.vulkan import backend  # noqa: E402
from meganeura.runtime.vulkan.device import VulkanDevice  # noqa: E402


@pytest.fixture(scope="module")
def staged_device():
    dev = VulkanDevice(direct_host_access=False)
    yield dev
    dev.close()


def _mlp():
    g = mg.Graph()
    x, y = g.input("x", (64, 32)), g.input("y", (64,), mg.i32)
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("a.weight", (48, 32)), g.parameter("a.bias", (48,))))
    return g, mg.ops.cross_entropy(mg.ops.linear(h, g.parameter("b.weight", (5, 48))), y)


@pytest.mark.parametrize("levels,mapped_inputs", [(True, False), (False, False), (True, True)])
def test_staged_memory_and_levels_match_the_reference(monkeypatch, staged_device, levels, mapped_inputs):
    """``mapped_inputs``: the device has host-mappable device memory on a large heap (a
    discrete GPU with resizable BAR), so inputs are written there and need no copy; else
    they are staged and copied in by the step."""
    if mapped_inputs:
        assert staged_device.input_mem_type is not None     # lavapipe's one memory type qualifies
    else:
        monkeypatch.setattr(staged_device, "input_mem_type", None)
    rt = backend.VulkanRuntime(staged_device, levels=levels)
    monkeypatch.setattr(backend, "_runtime", rt)
    g, loss = _mlp()
    ours = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="vulkan")
    ref = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="numpy")
    rng = np.random.default_rng(0)
    for _ in range(3):
        f = {"x": rng.standard_normal((64, 32)).astype(np.float32), "y": rng.integers(0, 5, 64).astype(np.int32)}
        np.testing.assert_allclose(ours.step(f), ref.step(f), rtol=1e-5)
    for name, v in ref.state_dict().items():
        # atol: a thousandth of one AdamW step (lr 1e-2), whose division by the root of the second
        # moment magnifies f32 rounding where gradients nearly cancel (4e-6 seen on lavapipe since
        # cross-entropy stopped storing the shifted logits)
        np.testing.assert_allclose(ours.state_dict()[name], v, rtol=1e-4, atol=1e-5, err_msg=name)
    st = ours.executor.plans["step"].step.sync_stats()
    inputs, n_after = ours.executor.input_buffers, len(ours.executor.plans["step"].copies_after)
    # the feeds and the optimizer's per-step scalars
    assert {"x", "y", "optim.step_size"} <= set(inputs) and all(b.host_visible == mapped_inputs for b in inputs.values())
    # staged inputs' uploads ride in the step's command buffer, as copies before the dispatches
    assert st["copies"] == (0 if mapped_inputs else len(inputs)) + n_after and \
        st["dispatches"] == ours.executor.plans["step"].n_dispatches
    n_ops = st["dispatches"] + st["copies"]
    if levels:
        assert st["barriers"] < n_ops - 1 and st["max_level_width"] > 1
    else:
        assert st["barriers"] == n_ops - 1
    ours.close()


def test_a_deferred_upload_is_visible_to_a_readback_before_any_step(staged_device):
    rt = backend.VulkanRuntime(staged_device)
    buf = rt.create_buffer(64)
    rt.upload_input(buf, np.arange(16, dtype=np.float32))
    assert rt._pending                                   # waiting for the next step
    np.testing.assert_array_equal(rt.readback(buf, 64, np.float32), np.arange(16, dtype=np.float32))
    assert not rt._pending
    rt.upload_input(buf, np.ones(16, np.float32))
    buf.destroy()                                        # a freed buffer's upload is dropped
    assert rt.take_pending() == []
    with pytest.raises(ValueError, match="upload of 128 B at offset 0 into a buffer of 64 B"):
        rt.upload(rt.create_buffer(64), np.zeros(32, np.float32))


def test_odd_sized_f16_tensors_and_closing_frees_recorded_steps():
    """f16 tensors of an odd element count (copies move whole words: buffers are rounded up
    to 4 bytes), and a closed session's recorded command buffers are destroyed."""
    g = mg.Graph()
    x = g.input("x", (3,), mg.f16)
    y = mg.ops.relu(x)
    s = mg.compile(g, outputs=[y], backend="vulkan")
    got = s.run({"x": np.array([-1, 2, -3], np.float16)})[0]
    np.testing.assert_array_equal(got, np.array([0, 2, 0], np.float16))
    step = s.executor.plans["run"].step
    progs = [p for p, _ in step.programs.values()]
    assert progs and all(p._cmd is not None for p in progs)
    s.close()
    assert not step.programs


def test_kernels_nobody_holds_are_destroyed(monkeypatch, staged_device):
    """Kernels evicted from the runtime's cache, once their sessions are closed, are
    collected and their pipelines destroyed (not kept until the device closes)."""
    import gc
    from meganeura.runtime.vulkan import pipelines
    destroyed = []
    real = pipelines._destroy_kernel
    monkeypatch.setattr(pipelines, "_destroy_kernel", lambda *a: (destroyed.append(a[1]), real(*a)))
    rt = backend.VulkanRuntime(staged_device)
    rt.pipeline_cache_size = 1
    monkeypatch.setattr(backend, "_runtime", rt)
    gc.collect()
    before = len(staged_device._kernels)
    for n in range(3, 9):                              # distinct shapes: distinct kernels
        g = mg.Graph()
        x = g.input("x", (n,))
        with mg.compile(g, outputs=[mg.ops.exp(x) * 2.0 + 1.0], backend="vulkan") as s:
            np.testing.assert_allclose(s.run({"x": np.zeros(n, np.float32)})[0], 3.0)
    gc.collect()
    assert len(staged_device._kernels) <= before + 1   # the one still cached
    assert len(destroyed) >= 5                          # their pipelines went back to the driver


def test_a_session_dropped_without_close_releases_its_recorded_steps():
    import gc
    g = mg.Graph()
    x = g.input("x", (5,))
    s = mg.compile(g, outputs=[mg.ops.exp(x)], backend="vulkan")
    s.run({"x": np.zeros(5, np.float32)})
    progs = [p for p, _ in s.executor.plans["run"].step.programs.values()]
    assert progs and all(p._cmd is not None for p in progs)
    del s
    gc.collect()
    assert all(p._cmd is None for p in progs)           # command buffer, fence and pools destroyed


def test_submissions_waited_for_one_by_one(monkeypatch, staged_device):
    """``VulkanRecorder.submit`` returns before the step has run; each submission has its own
    fence, so one is waited for (and its staging range read) while another is queued; the
    deferred inputs ride in the submit; a step waited for can be submitted again."""
    monkeypatch.setattr(staged_device, "input_mem_type", None)     # inputs staged, not mapped
    rt = backend.VulkanRuntime(staged_device)
    monkeypatch.setattr(backend, "_runtime", rt)
    sessions = []
    for op in (mg.ops.relu, mg.ops.exp):
        g = mg.Graph()
        x = g.input("x", (40,))
        sessions.append(mg.compile(g, outputs=[op(x)], backend="vulkan"))
    rec = sessions[0].executor.recorder
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = rng.standard_normal(40).astype(np.float32)
        subs = []
        for s in sessions:
            s.executor.upload({"x": x})
            assert rt._pending                            # staged: the input waits for the submit
            plan = s.executor.plan("run")
            subs.append(rec.submit(plan.step, plan.copies_after))
            assert not rt._pending
        assert subs[0].program is not subs[1].program and subs[0].program._fence is not subs[1].program._fence
        for s, sub, want in zip(sessions[::-1], subs[::-1], (np.exp(x), np.maximum(x, 0))):
            with rec.mapped_after(sub, s.executor.plan("run").staging[0], 160) as raw:
                np.testing.assert_allclose(raw.view(np.float32), want, rtol=1e-6)
            rec.wait(sub)                                 # a second wait returns at once
    with pytest.raises(ValueError, match="not host-visible"):
        with rec.mapped_after(subs[0], rt.create_buffer(16), 16):
            pass
    for s in sessions:
        s.close()


def test_repeated_steps_in_one_submit_run_in_order(monkeypatch, staged_device):
    """``run_repeated`` (the benchmarks' back-to-back replay) queues a step n times in one
    submit: three SGD steps on the same batch end where three steps one by one do."""
    rt = backend.VulkanRuntime(staged_device)
    monkeypatch.setattr(backend, "_runtime", rt)
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((64, 32)).astype(np.float32), "y": rng.integers(0, 5, 64).astype(np.int32)}
    ends = []
    for repeated in (False, True):
        g, loss = _mlp()
        s = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="vulkan", seed=4)
        s.step(feeds)                               # uploads the batch and the learning rate
        if repeated:
            s.executor.recorder.run_repeated(s.executor.plan("step").step, 3)
        else:
            for _ in range(3):
                s.executor.recorder.run(s.executor.plan("step").step)
        ends.append(s.state_dict())
        s.close()
    assert not np.allclose(ends[0]["a.weight"], _mlp_start(), atol=0)
    for name in ends[0]:
        np.testing.assert_array_equal(ends[1][name], ends[0][name], err_msg=name)


def _mlp_start():
    g, loss = _mlp()
    with mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), seed=4) as s:
        return s.state_dict()["a.weight"]


@pytest.mark.parametrize("staged", [True, False])
def test_a_new_buffer_holds_zeros_where_a_freed_one_was(staged_device, staged):
    """Values that start at zero (optimizer moments) are left to new buffers, as on wgpu;
    a range freed by a closed session is handed out again and must not keep its bytes."""
    from meganeura.runtime.vulkan.backend import get_vulkan_runtime
    rt = backend.VulkanRuntime(staged_device) if staged else get_vulkan_runtime()
    keep = rt.create_buffer(256)            # keeps the block from going back to the driver
    old = rt.create_buffer(256)
    rt.upload(old, np.full(64, np.nan, np.float32))
    where = (old.block, old.offset)
    old.destroy()
    new = rt.create_buffer(256)
    assert (new.block, new.offset) == where
    np.testing.assert_array_equal(rt.readback(new, 256, np.float32), np.zeros(64, np.float32))
    new.destroy()
    keep.destroy()


def test_device_memory_is_filled_once_per_block_not_per_buffer(staged_device, monkeypatch):
    """On device-only memory a new block is filled with zeros once; new buffers in never
    used bytes cost no fill (no submit each), one that reuses freed bytes gets its own."""
    rt = backend.VulkanRuntime(staged_device)
    fills = []
    real = staged_device.zero
    monkeypatch.setattr(staged_device, "zero", lambda rng: (fills.append(rng.size), real(rng)))
    bufs = [rt.create_buffer(4096) for _ in range(40)]
    assert len(fills) <= len({b.block for b in bufs})          # at most the blocks' fills
    for b in bufs:
        np.testing.assert_array_equal(rt.readback(b, 4096, np.float32), np.zeros(1024, np.float32))
    rt.upload(bufs[3], np.ones(1024, np.float32))
    where = (bufs[3].block, bufs[3].offset)
    bufs[3].destroy()
    del fills[:]
    again = rt.create_buffer(4096)
    assert (again.block, again.offset) == where and fills == [4096]
    np.testing.assert_array_equal(rt.readback(again, 4096, np.float32), np.zeros(1024, np.float32))
    for b in bufs[:3] + bufs[4:] + [again]:
        b.destroy()


def test_fence_wait_polls_first_except_on_software_devices(monkeypatch, staged_device):
    """A wait polls the fence before blocking (default 20 ms, MEGANEURA_SPIN_MS), except on
    a software device where the poll would take a core from the work unless asked; a bad
    value names the switch. With polling asked on lavapipe, steps still give the right result."""
    from meganeura.runtime.vulkan.device import spin_seconds
    monkeypatch.delenv("MEGANEURA_SPIN_MS", raising=False)
    assert spin_seconds() == 0.02 and spin_seconds(software=True) == 0.0
    monkeypatch.setenv("MEGANEURA_SPIN_MS", "5")
    assert spin_seconds(software=True) == 0.005
    monkeypatch.setenv("MEGANEURA_SPIN_MS", "soon")
    with pytest.raises(ValueError, match="MEGANEURA_SPIN_MS='soon'"):
        spin_seconds()
    monkeypatch.setenv("MEGANEURA_SPIN_MS", "50")
    rt = backend.VulkanRuntime(staged_device)
    monkeypatch.setattr(backend, "_runtime", rt)
    g = mg.Graph()
    x = g.input("x", (256,))
    s = mg.compile(g, outputs=[mg.ops.exp(x) * 2.0], backend="vulkan")
    v = np.linspace(-2, 2, 256, dtype=np.float32)
    for _ in range(3):
        np.testing.assert_allclose(s.run({"x": v})[0], np.exp(v) * 2.0, rtol=1e-6)
    s.close()


def test_inputs_take_mappable_device_memory_only_on_a_large_heap():
    """Inputs go to host-visible device-local memory only where its heap is at least 1 GiB
    (resizable BAR, as on an H200); a 256 MiB BAR window is left to the driver."""
    import vulkan as v
    from meganeura.runtime.vulkan.device import INPUT_HEAP_BYTES
    DL, HV = v.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, v.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
    HC, HCA = v.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, v.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
    dev = VulkanDevice.__new__(VulkanDevice)
    # the H200's table (driver 580): types 0-4, heap 0 device-local, heap 1 host
    dev.memory_types = [0, DL, HV | HC, HV | HC | HCA, DL | HV | HC]
    for bar, want in ((150 << 30, 4), (256 << 20, None)):
        dev.memory_type_heaps = [1, 0, 1, 1, 2]
        dev.memory_heaps = [dict(size=150 << 30), dict(size=100 << 30), dict(size=bar)]
        assert dev._find_type_on_heap(DL | HV | HC, INPUT_HEAP_BYTES) == want


def test_a_vulkan_process_never_imports_wgpu():
    """wgpu's bindings parse their C declarations when imported (0.24-0.34 s here): a process that
    trains and profiles on the Vulkan backend never loads them."""
    import os
    import subprocess
    import sys
    code = ("import sys, numpy as np, meganeura as mg\n"
            "g = mg.Graph(); x = g.input('x', (4, 8)); y = mg.ops.mm(x, g.parameter('w', (3, 8)), tb=True)\n"
            "s = mg.compile(g, loss=mg.ops.mean(y * y), optimizer=mg.optim.AdamW(lr=1e-3), backend='vulkan')\n"
            "f = {'x': np.ones((4, 8), np.float32)}; s.step(f); s.profile(f)\n"
            "print('wgpu' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                       env={**os.environ, "MEGANEURA_BACKEND": "vulkan"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "False", r.stdout
