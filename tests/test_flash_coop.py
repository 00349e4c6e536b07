"""Flash attention on cooperative matrices in accelerated precision on the Vulkan backend,
the forward (codegen.flash_coop) and the backward (codegen.flash_grad_coop): which kernels
qualify, the variants' bindings and grids, every such kernel of the workloads accepted by
glslang, and the kernels run against float64 with their fragment operations emulated (any
Vulkan device: lavapipe in CI) and on tensor cores where the device has them (skipped
elsewhere): masks, causal tile skipping, grouped heads, padded head dims, strided views with
an epilogue, the split over keys or queries, and a small dO (which the rewrite scales)."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.compilation import vulkan as vulkan_kernels
from meganeura.codegen import attention as attn, flash_coop, flash_grad_coop
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.reference import evaluate

from .samples_attention import head_split_block, sdpa_graph
from .test_coopmat import run_accelerated, runtime  # noqa: F401 - runtime: the Vulkan runtime fixture
from .test_flash_attention import CASES as FLASH_CASES, _case

ACCEL = CompileOptions(precision="accelerated", max_bindings=64)
# head dims up to 128: the f32 kernel's wide cases stay on it
CASES = [n for n, c in FLASH_CASES.items() if max(c[0][-1], c[2]) <= flash_coop.MAX_DIM]


@pytest.fixture
def flash_only(monkeypatch):
    """Small shapes take the flash kernel instead of the one-row kernel."""
    monkeypatch.setattr(attn, "MAX_ROW_WORK", 0)
    monkeypatch.setattr(attn, "ACCELERATED_MAX_ROW_WORK", 0)


def _flash(targets, options=ACCEL):
    kp = compile_plan(targets, n_forward=len(targets), options=options)
    return [d for d in kp.dispatches if d.kernel.archetype == "attention"]


def _f16(feeds):
    return {n: a.astype(np.float16).astype(np.float64) if a.dtype.kind == "f" else a for n, a in feeds.items()}


# ------------------------------------------------------------------ device-free: selection
def test_selection_takes_flash_forwards_only(flash_only):
    g = mg.Graph()
    q, k, v = g.input("q", (1, 2, 70, 64)), g.input("k", (1, 2, 130, 64)), g.input("v", (1, 2, 130, 64))
    out = mg.ops.scaled_dot_product_attention(q, k, v)
    (d,) = _flash([out], CompileOptions(precision="accelerated", max_bindings=64, workgroup_storage=49152))
    assert flash_coop.select(d.kernel, 49152) == ""
    assert "workgroup memory" in flash_coop.select(d.kernel, 8192)
    # lavapipe's 32 KiB takes fewer subgroups (16 query rows each), an H200's 48 KiB four
    assert flash_coop.subgroups(64, 64, 49152) == 4 and flash_coop.subgroups(64, 64, 32768, emulate=True) == 1
    src, bufs, groups = flash_coop.render(d.kernel, 49152)
    assert "coopMatMulAdd" in src and "store_out" in src
    # the WGSL kernel's bindings; the grid too where both take 64 query rows a workgroup
    assert len(bufs) == len(d.bufs) and all(a is b for a, b in zip(bufs, d.bufs)) and groups == tuple(d.groups)
    # the backward kernels and head dims past 128 stay on the f32 kernels
    do = g.input("do", out.shape)
    for dd in _flash(mg.grad(mg.ops.sum(out * do), [q, k, v])):
        if dd.kernel.spec.get("grad"):
            assert "not a flash attention forward" in flash_coop.select(dd.kernel)
    g2 = mg.Graph()
    wide = [g2.input(n, (1, 1, 70, 160)) for n in "qkv"]
    (d2,) = _flash([mg.ops.scaled_dot_product_attention(*wide)])
    assert "head dims" in flash_coop.select(d2.kernel)
    with pytest.raises(ValueError, match="cannot run flash attention on cooperative matrices"):
        flash_coop.render(d2.kernel)


def test_every_workload_flash_kernel_compiles_to_spirv():
    """Every flash attention kernel of the workloads at real size (Whisper's and the U-Net's:
    forwards, training forwards with the log-sum-exp, split or not, and the dq and dkv
    backward kernels) renders with the WGSL kernel's bindings (and the forward's grid), and
    glslang accepts it."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    from meganeura.runtime.vulkan import spirv
    from meganeura.compilation.glslang import compile_glsl
    opts = CompileOptions(precision="accelerated", max_bindings=BINDINGS, workgroup_storage=49152)
    seen = {}
    for name in ("whisper", "unet"):
        w = make(name, size="real", device="cpu")
        for phase in ("inference", "flb"):
            targets, n, upd = phase_targets(w, phase)
            for d in compile_plan(targets, n_forward=n, options=opts, updates=upd).dispatches:
                module = flash_grad_coop if d.kernel.spec.get("grad") else flash_coop
                if module.select(d.kernel, 49152):
                    continue
                src, bufs, groups = module.render(d.kernel, 49152)
                assert all(a is b for a, b in zip(bufs, d.bufs)) and len(bufs) == len(d.bufs), d.kernel.name
                if module is flash_coop:
                    assert groups == tuple(d.groups), d.kernel.name
                seen.setdefault(src, (name, d.kernel.spec.get("grad") or "forward"))
    assert {w for w, _ in seen.values()} == {"whisper", "unet"}
    assert {k for _, k in seen.values()} == {"forward", "dq", "dkv"}
    for src, where in seen.items():
        info = spirv.reflect(compile_glsl(src, name="flash_attention", target="vulkan1.3", disk_cache=False))
        assert "CooperativeMatrixKHR" in info["capabilities"], where


# ----------------------------------------------------------------- on the Vulkan runtime
def _run(runtime, monkeypatch, mode, g, outs, feeds):
    """(outputs, dispatches on cooperative matrices) of an accelerated session, at least one."""
    monkeypatch.setenv("MEGANEURA_COOPMAT", mode)
    got, swapped, _ = run_accelerated(runtime, g, outs, feeds)
    assert swapped > 0, "no kernel ran on cooperative matrices"
    return got, swapped


def _check_case(runtime, monkeypatch, mode, name):
    qs, ks, dv, mask, causal, gqa = FLASH_CASES[name]
    feeds = _case(name)
    g, ins, out = sdpa_graph(feeds, causal, gqa)
    assert [d.kernel.name for d in _flash([out])] == ["flash_attention"]
    (got,), _ = _run(runtime, monkeypatch, mode, g, [out], feeds)
    # float64 from the f16-rounded inputs: what is left is P's rounding to f16 (and the
    # accumulation order)
    (want,) = evaluate(g, [out], _f16(feeds), compute=np.float64)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 2e-3, (name, err)
    if mask is not None:                          # the fully masked row gives zeros
        assert np.all(got[..., 0 if mask == "float" else 1, :] == 0)


@pytest.mark.parametrize("name", CASES)
def test_emulated_kernel_matches_float64(runtime, name, monkeypatch, flash_only):
    _check_case(runtime, monkeypatch, "emulate", name)


@pytest.mark.parametrize("name", CASES)
def test_coop_kernel_matches_float64(runtime, name, monkeypatch, flash_only):
    if runtime.coopmat_reason:
        pytest.skip(f"{runtime.name}: {runtime.coopmat_reason}")
    _check_case(runtime, monkeypatch, "auto", name)


@pytest.mark.parametrize("mode", ["emulate", "auto"])
def test_output_rescaled_when_a_later_tile_has_larger_scores(runtime, monkeypatch, flash_only, mode):
    """The output stays in its fragments while each row's max stays within flash_coop.TAU of
    its reference; keys whose scores jump past that (the second and fourth tiles here, for
    every row; a causal row sees them only from its diagonal on) rescale it."""
    if mode == "auto" and runtime.coopmat_reason:
        pytest.skip(f"{runtime.name}: {runtime.coopmat_reason}")
    rng = np.random.default_rng(5)
    q = np.abs(rng.standard_normal((1, 2, 200, 16))).astype(np.float32)
    k = np.abs(rng.standard_normal((1, 2, 230, 16))).astype(np.float32)
    k[..., 64:, :] *= 8
    k[..., 192:, :] *= 4
    v = rng.standard_normal((1, 2, 230, 16)).astype(np.float32)
    feeds = {"q": q, "k": k, "v": v}
    for causal in (False, True):
        g, ins, out = sdpa_graph(feeds, causal)
        (got,), _ = _run(runtime, monkeypatch, mode, g, [out], feeds)
        (want,) = evaluate(g, [out], _f16(feeds), compute=np.float64)
        err = np.abs(got - want).max() / np.abs(want).max()
        assert err < 2e-3, (causal, err)


@pytest.mark.parametrize("mode", ["emulate", "auto"])
def test_strided_heads_epilogue_split_and_gradients(runtime, monkeypatch, flash_only, mode):
    """q, k and v as head splits of projections (strided views), the output's transpose and
    residual fused into the store, the keys split in two (partials and their log-sum-exps,
    combined by the next kernel), and the gradients of the block, whose f32 backward kernels
    read the forward's log-sum-exps: against float64 of the f32 inputs."""
    if mode == "auto" and runtime.coopmat_reason:
        pytest.skip(f"{runtime.name}: {runtime.coopmat_reason}")
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "2")
    g, out, ws, feeds, wvals = head_split_block(1, 130, 2, 16, seed=3)
    feeds = {**feeds, **wvals}
    loss = mg.ops.sum(out * out)
    grads = mg.grad(loss, [g.inputs["x"]] + list(ws.values()))
    kernels = _flash([out] + grads)
    assert any(d.kernel.spec.get("split") == 2 and d.kernel.outs for d in kernels), [d.kernel.spec for d in kernels]
    got, _ = _run(runtime, monkeypatch, mode, g, [out] + grads, feeds)
    want = evaluate(g, [out] + grads, {n: a.astype(np.float64) for n, a in feeds.items()}, compute=np.float64)
    for name, a, b in zip(["out", "dx", "dwq", "dwk", "dwv"], got, want):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < 1e-2, (name, err)


# the backward: a cotangent as small as a mean loss gives (the rewrite scales it by its peak)
BACKWARD_CASES = ["d64_partial_tiles", "causal_lq_gt_lk", "causal_lq_lt_lk_odd_d", "float_mask_masked_rows",
                  "int_mask_masked_rows", "gqa_causal_odd_d", "batch_dims_float_mask"]


def _check_backward(runtime, monkeypatch, mode, name, split):
    qs, ks, dv, mask, causal, gqa = FLASH_CASES[name]
    if name == "d64_partial_tiles" and mode == "emulate":      # lavapipe: 32 wide heads, fewer loop trips
        qs, ks, dv = qs[:-1] + (32,), ks[:-1] + (32,), 32
    feeds = _case(name)
    feeds = {n: (a[..., :qs[-1]] if n in "qk" else a[..., :dv] if n == "v" else a) for n, a in feeds.items()}
    feeds["do"] = (np.random.default_rng(7).standard_normal(qs[:-1] + (dv,)) * 1e-6).astype(np.float32)
    if split:
        monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", str(split))
    g, ins, out = sdpa_graph(feeds, causal, gqa)
    grads = mg.grad(mg.ops.sum(out * ins["do"]), [ins["q"], ins["k"], ins["v"]])
    kernels = _flash(grads)
    assert {"dq", "dkv"} <= {d.kernel.spec.get("grad") for d in kernels}
    # on tensor cores where their tiles fit the device (lavapipe's 32 KiB: not every head dim)
    storage = runtime.limits["max-compute-workgroup-storage-size"]
    fit = [d.kernel.spec.get("grad") for d in kernels if not (flash_grad_coop if d.kernel.spec.get("grad") else flash_coop)
           .select(d.kernel, storage, mode == "emulate")]
    assert "dq" in fit and len(fit) >= 2, fit
    got, swapped = _run(runtime, monkeypatch, mode, g, grads, feeds)
    assert swapped == len(fit), fit
    want = evaluate(g, grads, {n: a.astype(np.float64) if a.dtype.kind == "f" else a for n, a in feeds.items()},
                    compute=np.float64)
    for wrt, a, b in zip("qkv", got, want):
        err = np.abs(a - b).max() / np.abs(b).max()
        assert err < 3e-3, (name, wrt, err)


@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_emulated_backward_matches_float64(runtime, name, monkeypatch, flash_only):
    _check_backward(runtime, monkeypatch, "emulate", name, split=2 if name == "causal_lq_gt_lk" else None)


@pytest.mark.parametrize("name", BACKWARD_CASES)
def test_coop_backward_matches_float64(runtime, name, monkeypatch, flash_only):
    if runtime.coopmat_reason:
        pytest.skip(f"{runtime.name}: {runtime.coopmat_reason}")
    _check_backward(runtime, monkeypatch, "auto", name, split=2 if name == "causal_lq_gt_lk" else None)


def test_rewrite_scales_do_only_for_the_flash_backward(monkeypatch):
    """Accelerated precision divides dO by its peak for attention gradients the flash
    backward takes (its tensor-core kernel rounds dO to f16); short rows, whose gradient
    decomposes into f32 matmuls, keep theirs unscaled (scaling would only add launches)."""
    from meganeura.compiler import _accelerated_attention_grad

    def grads(lq):
        g = mg.Graph()
        q, k, v = (g.input(n, (1, 2, lq, 16)) for n in "qkv")
        out = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=True)
        mg.grad(mg.ops.sum(out * out), [q, k, v])
        return [t for t in g.nodes if t.op == "attention_grad"]
    long_, short = grads(1500), grads(8)
    assert long_ and all(map(_accelerated_attention_grad, long_))
    assert short and not any(map(_accelerated_attention_grad, short))


def test_training_plan_from_the_plan_cache_finds_its_attention_variants(runtime, monkeypatch, tmp_path, flash_only):
    """A plan read from the plan cache has no kernel IR: its flash forward, dq and dkv kernels
    (beside its matmuls) find their tensor-core variants in the plan's stored set, and the
    gradients match the first process's."""
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    for name in ("MEGANEURA_NO_DISK_CACHE", "MEGANEURA_NO_PLAN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGANEURA_COOPMAT", "emulate")
    rng = np.random.default_rng(11)
    feeds = {n: rng.standard_normal((1, 2, 70, 16)).astype(np.float32) for n in ("q", "k", "v", "do")}
    g, ins, out = sdpa_graph(feeds)
    grads = mg.grad(mg.ops.sum(out * ins["do"]), [ins["q"], ins["k"], ins["v"]])

    def run():
        monkeypatch.setattr(vulkan_kernels, "_variants", {})
        return run_accelerated(runtime, g, grads, feeds)

    first, swapped, cache = run()
    assert swapped == 3 and cache == "stored"         # the forward, dq and dkv
    again, swapped, cache = run()
    assert swapped == 3 and cache == "hit"
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)
