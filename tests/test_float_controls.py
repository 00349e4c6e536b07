"""The Vulkan kernels ask the driver to keep Inf, NaN and signed zeros only where the device
reports it (shaderSignedZeroInfNanPreserveFloat32): the device's report, its compile target,
the GLSL asked for on lavapipe (which has it) with IEEE results; and, on a device mocked
without it, a warning naming the device and kernels without the request that still run, or
an error under MEGANEURA_REQUIRE_IEEE=1."""
import warnings

import numpy as np
import pytest

import meganeura as mg
from meganeura.compilation import float_controls
from meganeura.compilation.target import Target

pytest.importorskip("vulkan")


@pytest.fixture
def runtime():
    from meganeura.runtime.backends import get_runtime_device, vulkan_unavailable_reason
    if vulkan_unavailable_reason():
        pytest.skip(vulkan_unavailable_reason())
    return get_runtime_device("vulkan")


@pytest.fixture
def glsl_calls(monkeypatch):
    """(preserve_ieee, GLSL) of every kernel printed from its kernel AST in this process from
    now on."""
    from meganeura.codegen import kernel_ast
    calls, real_print = [], kernel_ast.print_glsl

    def spy_print(tree, unroll=None, preserve_ieee=True):
        out = real_print(tree, unroll, preserve_ieee)
        calls.append((preserve_ieee, out))
        return out
    monkeypatch.setattr(kernel_ast, "print_glsl", spy_print)
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    from meganeura.compilation import vulkan
    vulkan.clear_memory()
    return calls


def _special(scale):
    """x / scale and x * 0.0 on Inf, NaN, signed zeros and ordinary numbers, with a distinct
    constant per call (distinct kernels)."""
    x_np = np.array([1.0, -2.0, 0.0, -0.0, np.inf, -np.inf, np.nan, 3.5], np.float32)
    g = mg.Graph()
    x = g.input("x", x_np.shape)
    return g, [x / 0.0 + scale, x * 0.0 * scale], x_np


def test_lavapipe_reports_float_controls_and_kernels_ask_for_them(runtime, glsl_calls):
    caps = runtime.vk.capabilities()
    assert caps["float_controls"]["signed_zero_inf_nan_f32"] is True      # lavapipe has it
    assert runtime.target().ieee_preserve is True
    g, outs, x = _special(1.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # no fallback warning on this device
        s = mg.compile(g, outputs=outs, backend="vulkan", plan_cache=False)
    got = s.run({"x": x})
    assert glsl_calls and all(p and "spirv_execution_mode(" in text for p, text in glsl_calls)
    with np.errstate(all="ignore"):
        want = [x / np.float32(0.0) + np.float32(1.0), x * np.float32(0.0) * np.float32(1.0)]
    for o, w in zip(got, want):
        np.testing.assert_array_equal(np.signbit(o[~np.isnan(w)]), np.signbit(w[~np.isnan(w)]))
        np.testing.assert_array_equal(o, w)


def test_device_without_float_controls_warns_and_compiles_without_asking(runtime, glsl_calls, monkeypatch):
    monkeypatch.setattr(runtime, "ieee_preserve", False)           # a device mocked without them
    monkeypatch.setattr(float_controls, "_warned", set())
    assert runtime.target().ieee_preserve is False
    g, outs, x = _special(2.0)
    with pytest.warns(RuntimeWarning, match=r"llvmpipe.* does not report shaderSignedZeroInfNanPreserveFloat32"):
        s = mg.compile(g, outputs=outs, backend="vulkan", plan_cache=False)
    assert glsl_calls and all(not p and "spirv_execution_mode(" not in text for p, text in glsl_calls)
    got = s.run({"x": x})
    finite = np.isfinite(x) & (x != 0)          # what any driver gives: the folds are the driver's
    with np.errstate(all="ignore"):
        np.testing.assert_array_equal(got[0][finite], (x / np.float32(0.0) + np.float32(2.0))[finite])
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)     # once per device
        g2, outs2, _ = _special(3.0)
        mg.compile(g2, outputs=outs2, backend="vulkan", plan_cache=False)


def test_require_ieee_refuses_a_device_without_float_controls(runtime, monkeypatch):
    monkeypatch.setattr(runtime, "ieee_preserve", False)
    monkeypatch.setenv("MEGANEURA_REQUIRE_IEEE", "1")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    g, outs, _ = _special(4.0)
    with pytest.raises(float_controls.IeeeUnsupported, match=r"llvmpipe.*MEGANEURA_REQUIRE_IEEE=1 refuses"):
        mg.compile(g, outputs=outs, backend="vulkan", plan_cache=False)
    monkeypatch.setattr(runtime, "ieee_preserve", True)            # a device with them: compiles
    mg.compile(g, outputs=outs, backend="vulkan", plan_cache=False)


def test_target_keeps_the_float_controls_in_its_description():
    t = Target.lavapipe()
    assert t.ieee_preserve and Target.from_dict(t.to_dict()) == t
    off = Target.from_dict(dict(t.to_dict(), ieee_preserve=False))
    assert not off.ieee_preserve and off.to_dict()["ieee_preserve"] is False
