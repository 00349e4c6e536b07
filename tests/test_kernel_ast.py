"""The typed kernel AST (``codegen/kernel_ast.py``): kernels built on it print GLSL equal to
what the WGSL-to-GLSL translator makes of their WGSL (so their SPIR-V is unchanged), and the
Vulkan runtime runs them printed, not translated; its nodes one by one. (That their WGSL is
what the templates printed before: ``test_kernel_ast_families.py`` and the plan digests.)"""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import kernel_ast, layout, pointwise
from meganeura.codegen.pointwise_ast import ast_kernel, ast_multi
from meganeura.codegen.expr import Node
from meganeura.graph import f16, f32, i32, u32
from meganeura.schedule import Buf, Kernel, View
from tests.printed_trees import tree_of
from tests.glsl_reference import check_glsl

SRC, DST = Buf(4 * 24, "input", "x"), Buf(4 * 48, "temp", "y")


def _cast(to, src_dtype=f32):
    return Kernel("cast", "pointwise", {"expr": ("op", Node("cast", to), [("leaf", 0)]), "dtype": to},
                  View(DST, (24,), (1,), 0, to), [View(SRC, (24,), (1,), 0, src_dtype)])


KERNELS = {
    "fill_i32": layout.fill(View(DST, (24,), (1,), 0, i32), -3, "fill"),
    "fill_u32": layout.fill(View(DST, (24,), (1,), 0, u32), 7, "fill"),
    "fill_-inf": layout.fill(View(DST, (24,), (1,), 0, f32), float("-inf"), "fill"),
    "fill_nan": layout.fill(View(DST, (24,), (1,), 0, f32), float("nan"), "fill"),
    "fill_f16": layout.fill(View(DST, (24,), (1,), 0, f16), 1.5, "fill"),
    "fill_strided": layout.fill(View(DST, (4, 6), (12, 1), 3, f32), 0, "fill"),
    "fill_one": layout.fill(View(DST, (1,), (1,), 5, f32), 2.0, "fill"),
    "copy_transposed": layout.copy_into(View(SRC, (4, 6), (1, 4), 0, f32), View(DST, (4, 6), (12, 2), 1, f32), "copy"),
    "copy_broadcast": layout.copy_into(View(SRC, (2, 3, 4), (0, 4, 1), 0, f32),
                                       View(DST, (2, 3, 4), (12, 4, 1), 0, f32), "copy"),
    "copy_same_buffer": layout.copy_into(View(DST, (24,), (1,), 0, f32), View(DST, (24,), (1,), 24, f32), "copy"),
    "cast_f16": _cast(f16),
    "cast_i32": _cast(i32),
    "cast_f32_from_f16": _cast(f32, f16),
}


def _same_as_template(k):
    tree, bufs = ast_kernel(k)
    wgsl, render_bufs, _ = pointwise.render(k)
    assert kernel_ast.print_wgsl(tree) == wgsl and tree_of(wgsl) is not None, k.name
    check_glsl(kernel_ast.print_glsl(tree), wgsl, k.name)
    assert bufs == render_bufs


def _pointwise(expr, reads, dtype=f32, **spec):
    return Kernel("k", "pointwise", {"expr": expr, "dtype": dtype, **spec}, View(DST, (24,), (1,), 0, dtype), reads)


X, Y = View(SRC, (24,), (1,), 0, f32), View(DST, (4, 6), (6, 1), 24, f32)


def _op(name, *kids, dtype=f32):
    return ("op", Node(name, dtype), list(kids))


KERNELS.update({
    "add_twice": _pointwise(_op("add", ("leaf", 0), ("leaf", 0)), [X]),
    "residual_chain": _pointwise(_op("mul", _op("add", ("leaf", 0), ("leaf", 1)), _op("neg", ("leaf", 1))), [X, Y]),
    "div_sub": _pointwise(_op("div", _op("sub", ("leaf", 0), ("leaf", 1)), ("leaf", 0)), [X, Y]),
    "cast_then_add": _pointwise(_op("add", _op("cast", ("leaf", 0)), ("leaf", 1)), [View(SRC, (24,), (1,), 0, f16), Y]),
    "stop_gradient": _pointwise(_op("stop_gradient", ("leaf", 0)), [X]),
    "half_plus_one": _pointwise(_op("add", _op("mul", ("leaf", 0), ("lit", 0.5, f32)), ("lit", 1.0, f32)), [X]),
    "minus_negative": _pointwise(_op("sub", ("lit", -0.25, f32), ("leaf", 0)), [X]),
    "builtins": _pointwise(_op("mul", _op("exp", _op("abs", ("leaf", 0))), _op("rsqrt", _op("round", ("leaf", 1)))),
                           [X, Y]),
    "sign_sin_floor": _pointwise(_op("sign", _op("sin", _op("floor", ("leaf", 0)))), [X]),
    "silu_sigmoid_reciprocal": _pointwise(_op("mul", _op("silu", ("leaf", 0)), _op("reciprocal", _op("sigmoid",
                                                                                                   ("leaf", 1)))), [X, Y]),
    "ema_adam": _pointwise(_op("adam_step", ("leaf", 0), _op("ema", ("leaf", 0), ("leaf", 1), ("lit", 0.9, f32),
                                                             ("lit", 0.1, f32)), ("leaf", 1), ("lit", 1e-3, f32),
                               ("lit", 2.0, f32), ("lit", 1e-8, f32)), [X, Y]),
    "second_stores": _pointwise(_op("add", ("leaf", 0), ("leaf", 1)), [X, Y],
                                stores=[View(DST, (24,), (1,), 24, f32), View(SRC, (24,), (1,), 0, f16)]),
})
_outs = _pointwise(_op("mul", ("leaf", 0), ("leaf", 1)), [X, Y], out_exprs=[_op("add", ("leaf", 0), ("leaf", 1)),
                                                                            ("leaf", 1)])
_outs.outs = [View(DST, (24,), (1,), 24, f32), View(SRC, (24,), (1,), 0, f16)]
KERNELS["further_outputs"] = _outs


@pytest.mark.parametrize("name", sorted(KERNELS))
def test_ast_kernels_print_the_template_wgsl_and_its_translation(name):
    _same_as_template(KERNELS[name])


def test_merged_launch_of_ast_kernels_prints_the_template():
    """A merged launch: one function per part, prototypes first in GLSL, a part's helper
    functions (tanh's) once in the module."""
    other = _pointwise(_op("tanh", ("leaf", 0)), [X])
    parts = [KERNELS["residual_chain"], KERNELS["fill_strided"], KERNELS["cast_f16"], other, other]
    multi = Kernel("m", "multi", {"parts": parts}, parts[0].out, [])
    tree, bufs, groups = ast_multi(multi)
    wgsl, render_bufs, render_groups = pointwise.render_multi(multi)
    assert kernel_ast.print_wgsl(tree) == wgsl and bufs == render_bufs and (groups, 1, 1) == render_groups
    check_glsl(kernel_ast.print_glsl(tree), wgsl, "m")
    assert wgsl.count("fn tanh_f(") == 1


def test_every_pointwise_kernel_is_on_the_ast():
    """What ``expr.ieee_guard`` turns into a helper (+ 0.0, x - x, * inf), an op of literals
    alone (WGSL types them abstractly: GLSL converts the folded value), helpers (tanh,
    relu's NaN-keeping max), select (log1p), comparisons, f16 arithmetic, a leaf read in its
    own order (``flat_leaf``): each prints the translator's GLSL."""
    lit = ("lit", 0.0, f32)
    for k in (_pointwise(_op("add", ("leaf", 0), lit), [X]), _pointwise(_op("sub", ("leaf", 0), ("leaf", 0)), [X]),
              _pointwise(_op("mul", ("leaf", 0), ("lit", float("inf"), f32)), [X]),
              _pointwise(_op("div", ("lit", 3.0, f32), ("lit", 2.0, f32)), [X]),
              _pointwise(_op("tanh", ("leaf", 0)), [X]), _pointwise(_op("relu", ("leaf", 0)), [X]),
              _pointwise(_op("log1p", ("leaf", 0)), [X]), _pointwise(_op("lt", ("leaf", 0), ("leaf", 0), dtype=u32),
                                                                     [X], u32),
              _pointwise(_op("add", ("leaf", 0), ("leaf", 0), dtype=f16), [View(SRC, (24,), (1,), 0, f16)], f16),
              _pointwise(("leaf", 0), [X], flat_leaf=True),
              _pointwise(_op("add", _op("mul", ("lit", 2.0, f32), ("lit", 3.0, f32)), ("leaf", 0)), [X]),
              _pointwise(_op("maximum", ("leaf", 0), ("lit", -1.5, f32)), [X])):
        _same_as_template(k)


@pytest.mark.parametrize("workload,precision", [("unet", "strict"), ("unet", "accelerated")])
def test_every_ast_kernel_of_a_workload_prints_as_before(workload, precision):
    """Each pointwise kernel and merged launch of a tiny workload's training step prints the
    WGSL its plan holds and that WGSL's translation."""
    from meganeura.bench.workloads import make
    from meganeura.compiler import CompileOptions, compile_plan, f16_weights
    from tests.test_compile import phase_targets
    targets, n_forward, updates = phase_targets(make(workload, "tiny", device="cpu"), "train_step")
    opts = CompileOptions(max_bindings=1 << 16, precision=precision)
    if precision == "accelerated":
        opts.f16_weights = f16_weights(targets[:n_forward])
    kp = compile_plan(targets, n_forward=n_forward, options=opts, updates=updates)
    found = [d.kernel for d in kp.dispatches if ast_kernel(d.kernel) is not None]
    for k in found:
        _same_as_template(k)
    merged = [d for d in kp.dispatches if d.kernel.archetype == "multi"]
    for d in merged:
        tree = ast_multi(d.kernel)[0]
        assert kernel_ast.print_wgsl(tree) == d.wgsl
        check_glsl(kernel_ast.print_glsl(tree), d.wgsl, d.kernel.name)
    assert found and merged, "no kernel of the plan is on the kernel AST"


def test_vulkan_runs_ast_kernels_printed(monkeypatch):
    """Unfused, a concat's copies, casts and f32 expressions run as AST kernels: the
    Vulkan runtime prints their GLSL from the AST (none translated) and the results match
    NumPy's."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_FUSE", "all")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    g = mg.Graph()
    x, y = g.input("x", (3, 5)), g.input("y", (2, 5))
    outs = [mg.ops.concat([x, y], 0), mg.ops.cast(x, "f16"), mg.ops.cast(y, "i32"), -(x * x - x),
            mg.ops.exp(mg.ops.abs(x)) * 0.5 + 1.0]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((3, 5)).astype(np.float32),
             "y": (rng.standard_normal((2, 5)) * 4).astype(np.float32)}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-5, atol=0)
    on_ast = {d.wgsl for d in kp.dispatches if ast_kernel(d.kernel) is not None}
    assert len(on_ast) == 6 and stats["kernels_printed"] == len(on_ast), (stats, kp.names)


def test_vulkan_runs_a_merged_launch_printed(monkeypatch):
    """Independent pointwise kernels merged into one launch (horizontal fusion) run with
    the launch's GLSL printed from the AST; the results match NumPy's."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    g = mg.Graph()
    x, y = g.input("x", (4, 8)), g.input("y", (3, 5))
    outs = [x * 2.0 + 1.0, -(y * y), mg.ops.cast(x, "f16")]
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((4, 8)).astype(np.float32), "y": rng.standard_normal((3, 5)).astype(np.float32)}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"]
        stats, kp = plan.executable.stats, plan.kernel_plan
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-6, atol=0)
    merged = [d for d in kp.dispatches if d.kernel.archetype == "multi"]
    assert merged and all(ast_multi(d.kernel) is not None for d in merged), kp.names
    assert stats["kernels_printed"] == len({d.wgsl for d in kp.dispatches}), (stats, kp.names)


# ------------------------------------------------------------------ the node set, node by node
K = kernel_ast
I, J, ACC, S = K.Name("i", "u32"), K.Name("j", "u32"), K.Name("acc", "f32"), K.Name("s", "u32")
PART = K.Name("part", "array<f32, 256>")


def _node_kernels():
    """Small kernels that use every node of the set (and their spellings' corner cases)."""
    U, F = K.u32, K.f32
    x = K.Load(0, I, "f32")
    head = (K.Let("i", K.add(K.Bin("*", K.Group(K.add(K.Field(K.WID, "x"), K.Bin("*", K.Field(K.WID, "y"),
                                                                            K.Field(K.NWG, "x")))), U(256)), K.LID)),
            K.ReturnIf(K.Bin(">=", I, U(24))))
    v4 = K.Name("v", "vec4<f32>")
    yield "expressions", K.ComputeKernel((K.Buffer("f32", False), K.Buffer("f32", True), K.Buffer("u32", True)), 256, head + (
        K.Let("a", K.Select(F(0.0, "0.0"), K.Neg(x), K.Bin("<", x, F(0.0, "0.0")))),
        K.Let("m", K.Bin("%", x, F(3.0, "3.0"))),
        K.Let("n", K.Bin("%", K.Convert("i32", I), K.Lit(-5, "i32"))),
        K.Let("bits", K.Bitcast("u32", x)),
        K.Let("back", K.Bitcast("f32", K.Bin("^", K.Name("bits", "u32"), K.Lit(0x80000000, "u32", "0x80000000u")))),
        K.Let("sh", K.Bin("|", K.Bin("<<", I, U(2, "2u")), K.Bin("&", K.Bin(">>", I, U(1, "1u")), U(3)))),
        K.Let("ok", K.Bin("&&", K.Not(K.Bin("==", I, U(3))), K.Bin("||", K.Bin("!=", I, U(5)), K.Lit(False, "bool")))),
        K.Let("v", K.Construct("vec4<f32>", (x, F(1.0, "1.0"), K.Neg(F(2.0, "2")), K.Convert("f32", K.Lit(3, "f32", "3"))))),
        K.Let("d", K.Call("dot", (v4, v4), "f32")),
        K.Let("w", K.Call("fma", (v4, K.Construct("vec4<f32>", (K.Name("d", "f32"),)), v4), "vec4<f32>")),
        K.Let("c", K.Select(v4, K.Name("w", "vec4<f32>"), K.Bin("<", v4, K.Name("w", "vec4<f32>")))),
        K.Let("q", K.Call("saturate", (K.Field(K.Name("c", "vec4<f32>"), "x", "f32"),), "f32")),
        K.Let("r", K.Call("max", (K.Call("round", (K.Name("q", "f32"),), "f32"), F(-0.5, "-0.5")), "f32")),
        K.Let("e", K.Bin("*", K.Neg(K.Group(K.Bin("+", K.Name("r", "f32"), F(float("inf"))))), F(float("nan")))),
        K.Let("input", K.Select(U(0), U(1), K.Name("ok", "bool"))),
        K.Store(1, I, K.add(K.Name("a", "f32"), K.Name("m", "f32"), K.Convert("f32", K.Name("n", "i32")),
                            K.Name("back", "f32"), K.Name("e", "f32"), K.Index(v4, U(2, "2"), "f32"))),
        K.Store(2, I, K.add(K.Name("sh", "u32"), K.Name("input", "u32"), K.Bitcast("u32", K.Lit(-1, "i32"))))))
    store = K.Function("store_out", (K.Name("o", "u32"), K.Name("v", "f32")),
                       (K.Store(1, K.Name("o", "u32"), K.Name("v", "f32")),))
    half = K.Function("half", (K.Name("x", "f32"),), (K.Return(K.Bin("*", K.Name("x", "f32"), F(0.5, "0.5"))),), "f32")
    red = K.Function("red", (K.Name("g", "u32"), K.Name("lid", "u32")), (
        K.Let("o", K.Name("g", "u32")), K.Blank(),
        K.Line((K.Var("acc", F(0.0, "0.0")), K.Var("cnt", ty="u32"), K.Var("tmp", ty="array<f32, 4>"))),
        K.For(K.Var("j", K.LID), K.Bin("<", J, U(1000)), K.Assign("j", K.Bin("+", J, U(256))), (
            K.Assign("acc", K.Bin("+", ACC, K.Call("half", (K.Load(0, K.add(K.Bin("*", K.Name("o", "u32"), U(1000)), J),
                                                                      "f32"),), "f32"))),
            K.AssignOp("cnt", "+", U(1, "1")),
            K.If(K.Bin(">", ACC, F(1e30, "1e30")), (K.Break(),)),
            K.If(K.Bin("==", K.Bin("%", J, U(2)), U(0, "0")), (K.Continue(),), inline=True))),
        K.AssignIndex("tmp", U(1, "1"), ACC),
        K.AssignOp("acc", "%", K.Index(K.Name("tmp", "array<f32, 4>"), U(1, "1"), "f32")),
        K.AssignIndex(PART, K.LID, ACC), K.Barrier("workgroup"),
        K.For(K.Var("s", U(128)), K.Bin(">", S, U(0)), K.Assign("s", K.Bin(">>", S, U(1))), (
            K.If(K.Bin("<", K.LID, S), (K.AssignIndex(PART, K.LID, K.Bin("+", K.Index(PART, K.LID, "f32"),
                                                                        K.Index(PART, K.add(K.LID, S), "f32"))),),
                 inline=True),
            K.Barrier("workgroup"))),
        K.For(K.Var("k", U(0)), K.Bin("<", K.Name("k", "u32"), U(4)), K.AssignOp("k", "+", U(1, "1")),
              (K.AssignOp("acc", "+", F(1.0, "1.0")),), inline=True),
        K.Block((K.Let("z", K.Index(PART, U(0, "0"), "f32")),)),
        K.If(K.Bin("==", K.LID, U(0)), (K.Let("acc2", K.Index(PART, U(0, "0"), "f32")),
                                        K.ExprStmt(K.Call("store_out", (K.Name("o", "u32"), K.Name("acc2", "f32")), "")),),
             inline=True),
        K.If(K.Bin("==", K.LID, U(1)), (K.Barrier("storage"),),
             K.If(K.Bin("==", K.LID, U(2)), (K.Return(),), (K.AssignOp("cnt", "*", U(2)),)))))
    yield "module", K.ComputeKernel((K.Buffer("f32", False), K.Buffer("f32", True)), 256,
                                    (K.ExprStmt(K.Call("red", (K.add(K.Field(K.WID, "x"), K.Bin("*", K.Field(K.WID, "y"),
                                                                                              K.Field(K.NWG, "x"))),
                                                               K.LID), "")),),
                                    module=(K.Blank(), store, half, K.Shared("part", "f32", 256), K.Private("seed", "u32"),
                                            K.Blank(), red, K.Blank()))
    yield "f16_and_arrays", K.ComputeKernel(
        (K.Buffer("f16", False), K.Buffer("f32", True, 2)), (16, 4),
        (K.Let("h", K.Call("max", (K.Load(0, K.LID, "f16"), K.Lit(0.0, "f16", "0.0")), "f16")),
         K.Let("g", K.Bin("*", K.Name("h", "f16"), K.Lit(1.5, "f16"))),
         K.Let("arr", K.Construct("array<f32, 2>", (F(1.0, "1"), K.Convert("f32", K.Name("g", "f16"))))),
         K.Store(1, K.LID, K.Index(K.Name("arr", "array<f32, 2>"), K.Bin("%", K.LID, U(2)), "f32"), member=U(1, "1")),
         K.Store(1, K.LID, K.Load(1, K.LID, "f32", member=U(0, "0")), member=K.Bin("&", K.LID, U(1)))),
        builtins=(("local_invocation_index", K.LID),))


NODE_KERNELS = dict(_node_kernels())


@pytest.mark.parametrize("name", sorted(NODE_KERNELS))
@pytest.mark.parametrize("unroll,ieee", [(False, True), (True, True), (True, False)])
def test_every_node_prints_glsl_as_the_translator_writes_it(name, unroll, ieee):
    """The GLSL of each node (and of the module items and entry forms) is what
    ``glsl.to_glsl`` writes for its WGSL, under each unroll and IEEE switch."""
    tree = NODE_KERNELS[name]
    wgsl = kernel_ast.print_wgsl(tree)
    check_glsl(kernel_ast.print_glsl(tree, unroll=unroll, preserve_ieee=ieee), wgsl, name, unroll, ieee)


def test_node_kernels_compile_in_both_languages():
    """The GLSL compiles to SPIR-V (glslang), the WGSL passes wgpu's shader compiler (naga;
    an f16 kernel only where the adapter has f16)."""
    from meganeura.compilation.glslang import compile_glsl
    for name, tree in NODE_KERNELS.items():
        compile_glsl(kernel_ast.print_glsl(tree), name=name, disk_cache=False)
    wgpu = pytest.importorskip("wgpu")
    device = wgpu.utils.get_default_device()
    for name, tree in NODE_KERNELS.items():
        if not tree.uses_f16() or "shader-f16" in device.features:
            device.create_shader_module(label=name, code=kernel_ast.print_wgsl(tree))


def test_wgsl_layout_of_blocks_and_lines():
    """Inline blocks stay on one line, ``Line`` joins statements, ``Blank`` is an empty line,
    operators print by precedence with the parentheses a ``Group`` writes."""
    text = kernel_ast.print_wgsl(NODE_KERNELS["module"])
    assert "\n    var acc = 0.0; var cnt: u32; var tmp: array<f32, 4>;\n" in text
    assert "        if (j % 2u == 0) { continue; }\n" in text
    assert "    for (var k = 0u; k < 4u; k += 1) { acc += 1.0; }\n" in text
    assert "    } else if (lid == 2u) {\n        return;\n    } else {\n" in text
    assert "\n\nfn red(" in text and "    let o = g;\n\n" in text
    e = kernel_ast.WgslPrinter().expr
    a, b, c = (K.Name(n, "u32") for n in "abc")
    assert e(K.Bin("-", a, K.Bin("-", b, c))) == "a - (b - c)" and e(K.Bin("-", K.Bin("-", a, b), c)) == "a - b - c"
    assert e(K.Bin("*", K.Bin("+", a, b), c)) == "(a + b) * c" and e(K.Bin("+", K.Group(K.Bin("*", a, b)), c)) == "(a * b) + c"
    assert e(K.Neg(K.Bin("+", a, b))) == "-(a + b)" and e(K.Bin("&&", K.Bin("<", a, b), K.Not(K.Bin("==", b, c)))) == \
        "a < b && !(b == c)"


class Twice:
    """A node of another module: ``2 * e`` (an expression printing itself)."""
    def __init__(self, e):
        self.e, self.ty = e, e.ty

    def wgsl(self, p):
        return f"2.0 * {p.expr(self.e, 10)}"

    def glsl(self, p):
        return f"(2.0 * {p.expr(self.e)})"


class Twice2:
    """A statement of another module: two lines of its own, a block of the printer's."""
    def __init__(self, body):
        self.body = body

    def wgsl(self, p):
        return ["if (lid < 1u) {", *p.block(self.body, 1), "}"]

    def glsl(self, p):
        return ["if ((lid < 1u)) {", *p.block(self.body, 1), "}"]


def test_foreign_nodes_print_themselves():
    tree = K.ComputeKernel((K.Buffer("f32", True),), 64, (
        K.Let("x", Twice(K.Load(0, K.LID, "f32"))), Twice2((K.Store(0, K.LID, K.Name("x", "f32")),))))
    wgsl = kernel_ast.print_wgsl(tree)
    assert "    let x = 2.0 * b0[lid];\n    if (lid < 1u) {\n        b0[lid] = x;\n    }\n" in wgsl
    check_glsl(kernel_ast.print_glsl(tree), wgsl, "foreign")


def test_printed_trees_go_to_the_collections_open_around_them():
    tree = NODE_KERNELS["expressions"]
    with kernel_ast.collected_trees() as outer:
        with kernel_ast.collected_trees() as inner:
            text = kernel_ast.printed(tree)
        assert inner == {text: tree} and outer == {text: tree}
        alone = kernel_ast.printed(NODE_KERNELS["expressions"])
    assert alone == text and tree_of(text) is tree        # the test's own collection too
    with kernel_ast.collected_trees() as after:
        pass
    assert after == {}


class Table:
    """A module item of another module: a workgroup array of two rows (WGSL text, GLSL
    declaration lines)."""
    def wgsl(self, p):
        return "var<workgroup> tab: array<f32, 8>;"

    def glsl(self, p):
        return ["shared float tab[8];"]


def test_foreign_module_items_and_expression_writer_trees():
    """A module item of another module prints itself; ``ExprWriter(ast=True)`` gives nodes
    (helper functions included) whose GLSL is the translation of their WGSL."""
    from meganeura.codegen.expr import ExprWriter
    leaf = (K.Name("x", "f32"), f32)
    w = ExprWriter(lambda e: leaf, ast=True)
    gelu = ("op", Node("gelu", f32, {"approximate": "none"}), [("leaf", 0)])
    val, dt = w.emit(_op("mul", gelu, _op("maximum", ("leaf", 0), ("lit", 0.5, f32))))
    assert dt is f32 and isinstance(val, K.Name) and all(isinstance(s, K.Let) for s in w.stmts)
    fn = K.Function("f", (K.Name("x", "f32"),), (*w.stmts, K.Return(val)), "f32")
    tree = K.ComputeKernel((K.Buffer("f32", True),), 64, (
        K.AssignIndex(K.Name("tab", "array<f32, 8>"), K.Bin("%", K.LID, K.u32(8)), K.Call("f", (K.Load(0, K.LID, "f32"),), "f32")),
        K.Barrier(), K.Store(0, K.LID, K.Index(K.Name("tab", "array<f32, 8>"), K.u32(0, "0"), "f32"))),
        module=(*w.helper_functions(), Table(), fn, K.Blank()))
    wgsl = kernel_ast.print_wgsl(tree)
    assert "var<workgroup> tab: array<f32, 8>;\nfn f(x: f32) -> f32 {" in wgsl and "fn gelu_erf(" in wgsl
    check_glsl(kernel_ast.print_glsl(tree), wgsl, "foreign_item")


def test_vector_buffers_workgroup_sizes_and_builtins():
    """Buffers of vectors (f16 ones enable f16 as ``Bindings.decls`` does), a 2-D workgroup,
    local_invocation_id, vector workgroup arrays and swizzles print as the translator reads them."""
    lid3 = K.Name("lid3", "vec3<u32>")
    v = K.Name("v", "vec4<f32>")
    tree = K.ComputeKernel((K.Buffer("vec4<f16>", False), K.Buffer("vec4<f32>", True)), (8, 4), (
        K.Let("i", K.add(K.Field(lid3, "x"), K.Bin("*", K.Field(lid3, "y"), K.u32(8)))),
        K.Let("v", K.Convert("vec4<f32>", K.Load(0, I, "vec4<f16>"))),
        K.AssignIndex(K.Name("tile", "array<vec4<f32>, 32>"), I, K.Bin("*", v, K.f32(2.0, "2.0"))),
        K.Barrier(),
        K.Store(1, I, K.Construct("vec4<f32>", (K.Field(v, "xy", "vec2<f32>"), K.Field(v, "w", "f32"), K.f32(0.0, "0.0"))))),
        module=(K.Shared("tile", "vec4<f32>", 32), K.Blank()), builtins=(("local_invocation_id", lid3),))
    wgsl = kernel_ast.print_wgsl(tree)
    assert wgsl.startswith("enable f16;\n") and "@compute @workgroup_size(8, 4)\n" in wgsl
    check_glsl(kernel_ast.print_glsl(tree), wgsl, "vectors")


def test_a_kernel_no_tree_builds_is_an_error_naming_it():
    """The tree is a kernel's only WGSL: a builder's None raises, naming the kernel."""
    from types import SimpleNamespace
    k = SimpleNamespace(name="gemv+silu", archetype="matmul")
    with pytest.raises(NotImplementedError, match=r"'gemv\+silu' \(matmul\): no kernel AST builds its output store"):
        kernel_ast.printed_made(k, None, "its output store")
