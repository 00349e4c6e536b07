"""The typed kernel AST (``codegen/kernel_ast.py``): kernels built on it print WGSL equal to
what their template wrote and GLSL equal to what the WGSL-to-GLSL translator makes of that
WGSL (so their SPIR-V is unchanged), and the Vulkan runtime runs them printed, not translated."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import kernel_ast, layout, pointwise
from meganeura.codegen.pointwise_ast import ast_kernel, ast_multi
from meganeura.codegen.expr import Node
from meganeura.codegen.glsl import to_glsl
from meganeura.graph import f16, f32, i32, u32
from meganeura.schedule import Buf, Kernel, View

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
    wgsl, template_bufs, _ = pointwise._render_template(k)
    assert kernel_ast.print_wgsl(tree) == wgsl, k.name
    assert kernel_ast.print_glsl(tree) == to_glsl(wgsl, k.name), k.name
    assert bufs == template_bufs


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
    """A merged launch whose parts are all on the AST: one function per part, prototypes
    first in GLSL; a part the AST does not build keeps the whole launch on the template."""
    parts = [KERNELS["residual_chain"], KERNELS["fill_strided"], KERNELS["cast_f16"]]
    multi = Kernel("m", "multi", {"parts": parts}, parts[0].out, [])
    tree, bufs, groups = ast_multi(multi)
    wgsl, template_bufs, template_groups = pointwise._render_multi_template(multi)
    assert kernel_ast.print_wgsl(tree) == wgsl and bufs == template_bufs and (groups, 1, 1) == template_groups
    assert kernel_ast.print_glsl(tree) == to_glsl(wgsl, "m")
    other = _pointwise(_op("tanh", ("leaf", 0)), [X])
    assert ast_multi(Kernel("m", "multi", {"parts": parts + [other]}, parts[0].out, [])) is None


def test_other_pointwise_kernels_stay_on_the_template():
    """What ``expr.ieee_guard`` turns into a helper (+ 0.0, x - x, * inf), an op of literals
    alone (WGSL types them abstractly), helpers (tanh, relu's NaN-keeping max), select
    (log1p), comparisons, f16 arithmetic, or a leaf read in its own order (``flat_leaf``) is
    not on the AST yet."""
    lit = ("lit", 0.0, f32)
    for k in (_pointwise(_op("add", ("leaf", 0), lit), [X]), _pointwise(_op("sub", ("leaf", 0), ("leaf", 0)), [X]),
              _pointwise(_op("mul", ("leaf", 0), ("lit", float("inf"), f32)), [X]),
              _pointwise(_op("div", ("lit", 3.0, f32), ("lit", 2.0, f32)), [X]),
              _pointwise(_op("tanh", ("leaf", 0)), [X]), _pointwise(_op("relu", ("leaf", 0)), [X]),
              _pointwise(_op("log1p", ("leaf", 0)), [X]), _pointwise(_op("lt", ("leaf", 0), ("leaf", 0), dtype=u32),
                                                                     [X], u32),
              _pointwise(_op("add", ("leaf", 0), ("leaf", 0), dtype=f16), [View(SRC, (24,), (1,), 0, f16)], f16),
              _pointwise(("leaf", 0), [X], flat_leaf=True)):
        assert ast_kernel(k) is None, k.spec["expr"]


@pytest.mark.parametrize("workload,precision", [("unet", "strict"), ("unet", "accelerated")])
def test_every_ast_kernel_of_a_workload_prints_as_before(workload, precision):
    """Each kernel of a tiny workload's training step that the AST builds (standalone
    copies, fills and casts) prints the template's WGSL and its translation."""
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
    merged = [d for d in kp.dispatches if d.kernel.archetype == "multi" and ast_multi(d.kernel) is not None]
    for d in merged:
        tree = ast_multi(d.kernel)[0]
        assert kernel_ast.print_wgsl(tree) == d.wgsl == pointwise._render_multi_template(d.kernel)[0]
        assert kernel_ast.print_glsl(tree) == to_glsl(d.wgsl, d.kernel.name)
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
