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
    from .kernel_ast import printed_made
    # (None: a paired product's output store, which no attention kernel has)
    return printed_made(kernel, tree(kernel), "its output store")
