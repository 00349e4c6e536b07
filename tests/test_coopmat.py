"""Matmuls on cooperative matrices (codegen.coopmat) in accelerated precision on the Vulkan
backend: which kernels qualify and when the runtime swaps them in (device-free, and on the
runtime without running them), every such kernel of the five workloads accepted by glslang,
the kernels run against NumPy with their fragment operations emulated (any Vulkan device:
lavapipe in CI), and on tensor cores where the device has them (skipped elsewhere)."""
import dataclasses
import os

import numpy as np
import pytest

import meganeura as mg
from meganeura.compilation import vulkan as vulkan_kernels
from meganeura.codegen import coopmat
from meganeura.compiler import CompileOptions, compile_plan

ACCEL = CompileOptions(precision="accelerated", max_bindings=64)


def _matmuls(targets, options=ACCEL):
    kp = compile_plan(targets, n_forward=len(targets), options=options)
    return [d for d in kp.dispatches if d.kernel.archetype == "matmul"]


def _linear_graph(m=40, k=24, n=52):
    g = mg.Graph()
    x, w = g.input("x", (m, k)), g.input("w", (n, k))
    return g, mg.ops.mm(x, w, tb=True)


# ------------------------------------------------------------------ device-free: selection
def test_selection_takes_tiled_f16_matmuls_only():
    _, y = _linear_graph()
    (acc,) = _matmuls([y])
    assert coopmat.select(acc.kernel) == ""
    (strict,) = _matmuls([y], CompileOptions(max_bindings=64))
    assert "f32 x f32" in coopmat.select(strict.kernel)
    _, y = _linear_graph(m=3)                       # few rows: a GEMV
    assert coopmat.select(_matmuls([y])[0].kernel) == "a GEMV"
    k = acc.kernel
    assert "prologue" in coopmat.select(dataclasses.replace(k, spec={**k.spec, "prologue": {"kind": "rms_norm"}}))
    assert "tile" in coopmat.select(dataclasses.replace(k, spec={**k.spec, "tile": 16}))
    from meganeura.plan_cache import _slim
    assert "no kernel IR" in coopmat.select(_slim(k))
    cast = compile_plan([y], n_forward=1, options=ACCEL).dispatches[0].kernel     # the operands' f16 casts
    assert "archetype" in coopmat.select(cast)


def test_render_keeps_the_wgsl_kernels_bindings_and_grid():
    g = mg.Graph()
    x = g.input("x", (2, 24, 40))
    y1 = mg.ops.mm(x, g.input("w1", (48, 40)), tb=True).reshape((2, 24, 3, 16)).transpose(1, 2)
    y2 = mg.ops.mm(x, g.input("w2", (32, 40)), tb=True)
    (d,) = _matmuls([y1, y2])
    parts = d.kernel.spec["parts"]
    assert len(parts) == 2 and "store_map" in parts[0].spec     # merged siblings, one transposed store
    for emulate in (False, True):
        src, bufs, groups = coopmat.render(d.kernel, emulate=emulate)
        assert len(bufs) == len(d.bufs) and all(a is b for a, b in zip(bufs, d.bufs))
        assert groups == tuple(d.groups)
        assert ("coopMatMulAdd" in src) != emulate and "store_out0" in src and "store_out1" in src
    with pytest.raises(ValueError, match="workgroup memory"):
        coopmat.render(d.kernel, workgroup_storage=4096)


def test_wide_tile_only_where_it_pays(monkeypatch):
    """The 128 x 256 tile needs a large grid, a long K and no more padding of N than 128 x 128."""
    monkeypatch.setenv("MEGANEURA_MATMUL_TILE", "128")
    monkeypatch.setenv("MEGANEURA_MATMUL_SPLIT", "1")
    monkeypatch.setattr(coopmat, "WIDE_MIN_GROUPS", 6)

    def grid(m, k, n):
        g = mg.Graph()
        y = mg.ops.mm(g.input("a", (m, k)), g.input("b", (k, n)))
        (d,) = _matmuls([y])
        return coopmat.render(d.kernel, emulate=True)[2][:2], tuple(d.groups[:2])

    assert grid(272, 512, 400) == ((2, 3), (4, 3))       # wide: N 400 pads to 512 either way
    assert grid(272, 496, 400) == ((4, 3), (4, 3))       # 31 K chunks: narrow
    assert grid(272, 512, 300) == ((3, 3), (3, 3))       # N 300 would pad to 512 instead of 384
    monkeypatch.setattr(coopmat, "WIDE_MIN_GROUPS", 7)
    assert grid(272, 512, 400) == ((4, 3), (4, 3))       # 6 wide workgroups: too few


def test_configs_and_mode_switches(monkeypatch):
    from meganeura.compilation.target import coopmat_mode
    monkeypatch.setenv("MEGANEURA_COOPMAT_CONFIG", "128:128x256x2x4x16")
    assert coopmat.configs()[128] == (128, 256, 2, 4, 16, 1) and coopmat.configs()[64] == coopmat.CONFIGS[64]
    monkeypatch.setenv("MEGANEURA_COOPMAT_CONFIG", "64:64x64x2x2x16x3")
    assert coopmat.configs()[64] == (64, 64, 2, 2, 16, 3)
    for bad in ("128:128x128x3x4x32", "96:96x96x2x2x32", "128:128x128x2x2", "128:128x128x2x2x8", "x",
                "128:128x128x2x4x16x5", "128:128x128x2x4x16x0", "128:128x128x2x4x16x2x2"):
        monkeypatch.setenv("MEGANEURA_COOPMAT_CONFIG", bad)
        with pytest.raises(ValueError, match="MEGANEURA_COOPMAT_CONFIG"):
            coopmat.configs()
    monkeypatch.delenv("MEGANEURA_COOPMAT_CONFIG")
    for raw, mode in (("", "auto"), ("0", "off"), ("emulate", "emulate"), ("ON", "auto")):
        monkeypatch.setenv("MEGANEURA_COOPMAT", raw)
        assert coopmat_mode() == mode
    monkeypatch.setenv("MEGANEURA_COOPMAT", "always")
    with pytest.raises(ValueError, match="MEGANEURA_COOPMAT='always'"):
        coopmat_mode()


# ------------------------------------------------------------------------------ glslang
def test_every_workload_coop_kernel_compiles_to_spirv():
    """Every tiled f16 matmul of the five workloads at real size (the H200's plans; inference
    and minimal: the forward matmuls and convolutions) renders for cooperative matrices with the WGSL kernel's bindings and
    grid, and glslang accepts it (SPIRV-Tools' validator too)."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import WORKLOADS, make
    from meganeura.runtime.vulkan import spirv
    from meganeura.compilation.glslang import compile_glsl
    opts = CompileOptions(precision="accelerated", max_bindings=BINDINGS, workgroup_storage=49152)
    seen, per_workload = {}, {}
    for name in WORKLOADS:
        w = make(name, size="real", device="cpu")
        for phase in ("inference", "minimal"):
            targets, n, upd = phase_targets(w, phase)
            for d in compile_plan(targets, n_forward=n, options=opts, updates=upd).dispatches:
                if coopmat.select(d.kernel):
                    continue
                src, bufs, groups = coopmat.render(d.kernel, 49152)
                assert all(a is b for a, b in zip(bufs, d.bufs)) and len(bufs) == len(d.bufs), d.kernel.name
                assert groups == tuple(d.groups), d.kernel.name
                seen.setdefault(src, d.kernel.name)
                per_workload[name] = per_workload.get(name, 0) + 1
    assert set(per_workload) == set(WORKLOADS), per_workload    # ResNet-50's: its convolutions
    for src, kname in seen.items():
        info = spirv.reflect(compile_glsl(src, name=kname, target="vulkan1.3", disk_cache=False, validate=True))
        assert "CooperativeMatrixKHR" in info["capabilities"], kname


def test_rounded_operand_kernels_compile_to_spirv(monkeypatch):
    """The kernels whose f32 operands are rounded to f16 in their loads (scaled by their
    workgroup's peak: a subgroup max on tensor cores), element-wise and vec4 fetches, one and
    two such operands: glslang accepts them for cooperative matrices."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.runtime.vulkan import spirv
    from meganeura.compilation.glslang import compile_glsl
    for name in ("round_split", "round_ta", "round_odd"):
        g, outs, feeds, want, env = _case(name)
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        (d,) = _matmuls(outs)
        assert coopmat.select(d.kernel) == "" and d.kernel.spec["f16_round"][0]
        src = coopmat.render(d.kernel, 49152)[0]
        assert "subgroupMax" in src and "ldexp" in src
        info = spirv.reflect(compile_glsl(src, name=name, target="vulkan1.3", disk_cache=False))
        assert "CooperativeMatrixKHR" in info["capabilities"], name


# ----------------------------------------------------------------- on the Vulkan runtime
def run_accelerated(runtime, g, outs, feeds):
    """(outputs, dispatches swapped for cooperative-matrix kernels, the plan cache's verdict)
    of an accelerated session of ``outs`` on the Vulkan runtime."""
    before = runtime.stats["coopmat_kernels"]
    with mg.compile(g, outputs=outs, backend="vulkan", precision="accelerated") as s:
        got = s.run(feeds)
        return got, runtime.stats["coopmat_kernels"] - before, s.executor.plans["run"].kernel_plan.stats.get("cache")


def kernel_variant(runtime, kernel, text, label, bufs, groups, precision="strict"):
    """(text, label, bufs, groups) of the compile stage's cooperative-matrix variant of one
    dispatch for ``runtime``'s target, or None where the WGSL kernel runs."""
    finisher = vulkan_kernels.VulkanKernels(runtime.target(), precision)
    out = finisher.variants([kernel], [(text, label, bufs, groups)])[0]
    return None if out[0] == text else out


@pytest.fixture(scope="module")
def runtime():
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.runtime.vulkan.backend import get_vulkan_runtime
    try:
        return get_vulkan_runtime()
    except Exception as e:          # noqa: BLE001 - no Vulkan device: nothing to run on
        pytest.skip(f"no Vulkan device: {e}")


def test_runtime_swaps_in_variants_only_where_asked(runtime, monkeypatch):
    _, y = _linear_graph()
    (d,) = _matmuls([y])
    args = (d.kernel, d.wgsl, "mm", d.bufs, d.groups)
    monkeypatch.setattr(vulkan_kernels, "_variants", {})
    monkeypatch.setattr(runtime, "coopmat_reason", "")           # as on a device with tensor cores
    monkeypatch.delenv("MEGANEURA_COOPMAT", raising=False)
    text, label, bufs, groups = kernel_variant(runtime, *args, precision="accelerated")
    assert "GL_KHR_cooperative_matrix" in text and bufs is d.bufs and groups == tuple(d.groups)
    assert kernel_variant(runtime, *args, precision="strict") is None
    monkeypatch.setenv("MEGANEURA_COOPMAT", "off")
    assert kernel_variant(runtime, *args, precision="accelerated") is None
    monkeypatch.setenv("MEGANEURA_COOPMAT", "emulate")
    text = kernel_variant(runtime, *args, precision="accelerated")[0]
    assert "coopMat" not in text and "frag_a" in text
    monkeypatch.delenv("MEGANEURA_COOPMAT")
    monkeypatch.setattr(runtime, "coopmat_reason", "no cooperative matrices (test)")
    assert kernel_variant(runtime, *args, precision="accelerated") is None


def test_variant_of_a_plan_from_the_plan_cache(runtime, monkeypatch, tmp_path):
    """A plan loaded from the plan cache has no kernel IR: its kernels find the variant
    stored on disk when the plan was first compiled (same GLSL, same bindings)."""
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    for name in ("MEGANEURA_COOPMAT", "MEGANEURA_NO_DISK_CACHE", "MEGANEURA_NO_PLAN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(runtime, "coopmat_reason", "")
    _, y = _linear_graph(m=48, k=40, n=56)
    fresh = compile_plan([y], n_forward=1, options=ACCEL, cache=True)
    (d,) = [d for d in fresh.dispatches if d.kernel.archetype == "matmul"]
    monkeypatch.setattr(vulkan_kernels, "_variants", {})
    first = kernel_variant(runtime, d.kernel, d.wgsl, "mm", d.bufs, d.groups, precision="accelerated")
    cached = compile_plan([y], n_forward=1, options=ACCEL, cache=True)
    assert cached.stats.get("cache") == "hit"
    (c,) = [c for c in cached.dispatches if c.kernel.archetype == "matmul"]
    assert coopmat.select(c.kernel).startswith("no kernel IR")
    monkeypatch.setattr(vulkan_kernels, "_variants", {})
    again = kernel_variant(runtime, c.kernel, c.wgsl, "mm", c.bufs, c.groups, precision="accelerated")
    assert again[0] == first[0] and again[2] is c.bufs and again[3] == first[3]
    import shutil
    shutil.rmtree(tmp_path / "coopmat")          # no stored variant: the WGSL kernel runs
    monkeypatch.setattr(vulkan_kernels, "_variants", {})
    assert kernel_variant(runtime, c.kernel, c.wgsl, "mm", c.bufs, c.groups, precision="accelerated") is None


def test_plan_from_the_plan_cache_reads_its_variants_as_one_set(runtime, monkeypatch, tmp_path):
    """A plan's variants (and which of its matmuls have none, a GEMV here) are also stored as
    one set, keyed by all their WGSL texts: a plan read from the plan cache reads that one
    file, not one file per kernel (removed here, so only the set can serve them)."""
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    for name in ("MEGANEURA_NO_DISK_CACHE", "MEGANEURA_NO_PLAN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGANEURA_COOPMAT", "emulate")
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((48, 40)).astype(np.float32), "v": rng.standard_normal((2, 40)).astype(np.float32),
             "w": rng.standard_normal((56, 40)).astype(np.float32)}
    g = mg.Graph()
    w = g.input("w", (56, 40))
    outs = [mg.ops.mm(g.input("x", (48, 40)), w, tb=True), mg.ops.mm(g.input("v", (2, 40)), w, tb=True)]

    def run():
        monkeypatch.setattr(vulkan_kernels, "_variants", {})
        return run_accelerated(runtime, g, outs, feeds)

    first, swapped, cache = run()
    assert swapped == 1 and cache == "stored"
    files = list((tmp_path / "coopmat").iterdir())
    sets = [f for f in files if f.name.endswith(".set.json")]
    assert len(sets) == 1 and len(files) == 2            # the set and the one variant's own file
    for f in files:
        if f not in sets:
            f.unlink()
    again, swapped, cache = run()
    assert swapped == 1 and cache == "hit"
    for a, b in zip(first, again):
        np.testing.assert_array_equal(a, b)


def test_variant_files_are_pruned_oldest_first(runtime, monkeypatch, tmp_path):
    """Storing a plan's set prunes the variant folder to the kernel sets' budget, oldest first."""
    import os
    from meganeura.runtime.vulkan import cache
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    for name in ("MEGANEURA_NO_DISK_CACHE", "MEGANEURA_NO_PLAN_CACHE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MEGANEURA_COOPMAT", "emulate")
    monkeypatch.setattr(vulkan_kernels, "_variants", {})
    monkeypatch.setattr(cache, "SET_MAX_BYTES", 1 << 20)
    stale = tmp_path / "coopmat" / ("0" * 64 + ".set.json")
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b" " * (2 << 20))
    os.utime(stale, (1, 1))
    g, y = _linear_graph(m=48, k=40, n=56)
    with mg.compile(g, outputs=[y], backend="vulkan", precision="accelerated") as s:
        s.run({"x": np.ones((48, 40), np.float32), "w": np.ones((56, 40), np.float32)})
    left = sorted(f.name for f in stale.parent.iterdir())
    assert stale.name not in left and sum(n.endswith(".set.json") for n in left) == 1, left


def _f16(x):
    return x.astype(np.float16).astype(np.float64)


def _case(name):
    """(graph, outputs, feeds, expected outputs in float64 from f16-rounded operands, env)."""
    rng = np.random.default_rng(0)
    r = lambda *s: rng.standard_normal(s).astype(np.float32)  # noqa: E731
    g = mg.Graph()
    env = {}
    if name == "plain":               # whole fragments: stored straight from the accumulators
        A, B = r(64, 48), r(48, 80)
        outs = [mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape))]
        return g, outs, {"a": A, "b": B}, [_f16(A) @ _f16(B)], env
    if name == "tb_batch_epilogue":   # x @ W^T + bias, relu; batch; M, N not tile multiples
        X, W, C = r(3, 40, 24), r(52, 24), r(52)
        y = mg.ops.relu(mg.ops.mm(g.input("x", X.shape), g.input("w", W.shape), tb=True) + g.input("c", C.shape))
        return g, [y], {"x": X, "w": W, "c": C}, [np.maximum(_f16(X) @ _f16(W).T + C, 0)], env
    if name == "ta_broadcast":        # A transposed per batch, B shared by the batch
        A, B = r(2, 24, 40), r(24, 56)
        y = mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape), ta=True)
        return g, [y], {"a": A, "b": B}, [np.swapaxes(_f16(A), -1, -2) @ _f16(B)], env
    if name == "odd_split_k":         # K=601: element-wise loads, a short last split, the partials summed
        A, B = r(37, 601), r(601, 19)
        return g, [mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape))], {"a": A, "b": B}, [_f16(A) @ _f16(B)], env
    if name == "merged_parts":        # sibling projections in one launch, one with a transposed store
        X, W1, W2 = r(2, 24, 40), r(48, 40), r(32, 40)
        x = g.input("x", X.shape)
        y1 = mg.ops.mm(x, g.input("w1", W1.shape), tb=True).reshape((2, 24, 3, 16)).transpose(1, 2)
        y2 = mg.ops.mm(x, g.input("w2", W2.shape), tb=True)
        want1 = (_f16(X) @ _f16(W1).T).reshape(2, 24, 3, 16).transpose(0, 2, 1, 3)
        return g, [y1, y2], {"x": X, "w1": W1, "w2": W2}, [want1, _f16(X) @ _f16(W2).T], env
    if name in ("tile64", "tile128"):  # the larger tiles (4 or 8 subgroups of 32)
        A, B = r(40, 70 if name == "tile64" else 130), r(80 if name == "tile64" else 140, 40)
        env["MEGANEURA_MATMUL_TILE"] = name[4:]
        y = mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape), ta=True, tb=True)
        return g, [y], {"a": A, "b": B}, [_f16(A).T @ _f16(B).T], env
    if name == "rect_tile":           # a 32x128 workgroup tile: a grid other than the WGSL kernel's
        A, B = r(2, 70, 48), r(2, 150, 48)
        env.update(MEGANEURA_MATMUL_TILE="64", MEGANEURA_COOPMAT_CONFIG="64:32x128x1x4x32")
        y = mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape), tb=True)
        return g, [y], {"a": A, "b": B}, [_f16(A) @ np.swapaxes(_f16(B), -1, -2)], env
    if name in ("depth2", "depth3"):  # K chunks ahead in registers; 3 leaves a partial last round
        A, B = r(40, 200), r(200, 36)
        env.update(MEGANEURA_MATMUL_TILE="64", MEGANEURA_MATMUL_SPLIT="1",
                   MEGANEURA_COOPMAT_CONFIG=f"64:64x64x2x2x16x{name[-1]}")
        return g, [mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape))], {"a": A, "b": B}, [_f16(A) @ _f16(B)], env
    if name == "wide":                # the 128 x 256 tile of a large grid, four chunks ahead of a short K
        A, B = r(272, 72), r(72, 400)
        env.update(MEGANEURA_MATMUL_TILE="128", MEGANEURA_MATMUL_SPLIT="1")
        return g, [mg.ops.mm(g.input("a", A.shape), g.input("b", B.shape))], {"a": A, "b": B}, [_f16(A) @ _f16(B)], env
    if name == "conv":                # implicit GEMM: the columns computed and rounded to f16 in the loads
        X, W, C = r(2, 6, 11, 13), r(20, 6, 3, 3), r(20)
        y = mg.ops.relu(mg.ops.conv2d(g.input("x", X.shape), g.input("w", W.shape), g.input("c", C.shape),
                                      stride=2, padding=1))
        return g, [y], {"x": X, "w": W, "c": C}, [np.maximum(_conv(_f16(X), _f16(W), 2, 1) + C[:, None, None], 0)], env
    if name == "conv_groups":         # grouped and dilated: the groups are a batch dimension of the product
        X, W = r(2, 8, 9, 10), r(12, 4, 3, 2)
        y = mg.ops.conv2d(g.input("x", X.shape), g.input("w", W.shape), padding=(2, 1), dilation=(2, 1), groups=2)
        want = np.concatenate([_conv(_f16(X[:, 4 * i:4 * i + 4]), _f16(W[6 * i:6 * i + 6]), 1, (2, 1), (2, 1))
                               for i in range(2)], axis=1)
        return g, [y], {"x": X, "w": W}, [want], env
    if name == "conv1x1":             # a 1x1 convolution: rows of x read as they are; 60 positions
        X, W = r(2, 8, 6, 10), r(12, 8, 1, 1)
        y = mg.ops.conv2d(g.input("x", X.shape), g.input("w", W.shape))
        return g, [y], {"x": X, "w": W}, [_conv(_f16(X), _f16(W), 1, 0)], env
    if name.startswith("round_"):     # f32 operands rounded to f16 in the loads, far outside f16's range
        # split: 7 chunks a split (the peak read in a pre-pass), element-wise fetches; ta: vec4
        # fetches, the whole split in registers; odd: element-wise, in registers
        rounded = (True, True) if name == "round_split" else (True, False)
        A = {"round_split": r(37, 601) * np.float32(1e-9), "round_ta": r(90, 40) * np.float32(1e-12),
             "round_odd": r(37, 45) * np.float32(1e6)}[name]
        B = r(601, 19) * np.float32(1e30) if name == "round_split" else r(A.shape[0 if name == "round_ta" else 1], 56).astype(np.float16)
        if name == "round_split":
            env["MEGANEURA_MATMUL_SPLIT"] = "3"
        a, b = g.input("a", A.shape), g.input("b", B.shape, B.dtype.name[0] + str(8 * B.dtype.itemsize))
        y = mg.ops.emit("matmul", [a, b], ta=name == "round_ta", tb=False, out_dtype="f32", f16_round=rounded)
        from meganeura.ops.linalg import round_f16_precision as rnd
        ra, rb = rnd(A).astype(np.float64), (rnd(B) if B.dtype == np.float32 else B).astype(np.float64)
        return g, [y], {"a": A, "b": B}, [(ra.T if name == "round_ta" else ra) @ rb], env
    if name == "merged_rows":         # a gradient's two products in one launch: 40 and 48 rows, one row tile
        G = r(40, 48) * np.float32(1e-9)
        W, X = r(48, 24).astype(np.float16), r(40, 24).astype(np.float16)
        env["MEGANEURA_MATMUL_TILE"] = "64"
        gi = g.input("g", G.shape)
        outs = [mg.ops.emit("matmul", [gi, g.input("w", W.shape, "f16")], ta=False, tb=False, out_dtype="f32",
                            f16_round=(True, False)),
                mg.ops.emit("matmul", [gi, g.input("x", X.shape, "f16")], ta=True, tb=False, out_dtype="f32",
                            f16_round=(True, False))]
        from meganeura.ops.linalg import round_f16_precision as rnd
        rg = rnd(G).astype(np.float64)
        return g, outs, {"g": G, "w": W, "x": X}, [rg @ W.astype(np.float64), rg.T @ X.astype(np.float64)], env
    raise KeyError(name)


def _conv(x, w, stride, pad, dilation=(1, 1)):
    """float64 cross-correlation, NCHW; ``pad`` an int or (rows, columns)."""
    ph, pw = (pad, pad) if isinstance(pad, int) else pad
    dh, dw = dilation
    x = np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))
    kh, kw = (w.shape[2] - 1) * dh + 1, (w.shape[3] - 1) * dw + 1
    win = np.lib.stride_tricks.sliding_window_view(x, (kh, kw), axis=(2, 3))[:, :, ::stride, ::stride, ::dh, ::dw]
    return np.einsum("nchwij,ocij->nohw", win, w)


CASES = ["plain", "tb_batch_epilogue", "ta_broadcast", "odd_split_k", "merged_parts", "tile64", "tile128", "rect_tile",
         "depth2", "depth3", "wide", "conv", "conv_groups", "conv1x1", "round_split", "round_ta", "round_odd",
         "merged_rows"]


def _run_case(runtime, name, mode, monkeypatch):
    g, outs, feeds, want, env = _case(name)
    monkeypatch.setenv("MEGANEURA_COOPMAT", mode)
    if name == "wide":             # a grid of 6 workgroups counts as large, and 5 K chunks as long
        monkeypatch.setattr(coopmat, "WIDE_MIN_GROUPS", 6)
        monkeypatch.setattr(coopmat, "WIDE_MIN_CHUNKS", 1)
    elif name == "round_split":     # the peak's pre-pass in steps of 3 chunks, the last one partial
        monkeypatch.setattr(coopmat, "SCALE_UNROLL", 3)
    elif mode == "emulate" and runtime.limits["max-compute-workgroup-storage-size"] < 49152:
        # lavapipe has 32 KiB of workgroup memory: the 128 tile with K chunks of 16 fits
        monkeypatch.setenv("MEGANEURA_COOPMAT_CONFIG", "128:128x128x2x4x16")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    if name in ("rect_tile", "wide"):        # the grid is the variant's, not the WGSL kernel's
        (d,) = [d for d in compile_plan(outs, n_forward=1, options=ACCEL).dispatches if d.kernel.archetype == "matmul"]
        groups = coopmat.render(d.kernel, runtime.limits["max-compute-workgroup-storage-size"], emulate=True)[2]
        assert groups != tuple(d.groups)
        if name == "wide":
            assert groups[:2] == (2, 3) and tuple(d.groups[:2]) == (4, 3)
    if name == "merged_rows":        # the WGSL kernel binds g twice (vec4 and scalar); the variant keeps both places
        (d,) = [d for d in compile_plan(outs, n_forward=2, options=ACCEL).dispatches if d.kernel.archetype == "matmul"]
        assert len(d.kernel.spec["parts"]) == 2 and len(d.bufs) == len({id(b) for b in d.bufs}) + 1
        src, bufs, _ = coopmat.render(d.kernel, emulate=True, bufs=d.bufs)
        assert len(bufs) == len(d.bufs) and all(a is b for a, b in zip(bufs, d.bufs))
    got, swapped, _ = run_accelerated(runtime, g, outs, feeds)
    assert swapped > 0, "no matmul ran on the cooperative-matrix kernel"
    for g_, w_ in zip(got, want):
        assert g_.shape == w_.shape
        # operands are exact f16 values and products exact in f32: what is left is the f32
        # accumulation order
        err = np.abs(g_ - w_).max() / np.abs(w_).max()
        assert err < 1e-5, (name, err)


# depth 3 unrolls its steps six times (lcm(3, 2)), which lavapipe took 36-67 s to compile:
# emulated, the register sets' rotation past two and a partial last round are left to
# ``wide`` (depth 4); on tensor cores every case runs
EMULATED_CASES = [c for c in CASES if c != "depth3"]


@pytest.mark.parametrize("name", EMULATED_CASES)
def test_emulated_kernel_matches_numpy(runtime, name, monkeypatch):
    """The kernels with their fragment operations as plain loops, on any Vulkan device:
    staging, layouts, guards, splits, parts and the epilogue checked."""
    _run_case(runtime, name, "emulate", monkeypatch)


@pytest.mark.parametrize("name", CASES)
def test_coop_kernel_matches_numpy(runtime, name, monkeypatch):
    if runtime.coopmat_reason:
        pytest.skip(f"{runtime.name}: {runtime.coopmat_reason}")
    _run_case(runtime, name, "auto", monkeypatch)


def test_benchmark_runs_emulated(runtime, monkeypatch, tmp_path):
    """bench/coopmat.py at tiny size, its kernels emulated: the table's rows ran on the
    cooperative-matrix kernels and match float64."""
    import importlib.util
    import json
    import pathlib
    path = pathlib.Path(__file__).resolve().parents[1] / "bench" / "coopmat.py"
    spec = importlib.util.spec_from_file_location("bench_coopmat", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    monkeypatch.setenv("MEGANEURA_COOPMAT", "emulate")
    out = tmp_path / "coopmat.json"
    bench.main(["--sizes", "48", "--size", "tiny", "--workloads", "whisper", "--samples", "2", "--warmup", "1",
                "--no-sweep", "--no-fma", "--out", str(out)])
    result = json.loads(out.read_text())
    assert len(result["cases"]) > 2 and result["mode"] == "emulate"
    for row in result["cases"]:
        assert row["kernel"] == "emulated" and row["max_rel_err"] < 1e-5 and row["ours_s"] > 0, row
