"""Every archetype rendered for f16 tensors (as accelerated mode and half-precision models
produce them) and for f32, compiled by the device's shader compiler and checked against
the NumPy reference."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.runtime.backends import gpu_device
from meganeura.compiler import CompileOptions, compile_plan

def _stat(x, stat, center):
    from meganeura.ops.registry import emit
    return emit("norm_stat", [x], stat=stat, k=1, center=center, eps=1e-5)


ARCHETYPES = {
    "pointwise": lambda g, x, w, ids: [mg.ops.gelu(x) * x + 1.0],
    "reduce": lambda g, x, w, ids: [mg.ops.sum(x, 1), mg.ops.amax(x, 0), mg.ops.mean(x)],
    "rows": lambda g, x, w, ids: [mg.ops.softmax(x, -1), mg.ops.log_softmax(x, 0)],
    # with the statistics a backward reads: stored by the norm kernels as further outputs
    "norm": lambda g, x, w, ids: [mg.ops.layer_norm(x, (x.shape[-1],)), mg.ops.rms_norm(x, (x.shape[-1],), eps=1e-5),
                                  _stat(x, "mean", True), _stat(x, "rstd", True), _stat(x, "rstd", False)],
    "norm_stats": lambda g, x, w, ids: [_stat(x, "mean", True), _stat(x, "rstd", True)],   # stats-only kernel
    "matmul": lambda g, x, w, ids: [mg.ops.linear(x, w), mg.ops.matmul(x, mg.ops.transpose(w, 0, 1))],
    "gemv": lambda g, x, w, ids: [mg.ops.linear(mg.ops.slice(x, 0, 0, 2), w)],
    "gather": lambda g, x, w, ids: [mg.ops.embedding(ids, w)],
    "attention": lambda g, x, w, ids: [mg.ops.scaled_dot_product_attention(
        mg.ops.reshape(x, (1, 1, 6, 8)), mg.ops.reshape(w, (1, 1, 12, 8)), mg.ops.reshape(w, (1, 1, 12, 8)))],
}


@pytest.mark.parametrize("dtype", ["f32", "f16"])
@pytest.mark.parametrize("arch", list(ARCHETYPES))
def test_archetype_renders_and_matches(arch, dtype):
    if dtype == "f16" and not gpu_device().has_f16:
        pytest.fail("the CI device (lavapipe) offers shader-f16; this device does not")
    dt = mg.f16 if dtype == "f16" else mg.f32
    g = mg.Graph()
    x = g.input("x", (6, 8), dt)
    w = g.input("w", (12, 8), dt)
    ids = g.input("ids", (3,), mg.i32)
    outs = ARCHETYPES[arch](g, x, w, ids)
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    archs = {u.archetype for d in kp.dispatches for u in d.kernel.spec.get("parts", [d.kernel])}
    # attention's kernel is f32 only: f16 attention decomposes into matmuls and a softmax
    expect = "matmul" if arch == "gemv" or (arch == "attention" and dtype == "f16") else \
        "norm" if arch == "norm_stats" else arch
    assert expect in archs, (arch, kp.names)
    if dtype == "f16":
        assert any("enable f16;" in d.wgsl for d in kp.dispatches)
    rng = np.random.default_rng(0)
    npdt = np.float16 if dtype == "f16" else np.float32
    feeds = {"x": rng.standard_normal((6, 8)).astype(npdt), "w": rng.standard_normal((12, 8)).astype(npdt),
             "ids": np.array([3, 0, 11], np.int32)}
    feeds = {n: v for n, v in feeds.items() if n in {i.name for i in g.inputs.values()}}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    got = mg.compile(g, outputs=outs, backend="gpu").run(feeds)
    tol = 2e-2 if dtype == "f16" else 1e-5
    for a, b in zip(want, got):
        assert b.dtype == a.dtype
        np.testing.assert_allclose(b.astype(np.float64), a.astype(np.float64), rtol=tol, atol=tol)
