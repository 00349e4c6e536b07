"""The quantized archetype on the typed kernel AST (``codegen/quantized_ast.py``,
``quantized_gemv_ast.py``, ``quantized_tiled_ast.py``): every block type's GEMV, tiled
product, dequantize and embedding kernel prints its golden WGSL (recorded as the templates
wrote it) and GLSL (recorded as the translator wrote it for that WGSL, each unroll and IEEE
setting the Vulkan stage uses), fused epilogues included; the Vulkan runtime runs them printed, with the results of
the NumPy interpreter."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import kernel_ast
from meganeura.compiler import compile_plan
from meganeura.ops.quantized import QTYPES, row_bytes
from tests.printed_trees import tree_of
from tests.glsl_reference import check_glsl, check_wgsl

def _words(g, name, q, n, k):
    return g.input(name, ((n * row_bytes(q, k) + 3) // 4,), mg.u32)


def _graphs():
    """(name, outputs) of quantized products of every block type, shape and fusion."""
    for q in QTYPES:
        k = 256 if q.endswith("_K") else 96
        for m in (1, 3, 7):
            g = mg.Graph()
            yield f"{q}-rows{m}", [mg.ops.quantized_linear(g.input("x", (m, k)), _words(g, "w", q, 9, k), q, 9, k)]
        g = mg.Graph()
        yield f"{q}-dequantize", [mg.ops.dequantize(_words(g, "w", q, 5, k), q, 5, k)]
        for dt in (mg.i32, mg.u32):
            g = mg.Graph()
            yield f"{q}-embedding-{dt.name}", [mg.ops.quantized_embedding(g.input(f"ids{dt.name}", (3,), dt),
                                                                          _words(g, "w", q, 5, k), q, 5, k)]
    k = 256
    for norm in ("layer_norm", "rms_norm"):
        for m in (1, 2):
            g = mg.Graph()
            x, nw, nb = g.input("x", (m, k)), g.input("nw", (k,)), g.input("nb", (k,))
            h = mg.ops.layer_norm(x, (k,), nw, nb, 1e-5) if norm == "layer_norm" else mg.ops.rms_norm(x, (k,), nw, 1e-5)
            yield f"{norm}-{m}-siblings", [mg.ops.quantized_linear(h, _words(g, f"w{q}", q, n, k), q, n, k)
                                           for q, n in [("Q8_0", 5), ("Q4_K", 3), ("Q6_K", 600)]]
    g = mg.Graph()
    x = g.input("x", (3, 100))
    yield "x-off-a-vec4", [mg.ops.quantized_linear(x[:, 2:98], _words(g, "w", "Q8_0", 9, 96), "Q8_0", 9, 96),
                           mg.ops.quantized_linear(x[:1, 2:98], _words(g, "v", "Q4_0", 9, 96), "Q4_0", 9, 96)]
    for m in (2, 9):        # epilogues: a bias, silu, a residual; SwiGLU's gate beside up
        g = mg.Graph()
        x, b, r = g.input("x", (m, 64)), g.input("b", (7,)), g.input("r", (m, 7))
        gate = mg.ops.quantized_linear(x, _words(g, "g", "Q5_0", 7, 64), "Q5_0", 7, 64)
        up = mg.ops.quantized_linear(x, _words(g, "u", "Q4_1", 7, 64), "Q4_1", 7, 64)
        yield f"epilogue-{m}", [mg.ops.silu(mg.ops.quantized_linear(x, _words(g, "w", "Q8_0", 7, 64), "Q8_0", 7, 64, b)) + r,
                                mg.ops.silu(gate) * up]


def _check(k, text):
    """The kernel's WGSL (``text``, as the plan holds it) and the GLSL printed from its tree
    against their golden digests; False where it has no tree."""
    tree = tree_of(text)
    check_wgsl(text, k.name)
    if tree is None:
        return False
    for unroll in (False, True):
        for ieee in (True, False):
            check_glsl(kernel_ast.print_glsl(tree, unroll, ieee), text, k.name, unroll, ieee)
    return True


def test_quantized_kernels_print_their_templates_wgsl_and_the_translators_glsl():
    on_tree, kept = {}, []
    for name, outs in _graphs():
        for d in compile_plan(outs).dispatches:
            if d.kernel.archetype == "quantized":
                if _check(d.kernel, d.wgsl):
                    on_tree[(name, d.kernel.spec["mode"])] = d.kernel.name
                else:
                    kept.append(name)
    modes = {m for _, m in on_tree}
    assert modes == {"gemv", "tiled", "dequant", "embed"}, modes
    assert len(on_tree) >= 60 and not kept, (len(on_tree), kept)


def test_vulkan_runs_quantized_kernels_printed(monkeypatch):
    """A GEMV with a norm in its loads beside sibling parts, a tiled product, a dequantize and
    an embedding: all printed from their trees (none translated) on the Vulkan runtime, with
    the NumPy interpreter's results."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    from gguf import quants
    import gguf
    from meganeura.ops.quantized import weight_words
    rng = np.random.default_rng(3)
    k, feeds = 256, {}
    g = mg.Graph()
    x, x7, nw = g.input("x", (2, k)), g.input("x7", (7, k)), g.input("nw", (k,))
    h = mg.ops.rms_norm(x, (k,), nw, 1e-5)
    feeds.update(x=rng.standard_normal((2, k)).astype(np.float32), x7=rng.standard_normal((7, k)).astype(np.float32),
                 nw=rng.standard_normal(k).astype(np.float32), ids=np.array([2, 0, 4], np.int32))
    ws = {}
    for q, n in [("Q8_0", 5), ("Q4_0", 6), ("Q6_K", 3)]:
        if q.endswith("_K"):
            raw = rng.integers(0, 256, (n, row_bytes(q, k)), dtype=np.uint8)
            raw[:, 208:210] = (rng.standard_normal((n, 1)) * 0.01).astype(np.float16).view(np.uint8)
        else:
            raw = quants.quantize(rng.standard_normal((n, k)).astype(np.float32), gguf.GGMLQuantizationType[q])
        feeds[q] = weight_words(raw)
        ws[q] = (g.input(q, feeds[q].shape, mg.u32), n)
    outs = [mg.ops.quantized_linear(h, w, q, n, k) for q, (w, n) in ws.items()]
    outs += [mg.ops.quantized_linear(x7, ws["Q4_0"][0], "Q4_0", 6, k), mg.ops.dequantize(ws["Q6_K"][0], "Q6_K", 3, k),
             mg.ops.quantized_embedding(g.input("ids", (3,), mg.i32), ws["Q8_0"][0], "Q8_0", 5, k)]
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=1e-5)
    assert sorted(d.kernel.spec["mode"] for d in kp.dispatches) == ["dequant", "embed", "gemv", "tiled"], kp.names
    assert stats["kernels_printed"] == len({d.wgsl for d in kp.dispatches}), (stats, kp.names)
