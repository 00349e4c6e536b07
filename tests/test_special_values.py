"""NaN, infinities, signed zeros and huge values through every elementwise, reduction, row
and fused kernel on the GPU backend, in trusted and checked shader modes, against PyTorch
on the CPU (float32). A NaN anywhere a result depends on must come out as NaN."""
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import meganeura as mg

NAN, INF = float("nan"), float("inf")
SPECIAL = np.array([NAN, INF, -INF, -0.0, 0.0, 1e30, -1e30, 1.5, -2.5, 3e-5, 88.0, -104.0], np.float32)


@pytest.fixture(scope="module")
def checked_device():
    from meganeura.runtime.device import Device
    return Device(checked=True)


@pytest.fixture(params=["trusted", "checked"])
def shader_mode(request, monkeypatch, checked_device):
    if request.param == "checked":
        from meganeura.runtime import device
        monkeypatch.setattr(device, "_device", checked_device)
    return request.param


def run_gpu(fn, *arrays):
    g = mg.Graph()
    xs = [g.input(f"x{i}", a.shape) for i, a in enumerate(arrays)]
    # ``* 1.0`` keeps the op off the raw inputs, so it is rendered as a kernel of its own
    # or as an epilogue, the way it sits in a model
    out = fn(*[x * 1.0 for x in xs])
    sess = mg.compile(g, outputs=[out], backend="gpu")
    return sess.run({f"x{i}": a for i, a in enumerate(arrays)})[0]


def check(got, want, what):
    want = np.asarray(want, np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want), err_msg=f"{what}: NaN positions")
    np.testing.assert_array_equal(np.isposinf(got), np.isposinf(want), err_msg=f"{what}: +inf positions")
    np.testing.assert_array_equal(np.isneginf(got), np.isneginf(want), err_msg=f"{what}: -inf positions")
    fin = np.isfinite(want)
    np.testing.assert_allclose(got[fin], want[fin], rtol=2e-5, atol=1e-6, err_msg=what)


T = torch.tensor
# (name, ours, torch's) on the special values
UNARY = [
    ("relu", mg.ops.relu, torch.relu),
    ("tanh", mg.ops.tanh, torch.tanh),
    ("sigmoid", mg.ops.sigmoid, torch.sigmoid),
    ("silu", mg.ops.silu, F.silu),
    ("gelu", mg.ops.gelu, F.gelu),
    ("gelu_tanh", lambda x: mg.ops.gelu(x, approximate="tanh"), lambda x: F.gelu(x, approximate="tanh")),
    ("erf", mg.ops.erf, torch.erf),
    ("exp", mg.ops.exp, torch.exp),
    ("log", mg.ops.log, torch.log),
    ("sqrt", mg.ops.sqrt, torch.sqrt),
    ("abs", mg.ops.abs, torch.abs),
    ("neg", mg.ops.neg, torch.neg),
    ("square", mg.ops.square, torch.square),
    ("pow3", lambda x: mg.ops.pow(x, 3), lambda x: torch.pow(x, 3)),
    ("clamp", lambda x: mg.ops.clamp(x, -1.0, 1.0), lambda x: torch.clamp(x, -1.0, 1.0)),
    ("clamp_min", lambda x: mg.ops.clamp(x, min=0.5), lambda x: torch.clamp(x, min=0.5)),
    ("clamp_max", lambda x: mg.ops.clamp(x, max=0.5), lambda x: torch.clamp(x, max=0.5)),
]
# torch's CPU GELU gives NaN at +inf (its vectorised erf), the limit is +inf: ours, and NumPy's
OVERRIDES = {"gelu": {1: INF}}


@pytest.mark.parametrize("name,ours,theirs", UNARY, ids=[u[0] for u in UNARY])
def test_unary_special_values(name, ours, theirs, shader_mode):
    want = theirs(T(SPECIAL)).numpy().copy()
    for i, v in OVERRIDES.get(name, {}).items():
        want[i] = v
    check(run_gpu(ours, SPECIAL), want, name)


BINARY = [
    ("maximum", mg.ops.maximum, torch.maximum),
    ("minimum", mg.ops.minimum, torch.minimum),
    ("add", mg.ops.add, torch.add),
    ("mul", mg.ops.mul, torch.mul),
    ("div", mg.ops.div, torch.div),
]


@pytest.mark.parametrize("name,ours,theirs", BINARY, ids=[b[0] for b in BINARY])
def test_binary_special_values(name, ours, theirs, shader_mode):
    a = np.ascontiguousarray(np.broadcast_to(SPECIAL[:, None], (12, 12)))
    b = np.ascontiguousarray(a.T)
    check(run_gpu(ours, a, b), theirs(T(a), T(b)).numpy(), name)


def special_rows(width):
    """Rows: one NaN, all -inf, a +inf, huge, signed zeros, finite, NaN and inf together."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((7, width)).astype(np.float32)
    x[0, width // 2] = NAN
    x[1, :] = -INF
    x[2, width - 1] = INF
    x[3, :2] = [1e30, 2e30]
    x[4, :] = -0.0
    x[6, 0], x[6, width - 1] = INF, NAN
    return x


ROWS = [
    ("amax", lambda x: mg.ops.amax(x, 1), lambda x: torch.amax(x, 1)),
    ("amax_all", lambda x: mg.ops.amax(x), lambda x: torch.amax(x)),
    ("amin", lambda x: mg.ops.amin(x, 1), lambda x: torch.amin(x, 1)),
    ("sum", lambda x: mg.ops.sum(x, 1), lambda x: torch.sum(x, 1)),
    ("mean", lambda x: mg.ops.mean(x, 1), lambda x: torch.mean(x, 1)),
    ("softmax", lambda x: mg.ops.softmax(x, 1), lambda x: torch.softmax(x, 1)),
    ("log_softmax", lambda x: mg.ops.log_softmax(x, 1), lambda x: torch.log_softmax(x, 1)),
    # a row of -inf gives zeros (torch's masked attention convention); a NaN row stays NaN
    ("safe_softmax", lambda x: mg.ops.safe_softmax(x, 1),
     lambda x: torch.where(torch.isneginf(x).all(1, keepdim=True), 0.0, torch.softmax(x, 1))),
    ("layer_norm", lambda x: mg.ops.layer_norm(x, (x.shape[1],)), lambda x: F.layer_norm(x, (x.shape[1],))),
    ("rms_norm", lambda x: mg.ops.rms_norm(x, (x.shape[1],)), lambda x: F.rms_norm(x, (x.shape[1],))),
    ("cross_entropy", None, None),
]


# 8: one thread per row; 300: a workgroup per row; 9000: the chunked two-stage reduction
@pytest.mark.parametrize("width", [8, 300, 9000])
@pytest.mark.parametrize("name,ours,theirs", ROWS, ids=[r[0] for r in ROWS])
def test_row_special_values(name, ours, theirs, width, shader_mode):
    x = special_rows(width)
    if name.endswith("_norm"):
        # squares of 1e30 overflow; torch's own result then depends on the width (NaN or 0)
        x[3, :2] = [1e15, 2e15]
    if name == "cross_entropy":
        labels = (np.arange(7) * 3 % width).astype(np.int32)
        g = mg.Graph()
        xi, li = g.input("x", x.shape), g.input("labels", (7,), mg.i32)
        out = mg.ops.cross_entropy(xi * 1.0, li, reduction="none")
        got = mg.compile(g, outputs=[out], backend="gpu").run({"x": x, "labels": labels})[0]
        want = F.cross_entropy(T(x), T(labels).long(), reduction="none").numpy()
    else:
        got, want = run_gpu(ours, x), theirs(T(x)).numpy()
    check(got, want, f"{name} width {width}")


def test_matmul_epilogue_and_gemv_propagate_nan(shader_mode):
    """A NaN input row makes that output row NaN through the fused matmul+add+relu (tiled
    and one-row GEMV paths); an inf weight column gives inf or NaN as torch."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((16, 32)).astype(np.float32)
    b = rng.standard_normal(16).astype(np.float32)
    w[3, 5] = INF
    for m in (1, 24):
        x = rng.standard_normal((m, 32)).astype(np.float32)
        x[0, 7] = NAN
        got = run_gpu(lambda x, w, b: mg.ops.relu(mg.ops.linear(x, w, b)), x, w, b)
        check(got, torch.relu(F.linear(T(x), T(w), T(b))).numpy(), f"linear+relu m={m}")


def test_attention_nan_score_and_masked_row(shader_mode):
    """A NaN in a query gives a NaN output row; a fully masked row still gives zeros."""
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal((1, 2, 6, 8)).astype(np.float32) for _ in range(3))
    q[0, 1, 2, 3] = NAN
    mask = np.zeros((6, 6), np.float32)
    mask[4, :] = -INF                      # query row 4 sees no key
    got = run_gpu(lambda q, k, v, m: mg.ops.scaled_dot_product_attention(q, k, v, m), q, k, v, mask)
    want = F.scaled_dot_product_attention(T(q), T(k), T(v), T(mask)).numpy()
    want[:, :, 4, :] = 0.0                  # torch gives NaN there; ours (and the op's doc) zeros
    check(got, want, "attention")


BACKENDS = ["numpy", "gpu", "wgpu"]
X_SPECIAL = np.array([1.0, -1.0, 0.0, -0.0, INF, -INF, NAN, 3.5], np.float32)


def run_on(backend, fn, *arrays):
    g = mg.Graph()
    xs = [g.input(f"x{i}", a.shape) for i, a in enumerate(arrays)]
    outs = fn(*xs)
    return mg.compile(g, outputs=outs, backend=backend).run({f"x{i}": a for i, a in enumerate(arrays)})


def check_bits(got, want, what):
    """Same value, NaN where NaN, and the same sign of zero."""
    want = np.asarray(want, np.float32)
    check(got, want, what)
    zero = want == 0
    np.testing.assert_array_equal(np.signbit(got[zero]), np.signbit(want[zero]), err_msg=f"{what}: signs of zeros")


SCALAR_FOLDS = [
    ("div_zero", lambda x: x / 0.0, lambda x: x / 0.0),
    ("div_neg_zero", lambda x: x / -0.0, lambda x: x / -0.0),
    ("mul_zero", lambda x: x * 0.0, lambda x: x * 0.0),
    ("zero_mul_neg", lambda x: -0.0 * x, lambda x: -0.0 * x),
    ("sub_self", lambda x: x - x, lambda x: x - x),
    ("add_zero", lambda x: x + 0.0, lambda x: x + 0.0),
    ("sub_neg_zero", lambda x: x - (-0.0), lambda x: x - (-0.0)),
    ("chain", lambda x: (x * 2.0) / 0.0 + (x - x), lambda x: (x * 2.0) / 0.0 + (x - x)),
]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name,ours,theirs", SCALAR_FOLDS, ids=[s[0] for s in SCALAR_FOLDS])
def test_scalar_folds_keep_ieee_results(name, ours, theirs, backend):
    """``x / 0.0``, ``x * 0.0``, ``x - x``, ``x + 0.0`` with Inf, NaN and signed zeros: as
    torch, on every backend (drivers fold these to 0 or x unless the kernels keep them)."""
    got = run_on(backend, lambda x: [ours(x)], X_SPECIAL)[0]
    check_bits(got, theirs(T(X_SPECIAL)).numpy(), f"{name} on {backend}")


def test_glsl_kernels_ask_the_driver_to_preserve_inf_nan_and_signed_zero():
    """The direct Vulkan backend's kernels carry SignedZeroInfNanPreserve for f32, and the
    device (lavapipe in CI) reports the float control it needs."""
    from meganeura.codegen import kernel_ast as K
    from meganeura.runtime.vulkan import _vk
    from meganeura.runtime.vulkan._vk import new
    from meganeura.runtime.vulkan.device import VulkanDevice
    empty = K.ComputeKernel((), 1, ())
    assert "spirv_execution_mode(" in K.print_glsl(empty) and "4461, 32" in K.print_glsl(empty)
    assert "spirv_execution_mode(" not in K.print_glsl(empty, preserve_ieee=False)
    vk = _vk.vk
    p12 = new("VkPhysicalDeviceVulkan12Properties", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES)
    p2 = new("VkPhysicalDeviceProperties2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=p12)
    _vk.lib.vkGetPhysicalDeviceProperties2(VulkanDevice().physical, p2)
    assert p12.shaderSignedZeroInfNanPreserveFloat32
