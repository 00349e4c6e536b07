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
from .common import ENTRY, GROUP_INDEX, WG, Bindings, coords, grid, literal, offset_expr
from .expr import ExprWriter, read_leaves

INIT = {"sum": "0.0", "mean": "0.0"}     # sums only: a max would need the NaN-propagating combine


def _evaluator(name, expr, leaves, shape, b, extra_params="", special=None):
    """``fn name(c0.., extra) -> f32`` evaluating ``expr`` over ``leaves`` (views read at
    coordinates c of ``shape``, broadcast)."""
    params = ", ".join([f"c{d}: u32" for d in range(len(shape))] + ([extra_params] if extra_params else []))
    lines, vals = read_leaves(leaves, shape, b)

    def leaf(e):
        if e[0] == "leaf":
            return vals[e[1]]
        return special(e)
    w = ExprWriter(leaf, last_coord=f"c{len(shape) - 1}")
    val, dt = w.emit(expr)
    if dt.name != "f32":
        val = f"f32({val})"
    return w.helpers(), f"fn {name}({params}) -> f32 {{\n" + "\n".join(lines + w.lines) + f"\n    return {val};\n}}\n"


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
        helpers.update((h, None) for h in hs)
        fns.append(fn)
    lo, hi = spec["out_reads"]
    nred = len(spec["reduces"])
    hs, fn = _evaluator("out_val", spec["expr"], reads[lo:hi], shape, b,
                        ", ".join(f"red{i}: f32" for i in range(nred)), special=lambda e: (f"red{e[1]}", f32))
    helpers.update((h, None) for h in hs)
    fns.append(fn)
    call_args = ", ".join(f"c{d}" for d in range(len(shape)))
    body = [f"    let o = {GROUP_INDEX};", f"    if (o >= {n_out}u) {{ return; }}"]
    body += coords("o", kshape, prefix="k")
    # full coordinates: kept dims from the row, reduced dims from j
    cmap = "\n".join(f"        let c{d} = k{kept.index(d)};" if d in kept else f"        let c{d} = q{dims.index(d)};"
                     for d in range(len(shape)))
    split = "\n".join("    " + ln for ln in coords("j", rshape, prefix="q"))
    for i, red in enumerate(spec["reduces"]):
        acc = f"acc{i}"
        comb = f"{acc} + x"
        tcomb = "part[lid] + part[lid + t]"
        fin = f" * {literal(1.0 / max(red['count'], 1), f32)}" if red["kind"] == "mean" else ""
        body += [f"    var {acc} = {INIT[red['kind']]};",
                 f"    for (var j = lid; j < {r}u; j = j + {WG}u) {{", split, cmap,
                 f"        let x = red_in{i}({call_args});", f"        {acc} = {comb};", "    }",
                 f"    part[lid] = {acc};", "    workgroupBarrier();",
                 f"    for (var t = {WG // 2}u; t > 0u; t = t >> 1u) {{",
                 f"        if (lid < t) {{ part[lid] = {tcomb}; }}", "        workgroupBarrier();", "    }",
                 f"    let red{i} = part[0]{fin};", "    workgroupBarrier();"]
    reds = ", ".join(f"red{i}" for i in range(nred))
    body += [f"    for (var j = lid; j < {r}u; j = j + {WG}u) {{", split, cmap,
             f"        b{ob}[{offset_expr(out.offset, out.strides)}] = {out.dtype.wgsl}(out_val({call_args}, {reds}));",
             "    }"]
    src = "\n".join([b.decls()] + list(helpers) + fns) + f"\nvar<workgroup> part: array<f32, {WG}>;\n\n" + \
        ENTRY.format(wg=WG) + "\n".join(body) + "\n}\n"
    return src, b.bufs, grid(n_out)
