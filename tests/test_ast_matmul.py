"""The matmul archetype on the typed kernel AST (``codegen/gemv_ast.py``, ``matmul_ast.py``):
GEMVs and tiled products of many shapes and options (operands computed in the loads and the
shared-body form included) print their golden WGSL (recorded as the templates wrote it) and
GLSL (recorded as the translator wrote it for that WGSL, each unroll and IEEE setting the
Vulkan stage uses), fused epilogues included; the Vulkan runtime runs them printed."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import kernel_ast
from meganeura.compiler import compile_plan
from tests.printed_trees import tree_of
from tests.glsl_reference import check_glsl, check_wgsl


def check_kernel(k, text):
    """``text`` (a kernel's WGSL as rendered) and the GLSL printed from its tree against their
    golden digests; False where it has no tree."""
    tree = tree_of(text)
    check_wgsl(text, k.name)
    if tree is None:
        return False
    for unroll in (False, True):
        for ieee in (True, False):
            check_glsl(kernel_ast.print_glsl(tree, unroll, ieee), text, k.name, unroll, ieee)
    return True


def _checked(outs):
    """(on the tree, kept) counts of the matmul kernels of ``outs``' plan, each checked."""
    on, kept = 0, 0
    for d in compile_plan(outs).dispatches:
        if d.kernel.archetype == "matmul":
            if check_kernel(d.kernel, d.wgsl):
                on += 1
            else:
                kept += 1
    return on, kept


GEMV_SHAPES = [((1, 40), (40, 300)), ((3, 2, 33), (33, 17)), ((4, 64), (64, 9)), ((1, 5), (5, 7)),
               ((2, 1, 3, 24), (3, 24, 129)), ((2, 64), (64, 5000)), ((1, 40000), (40000, 3))]


@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_gemvs_print_their_templates_wgsl_and_the_translators_glsl(ta, tb):
    total = 0
    for sa, sb in GEMV_SHAPES:
        g = mg.Graph()
        a = g.input("a", sa[:-2] + sa[-2:][::-1] if ta else sa)
        b = g.input("b", sb[:-2] + sb[-2:][::-1] if tb else sb)
        on, kept = _checked([mg.ops.mm(a, b, ta=ta, tb=tb)])
        assert kept == 0, (sa, sb)
        total += on
    assert total >= len(GEMV_SHAPES)


def _decoder(norm, M, pair=False, w=True):
    g = mg.Graph()
    k = 96
    x = g.input("x", (M, k))
    nw, nb = g.parameter("nw", (k,)), g.parameter("nb", (k,))
    if norm == "layer_norm":
        h = mg.ops.layer_norm(x, (k,), nw if w else None, nb, 1e-5)
    else:
        h = mg.ops.rms_norm(x, (k,), nw if w else None, 1e-6)
    outs = [mg.ops.linear(h, g.parameter(f"w{j}", (n, k))) for j, n in enumerate((24, 8, 8))]
    if pair:
        outs.append(mg.ops.silu(mg.ops.linear(h, g.parameter("g", (40, k)))) * mg.ops.linear(h, g.parameter("u", (40, k))))
    return outs


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_gemvs_with_norms_siblings_and_pairs(norm):
    """A norm of A's rows in the loads, sibling GEMVs sharing a launch, and a gate beside up
    (SwiGLU's epilogue)."""
    for M in (1, 3):
        for w in (True, False):
            on, kept = _checked(_decoder(norm, M, w=w))
            assert on >= 1 and kept == 0, (M, w)
    on, kept = _checked(_decoder(norm, 2, pair=True))
    assert on >= 1 and kept == 0


def test_the_decoding_llama_plans_gemvs():
    """Every GEMV of a tiny Llama's decode step (epilogues, transposed stores) is printed from
    the tree."""
    from meganeura.models import llama
    g, logits, new = llama.build_decoder(llama.LlamaConfig.tiny(), 1, 1, 16, cache_as_state=True)
    on, kept = _checked([logits] + new)
    assert on >= 4 and kept == 0, (on, kept)


def test_vulkan_runs_gemvs_printed(monkeypatch):
    """GEMVs of every layout, a norm in the loads and an epilogue reading another product on
    the Vulkan runtime, printed from their trees, with the NumPy interpreter's results."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    rng = np.random.default_rng(1)
    g = mg.Graph()
    a, at, b, bt = g.input("a", (2, 40)), g.input("at", (40, 3)), g.input("b", (40, 70)), g.input("bt", (70, 40))
    nw = g.input("nw", (40,))
    outs = [mg.ops.mm(a, b), mg.ops.mm(at, b, ta=True), mg.ops.mm(a, bt, tb=True),
            mg.ops.mm(mg.ops.rms_norm(a, (40,), nw, 1e-6), bt, tb=True),
            mg.ops.gelu(mg.ops.mm(a, bt, tb=True) + mg.ops.mm(a, b)[:, :1])]
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in
             [("a", (2, 40)), ("at", (40, 3)), ("b", (40, 70)), ("bt", (70, 40)), ("nw", (40,))]}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)
    printed = {d.wgsl for d in kp.dispatches if tree_of(d.wgsl) is not None}
    assert sum(1 for d in kp.dispatches if d.kernel.spec.get("gemv")) >= 3
    assert printed and stats["kernels_printed"] == len(printed), (stats, kp.names)


TILED_SHAPES = [((3, 2, 33), (33, 17)), ((6, 64), (64, 9)), ((128, 8), (8, 128)), ((130, 9), (9, 131)),
                ((64, 16), (16, 64)), ((2, 1, 70, 24), (3, 24, 129)), ((2, 130, 20), (20, 132)), ((256, 64), (64, 128)),
                ((40, 300), (300, 36))]
SWITCHES = [{"MEGANEURA_MATMUL_TILE": "32"}, {"MEGANEURA_MATMUL_TILE": "64", "MEGANEURA_MATMUL_SPLIT": "2"},
            {"MEGANEURA_MATMUL_TILE": "128"}, {"MEGANEURA_MATMUL_BLOCK": "128x64/16x8"},
            {"MEGANEURA_MATMUL_BLOCK": "128x128/8x16", "MEGANEURA_MATMUL_SPLIT": "3"}, {}]


@pytest.mark.parametrize("switches", SWITCHES, ids=lambda s: "-".join(f"{k[18:]}{v}" for k, v in s.items()) or "auto")
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
def test_tiled_products_print_their_templates_wgsl_and_the_translators_glsl(monkeypatch, switches, ta, tb):
    """Every tile and block (the peeled 128-row form too), K splits, bounds checks, broadcast
    batches and both layouts of each operand."""
    for k, v in switches.items():
        monkeypatch.setenv(k, v)
    total = 0
    for sa, sb in TILED_SHAPES:
        g = mg.Graph()
        a = g.input("a", sa[:-2] + sa[-2:][::-1] if ta else sa)
        b = g.input("b", sb[:-2] + sb[-2:][::-1] if tb else sb)
        on, kept = _checked([mg.ops.mm(a, b, ta=ta, tb=tb)])
        assert kept == 0, (sa, sb)
        total += on
    assert total >= len(TILED_SHAPES) - 1


@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("k", [64, 30])
def test_tiled_products_with_a_norm_in_the_loads_and_siblings(monkeypatch, norm, k):
    """A norm of A's rows computed by the tiled kernel (vec4 and scalar loads), sibling
    products sharing a launch, with and without the norm's weight."""
    for block in ("", "128x64/16x8"):
        monkeypatch.setenv("MEGANEURA_MATMUL_BLOCK", block)
        for w in (True, False):
            g = mg.Graph()
            x = g.input("x", (40, k))
            nw, nb = g.parameter("nw", (k,)), g.parameter("nb", (k,))
            h = mg.ops.layer_norm(x, (k,), nw if w else None, nb, 1e-5) if norm == "layer_norm" else \
                mg.ops.rms_norm(x, (k,), nw if w else None, 1e-6)
            on, kept = _checked([mg.ops.linear(h, g.parameter(f"w{j}", (n, k))) for j, n in enumerate((48, 16))])
            assert on >= 1 and kept == 0, (block, w)


@pytest.mark.parametrize("rounded", [(True, False), (False, True), (True, True)])
def test_tiled_products_rounding_operands_to_f16(rounded):
    from meganeura.codegen.matmul_tiles import accelerate
    g = mg.Graph()
    a, b = g.input("a", (70, 48)), g.input("b", (48, 66))
    on, kept = _checked([accelerate(a, b, False, False, f16_round=rounded)])
    assert on == 1 and kept == 0


def test_the_whisper_training_plans_products():
    """Every matmul of the tiny Whisper encoder's training step, the im2col gathers in the
    loads of its convolutions included, is printed from its tree."""
    from meganeura.bench import compile_time
    from meganeura.bench.workloads import make
    _, s, _ = compile_time._session(make("whisper", size="tiny", device="cpu"), "train", "numpy")
    targets, n_forward, updates = compile_time._plan_args(s.program, "grads")
    on, kept = 0, 0
    for d in compile_plan(targets, n_forward=n_forward, updates=updates).dispatches:
        if d.kernel.archetype == "matmul":
            if check_kernel(d.kernel, d.wgsl):
                on += 1
            else:
                kept += 1
    assert on >= 5 and kept == 0, (on, kept)


@pytest.mark.parametrize("block", ["", "128x64/16x8"])
def test_vulkan_runs_tiled_products_printed(monkeypatch, block):
    """Tiled products with bounds checks, A or B transposed, a norm in the loads (the peeled
    128-row form too), epilogues and a transposed store on the Vulkan runtime, printed from
    their trees, with the NumPy interpreter's results."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    monkeypatch.setenv("MEGANEURA_MATMUL_BLOCK", block)
    rng = np.random.default_rng(2)
    shapes = {"a": (130, 36), "b": (36, 70), "at": (36, 20), "bt": (70, 36), "nw": (36,)}
    g = mg.Graph()
    t = {n: g.input(n, s) for n, s in shapes.items()}
    outs = [mg.ops.mm(t["a"], t["b"]), mg.ops.mm(t["at"], t["b"], ta=True), mg.ops.mm(t["a"], t["bt"], tb=True),
            mg.ops.mm(mg.ops.rms_norm(t["a"], (36,), t["nw"], 1e-6), t["bt"], tb=True),
            mg.ops.tanh(mg.ops.mm(t["a"], t["bt"], tb=True) * 0.5 + t["nw"][:1]),
            mg.ops.transpose(mg.ops.mm(t["at"], t["b"], ta=True), 0, 1)]
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-4)
    tiled = [d for d in kp.dispatches if d.kernel.archetype == "matmul"]
    assert len(tiled) >= 2 and all(tree_of(d.wgsl) is not None for d in tiled), kp.names
    assert stats["kernels_printed"] >= len({d.wgsl for d in tiled}), (stats, kp.names)


def test_alike_siblings_share_one_body_over_arrays_of_buffers():
    """Where the runtime binds arrays of buffers, alike sibling products (key and value
    projections of one context; with epilogues and a norm in the loads) share one body that
    reads its weights through an array indexed by the part: printed from the tree too."""
    from meganeura.compiler import CompileOptions
    opts = CompileOptions(binding_arrays=True, max_bindings=64)
    for norm in (False, True):
        g = mg.Graph()
        x, nw = g.input("x", (40, 64)), g.parameter("nw", (64,))
        h = mg.ops.rms_norm(x, (64,), nw, 1e-6) if norm else x
        outs = [mg.ops.linear(h, g.parameter(f"w{j}", (32, 64))) for j in range(3)]
        outs += [mg.ops.silu(mg.ops.linear(h, g.parameter("v", (48, 64)), g.parameter("vb", (48,))))]
        shared = 0
        for d in compile_plan(outs, options=opts).dispatches:
            if d.kernel.archetype == "matmul":
                assert tree_of(d.wgsl) is not None
                check_wgsl(d.wgsl, d.kernel.name)
                tree = tree_of(d.wgsl)
                for unroll in (False, True):
                    check_glsl(kernel_ast.print_glsl(tree, unroll), d.wgsl, d.kernel.name, unroll)
                shared += "binding_array" in d.wgsl and "fn locate" in d.wgsl
        assert shared == 1, norm


def test_vulkan_runs_a_shared_body_printed(monkeypatch):
    """Three alike products over one input on the Vulkan runtime (which binds arrays of
    buffers): one launch, one shared body, printed from its tree, with NumPy's results."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    g = mg.Graph()
    x = g.input("x", (40, 64))
    outs = [mg.ops.linear(x, g.input(f"w{j}", (32, 64))) + 1.0 for j in range(3)]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((40, 64)).astype(np.float32),
             **{f"w{j}": rng.standard_normal((32, 64)).astype(np.float32) for j in range(3)}}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-4)
    (d,) = kp.dispatches
    assert "binding_array" in d.wgsl and tree_of(d.wgsl) is not None and stats["kernels_printed"] == 1


def _pointwise_operands(g):
    x, y, w = g.input("x", (40, 64)), g.input("y", (40, 64)), g.input("w", (48, 64))
    return [mg.ops.linear(mg.ops.silu(x) * y, w), mg.ops.mm(mg.ops.gelu(x), mg.ops.exp(y), ta=True),
            mg.ops.mm(x, mg.ops.tanh(w) + 1.0, tb=True)]


def test_products_computing_a_pointwise_operand_in_their_loads():
    """An operand that a pointwise expression computes in the loads (SwiGLU's product before
    the down projection; helpers such as erf and tanh once in the module), either operand."""
    g = mg.Graph()
    computed = 0
    for d in compile_plan(_pointwise_operands(g)).dispatches:
        if d.kernel.archetype == "matmul":
            assert check_kernel(d.kernel, d.wgsl), d.kernel.name
            computed += sum(len(p.spec.get("gathers", {})) for p in d.kernel.spec.get("parts", [d.kernel]))
    assert computed >= 2


def test_vulkan_runs_pointwise_operands_printed(monkeypatch):
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    g = mg.Graph()
    outs = _pointwise_operands(g)
    rng = np.random.default_rng(4)
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in [("x", (40, 64)), ("y", (40, 64)), ("w", (48, 64))]}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-4)
    mm = [d for d in kp.dispatches if d.kernel.archetype == "matmul"]
    assert mm and all(tree_of(d.wgsl) is not None for d in mm), kp.names
    assert stats["kernels_printed"] == len({d.wgsl for d in kp.dispatches}), (stats, kp.names)
