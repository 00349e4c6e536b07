"""Accelerated precision runs large backward matmuls on f16 operands too. Gradients are
often far below f16's range: a matmul reads its gradient operand in f32 and rounds it to f16
precision in its loads (the tensor-core kernel scales it into f16's range by a power of two),
and so does a convolution's product its cotangent; deeper products scale a gradient operand by
its largest magnitude before the cast and unscale the product after; forward values are cast
as in the forward pass. Checked against the strict session on the device, with gradients scaled down to
where unscaled f16 would flush them to zero."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.compilation import precision as compiler     # the thresholds of accelerated precision

B, D, H = 16, 32, 64


def _session(precision, loss_scale):
    g = mg.Graph()
    x = g.input("x", (B, D))
    h = mg.ops.gelu(mg.ops.linear(x, g.parameter("w1", (H, D)), g.parameter("b1", (H,))))
    y = mg.ops.linear(h, g.parameter("w2", (D, H)))
    loss = mg.ops.mean(y * y) * loss_scale
    return mg.compile(g, loss=loss, precision=precision, seed=3, backend="gpu")


def _grads(precision, loss_scale):
    feeds = {"x": np.random.default_rng(0).standard_normal((B, D)).astype(np.float32)}
    with _session(precision, loss_scale) as s:
        s.compute_grads(feeds)
        plan = s.executor.plans["grads"]
        return s.grads(), list(plan.names), plan.kernel_plan


def _matmul_parts(kp):
    return [u for d in kp.dispatches for u in d.kernel.spec.get("parts", [d.kernel]) if u.archetype == "matmul"]


# 1e37: gradients near 1e34, far above f16's range; 1e-9: far below it
@pytest.mark.parametrize("loss_scale,coopmat", [(1.0, "auto"), (1e-9, "auto"), (1e37, "auto"),
                                                (1e-9, "emulate"), (1e37, "emulate")])
def test_backward_matmuls_on_f16_match_strict(monkeypatch, loss_scale, coopmat):
    """Every backward matmul reads its gradient operand in f32 and rounds it to f16 precision
    in its loads (on the cooperative-matrix kernel: scaled into f16's range by a power of two
    per workgroup), its forward operand in f16: no max reduction, no scaled cast."""
    monkeypatch.setattr(compiler, "BACKWARD_MATMUL_F16_MIN_MACS", 0)      # every backward matmul
    want, got, names, kp, swapped = _strict_and_accelerated(_grads, loss_scale, coopmat, monkeypatch)
    if coopmat == "emulate":
        from meganeura.codegen import coopmat as coop
        taken = [d.kernel for d in kp.dispatches if d.kernel.archetype == "matmul" and coop.select(d.kernel) == ""]
        assert swapped == len(taken)
        assert any(u.spec.get("f16_round") for k in taken for u in k.spec.get("parts", [k])), names
    assert not any("reduce_max" in n for n in names), names
    rounded = [u.spec.get("f16_round") for u in _matmul_parts(kp)]
    assert rounded.count((True, False)) == 3 and rounded.count(None) == 2, rounded
    if loss_scale < 1:      # unscaled f16 would hold none of these values
        for name, w in want.items():
            assert np.abs(w).max() < 6e-8 * 2 ** 10, name
    _close_to_strict(want, got)


def test_small_backward_matmuls_stay_f32():
    # below BACKWARD_MATMUL_F16_MIN_MACS a product is too small for f16 operands to pay
    want, _, _ = _grads("strict", 1.0)
    got, names, kp = _grads("accelerated", 1.0)
    assert not any(u.spec.get("f16_round") for u in _matmul_parts(kp)), names
    for name, w in want.items():
        # only the forward matmuls round to f16
        np.testing.assert_allclose(got[name], w, rtol=0, atol=2e-3 * np.abs(w).max(), err_msg=name)


def test_deep_backward_matmuls_take_the_scaled_cast_threshold():
    """A backward matmul deeper than BACKWARD_ROUND_MAX_K would take the scaled cast: below
    BACKWARD_F16_MIN_MACS it stays f32, as a convolution does; a shallow one of the same size
    rounds its gradient in the loads."""
    from meganeura.compiler import CompileOptions, compile_plan
    g = mg.Graph()
    x = g.input("x", (8192, 16))
    h = x @ g.parameter("w", (16, 16))
    loss = mg.ops.mean(h * h)
    (gw, gx) = mg.autodiff.grad(loss, [g.parameters["w"], x])
    kp = compile_plan([loss, gw, gx], n_forward=1, options=CompileOptions("accelerated"))
    assert not any("reduce_max" in n for n in kp.names), kp.names
    flags = {}          # by output rows and columns (a K split writes partials before them)
    for u in _matmul_parts(kp):
        flags.setdefault(u.out.shape[-2:], set()).add(u.spec.get("f16_round"))
    # the forward product and the input gradient (K 16), the weight gradient (K 8192)
    assert flags == {(8192, 16): {None, (True, False)}, (16, 16): {None}}, flags


def test_rounded_operand_matches_the_reference():
    """A matmul whose f32 operand is rounded to f16 precision in its loads (``f16_round``)
    gives what the NumPy reference does: f16's 11 significant bits, f32's exponent range."""
    from meganeura.ops.linalg import round_f16_precision
    rng = np.random.default_rng(2)
    a = (rng.standard_normal((40, 72)) * 1e-12).astype(np.float32)
    b = rng.standard_normal((56, 72)).astype(np.float16)
    r = round_f16_precision(a)
    assert np.array_equal(r * 2.0 ** 40, (a * 2.0 ** 40).astype(np.float16).astype(np.float32))
    g = mg.Graph()
    y = mg.ops.emit("matmul", [g.input("a", a.shape), g.input("b", b.shape, "f16")], ta=False, tb=True,
                    out_dtype="f32", f16_round=(True, False))
    want = r.astype(np.float64) @ b.astype(np.float64).T
    for backend in ("numpy", "gpu", "wgpu"):       # "gpu": the direct Vulkan backend where there is one
        with mg.compile(g, outputs=[y], backend=backend) as s:
            (got,) = s.run({"a": a, "b": b})
        assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), backend
    with pytest.raises(TypeError, match="f16_round"):
        mg.ops.emit("matmul", [g.input("c", a.shape, "f16"), g.input("d", b.shape, "f16")], ta=False, tb=True,
                    out_dtype="f32", f16_round=(True, False))


def test_only_the_autodiffs_matmuls_count_as_backward(monkeypatch):
    """A matmul that only a state update reads (not on the loss's path, not made by the
    autodiff) keeps f32 operands, and its operands are not taken for gradients."""
    from meganeura.compiler import CompileOptions, compile_plan
    monkeypatch.setattr(compiler, "BACKWARD_MATMUL_F16_MIN_MACS", 0)
    g = mg.Graph()
    x = g.input("x", (B, D))
    h = x @ g.parameter("w", (D, H))
    loss = mg.ops.mean(h * h)
    stat = mg.ops.mm(mg.ops.relu(h) * 1e-3, h, ta=True)      # a statistic for a state update
    (gw,) = mg.autodiff.grad(loss, [g.parameters["w"]])
    kp = compile_plan([loss, stat, gw], n_forward=1, options=CompileOptions("accelerated"))
    # one gradient rounded in the loads (the weight gradient's dh), not the statistic's operands
    parts = _matmul_parts(kp)
    assert [u.spec.get("f16_round") for u in parts if u.out.shape == (D, H)] == [(False, True)], kp.names
    for u in parts:
        if u.out.shape == (H, H):
            assert [v.dtype.name for v in u.reads[:2]] == ["f32", "f32"] and not u.spec.get("f16_round"), u.name


def _strict_and_accelerated(grads, loss_scale, coopmat, monkeypatch):
    """``grads(precision, loss_scale)`` strict and accelerated with ``MEGANEURA_COOPMAT`` set:
    (strict gradients, accelerated gradients, names, plan, dispatches the Vulkan runtime ran
    on cooperative-matrix kernels). Emulated kernels need the Vulkan runtime (skipped without)."""
    monkeypatch.setenv("MEGANEURA_COOPMAT", coopmat)
    want = grads("strict", loss_scale)[0]
    runtime = _vulkan_runtime()
    before = runtime.stats["coopmat_kernels"] if runtime else 0
    got, names, plan = grads("accelerated", loss_scale)
    if coopmat == "emulate" and runtime is None:
        pytest.skip("no Vulkan runtime: the strict-vs-accelerated check ran on wgpu above")
    return want, got, names, plan, (runtime.stats["coopmat_kernels"] - before if runtime else 0)


def _vulkan_runtime():
    """The Vulkan runtime when the GPU backend is it, else None."""
    from meganeura.runtime.backends import gpu_device
    rt = gpu_device()
    return rt if getattr(rt, "backend", None) == "vulkan" else None


def _conv_grads(precision, loss_scale):
    rng = np.random.default_rng(1)
    g = mg.Graph()
    x = g.input("x", (2, 5, 12, 10))
    h = mg.ops.gelu(mg.ops.conv2d(x, g.parameter("w1", (8, 5, 3, 3)), g.parameter("b1", (8,)), padding=1))
    y = mg.ops.conv2d(h, g.parameter("w2", (6, 8, 3, 3)), stride=2)
    loss = mg.ops.mean(y * y) * loss_scale
    with mg.compile(g, loss=loss, precision=precision, seed=3, backend="gpu") as s:
        s.compute_grads({"x": rng.standard_normal((2, 5, 12, 10)).astype(np.float32)})
        return s.grads(), list(s.executor.plans["grads"].names), s.executor.plans["grads"]


# 1e-9: a cotangent far below f16's smallest normal, which the rounding's scale brings back
@pytest.mark.parametrize("loss_scale,coopmat", [(1.0, "auto"), (1e-9, "auto"), (1e37, "auto"),
                                                (1.0, "emulate"), (1e-9, "emulate")])
def test_backward_convolutions_on_f16_match_strict(monkeypatch, loss_scale, coopmat):
    """Both gradients of a convolution (its input's, a matmul then col2im; its weight's, a
    matmul over the columns computed in the loads) read the cotangent in f32, rounded to f16
    in the product's loads, and their forward operand in f16: no max reduction, no scaled
    cast; on the Vulkan backend also with the cooperative-matrix kernels (emulated: any device)."""
    monkeypatch.setattr(compiler, "BACKWARD_MATMUL_F16_MIN_MACS", 0)
    want, got, names, plan, swapped = _strict_and_accelerated(_conv_grads, loss_scale, coopmat, monkeypatch)
    if coopmat == "emulate":
        assert swapped == 5
    assert not any("reduce_max" in n for n in names), names
    products = [(d.kernel.name, [v.dtype.name for v in d.kernel.reads[:2]], d.kernel.spec.get("f16_round"))
                for d in plan.kernel_plan.dispatches if d.kernel.archetype == "matmul"]
    # the forward convolutions (f16 x f16), the input gradient of the second (weight x
    # cotangent), both weight gradients (cotangent x the columns, computed in the loads)
    assert sum(r is None and t == ["f16", "f16"] and "im2col" in n for n, t, r in products) == 2, products
    assert sum(r == (False, True) and t == ["f16", "f32"] for n, t, r in products) == 1, products
    assert sum(r == (True, False) and t[0] == "f32" and "im2col" in n for n, t, r in products) == 2, products
    _close_to_strict(want, got)


def test_deep_backward_convolutions_take_the_scaled_cast(monkeypatch):
    """A convolution gradient deeper than BACKWARD_ROUND_MAX_K scales its cotangent by its
    peak and casts it before the product (a max reduction), as before rounding in the loads."""
    monkeypatch.setattr(compiler, "BACKWARD_MATMUL_F16_MIN_MACS", 0)
    monkeypatch.setattr(compiler, "BACKWARD_F16_MIN_MACS", 0)
    monkeypatch.setattr(compiler, "BACKWARD_CONV_ROUND_MAX_K", 5)     # the input gradient's K is 6
    want, got, names, plan, _ = _strict_and_accelerated(_conv_grads, 1e-9, "auto", monkeypatch)
    assert any("reduce_max" in n for n in names), names
    f16_reads = [d.kernel.name for d in plan.kernel_plan.dispatches if d.kernel.archetype == "matmul"
                 and [v.dtype.name for v in d.kernel.reads[:2]] == ["f16", "f16"]]
    # the forward convolutions, the input gradient of the second, both weight gradients
    assert len(f16_reads) == 5 and sum("im2col" in n for n in f16_reads) == 4, names
    _close_to_strict(want, got)


def _close_to_strict(want, got):
    """Every accelerated gradient within 2e-3 (relative L2, in f64) of the strict one."""
    for name, w in want.items():
        assert np.abs(w).max() > 0, name
        g64, w64 = got[name].astype(np.float64), w.astype(np.float64)      # norms of 1e35 overflow f32
        err = np.linalg.norm(g64 - w64) / np.linalg.norm(w64)
        assert err < 2e-3, (name, err)


def _conv1d_grads(precision, loss_scale):
    rng = np.random.default_rng(2)
    g = mg.Graph()
    x = g.input("x", (2, 6, 40))
    h = mg.ops.gelu(mg.ops.conv1d(x, g.parameter("w1", (8, 6, 3)), g.parameter("b1", (8,)), padding=1))
    y = mg.ops.conv1d(h, g.parameter("w2", (5, 8, 3)), stride=2, padding=1)
    loss = mg.ops.mean(y * y) * loss_scale
    with mg.compile(g, loss=loss, precision=precision, seed=3, backend="gpu") as s:
        s.compute_grads({"x": rng.standard_normal((2, 6, 40)).astype(np.float32)})
        return s.grads(), list(s.executor.plans["grads"].names), s.executor.plans["grads"]


@pytest.mark.parametrize("coopmat", ["auto", "emulate"])
def test_backward_conv1d_rounds_its_cotangent(monkeypatch, coopmat):
    """A 1-D convolution is a 2-D one over reshaped views: its gradients' products still find
    the cotangent behind them (a reshape of a reshape folds into one) and round it in their
    loads; cast unscaled, gradients this small would be flushed to zero."""
    monkeypatch.setattr(compiler, "BACKWARD_MATMUL_F16_MIN_MACS", 0)
    want, got, names, plan, _ = _strict_and_accelerated(_conv1d_grads, 1e-9, coopmat, monkeypatch)
    rounded = [d.kernel.spec.get("f16_round") for d in plan.kernel_plan.dispatches if d.kernel.archetype == "matmul"]
    assert rounded.count((True, False)) == 2 and rounded.count((False, True)) == 1, (rounded, names)
    assert not any(n == "cast" or "reduce_max" in n for n in names), names
    _close_to_strict(want, got)
