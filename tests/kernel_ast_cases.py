"""Small graphs whose plans hold the pointwise, merged, reduction, row, norm and fused-rows
kernels in many shapes and options (``tests/test_kernel_ast_families.py``): each case builds
its graph and returns its outputs (and a loss, for a training step's kernels too)."""
import numpy as np

import meganeura as mg
from meganeura.graph import f32


def _x(g, name, shape):
    return g.input(name, shape)


def _pointwise(g):
    x, y = _x(g, "x", (3, 5)), _x(g, "y", (5,))
    z = _x(g, "z", (2, 3, 4))
    o = mg.ops
    outs = [o.tanh(x), o.relu(x - y), o.gelu(x), o.gelu(x, approximate="tanh"), o.erf(x), o.log1p(o.abs(x)),
            o.expm1(x), o.where(o.lt(x, y), x, y * 2.0), o.cast(o.eq(x, y), "f32"), o.maximum(x, y), o.minimum(x, 0.5),
            o.pow(x, 2.0), o.pow(x, -3.0), o.pow(o.abs(x), 0.5), o.pow(o.abs(x), 1.7), o.maximum(o.cast(x, "i32"), o.cast(y, "i32")) + o.cast(x, "i32"),
            x * 0.0, x - x, x + 0.0, x * float("inf"), x / 0.0, o.sigmoid(x) * o.silu(y), o.rotate_half(z),
            z.transpose(0, 2) * 3.0, o.sign(z) + o.floor(z) - o.ceil(z)]
    return {"outputs": outs}


def _pointwise_f16(g):
    x = _x(g, "x", (4, 6))
    h = mg.ops.cast(x, "f16")
    return {"outputs": [mg.ops.tanh(h) * h, mg.ops.relu(h) + mg.ops.cast(mg.ops.gt(h, 0.25), "f16"), mg.ops.exp(h),
                        mg.ops.cast(h * 2.0 + 1.0, "f32")]}


def _reductions(g):
    s = _x(g, "s", (5, 12))          # rows of 12: lanes
    t = _x(g, "t", (3, 4, 300))      # rows of 300: a workgroup each
    u = _x(g, "u", (2, 9000))        # chunked
    v = _x(g, "v", (5000, 3))        # many short rows: a thread each
    o = mg.ops
    outs = [o.sum(s, 1), o.mean(s, 1), o.amax(s, 1), o.sum(t, -1), o.mean(t, (0, 2)), o.amax(t, 1), o.sum(u, 1),
            o.amax(u, 1), o.mean(u, 1), o.sum(v, 1), o.amax(v, 0), o.sum(s * s + 1.0, 1) * 2.0, o.sum(o.exp(t), 2),
            o.sum(o.cast(s, "i32"), 1), o.sum(o.cast(t, "f16"), 2), o.sum(s, (0, 1))]
    return {"outputs": outs}


def _merged(g):
    a, b, c = _x(g, "a", (4, 8)), _x(g, "b", (3, 70)), _x(g, "c", (6, 20))
    o = mg.ops
    return {"outputs": [a * 2.0 + 1.0, o.sum(b, 1), o.amax(c, 1), o.tanh(c), o.mean(a, 0), -(b * b)]}


def _rows(g):
    a, b, c = _x(g, "a", (5, 7)), _x(g, "b", (3, 300)), _x(g, "c", (2, 70, 90))
    o = mg.ops
    return {"outputs": [o.softmax(a, -1), o.log_softmax(b, -1), o.safe_softmax(a, 0), o.softmax(c.transpose(-1, -2), 1),
                        o.softmax(b, -1) * 2.0, o.log_softmax(o.cast(a, "f16"), -1)]}


def _norms(g):
    a, b, c = _x(g, "a", (4, 6)), _x(g, "b", (3, 300)), _x(g, "c", (2, 8, 40))
    w, bias = _x(g, "w", (300,)), _x(g, "bias", (300,))
    o = mg.ops
    return {"outputs": [o.layer_norm(a, (6,)), o.rms_norm(b, (300,), w, 1e-6), o.layer_norm(c, (8, 40)),
                        o.layer_norm(b + 1.0, (300,), w, bias), o.rms_norm(a * a, (6,), None, 1e-6),
                        o.layer_norm(c.transpose(1, 2), (8,))]}


def _norm_training(g):
    x = _x(g, "x", (6, 96))
    w = g.parameter("w", (96,), init=np.linspace(0.5, 1.5, 96, dtype=np.float32))
    o = mg.ops
    h = o.layer_norm(x * 1.5, (96,), w, None)
    h2 = o.rms_norm(o.gelu(h), (96,), None, 1e-6)
    return {"outputs": [h2], "loss": o.mean(h2 * h2)}


def _rowfuse(g):
    x, y = _x(g, "x", (6, 300)), _x(g, "y", (4, 3, 50))
    o = mg.ops
    z = x - o.mean(x, 1, keepdim=True)
    c = y * o.sum(y * 2.0, (0, 2), keepdim=True) + o.mean(o.exp(y), (0, 2), keepdim=True)
    return {"outputs": [z * o.sum(x * x, 1, keepdim=True), c]}


CASES = {"pointwise": _pointwise, "pointwise_f16": _pointwise_f16, "reductions": _reductions, "merged": _merged,
         "rows": _rows, "norms": _norms, "norm_training": _norm_training,
         "rowfuse": _rowfuse}


def plans(case, options=None, unfused=False):
    """The kernel plans of ``case``: its inference plan and, for a case with a loss, its
    gradient plan, under each of ``options`` (CompileOptions; default: plain, and with arrays
    of buffers)."""
    from meganeura.compiler import FUSION_PASSES, CompileOptions, compile_plan
    g = mg.Graph()
    spec = CASES[case](g) if isinstance(case, str) else case(g)
    if "loss" in spec:
        s = mg.compile(g, loss=spec["loss"], optimizer=mg.optim.SGD(lr=0.1), backend="numpy")
        phases = ["grads"]
    else:
        s = mg.compile(g, outputs=spec["outputs"], backend="numpy")
        phases = ["run"]
    options = options or [CompileOptions(max_bindings=1 << 16),
                          CompileOptions(max_bindings=1 << 16, binding_arrays=True),
                          CompileOptions(max_bindings=1 << 16, disabled=frozenset({"horizontal"})),
                          CompileOptions(max_bindings=1 << 16, disabled=frozenset(FUSION_PASSES))]
    out = []
    for phase in phases:
        fetches, grad_names, upd, targets = s.program.targets(phase)
        base = len(fetches) + len(grad_names)
        updates = {base + j: n for j, (n, _) in enumerate(upd)}
        for opts in options:
            out.append(compile_plan(targets, n_forward=len(fetches), options=opts, updates=updates))
    return out


def feeds_for(g_inputs, seed=0):
    rng = np.random.default_rng(seed)
    return {t.name: (rng.standard_normal(t.shape) * 2).astype(np.float32) for t in g_inputs}


__all__ = ["CASES", "plans", "feeds_for", "f32"]
