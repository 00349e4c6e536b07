"""The combine of a flash forward split over keys (``flash_split.py``) on the typed kernel
AST: its only WGSL (and GLSL) is printed from this tree."""
from __future__ import annotations

from . import kernel_ast as K
from .common import WG, Bindings, grid
from .kernel_ast_attn import (NEG_INF, POS_INF, Body, buffers, call, f32, group_index, grp, lit, load, name, sel,
                              sum_terms)
from .store_ast import store_items


def combine_tree(kernel):
    """(``ComputeKernel``, bound buffers, workgroups) of the combine, or None where its output
    store is not on the AST yet (``store_ast``)."""
    o_s, lse_s = kernel.reads[:2]
    S = kernel.spec["combine"]
    dv = o_s.shape[-1]
    rows = lse_s.size // S
    n = rows * dv
    b = Bindings()
    fns = store_items(kernel, b, require=("fmax_f32",))     # a NaN partial LSE gives a NaN row
    if fns is None:
        return None
    ob, lb = b.index(o_s.buf, o_s.dtype), b.index(lse_s.buf, lse_s.dtype)
    B = Body()
    e = B.let("e", grp(group_index()) * WG + name("lid", "u32"))
    with B.if_(e.ge(n), inline=True):
        B.ret()
    row = B.let("row", e / dv)
    ls = [B.let(f"l{s}", load(lb, lit(lse_s.offset) + lit(s * rows) + row, "f32")) for s in range(S)]
    m = ls[0]
    for s in range(1, S):
        m = call("fmax_f32", m, ls[s])
    m = B.let("m", m)
    live = B.let("live", m.ne(NEG_INF))
    mref = B.let("mref", sel(f32(0.0), m, live))
    ws = [B.let(f"w{s}", call("exp", ls[s] - mref)) for s in range(S)]
    wsum = B.let("wsum", sum_terms(ws))
    acc = B.let("acc", sum_terms([ws[s] * load(ob, lit(o_s.offset) + lit(s * n) + e, "f32") for s in range(S)]))
    B.call("store_out", e, sel(f32(0.0), acc / wsum, live))
    if kernel.outs:
        lse = kernel.outs[0]
        assert lse.is_contiguous() and lse.size == rows, lse.shape
        rb = b.index(lse.buf, lse.dtype, write=True)
        with B.if_((e % dv).eq(0), inline=True):
            B.store(rb, lit(lse.offset) + row, sel(POS_INF, m + call("log", wsum), live))
    return K.ComputeKernel(buffers(b), WG, B.stmts, module=(*fns, K.Blank())), b.bufs, grid(-(-n // WG))
