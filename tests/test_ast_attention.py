"""The attention and gather kernels on the typed kernel AST: for every distinct kernel of many
shapes and options (``ast_attn_cases``), the WGSL printed from the tree has its golden digest
(recorded as the templates wrote it), and so has the GLSL printed from it (recorded as the
WGSL-to-GLSL translator wrote it for that WGSL) under each unroll and IEEE setting of the
Vulkan stage; the Vulkan runtime runs them printed, and they match NumPy on every backend."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import attention_ast, flash_ast, flash_grad_ast, flash_split_ast, gather_ast, kernel_ast
from meganeura.schedule import Buf
from tests.printed_trees import tree_of

from . import ast_attn_cases
from tests.glsl_reference import check_glsl, check_wgsl

_CASES = {}


def _attention():
    if "attention" not in _CASES:
        _CASES["attention"] = ast_attn_cases.attention_kernels()
    return _CASES["attention"]


def _family(pred):
    return {k: v for k, v in _attention().items() if pred(v.spec)}


FAMILIES = {
    "attention": (lambda s: not (s.get("flash") or s.get("grad") or s.get("combine")), attention_ast.tree),
    "flash": (lambda s: s.get("flash") and not s.get("grad"), flash_ast.tree),
    "flash_split": (lambda s: s.get("combine"), flash_split_ast.combine_tree),
    "flash_grad": (lambda s: s.get("grad"), flash_grad_ast.tree),
}


def _same(kernel, build):
    got = build(kernel)
    assert got is not None, kernel.name
    tree = got[0]
    wgsl = kernel_ast.print_wgsl(tree)
    check_wgsl(wgsl, kernel.name)
    for unroll, ieee in ((False, True), (True, True), (False, False)):     # (IEEE changes the header only)
        check_glsl(kernel_ast.print_glsl(tree, unroll=unroll, preserve_ieee=ieee), wgsl, kernel.name, unroll, ieee)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_ast_kernels_print_the_templates_wgsl_and_the_translators_glsl(family):
    pred, build = FAMILIES[family]
    kernels = _family(pred)
    assert len(kernels) >= 20, (family, len(kernels))
    for label, k in kernels.items():
        _same(k, build)


ERRORS = (Buf(64, "temp", "errors"), 3)       # checked mode's error buffer, its first slot


@pytest.mark.parametrize("checked", [False, True])
def test_gather_kernels_print_the_templates_wgsl_and_the_translators_glsl(checked):
    """one_hot, embedding and its gradient, im2col and col2im (with epilogues; in checked
    mode with their index reports)."""
    kernels = ast_attn_cases.gather_kernels()
    assert len({k.name.split("+")[0] for k in kernels.values()}) == 5
    for k in kernels.values():
        _same(k, lambda k: gather_ast.kernel_tree(k, ERRORS if checked else None))


def test_cases_cover_the_options():
    """The cases reach each option of the kernels: splits, the LSE output, masks, causal,
    epilogues, the piped forward, wide heads (several chunks), resident backward operands."""
    ks = _attention().values()
    fwd = [k for k in ks if k.spec.get("flash") and not k.spec.get("grad")]
    assert {k.spec.get("split", 1) for k in fwd} >= {1, 2, 3}
    assert any(k.outs for k in fwd) and any(k.epilogue is not None for k in fwd)
    assert any(k.spec.get("int_mask") for k in fwd) and any(k.spec["masked"] and not k.spec["int_mask"] for k in fwd)
    assert any(k.spec["causal"] for k in fwd) and any(k.reads[0].shape[-1] > 64 for k in fwd)
    grads = [k for k in ks if k.spec.get("grad")]
    assert {k.spec["grad"] for k in grads} == {"dq", "dkv"} and {k.spec.get("split", 1) for k in grads} >= {1, 2}
    assert any("XV" in kernel_ast.print_wgsl(flash_grad_ast.tree(k)[0]) for k in grads)       # resident operands
    assert any("kr[" in kernel_ast.print_wgsl(flash_ast.tree(k)[0]) for k in fwd)            # piped loads


@pytest.fixture
def flash_only(monkeypatch):
    from meganeura.codegen import attention as attn
    monkeypatch.setattr(attn, "MAX_ROW_WORK", 0)
    monkeypatch.setattr(attn, "ACCELERATED_MAX_ROW_WORK", 0)


def _sdpa_grads(rng, qs, ks, dv, causal):
    g = mg.Graph()
    q, k, v = g.input("q", qs), g.input("k", ks), g.input("v", ks[:-1] + (dv,))
    w = g.input("w", qs[:-1] + (dv,))
    out = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=causal)
    grads = mg.grad(mg.ops.sum(out * w), [q, k, v])
    feeds = {"q": rng.standard_normal(qs), "k": rng.standard_normal(ks), "v": rng.standard_normal(ks[:-1] + (dv,)),
             "w": rng.standard_normal(qs[:-1] + (dv,))}
    return g, [out] + grads, {n: a.astype(np.float32) for n, a in feeds.items()}


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_flash_forward_and_backward_on_the_ast_match_numpy(backend, flash_only, monkeypatch):
    """The flash forward (split over keys in two, with its combine) and backward, built on
    the AST, against the NumPy interpreter; on the direct Vulkan backend their GLSL is
    printed from the tree (none of them translated)."""
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "2")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    rng = np.random.default_rng(3)
    g, outs, feeds = _sdpa_grads(rng, (1, 2, 20, 8), (1, 2, 70, 8), 12, True)
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    if backend == "gpu":
        pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    with mg.compile(g, outputs=outs, backend=backend) as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        kp = plan.kernel_plan
        stats = getattr(plan.executable, "stats", {})
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-5)
    on_ast = {d.wgsl for d in kp.dispatches if tree_of(d.wgsl) is not None}
    flashes = {d.wgsl for d in kp.dispatches if d.kernel.archetype == "attention" and "combine" not in d.kernel.spec}
    assert flashes and flashes <= on_ast, kp.names
    if backend == "gpu":
        assert stats["kernels_printed"] >= len(flashes), (stats, kp.names)


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_one_row_attention_on_the_ast_matches_numpy(backend, monkeypatch):
    """The one-row attention kernel (a float mask, fully masked rows, an epilogue), built on
    the AST, against the NumPy interpreter. (Checked mode's gathers, on the AST:
    tests/test_index_checks.py.)"""
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    if backend == "gpu":
        pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    rng = np.random.default_rng(5)
    g = mg.Graph()
    q, k, v = g.input("q", (1, 2, 3, 8)), g.input("k", (1, 2, 9, 8)), g.input("v", (1, 2, 9, 6))
    m = g.input("m", (3, 9))
    out = mg.ops.scaled_dot_product_attention(q, k, v, m) * 2.0
    feeds = {"q": rng.standard_normal((1, 2, 3, 8)), "k": rng.standard_normal((1, 2, 9, 8)),
             "v": rng.standard_normal((1, 2, 9, 6)), "m": np.where(rng.random((3, 9)) < 0.3, -np.inf, 0.0)}
    feeds = {n: a.astype(np.float32) for n, a in feeds.items()}
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    with mg.compile(g, outputs=[out], backend=backend) as s:
        got = s.run(feeds)[0]
        kp = s.executor.plans["run"].kernel_plan
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert [tree_of(d.wgsl) is not None for d in kp.dispatches] == [True], kp.names


def test_gather_in_a_matmuls_loads_as_a_function_tree():
    """An im2col computed in an implicit-GEMM convolution's operand loads:
    ``gather_ast.function_tree`` prints its golden WGSL function (recorded as the template
    wrote it), and GLSL as the translator wrote for it."""
    from meganeura.codegen.common import Bindings
    from meganeura.compiler import CompileOptions, compile_plan
    found = 0
    for stride, pad in ((2, 3), (1, 1)):       # a stem convolution's shape (as resnet50's, tiny)
        g = mg.Graph()
        x, w = g.input("x", (4, 3, 32, 32)), g.parameter("w", (8, 3, 7, 7))
        out = mg.ops.conv2d(x, w, stride=stride, padding=pad)
        for dt in (None, "f16"):
            kp = compile_plan([out], options=CompileOptions(max_bindings=32))
            for d in kp.dispatches:
                for op, gs in d.kernel.spec.get("gathers", {}).items():
                    if "form" not in gs:
                        continue
                    gs = {**gs, "dtype": dt} if dt else gs
                    reads = d.kernel.reads[gs["first"]:gs["first"] + gs["n"]]
                    b1 = Bindings()
                    fn = gather_ast.function_tree(gs, reads, b1, "gat0_a")
                    check_wgsl(kernel_ast.WgslPrinter().function(fn) + "\n", "gat0_a")
                    assert b1.bufs == [v.buf for v in reads] and b1.scalar == set(range(len(reads)))
                    k = kernel_ast.ComputeKernel(tuple(kernel_ast.Buffer(t, False) for t in b1.types), 1, (),
                                                 module=(fn, kernel_ast.Blank()), enable_f16=b1.enable_f16)
                    check_glsl(kernel_ast.print_glsl(k), kernel_ast.print_wgsl(k), "gat0_a")
                    found += 1
    assert found >= 2
