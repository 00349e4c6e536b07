"""Every op of the sample table on the GPU backend (lavapipe in CI): forward outputs and
gradients match the reference interpreter in strict f32."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.reference import evaluate

from .harness import assert_close, build
from .opinfo import all_samples

SAMPLES = all_samples()
# a known compiler bug keeps its sample: the GPU run must fail until it is fixed (strict)
PARAMS = [pytest.param(s, id=s.name, marks=pytest.mark.xfail(strict=True, reason=s.gpu_bug) if s.gpu_bug else ())
          for s in SAMPLES]


@pytest.fixture(scope="module")
def checked_device():
    from meganeura.runtime.device import Device
    dev = Device(checked=True)
    assert dev.checked and not dev.trusted
    return dev


@pytest.fixture(params=["wgpu-trusted", "wgpu-checked", "vulkan"])
def shader_mode(request, monkeypatch, checked_device):
    """The backend that runs the table. wgpu with trusted modules (no runtime bounds
    checks) and with checked ones: an out-of-bounds access that trusted mode would let
    through shows up as a difference. The direct Vulkan backend: the same kernels rendered
    as GLSL."""
    if request.param == "wgpu-checked":
        from meganeura.runtime import device
        monkeypatch.setattr(device, "_device", checked_device)
    if request.param == "vulkan":
        pytest.importorskip("vulkan", reason="the vulkan extra")
    return request.param


@pytest.mark.parametrize("sample", PARAMS)
def test_gpu_matches_reference(sample, shader_mode):
    g, feeds, float_inputs, outs, _, loss = build(sample)
    grads = [gr for gr in mg.grad(loss, [t for _, t in float_inputs])] if sample.grad else []
    targets = outs + grads
    want = evaluate(g, targets, feeds)
    sess = mg.compile(g, outputs=targets, backend=shader_mode.split("-")[0])
    got = sess.run(feeds)
    for k, (a, b) in enumerate(zip(got, want)):
        what = f"{sample.name} {'output' if k < len(outs) else 'gradient'} {k}"
        assert a.dtype == b.dtype or a.dtype.kind == b.dtype.kind, what
        assert_close(a, b, max(sample.rtol, 1e-4), max(sample.atol, 1e-5), what)
