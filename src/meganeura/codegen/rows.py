"""Row kernels with prologue and epilogue: softmax and log_softmax along one axis in a
single dispatch (max, sum of exponentials and the normalised write), instead of the four
kernels their decompositions take."""
from __future__ import annotations

import numpy as np

from ..schedule import Kernel, contiguous_strides
from .common import ENTRY, GROUP_INDEX, WG, Bindings, coords, grid

NEG_INF = "bitcast<f32>(0xff800000u)"


def lower_softmax(t, ins, out, materialize):
    return [Kernel(t.op, "rows", {"kind": t.op, "dim": t.attrs["dim"]}, out, [ins[0]])]


def render(kernel):
    v, out, spec = kernel.reads[0], kernel.out, kernel.spec
    d = spec["dim"] % len(v.shape)
    kept = [i for i in range(len(v.shape)) if i != d]
    kshape = [v.shape[i] for i in kept]
    n_rows, r = int(np.prod(kshape, dtype=np.int64)), v.shape[d]
    ost = contiguous_strides(out.shape)
    b = Bindings()
    ob, ib = b.index(out.buf, out.dtype), b.index(v.buf, v.dtype)
    ibase = " + ".join([f"{v.offset}u"] + [f"k{n} * {v.strides[i]}u" for n, i in enumerate(kept)])
    obase = " + ".join([f"{out.offset}u"] + [f"k{n} * {ost[i]}u" for n, i in enumerate(kept)])
    x = f"b{ib}[ibase + j * {v.strides[d]}u]"
    y = f"b{ob}[obase + j * {ost[d]}u]"
    write = f"exp({x} - m) / total" if spec["kind"] == "softmax" else f"{x} - m - log(total)"
    rows = "\n".join(coords("row", kshape, prefix="k"))
    if r < 64:   # short rows: one thread each
        src = b.decls() + "\n\n" + ENTRY.format(wg=WG) + f"""    let row = ({GROUP_INDEX}) * {WG}u + lid;
    if (row >= {n_rows}u) {{ return; }}
{rows}
    let ibase = {ibase}; let obase = {obase};
    var m = {NEG_INF};
    for (var j = 0u; j < {r}u; j = j + 1u) {{ m = max(m, {x}); }}
    var total = 0.0;
    for (var j = 0u; j < {r}u; j = j + 1u) {{ total = total + exp({x} - m); }}
    for (var j = 0u; j < {r}u; j = j + 1u) {{ {y} = {write}; }}
}}
"""
        return src, b.bufs, grid(-(-n_rows // WG))
    tree = """    for (var s = {half}u; s > 0u; s = s >> 1u) {{
        if (lid < s) {{ part[lid] = {op}; }}
        workgroupBarrier();
    }}"""
    src = b.decls() + f"\nvar<workgroup> part: array<f32, {WG}>;\n\n" + ENTRY.format(wg=WG) + f"""    let row = {GROUP_INDEX};
    if (row >= {n_rows}u) {{ return; }}
{rows}
    let ibase = {ibase}; let obase = {obase};
    var mx = {NEG_INF};
    for (var j = lid; j < {r}u; j = j + {WG}u) {{ mx = max(mx, {x}); }}
    part[lid] = mx;
    workgroupBarrier();
{tree.format(half=WG // 2, op="max(part[lid], part[lid + s])")}
    let m = part[0];
    workgroupBarrier();
    var acc = 0.0;
    for (var j = lid; j < {r}u; j = j + {WG}u) {{ acc = acc + exp({x} - m); }}
    part[lid] = acc;
    workgroupBarrier();
{tree.format(half=WG // 2, op="part[lid] + part[lid + s]")}
    let total = part[0];
    for (var j = lid; j < {r}u; j = j + {WG}u) {{ {y} = {write}; }}
}}
"""
    return src, b.bufs, grid(n_rows)
