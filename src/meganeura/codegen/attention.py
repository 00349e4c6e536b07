"""The attention archetype: scaled dot-product attention for short query rows against
short key sequences (decoding, a 128-token prefill, cross-attention to a few tokens) in
one kernel, instead of a scores matmul, a softmax and a probabilities matmul.

One workgroup per query row (batch, head, position): its scores live in workgroup memory,
softmax statistics combine through a tree, and the output columns are summed over key
slices. Grouped heads read kv head h // G; a float mask is added to the scaled scores, an
integer mask keeps non-zero positions, is_causal keeps j <= i; a fully masked row gives
zeros, as the op's decomposition does. Longer sequences run the flash kernel
(``flash.py``: query tiles, key tiles through workgroup memory, online softmax); shapes
neither takes decompose into matmuls and a softmax. Both are this one archetype
(``spec["flash"]`` picks the renderer), so epilogue fusion treats them alike; so is the
flash backward (``spec["grad"]``: ``flash_grad.py``), which the gradient takes where the
forward runs the flash kernel, and the combine of a flash forward split over keys
(``spec["combine"]``: ``flash_split.py``).
"""
from __future__ import annotations

import contextvars

import numpy as np

from ..schedule import Kernel, View, contiguous_strides
from .common import ENTRY, GROUP_INDEX, WG, Bindings, broadcast_view_strides, coords, grid, literal
from .expr import OutputStore
from .pointwise import sum_kernel
from . import flash, flash_grad, flash_split

MAX_KEYS = 2048          # scores of one row in workgroup memory (8 KiB)
MAX_ROW_WORK = 1 << 17   # Lq * Lk per head: beyond it the matmul path is faster
# in accelerated precision the flash kernels run on tensor cores (``flash_coop``,
# ``flash_grad_coop``) and take shorter rows: SmolLM2's 128 x 128 heads on an H200, inference
# 2.13 -> 1.75 ms and train step 7.72 -> 7.63 (in strict f32 its step went 10.14 -> 10.87)
ACCELERATED_MAX_ROW_WORK = 1 << 13
# whether the compile under way is in accelerated precision (the compiler sets it)
ACCELERATED = contextvars.ContextVar("attention_accelerated", default=False)
MAX_DIM = 256

NEG_INF = "bitcast<f32>(0xff800000u)"


def short_rows(t) -> bool:
    """Shapes the one-row kernel takes: short rows against at most MAX_KEYS keys."""
    q, k, v = t.inputs[:3]
    return _short(q, k, v, t.shape[:-2])


def _short(q, k, v, lead) -> bool:
    if q.ndim < 3 or q.dtype.name != "f32" or k.dtype is not q.dtype or v.dtype is not q.dtype:
        return False
    lq, lk = q.shape[-2], k.shape[-2]
    # the output's heads are q's (a q head broadcast against several kv heads is not)
    work = ACCELERATED_MAX_ROW_WORK if ACCELERATED.get() else MAX_ROW_WORK
    return (0 < lk <= MAX_KEYS and lq * lk <= work and 0 < q.shape[-1] <= MAX_DIM
            and 0 < v.shape[-1] <= MAX_DIM and q.shape[:-3] == k.shape[:-3] == v.shape[:-3]
            and k.shape[-3] == v.shape[-3] and q.shape[-3] % k.shape[-3] == 0
            and tuple(lead) == tuple(q.shape[:-2]))


def flash_path(q, k, v, lead) -> bool:
    """Attention of these operands runs the flash kernel (and its backward may too)."""
    return not _short(q, k, v, lead) and flash.shapes_ok(q, k, v, lead) \
        and flash.rows_per_group(q.shape[-1]) is not None \
        and flash.loop_trips(k.shape[-2], q.shape[-1], v.shape[-1]) <= flash.LOOP_BOUND


def lse_supported(t) -> bool:
    """``attention_lse`` is kept where the flash forward computes it (as a second output)."""
    q, k, v = t.inputs[:3]
    return flash_path(q, k, v, t.shape[:-1])


def grad_supported(t) -> bool:
    """``attention_grad`` runs the flash backward where the forward runs the flash kernel;
    elsewhere it decomposes (short rows: the probabilities are small)."""
    q, k, v, do = t.inputs[:4]
    return flash_path(q, k, v, do.shape[:-2]) and flash_grad.supported(t)


def supported(t) -> bool:
    """Shapes a kernel takes: the one-row kernel for short rows (decoding, a 128-token
    prefill: measured faster than the flash kernel there on an H200), the flash kernel for
    longer sequences; others decompose into matmuls and a softmax."""
    return short_rows(t) or flash.supported(t)


def _mask_spec(t, mask_at):
    m = t.inputs[mask_at] if len(t.inputs) > mask_at else None
    return {"scale": t.attrs["scale"], "causal": t.attrs["is_causal"], "masked": m is not None,
            "int_mask": m is not None and not m.dtype.is_float}


def lower_attention(t, ins, out, materialize, temp, siblings=()):
    """The SDPA node, or its LSE node (``attention_lse``), with the other as a sibling: one
    flash kernel writes the output and, as its second output, the LSE. Split over keys,
    the flash kernel writes partial outputs and LSEs, and a combine kernel writes both."""
    reads = list(ins)        # q, k and v are read through their views (head splits cost nothing)
    spec = _mask_spec(t, 3)
    views = {t.op: out, **{s.op: v for s, v in siblings}}
    q, k, v = t.inputs[:3]
    if "attention_lse" not in views and short_rows(t):
        return [Kernel("attention", "attention", spec, out, reads)]
    lse = views.get("attention_lse")
    o = views.get("scaled_dot_product_attention") or \
        temp(lse.shape + (v.shape[-1],), q.dtype)             # only the LSE is needed
    spec["flash"] = flash.rows_per_group(q.shape[-1])         # query rows per workgroup (portable)
    # the split is fixed here (its buffers' sizes depend on it), by the workgroups the
    # kernel will run on this adapter (the tile sizing later gives it the adapter's rows)
    bq = flash.rows_per_group(q.shape[-1], flash.ADAPTER_SMEM.get() or None) or spec["flash"]
    nt = -(-k.shape[-2] // flash.BK)
    s = flash_split.splits(int(np.prod(q.shape[:-2])) * -(-q.shape[-2] // bq), nt)
    if s == 1:
        name = "flash_attention+lse" if lse is not None else "flash_attention"
        return [Kernel(name, "attention", spec, o, reads, outs=[lse] if lse is not None else [])]
    rows = o.shape[:-1]
    o_s, lse_s = temp((s,) + o.shape, q.dtype), temp((s,) + rows, q.dtype)
    return [Kernel("flash_attention_split", "attention", {**spec, "split": s}, o_s, reads, outs=[lse_s]),
            Kernel("flash_attention_combine" + ("+lse" if lse is not None else ""), "attention",
                   {"combine": s}, o, [o_s, lse_s], outs=[lse] if lse is not None else [])]


def lower_attention_grad(t, ins, out, materialize, temp, siblings=()):
    """``attention_grad`` nodes: dq alone, or dk and dv (siblings) in one kernel of two
    outputs; a gradient nobody reads goes to a scratch buffer. Split over the walked tiles
    (``flash_grad.splits``), the kernel writes S partial gradients side by side and a
    pointwise kernel per gradient sums them (where epilogues fuse, as after split-K)."""
    spec = {**_mask_spec(t, 6)}
    q, k = t.inputs[:2]
    if t.attrs["wrt"] == "q":
        s = flash_grad.splits("dq", q.shape, k.shape)
        if s == 1:
            return [Kernel("flash_attention_dq", "attention", {**spec, "grad": "dq"}, out, list(ins))]
        part = temp((s,) + tuple(t.shape), t.dtype)
        return [Kernel("flash_attention_dq", "attention", {**spec, "grad": "dq", "split": s}, part, list(ins)),
                _sum_splits("flash_attention_dq.sum", part, out, s)]
    views = {t.attrs["wrt"]: out, **{s.attrs["wrt"]: v for s, v in siblings}}
    dk = views.get("k") or temp(t.inputs[1].shape, t.dtype)
    dv = views.get("v") or temp(t.inputs[2].shape, t.dtype)
    s = flash_grad.splits("dkv", q.shape, k.shape)
    if s == 1:
        return [Kernel("flash_attention_dkv", "attention", {**spec, "grad": "dkv"}, dk, list(ins), outs=[dv])]
    dk_s, dv_s = temp((s,) + tuple(dk.shape), t.dtype), temp((s,) + tuple(dv.shape), t.dtype)
    return [Kernel("flash_attention_dkv", "attention", {**spec, "grad": "dkv", "split": s}, dk_s, list(ins),
                   outs=[dv_s]),
            _sum_splits("flash_attention_dk.sum", dk_s, dk, s), _sum_splits("flash_attention_dv.sum", dv_s, dv, s)]


def _sum_splits(name, part, out, s):
    """``out`` = the sum of the ``s`` contiguous partials side by side in ``part``."""
    shape = tuple(part.shape[1:])
    size = int(np.prod(shape, dtype=np.int64))
    return sum_kernel(name, [View(part.buf, shape, contiguous_strides(shape), part.offset + j * size, part.dtype)
                             for j in range(s)], out)


def render(kernel):
    if kernel.spec.get("grad"):
        return flash_grad.render(kernel)
    if kernel.spec.get("combine"):
        return flash_split.render_combine(kernel)
    if kernel.spec.get("flash"):
        return flash.render(kernel)
    from .attention_ast import tree
    from .kernel_ast import printed
    got = tree(kernel)
    if got is None:        # (a paired product's output store, which no attention kernel has)
        return _render_template(kernel)
    return printed(got[0]), got[1], got[2]


def _render_template(kernel):
    """The one-row kernel's WGSL template (what ``attention_ast`` builds, line for line)."""
    q, k, v = kernel.reads[:3]
    spec = kernel.spec
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    rows = int(np.prod(batch, dtype=np.int64)) * hq * lq
    b = Bindings()
    store = OutputStore(kernel, b).require("fmax_f32")   # a NaN score gives a NaN row
    qb, kb, vb = (b.index(x.buf, x.dtype) for x in (q, k, v))
    # output columns: DV lanes (a power of two) per key slice, WG // DV slices
    DV = 1 << max(0, (dv - 1).bit_length())
    slices = WG // DV
    nbd = len(batch)

    def base(x, head):
        """Element offset of row 0 of ``x`` at batch ``bz`` and head ``head``."""
        st = x.strides
        terms = [f"{x.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nbd) if st[n]]
        return " + ".join(terms + ([f"{head} * {st[nbd]}u"] if st[nbd] else []))
    qs, ks, vs = q.strides, k.strides, v.strides
    lines = [f"    let row = {GROUP_INDEX};", f"    if (row >= {rows}u) {{ return; }}",
             f"    let i = row % {lq}u; let h = (row / {lq}u) % {hq}u; let bz = row / {lq * hq}u;"]
    lines += coords("bz", batch, prefix="z") if batch else []
    lines += [f"    let hk = h / {group}u;",
              f"    let qoff = {base(q, 'h')} + i * {qs[-2]}u;",
              f"    let koff = {base(k, 'hk')};",
              f"    let voff = {base(v, 'hk')};"]
    # scores: P lanes share one key (each sums D / P products, independent loads), so a
    # pass covers WG / P keys; the lanes' partial sums combine through ``red``
    P = 8 if d >= 8 else 1
    KPP = WG // P
    score = [f"        var s = red[lid] * {literal(spec['scale'], q.dtype)};"]
    if spec["masked"]:
        m = kernel.reads[3]
        mb = b.index(m.buf, m.dtype)
        st = broadcast_view_strides(m, tuple(batch) + (hq, lq, lk))
        terms = [f"{m.offset}u"] + [f"z{n} * {st[n]}u" for n in range(len(batch)) if st[n]]
        terms += [f"{c} * {s_}u" for c, s_ in zip(("h", "i"), st[len(batch):len(batch) + 2]) if s_]
        lines.append(f"    let moff = {' + '.join(terms)};")
        mv = f"b{mb}[moff + j * {st[-1]}u]"
        score.append(f"        s = select({NEG_INF}, s, {mv} != {literal(0, m.dtype)});" if spec["int_mask"]
                     else f"        s = s + {mv};")
    if spec["causal"]:
        score.append(f"        s = select({NEG_INF}, s, j <= i);")
    tree = """    workgroupBarrier();
    for (var t = {half}u; t > 0u; t = t >> 1u) {{
        if (lid < t) {{ red[lid] = {op}; }}
        workgroupBarrier();
    }}"""
    body = "\n".join(lines) + f"""
    for (var c = lid; c < {d}u; c = c + {WG}u) {{ qv[c] = b{qb}[qoff + c * {qs[-1]}u]; }}
    workgroupBarrier();
    let p = lid % {P}u; let kl = lid / {P}u;
    var mx = {NEG_INF};
    for (var j0 = 0u; j0 < {lk}u; j0 = j0 + {KPP}u) {{
        let j = j0 + kl;
        var part_s = 0.0;
        if (j < {lk}u) {{
            for (var c = p; c < {d}u; c = c + {P}u) {{ part_s = fma(qv[c], b{kb}[koff + j * {ks[-2]}u + c * {ks[-1]}u], part_s); }}
        }}
        red[lid] = part_s;
        workgroupBarrier();
        for (var t = {P // 2}u; t > 0u; t = t >> 1u) {{
            if (p < t) {{ red[lid] = red[lid] + red[lid + t]; }}
            workgroupBarrier();
        }}
        if (p == 0u && j < {lk}u) {{
    {chr(10).join("    " + ln for ln in score)}
            sc[j] = s;
            mx = fmax_f32(mx, s);
        }}
        workgroupBarrier();
    }}
    red[lid] = mx;
{tree.format(half=WG // 2, op="fmax_f32(red[lid], red[lid + t])")}
    let m = red[0];
    let live = bitcast<u32>(m) != 0xff800000u;   // a fully masked row gives zeros (a NaN row stays NaN)
    workgroupBarrier();
    var tot = 0.0;
    for (var j = lid; j < {lk}u; j = j + {WG}u) {{
        let e = select(0.0, exp(sc[j] - m), live);
        sc[j] = e;
        tot = tot + e;
    }}
    red[lid] = tot;
{tree.format(half=WG // 2, op="red[lid] + red[lid + t]")}
    let inv = select(0.0, 1.0 / red[0], live);
    workgroupBarrier();
    let col = lid % {DV}u; let sl = lid / {DV}u;
    var acc = 0.0;
    if (col < {dv}u) {{
        for (var j = sl; j < {lk}u; j = j + {slices}u) {{ acc = fma(sc[j], b{vb}[voff + j * {vs[-2]}u + col * {vs[-1]}u], acc); }}
    }}
    red[lid] = acc;
    workgroupBarrier();
    for (var t = {slices // 2}u; t > 0u; t = t >> 1u) {{
        if (sl < t) {{ red[lid] = red[lid] + red[lid + t * {DV}u]; }}
        workgroupBarrier();
    }}
    if (sl == 0u && col < {dv}u) {{ store_out(row * {dv}u + col, red[lid] * inv); }}
}}
"""
    src = b.decls() + "\n" + store.module_text() + \
        f"\nvar<workgroup> sc: array<f32, {lk}>;\nvar<workgroup> red: array<f32, {WG}>;\n" \
        f"var<workgroup> qv: array<f32, {d}>;\n\n" + ENTRY.format(wg=WG) + body
    return src, b.bufs, grid(rows)
