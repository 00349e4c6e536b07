"""The fused-rows archetype: reductions over some axes and the pointwise kernel that reads
their results back across those axes, in one workgroup per kept position (a norm's
backward: mean(dn) and mean(dn * n) over each row or channel, then the input gradient).

Every operand is evaluated at the full coordinates of the reductions' input shape (which
is the pointwise kernel's output shape): a reduction's input is a view or the expression
of a pointwise kernel fused into its loads; the consumer reads the reduced values as
workgroup-uniform scalars. Each pass over a row loops r / 256 times per thread.
"""
from __future__ import annotations

import numpy as np

from ..graph import f32
from .common import WG, Bindings, grid, wgsl_type
from .expr import ExprWriter, read_leaves
from .expr_ast import coords, offset_expr
from .kernel_ast import (GROUP, LID, Assign, Barrier, Bin, Blank, Call, ComputeKernel, Convert, For, Function, If, Index, Let,
                         Line, Lit, Name, Return, ReturnIf, Shared, Store, Var, add, buffers, printed, u32)

INIT = {"sum": "0.0", "mean": "0.0"}     # sums only: a max would need the NaN-propagating combine


def _evaluator(name, expr, leaves, shape, b, extra=(), special=None):
    """(helper functions, ``fn name(c0.., extra) -> f32`` evaluating ``expr`` over ``leaves``
    (views read at coordinates c of ``shape``, broadcast)), on the kernel AST."""
    params = tuple(Name(f"c{d}", "u32") for d in range(len(shape))) + tuple(extra)
    stmts, vals = read_leaves(leaves, shape, b, ast=True)

    def leaf(e):
        if e[0] == "leaf":
            return vals[e[1]]
        return special(e)
    w = ExprWriter(leaf, last_coord=Name(f"c{len(shape) - 1}", "u32"), ast=True)
    val, dt = w.emit(expr)
    if dt.name != "f32":
        val = Convert("f32", val)
    return w.helper_functions(), Function(name, params, tuple(stmts + w.stmts + [Return(val)]), "f32")


def render(kernel):
    spec, out = kernel.spec, kernel.out
    shape, dims = tuple(spec["shape"]), tuple(spec["dims"])
    kept = [d for d in range(len(shape)) if d not in dims]
    kshape, rshape = [shape[d] for d in kept], [shape[d] for d in dims]
    n_out, r = int(np.prod(kshape, dtype=np.int64)), int(np.prod(rshape, dtype=np.int64))
    b = Bindings()
    ob = b.index(out.buf, out.dtype, write=True)
    helpers, fns = {}, []
    reads = list(kernel.reads)
    for i, red in enumerate(spec["reduces"]):
        lo, hi = red["reads"]
        hs, fn = _evaluator(f"red_in{i}", red["expr"], reads[lo:hi], shape, b)
        helpers.update((h.name, h) for h in hs)
        fns += [fn, Blank()]
    lo, hi = spec["out_reads"]
    nred = len(spec["reduces"])
    reds = [Name(f"red{i}", "f32") for i in range(nred)]
    hs, fn = _evaluator("out_val", spec["expr"], reads[lo:hi], shape, b, reds,
                        special=lambda e: (Name(f"red{e[1]}", "f32"), f32))
    helpers.update((h.name, h) for h in hs)
    fns += [fn, Blank()]
    call_args = tuple(Name(f"c{d}", "u32") for d in range(len(shape)))
    o, j, t, lid = Name("o", "u32"), Name("j", "u32"), Name("t", "u32"), LID
    body = [Let("o", GROUP), ReturnIf(Bin(">=", o, u32(n_out)))]
    body += coords(o, kshape, prefix="k")
    # full coordinates: kept dims from the row, reduced dims from j
    cmap = Line(tuple(Let(f"c{d}", Name(f"k{kept.index(d)}" if d in kept else f"q{dims.index(d)}", "u32"))
                      for d in range(len(shape))))
    split = coords(j, rshape, prefix="q") or [Blank()]
    part = Name("part", f"array<f32, {WG}>")

    def at(i):
        return Index(part, i, "f32")
    each = (Var("j", lid), Bin("<", j, u32(r)), Assign("j", Bin("+", j, u32(WG))))
    for i, red in enumerate(spec["reduces"]):
        acc = Name(f"acc{i}", "f32")
        fin = Bin("*", at(ZERO), Lit(1.0 / max(red["count"], 1), f32)) if red["kind"] == "mean" else at(ZERO)
        body += [Var(acc.id, Lit(0.0, f32, INIT[red["kind"]])),
                 For(*each, (*split, *_lines(cmap), Let("x", Call(f"red_in{i}", call_args, "f32")),
                             Assign(acc.id, Bin("+", acc, Name("x", "f32"))))),
                 Assign(at(lid), acc), Barrier(),
                 For(Var("t", u32(WG // 2)), Bin(">", t, u32(0)), Assign("t", Bin(">>", t, u32(1))), (
                     If(Bin("<", lid, t), (Assign(at(lid), Bin("+", at(lid), at(add(lid, t)))),), inline=True),
                     Barrier())),
                 Let(f"red{i}", fin), Barrier()]
    value = Convert(wgsl_type(out.dtype), Call("out_val", call_args + tuple(reds), "f32"))
    body.append(For(*each, (*split, *_lines(cmap), Store(ob, offset_expr(out.offset, out.strides), value))))
    module = [*helpers.values(), *fns, Shared("part", "f32", WG), Blank()]
    tree = ComputeKernel(buffers(b), WG, tuple(body), module=tuple(module))
    return printed(tree), b.bufs, grid(n_out)


ZERO = Lit(0, "u32", "0")


def _lines(line):
    """``cmap``'s lets, one a line as the template wrote them (none: an empty line)."""
    return list(line.stmts) or [Blank()]
