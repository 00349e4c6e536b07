"""GPU runtime tests (run on lavapipe where there is no GPU)."""

import json

import numpy as np
import pytest

wgpu = pytest.importorskip("wgpu")

from meganeura.runtime import Device, StepRecorder, describe, get_device, write_chrome_trace  # noqa: E402
from meganeura.runtime.device import parse_bindings  # noqa: E402
from meganeura.runtime.profiler import kernel_table  # noqa: E402

AFFINE = """
@group(0) @binding(0) var<storage, read_write> x: array<f32>;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&x)) {
        y[i] = 2.0 * x[i] + 1.0;
    }
}
"""

ADD_ONE = """
@group(0) @binding(0) var<storage, read_write> a: array<f32>;

@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    if (i < arrayLength(&a)) {
        a[i] = a[i] + 1.0;
    }
}
"""

TIMES_TWO = ADD_ONE.replace("a[i] + 1.0", "a[i] * 2.0")


@pytest.fixture(scope="module")
def dev():
    try:
        return get_device()
    except RuntimeError as e:  # no adapter at all
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def checked_dev(dev):
    return Device(adapter=dev.adapter, checked=True)


def test_adapter_found(dev):
    assert dev.adapter_info["name"]
    assert isinstance(dev.features, set)
    assert dev.limits["max-storage-buffer-binding-size"] > 0
    text = describe(dev)
    assert "chosen:" in text and dev.name in text
    if dev.is_software:
        assert "SOFTWARE" in text
    print(text)


def test_parse_bindings():
    assert parse_bindings(AFFINE) == ["rw", "rw"]
    src = "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n" \
          "@binding(0) @group(0) var<storage, read> x: array<f32>;"
    assert parse_bindings(src) == ["read", "rw"]
    with pytest.raises(ValueError, match="0..N-1"):
        parse_bindings("@group(0) @binding(2) var<storage, read_write> y: array<f32>;")


def _affine(device):
    n = 1000
    x = np.arange(n, dtype=np.float32) * 0.5 - 3.0
    bx = device.create_buffer(x.nbytes)
    by = device.create_buffer(x.nbytes)
    device.upload(bx, x)
    p = device.pipeline(AFFINE)
    bg = device.bind_group(p, [bx, by])
    StepRecorder(device).run([(p, bg, ((n + 63) // 64, 1, 1))])
    y = device.readback(by, x.nbytes, np.float32, (n,))
    np.testing.assert_allclose(y, 2 * x + 1, rtol=0, atol=0)
    return p


def test_affine_trusted(dev):
    p = _affine(dev)
    assert p.trusted == dev.trusted
    if dev.trusted_unavailable_reason is None and not dev.checked:
        assert p.trusted


def test_affine_checked(checked_dev):
    p = _affine(checked_dev)
    assert not p.trusted and checked_dev.checked


def test_pipeline_cache_dedupes(dev):
    before = dict(dev.stats)
    p1 = dev.pipeline(TIMES_TWO)
    p2 = dev.pipeline(str(TIMES_TWO))  # equal text, different object
    assert p1 is p2
    assert dev.stats["pipelines_compiled"] - before["pipelines_compiled"] <= 1
    assert dev.stats["pipeline_cache_hits"] - before["pipeline_cache_hits"] >= 1
    assert dev.stats["compile_seconds"] > 0


def test_readback_staging_reused(dev):
    b = dev.create_buffer(256)
    dev.upload(b, np.arange(64, dtype=np.float32))
    dev.readback(b, 256)
    created = dev.stats["staging_buffers_created"]
    for i in range(5):
        dev.upload(b, np.full(64, i, np.float32))
        out = dev.readback(b, 256, np.float32, (64,))
        assert (out == i).all()
    assert dev.stats["staging_buffers_created"] == created
    # odd sizes round up to 4 bytes and read back only what was asked
    dev.upload(b, np.arange(3, dtype=np.uint8))
    assert dev.readback(b, 3, np.uint8).tolist() == [0, 1, 2]


def test_buffer_rounding(dev):
    assert dev.create_buffer(0).size == 4
    assert dev.create_buffer(5).size == 8


def test_many_dispatches_one_pass(dev):
    n = 1000
    a = dev.create_buffer(4 * n)
    dev.upload(a, np.zeros(n, np.float32))
    p = dev.pipeline(ADD_ONE)
    bg = dev.bind_group(p, [a])
    rec = StepRecorder(dev)
    step = rec.prepare([(p, bg, ((n + 63) // 64, 1, 1))] * 50)
    assert step.num_set_pipeline == 1
    rec.run(step)
    rec.run(step)  # a prepared step is reused across steps
    out = dev.readback(a, 4 * n, np.float32, (n,))
    np.testing.assert_array_equal(out, np.full(n, 100.0, np.float32))


def test_alternating_pipelines_and_copies(dev):
    # (x + 1) * 2, three times: checks SetPipeline switching and copies_after.
    n = 130
    a = dev.create_buffer(4 * n)
    dev.upload(a, np.ones(n, np.float32))
    pa, pt = dev.pipeline(ADD_ONE), dev.pipeline(TIMES_TWO)
    bga, bgt = dev.bind_group(pa, [a]), dev.bind_group(pt, [a])
    wg = ((n + 63) // 64, 1, 1)
    step = StepRecorder(dev).prepare([(pa, bga, wg), (pt, bgt, wg)] * 3)
    st = dev.staging(4 * n)
    StepRecorder(dev).run(step, copies_after=[(a, st, 4 * n)])
    out = dev.read_staging(st, 4 * n, np.float32, (n,))
    v = 1.0
    for _ in range(3):
        v = (v + 1) * 2
    np.testing.assert_array_equal(out, np.full(n, v, np.float32))


def test_sync(dev):
    a = dev.create_buffer(64)
    dev.upload(a, np.zeros(16, np.float32))
    p = dev.pipeline(ADD_ONE)
    StepRecorder(dev).run([(p, dev.bind_group(p, [a]), (1, 1, 1))], wait=True)
    dev.sync()


def test_timestamps_trace(dev, tmp_path):
    if not dev.has_timestamps:
        print("skipped: adapter has no timestamp-query feature")
        pytest.skip("adapter has no timestamp-query feature")
    n = 4096
    a = dev.create_buffer(4 * n)
    dev.upload(a, np.zeros(n, np.float32))
    pa, pt = dev.pipeline(ADD_ONE), dev.pipeline(TIMES_TWO)
    bga, bgt = dev.bind_group(pa, [a]), dev.bind_group(pt, [a])
    wg = (n // 64, 1, 1)
    rec = StepRecorder(dev)
    step = rec.prepare([(pa, bga, wg), (pt, bgt, wg)] * 4, names=["add_one", "times_two"] * 4)
    ts = rec.run(step, timestamps=True)
    assert ts.shape == (8, 2)
    assert (ts[:, 1] >= ts[:, 0]).all()
    assert (ts[1:, 0] >= ts[:-1, 0]).all()
    path = tmp_path / "trace.json"
    write_chrome_trace(path, step.names, ts)
    doc = json.loads(path.read_text())
    xs = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == 8 and {e["name"] for e in xs} == {"add_one", "times_two"}
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in xs)
    rows = kernel_table(step.names, ts)
    assert {r[0] for r in rows} == {"add_one", "times_two"} and all(r[2] == 4 for r in rows)
    out = dev.readback(a, 4 * n, np.float32, (n,))
    v = 0.0
    for _ in range(4):
        v = (v + 1) * 2
    np.testing.assert_array_equal(out, np.full(n, v, np.float32))


def test_adapter_selector_and_summary(dev):
    d = Device(adapter="0")
    assert d.adapter is not None and d.adapter_info["backend"]
    with pytest.raises(RuntimeError, match="matches none"):
        Device(adapter="no-such-adapter-name")
    assert "pipelines compiled" in dev.compile_summary()


def test_immediates(dev):
    if "immediates" not in dev.features:
        pytest.skip("adapter has no immediates feature")
    src = """
struct P { v: f32, n: u32 }
var<immediate> pc: P;
@group(0) @binding(0) var<storage, read_write> a: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < pc.n) { a[gid.x] = a[gid.x] + pc.v; }
}
"""
    a = dev.create_buffer(4 * 128)
    dev.upload(a, np.zeros(128, np.float32))
    p = dev.pipeline(src, immediate_size=8)
    bg = dev.bind_group(p, [a])

    def imm(v, n):
        return np.array([v], np.float32).tobytes() + np.array([n], np.uint32).tobytes()

    StepRecorder(dev).run([(p, bg, (2, 1, 1), imm(10.0, 100)), (p, bg, (2, 1, 1), imm(0.5, 128))])
    out = dev.readback(a, 4 * 128, np.float32, (128,))
    np.testing.assert_array_equal(out[:100], 10.5)
    np.testing.assert_array_equal(out[100:], 0.5)


def test_timestamps_per_pass_fallback(dev):
    if not dev.has_timestamps:
        pytest.skip("adapter has no timestamp-query feature")
    a = dev.create_buffer(256)
    dev.upload(a, np.zeros(64, np.float32))
    p = dev.pipeline(ADD_ONE)
    bg = dev.bind_group(p, [a])
    saved = dev.has_timestamps_in_passes
    dev.has_timestamps_in_passes = False  # force one pass per dispatch
    try:
        ts = StepRecorder(dev).run([(p, bg, (1, 1, 1))] * 5, timestamps=True)
    finally:
        dev.has_timestamps_in_passes = saved
    assert ts.shape == (5, 2) and (ts[:, 1] >= ts[:, 0]).all()
    np.testing.assert_array_equal(dev.readback(a, 256, np.float32), 5.0)
