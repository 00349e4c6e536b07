"""The row-reduction archetype: sum / mean / max of a strided view over any set of axes.

Short rows: one thread per output, or LANES threads per output when there are too few
outputs to occupy the GPU. Long rows: one workgroup per output, threads stride over the
row and combine through workgroup memory.
"""
from __future__ import annotations

import numpy as np

from ..graph import f32
from ..schedule import Kernel, View
from .common import ENTRY, GROUP_INDEX, WG, Bindings, coords, grid, literal
from .expr import ExprWriter, OutputStore, read_leaves

INIT = {"sum": "0.0", "mean": "0.0", "max": "bitcast<f32>(0xff800000u)"}
COMBINE = {"sum": "{a} + {b}", "mean": "{a} + {b}", "max": "max({a}, {b})"}


CHUNK = 4096     # elements one workgroup reduces in the first stage of a long reduction
# Rows of 8 to 63 elements with fewer than MANY_OUTPUTS outputs: LANES threads per output
# instead of one (a thread per output would leave most of the GPU idle). ResNet-50's
# global average pool at batch 1 (2048 outputs of 49, the last split-K sum in its loads):
# 8 workgroups, H200 60 us a launch.
LANES = 32
MANY_OUTPUTS = 4096


def lower_reduce(t, ins, out, materialize, temp):
    kind = {"reduce_sum": "sum", "reduce_mean": "mean", "reduce_max": "max"}[t.op]
    dims = tuple(t.attrs["dims"])
    v = ins[0]
    r = int(np.prod([v.shape[d] for d in dims], dtype=np.int64))
    n_out = int(np.prod([n for d, n in enumerate(v.shape) if d not in dims], dtype=np.int64))
    if r == 0 and n_out:
        # over an empty axis: the value of no elements (torch's: 0, NaN for the mean, and
        # max is refused when the graph is built), a constant that fusion folds into the
        # consumers, where the expression writer keeps IEEE results (0 / 0 is NaN) that a
        # driver folding a loop of no trips would lose
        value = {"sum": 0.0, "mean": float("nan"), "max": float("-inf")}[kind]
        if not out.dtype.is_float:
            value = 0
        return [Kernel(t.op, "pointwise", {"expr": ("lit", value, out.dtype), "dtype": out.dtype}, out, [])]
    if r == 1 and v.size:
        # over size-1 dims only (an unbroadcast of a batch of one): a copy, which fusion
        # folds into the producer's store
        kept = [d for d in range(len(v.shape)) if d not in dims]
        st = v.strides if len(t.shape) == len(v.shape) else tuple(v.strides[d] for d in kept)
        return [Kernel(t.op, "pointwise", {"expr": ("leaf", 0), "dtype": out.dtype}, out,
                       [View(v.buf, t.shape, tuple(st), v.offset, v.dtype)])]
    if r >= 2 * CHUNK and (n_out < 512 or r > 4 * CHUNK):
        # long rows: few workgroups would each loop far too long (slow, and past the
        # 65535-iteration loop bound of software drivers); chunks of the rows reduce in
        # parallel into partials, then a second pass reduces the partials
        chunks = -(-r // CHUNK)
        part = temp((n_out, chunks), out.dtype)
        first = Kernel(f"{t.op}.partial", "reduce", {"kind": "max" if kind == "max" else "sum", "dims": dims,
                                                     "chunks": chunks}, part, [v])
        return [first, Kernel(t.op, "reduce", {"kind": kind, "dims": (1,), "count": r}, out, [part])]
    return [Kernel(t.op, "reduce", {"kind": kind, "dims": dims}, out, [v])]


def _prologue_load(pro, leaves, b, dt, name="load_in"):
    """``fn load_in(i)``: the reduction's input element at buffer index ``i`` of the fused
    pointwise kernel's output, evaluated from that kernel's operands instead of memory."""
    pout = pro["out"]
    reads, vals = read_leaves(leaves, pout.shape, b, "p")
    lines = [f"    let f = i - {pout.offset}u;"] + coords("f", pout.shape, "p") + reads
    w = ExprWriter(lambda e: vals[e[1]])
    val, vdt = w.emit(pro["expr"])
    if vdt is not dt:
        val = f"{dt.wgsl}({val})"
    fn = f"fn {name}(i: u32) -> {dt.wgsl} {{\n" + "\n".join(lines + w.lines) + f"\n    return {val};\n}}\n"
    return "\n".join(w.helpers(b) + [fn]), (lambda idx: f"{name}({idx})")


def mergeable(kernel) -> bool:
    """A reduction that can share a launch with pointwise kernels (``part``): float data
    (accumulated in f32, the scratch's type)."""
    v = kernel.spec["prologue"]["view"] if "prologue" in kernel.spec else kernel.reads[0]
    return v.dtype.is_float


def _sizes(kernel):
    """(outputs, elements per output) of a reduction."""
    v = kernel.spec["prologue"]["view"] if "prologue" in kernel.spec else kernel.reads[0]
    dims = kernel.spec["dims"]
    r = int(np.prod([v.shape[d] for d in dims], dtype=np.int64))
    # the kept axes' product, not size // r: over an empty axis every output still gets
    # the reduction's value of no elements (0 for sum, NaN for mean)
    return int(np.prod([n for d, n in enumerate(v.shape) if d not in dims], dtype=np.int64)), r


def _form(n_out, r) -> str:
    """How a reduction of ``n_out`` rows of ``r`` elements runs: "lanes" (LANES threads per
    row), "threads" (one thread per row) or "workgroup" (one workgroup per row)."""
    if 8 <= r < 64 and n_out < MANY_OUTPUTS:
        return "lanes"
    return "threads" if r < 64 or n_out >= MANY_OUTPUTS else "workgroup"


def groups(kernel) -> int:
    """Workgroups of a reduction (without rendering it): a chunk each in a chunked first
    stage, a thread per output for short rows or many outputs, else a workgroup per output."""
    n_out, r = _sizes(kernel)
    if kernel.spec.get("chunks"):
        return n_out * kernel.spec["chunks"]
    form = _form(n_out, r)
    return -(-n_out // (WG // LANES)) if form == "lanes" else -(-n_out // WG) if form == "threads" else n_out


def render(kernel):
    b = Bindings()
    module, fn, groups = part(kernel, b, "")
    v = kernel.spec["prologue"]["view"] if "prologue" in kernel.spec else kernel.reads[0]
    scratch = SCRATCH if v.dtype.is_float else SCRATCH.replace("f32", v.dtype.wgsl)
    src = b.decls() + "\n" + module + scratch + "\n" + fn + "\n" + ENTRY.format(wg=WG) + \
        f"    red({GROUP_INDEX}, lid);\n}}\n"
    return src, b.bufs, grid(groups)


SCRATCH = f"var<workgroup> part: array<f32, {WG}>;\n"     # float data accumulates in f32


def part(kernel, b, suffix):
    """(module-level WGSL, ``fn red{suffix}(g: u32, lid: u32)`` reducing for workgroup
    ``g`` of this kernel's range, its workgroup count). Module names carry ``suffix`` so
    that several reductions can share one launch (``pointwise.render_multi``); they all
    use the module's workgroup scratch ``SCRATCH``."""
    spec = kernel.spec
    pro = spec.get("prologue")
    v = pro["view"] if pro else kernel.reads[0]
    dims, kind = spec["dims"], spec["kind"]
    kept = [d for d in range(len(v.shape)) if d not in dims]
    kshape, rshape = [v.shape[d] for d in kept], [v.shape[d] for d in dims]
    n_out, r = int(np.prod(kshape, dtype=np.int64)), int(np.prod(rshape, dtype=np.int64))
    dt = f32 if v.dtype.is_float else v.dtype      # f16 data accumulates in f32
    if not dt.is_float:
        INIT_T = {"sum": literal(0, dt), "mean": literal(0, dt), "max": literal(-2**31 if dt.name == "i32" else 0, dt)}
    else:
        INIT_T = INIT
    store = OutputStore(kernel, b, dt, name=f"store_out{suffix}")
    st = f"store_out{suffix}"
    if pro:
        load_fn, load_at = _prologue_load(pro, kernel.reads, b, dt, name=f"load_in{suffix}")
    else:
        ib = b.index(v.buf, v.dtype)
        load_fn = ""
        load_at = (lambda idx: f"b{ib}[{idx}]") if v.dtype is dt else (lambda idx: f"{dt.wgsl}(b{ib}[{idx}])")  # noqa: E731
    base = " + ".join([str(v.offset) + "u"] + [f"k{i} * {v.strides[d]}u" for i, d in enumerate(kept)])
    step = " + ".join(["0u"] + [f"r{i} * {v.strides[d]}u" for i, d in enumerate(dims)])
    comb = COMBINE[kind]
    if kind == "max" and dt.is_float:      # a NaN anywhere in the row gives NaN, as torch
        comb = f"fmax_{dt.name}({{a}}, {{b}})"
        store.require(f"fmax_{dt.name}")
    count = spec.get("count", r)
    # the mean of no elements is NaN (0 / 0), as torch's
    fin = "acc" if kind != "mean" else f"acc * {literal(1.0 / count, dt)}" if count else literal(float("nan"), dt)
    rows = coords("o", kshape, prefix="k")
    inner = coords("j", rshape, prefix="r")
    load = load_at(f"base + {step}")
    body_read = "\n".join("    " + ln for ln in inner) + f"\n        acc = {comb.format(a='acc', b=load)};"
    module = store.module_text() + "\n" + load_fn
    head = f"fn red{suffix}(g: u32, lid: u32) {{\n"
    if spec.get("chunks"):
        return module, head + _chunked_body(kernel, load_at, v, kept, kshape, dims, rshape, r,
                                                      INIT_T[kind], comb, st), groups(kernel)
    form = _form(n_out, r)
    if form == "lanes":
        per = WG // LANES
        fn = head + f"    let o = g * {per}u + lid / {LANES}u; let lane = lid % {LANES}u;\n" + \
            f"    var acc = {INIT_T[kind]};\n    if (o < {n_out}u) {{\n" + \
            "\n".join("    " + ln for ln in rows) + f"\n        let base = {base};\n" + \
            f"        for (var j = lane; j < {r}u; j = j + {LANES}u) {{\n" + \
            "\n".join("    " + ln for ln in body_read.split("\n")) + "\n        }\n    }\n" + \
            "    part[lid] = acc;\n    workgroupBarrier();\n" + \
            f"    for (var s = {LANES // 2}u; s > 0u; s = s >> 1u) {{\n" + \
            f"        if (lane < s) {{ part[lid] = {comb.format(a='part[lid]', b='part[lid + s]')}; }}\n" + \
            "        workgroupBarrier();\n    }\n" + \
            f"    if (lane == 0u && o < {n_out}u) {{ let acc2 = part[lid]; {st}(o, {fin.replace('acc', 'acc2')}); }}\n}}\n"
        return module, fn, groups(kernel)
    if form == "threads":
        fn = head + f"    let o = g * {WG}u + lid;\n    if (o >= {n_out}u) {{ return; }}\n" + \
            "\n".join(rows) + f"\n    let base = {base};\n    var acc = {INIT_T[kind]};\n" + \
            f"    for (var j = 0u; j < {r}u; j = j + 1u) {{\n{body_read}\n    }}\n" + \
            f"    {st}(o, {fin});\n}}\n"
        return module, fn, groups(kernel)
    fn = head + f"    let o = g;\n    if (o >= {n_out}u) {{ return; }}\n" + \
        "\n".join(rows) + f"\n    let base = {base};\n    var acc = {INIT_T[kind]};\n" + \
        f"    for (var j = lid; j < {r}u; j = j + {WG}u) {{\n{body_read}\n    }}\n" + \
        "    part[lid] = acc;\n    workgroupBarrier();\n" + \
        f"    for (var s = {WG // 2}u; s > 0u; s = s >> 1u) {{\n" + \
        f"        if (lid < s) {{ part[lid] = {comb.format(a='part[lid]', b='part[lid + s]')}; }}\n" + \
        "        workgroupBarrier();\n    }\n" + \
        f"    if (lid == 0u) {{ let acc2 = part[0]; {st}(o, {fin.replace('acc', 'acc2')}); }}\n}}\n"
    return module, fn, groups(kernel)


def _chunked_body(kernel, load_at, v, kept, kshape, dims, rshape, r, init, comb, st):
    """First stage of a long reduction: workgroup g reduces chunk g % S of output g / S."""
    S = kernel.spec["chunks"]
    C = -(-r // S)
    n_out = int(np.prod(kshape, dtype=np.int64))
    base = " + ".join([str(v.offset) + "u"] + [f"k{i} * {v.strides[d]}u" for i, d in enumerate(kept)])
    step = " + ".join(["0u"] + [f"r{i} * {v.strides[d]}u" for i, d in enumerate(dims)])
    inner = "\n".join("    " + ln for ln in coords("j", rshape, prefix="r"))
    return f"""    if (g >= {n_out * S}u) {{ return; }}
    let o = g / {S}u; let s = g % {S}u;
{chr(10).join(coords("o", kshape, prefix="k"))}
    let base = {base};
    var acc = {init};
    let jend = min(s * {C}u + {C}u, {r}u);
    for (var j = s * {C}u + lid; j < jend; j = j + {WG}u) {{
{inner}
        acc = {comb.format(a="acc", b=load_at(f"base + {step}"))};
    }}
    part[lid] = acc;
    workgroupBarrier();
    for (var t = {WG // 2}u; t > 0u; t = t >> 1u) {{
        if (lid < t) {{ part[lid] = {comb.format(a="part[lid]", b="part[lid + t]")}; }}
        workgroupBarrier();
    }}
    if (lid == 0u) {{ {st}(g, part[0]); }}
}}
"""
