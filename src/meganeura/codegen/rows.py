"""Row kernels with prologue and epilogue, one dispatch each instead of the four or more
kernels their decompositions take: softmax and log_softmax along one axis (max, sum of
exponentials, normalised write) and layer_norm / rms_norm over trailing axes (statistics,
then the normalised, scaled and shifted write)."""
from __future__ import annotations

import numpy as np

from ..graph import f32
from ..schedule import Kernel, contiguous_strides
from .expr import OutputStore
from .common import ENTRY, GROUP_INDEX, WG, Bindings, coords, grid

NEG_INF = "bitcast<f32>(0xff800000u)"


def lower_softmax(t, ins, out, materialize, temp):
    return [Kernel(t.op, "rows", {"kind": t.op, "dim": t.attrs["dim"]}, out, [ins[0]])]


def render(kernel):
    v, spec = kernel.reads[0], kernel.spec
    d = spec["dim"] % len(v.shape)
    kept = [i for i in range(len(v.shape)) if i != d]
    kshape = [v.shape[i] for i in kept]
    n_rows, r = int(np.prod(kshape, dtype=np.int64)), v.shape[d]
    ost = contiguous_strides(kernel.shape)
    b = Bindings()
    store = OutputStore(kernel, b).require("fmax_f32")   # a NaN in a row gives a NaN row
    ib = b.index(v.buf, v.dtype)
    ibase = " + ".join([f"{v.offset}u"] + [f"k{n} * {v.strides[i]}u" for n, i in enumerate(kept)])
    obase = " + ".join(["0u"] + [f"k{n} * {ost[i]}u" for n, i in enumerate(kept)])
    x = f"f32(b{ib}[ibase + j * {v.strides[d]}u])"   # f32 arithmetic whatever the storage type
    y = f"obase + j * {ost[d]}u"
    write = {"softmax": f"exp({x} - m) / total", "log_softmax": f"{x} - m - log(total)",
             # a row of -inf (fully masked) gives zeros; compared on the bits, so a NaN row stays NaN
             "safe_softmax": f"select(exp({x} - m) / total, 0.0, bitcast<u32>(m) == 0xff800000u)"}[spec["kind"]]
    rows = "\n".join(coords("row", kshape, prefix="k"))
    if r < 64:   # short rows: one thread each
        src = b.decls() + "\n" + store.module_text() + "\n\n" + ENTRY.format(wg=WG) + f"""    let row = ({GROUP_INDEX}) * {WG}u + lid;
    if (row >= {n_rows}u) {{ return; }}
{rows}
    let ibase = {ibase}; let obase = {obase};
    var m = {NEG_INF};
    for (var j = 0u; j < {r}u; j = j + 1u) {{ m = fmax_f32(m, {x}); }}
    var total = 0.0;
    for (var j = 0u; j < {r}u; j = j + 1u) {{ total = total + exp({x} - m); }}
    for (var j = 0u; j < {r}u; j = j + 1u) {{ store_out({y}, {write}); }}
}}
"""
        return src, b.bufs, grid(-(-n_rows // WG))
    tree = """    for (var s = {half}u; s > 0u; s = s >> 1u) {{
        if (lid < s) {{ part[lid] = {op}; }}
        workgroupBarrier();
    }}"""
    src = b.decls() + "\n" + store.module_text() + f"\nvar<workgroup> part: array<f32, {WG}>;\n\n" + ENTRY.format(wg=WG) + f"""    let row = {GROUP_INDEX};
    if (row >= {n_rows}u) {{ return; }}
{rows}
    let ibase = {ibase}; let obase = {obase};
    var mx = {NEG_INF};
    for (var j = lid; j < {r}u; j = j + {WG}u) {{ mx = fmax_f32(mx, {x}); }}
    part[lid] = mx;
    workgroupBarrier();
{tree.format(half=WG // 2, op="fmax_f32(part[lid], part[lid + s])")}
    let m = part[0];
    workgroupBarrier();
    var acc = 0.0;
    for (var j = lid; j < {r}u; j = j + {WG}u) {{ acc = acc + exp({x} - m); }}
    part[lid] = acc;
    workgroupBarrier();
{tree.format(half=WG // 2, op="part[lid] + part[lid + s]")}
    let total = part[0];
    for (var j = lid; j < {r}u; j = j + {WG}u) {{ store_out({y}, {write}); }}
}}
"""
    return src, b.bufs, grid(n_rows)


def lower_norm(t, ins, out, materialize, temp):
    """layer_norm / rms_norm over the trailing axes: one row per normalised slice. The input
    is read through its view (a batch norm is a layer norm over a transposed view)."""
    dense = [ins[0]] + [materialize(v, x) for v, x in zip(ins[1:], t.inputs[1:])]
    a = t.attrs
    spec = {"kind": t.op, "eps": float(a["eps"]), "row": int(np.prod(a["normalized_shape"], dtype=np.int64)),
            "weight": bool(a.get("has_weight")), "bias": bool(a.get("has_bias"))}
    return [Kernel(t.op, "norm", spec, out, dense)]


def lower_norm_stat(t, ins, out, materialize, temp):
    """A norm's statistic alone (``ops.normalization.norm_stat``): a row kernel that stores it, unless
    the fusion pass ``normstats`` moves it into the norm kernel over the same rows."""
    a = t.attrs
    spec = {"kind": "layer_norm" if a["center"] else "rms_norm", "eps": float(a["eps"]),
            "row": int(np.prod(t.inputs[0].shape[t.inputs[0].ndim - a["k"]:], dtype=np.int64)),
            "weight": False, "bias": False, "stats_only": a["stat"]}
    return [Kernel(f"norm_{a['stat']}", "norm", spec, out, [ins[0]])]


def render_norm(kernel):
    """A norm's rows (or, ``spec["stats_only"]``, one statistic per row through the
    epilogue); statistics in ``kernel.outs`` (``spec["out_stats"]``: "mean" or "rstd"
    each) are stored beside, one value per row. ``spec["prologue"]``: the input is a
    pointwise kernel's value, computed here (``fuse.fuse_norm_producer``), stored as the
    ``outs`` marked "x" and kept in workgroup memory for the normalised write."""
    spec, out = kernel.spec, kernel.out
    pro = spec.get("prologue")
    x = pro["view"] if pro else kernel.reads[0]
    r = spec["row"]
    only = spec.get("stats_only")
    n_rows = out.size if only else out.size // r
    b = Bindings()
    store = OutputStore(kernel, b)
    stat_vars = {"mean": "mean", "rstd": "inv"}
    outs = list(zip(kernel.outs, spec.get("out_stats", ())))
    extra_stats = [(b.index(v.buf, v.dtype, write=True), v, st) for v, st in outs if st != "x"]
    extra = kernel.reads[:pro["first"]] if pro else kernel.reads[1:]
    module = ""
    if pro:
        from .reduce import _prologue_load
        from .kernel_ast import Name, WgslPrinter
        items, load_node = _prologue_load(pro, kernel.reads[pro["first"]:pro["first"] + pro["n"]], b, f32)
        module = "\n".join(WgslPrinter().item(it) for it in items) + "\n"
        load_at = lambda idx: WgslPrinter().expr(load_node(Name(idx, "u32")))  # noqa: E731
        # the first pass evaluates (and stores, for other readers) each element and keeps
        # it for the second
        keep = f"    b{b.index(x.buf, x.dtype, write=True)}[i] = v;\n" if any(st == "x" for _, st in outs) else ""
        module += f"""
fn x_first(row: u32, j: u32) -> f32 {{
    let i = x_at(row, j);
    let v = {load_at("i")};
{keep}    xrow[j] = v;
    return v;
}}
"""
        xv, xv2 = "x_first(row, j)", "xrow[j]"
    else:
        xb = b.index(x.buf, x.dtype)
        xv = xv2 = f"f32(b{xb}[x_at(row, j)])"
    wb = b.index(extra[0].buf, extra[0].dtype) if spec["weight"] else None
    bb = b.index(extra[-1].buf, extra[-1].dtype) if spec["bias"] else None
    y = "(xj - mean) * inv" if spec["kind"] == "layer_norm" else "xj * inv"
    if wb is not None:
        y = f"{y} * f32(b{wb}[{extra[0].offset}u + j])"
    if bb is not None:
        y = f"{y} + f32(b{bb}[{extra[-1].offset}u + j])"
    center = spec["kind"] == "layer_norm"
    wg = WG if r >= 64 else 1
    assert wg > 1 or not pro, "a norm computing its input needs a workgroup per row"
    if wg == 1:   # short rows: one thread each
        head = f"""    let row = ({GROUP_INDEX}) * {WG}u + lid;
    if (row >= {n_rows}u) {{ return; }}
    let base = row * {r}u;
"""
        sums = lambda expr: f"var acc = 0.0;\n    for (var j = 0u; j < {r}u; j = j + 1u) {{ let xj = {xv}; acc = acc + {expr}; }}"  # noqa: E731
        loop = f"for (var j = 0u; j < {r}u; j = j + 1u)"
    else:
        head = f"""    let row = {GROUP_INDEX};
    if (row >= {n_rows}u) {{ return; }}
    let base = row * {r}u;
"""
        sums = lambda expr: (f"var acc = 0.0;\n    for (var j = lid; j < {r}u; j = j + {WG}u) {{ let xj = {xv}; acc = acc + {expr}; }}\n"  # noqa: E731
                             f"    part[lid] = acc;\n    workgroupBarrier();\n"
                             f"    for (var s = {WG // 2}u; s > 0u; s = s >> 1u) {{\n"
                             f"        if (lid < s) {{ part[lid] = part[lid] + part[lid + s]; }}\n"
                             f"        workgroupBarrier();\n    }}\n    acc = part[0];\n    workgroupBarrier();")
        loop = f"for (var j = lid; j < {r}u; j = j + {WG}u)"
    body = head
    if center and wg > 1:
        body += _welford(xv, r)
    elif center:
        body += "    var mean = 0.0;\n    {\n    " + sums("xj") + f"\n    mean = acc / {float(r)!r};\n    }}\n"
        body += "    var var_ = 0.0;\n    {\n    " + sums("(xj - mean) * (xj - mean)") + \
            f"\n    var_ = acc / {float(r)!r};\n    }}\n"
    else:
        body += "    var var_ = 0.0;\n    {\n    " + sums("xj * xj") + f"\n    var_ = acc / {float(r)!r};\n    }}\n"
    body += f"    let inv = inverseSqrt(var_ + {spec['eps']!r});\n"
    first = "lid == 0u" if wg > 1 else "true"
    stores = [f"b{bi}[{v.offset}u + row] = {v.dtype.wgsl}({stat_vars[st]});" for bi, v, st in extra_stats]
    if only:
        stores.append(f"store_out(row, {stat_vars[only]});")
    if stores:
        body += f"    if ({first}) {{ " + " ".join(stores) + " }\n"
    if not only:
        body += f"    {loop} {{\n        let xj = {xv2};\n        store_out(base + j, {y});\n    }}\n"
    body += "}\n"
    shared = "\n"
    if wg > 1:
        shared = f"\nvar<workgroup> part: array<f32, {WG}>;\n" + \
            (f"var<workgroup> part_n: array<f32, {WG}>;\nvar<workgroup> part_q: array<f32, {WG}>;\n" if center else "") + \
            (f"var<workgroup> xrow: array<f32, {r}>;\n" if pro else "")
    src = b.decls() + "\n" + store.module_text() + "\n" + _index_fn(x, r) + shared + module + "\n" + \
        ENTRY.format(wg=WG) + body
    return src, b.bufs, grid(n_rows if wg > 1 else -(-n_rows // WG))


def _welford(xv, r) -> str:
    """WGSL for a long row's mean and variance in one pass over it (``mean``, ``var_``):
    each thread keeps Welford's count, mean and sum of squared deviations over its
    elements, and the workgroup merges them pairwise (Chan et al.), so the row is read
    twice in all (statistics, then the normalised write) instead of three times, and the
    variance needs no second reduction. Stable where sum-of-squares formulas cancel."""
    return f"""    var cnt = 0.0; var mean = 0.0; var q = 0.0;
    for (var j = lid; j < {r}u; j = j + {WG}u) {{
        let xj = {xv};
        cnt = cnt + 1.0;
        let d = xj - mean;
        mean = mean + d / cnt;
        q = q + d * (xj - mean);
    }}
    part_n[lid] = cnt; part[lid] = mean; part_q[lid] = q;
    workgroupBarrier();
    for (var s = {WG // 2}u; s > 0u; s = s >> 1u) {{
        if (lid < s) {{
            let na = part_n[lid]; let nb = part_n[lid + s]; let n = na + nb;
            if (nb > 0.0) {{
                let d = part[lid + s] - part[lid];
                part[lid] = part[lid] + d * (nb / n);
                part_q[lid] = part_q[lid] + part_q[lid + s] + d * d * (na * nb / n);
                part_n[lid] = n;
            }}
        }}
        workgroupBarrier();
    }}
    mean = part[0];
    let var_ = part_q[0] / {float(r)!r};
    workgroupBarrier();
"""


def _index_fn(x, r) -> str:
    """``fn x_at(row, j)``: the element of view ``x`` at position j of normalised row
    ``row`` (rows over the leading dims, j over the trailing dims of size ``r``)."""
    if x.is_contiguous():
        return f"fn x_at(row: u32, j: u32) -> u32 {{ return {x.offset}u + row * {r}u + j; }}\n"
    k, size = 0, 1
    while size < r:
        k += 1
        size *= x.shape[-k]
    lead, trail = x.shape[:-k], x.shape[-k:]
    lines = coords("row", lead, prefix="a") + coords("j", trail, prefix="t")
    terms = [f"{x.offset}u"] + [f"a{d} * {s}u" for d, s in enumerate(x.strides[:-k]) if s] + \
        [f"t{d} * {s}u" for d, s in enumerate(x.strides[-k:]) if s]
    return "fn x_at(row: u32, j: u32) -> u32 {\n" + "\n".join(lines) + f"\n    return {' + '.join(terms)};\n}}\n"
