"""Row kernels with prologue and epilogue, one dispatch each instead of the four or more
kernels their decompositions take: softmax and log_softmax along one axis (max, sum of
exponentials, normalised write) and layer_norm / rms_norm over trailing axes (statistics,
then the normalised, scaled and shifted write)."""
from __future__ import annotations

import numpy as np

from ..graph import f32
from ..schedule import Kernel, contiguous_strides
from .common import WG, Bindings, grid, wgsl_type
from .expr import OutputStore
from .expr_ast import coords
from .kernel_ast import (GROUP, LID, Assign, Barrier, Bin, Bitcast, Blank, Block, Call, ComputeKernel, Convert, ExprStmt, For,
                         Function, Group, If, Index, Let, Line, Lit, Load, Name, Return, ReturnIf, Select, Shared, Store,
                         Var, add, buffers, printed, u32)


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
    ibase = add(u32(v.offset), *[Bin("*", Name(f"k{n}", "u32"), u32(v.strides[i])) for n, i in enumerate(kept)])
    obase = add(u32(0), *[Bin("*", Name(f"k{n}", "u32"), u32(ost[i])) for n, i in enumerate(kept)])
    x = Convert("f32", Load(ib, add(IBASE, Bin("*", J, u32(v.strides[d]))), wgsl_type(v.dtype)))   # f32 whatever the storage
    y = add(OBASE, Bin("*", J, u32(ost[d])))
    e = Call("exp", (Bin("-", x, M),), "f32")
    write = {"softmax": Bin("/", e, TOTAL), "log_softmax": Bin("-", Bin("-", x, M), Call("log", (TOTAL,), "f32")),
             # a row of -inf (fully masked) gives zeros; compared on the bits, so a NaN row stays NaN
             "safe_softmax": Select(Bin("/", e, TOTAL), f32_lit(0.0, "0.0"),
                                    Bin("==", Bitcast("u32", M), Lit(0xff800000, "u32", "0xff800000u")))}[spec["kind"]]
    rows = coords(Name("row", "u32"), kshape, prefix="k") or [Blank()]
    head = [Line((Let("ibase", ibase), Let("obase", obase)))]
    store_y = ExprStmt(Call("store_out", (y, write), ""))

    def each(start, step, *stmts):
        return For(Var("j", start), Bin("<", J, u32(r)), Assign("j", Bin("+", J, step)), stmts, inline=True)
    if r < 64:   # short rows: one thread each
        body = [Let("row", add(Bin("*", Group(GROUP), u32(WG)), LID)), ReturnIf(Bin(">=", ROW, u32(n_rows))), *rows,
                *head, Var("m", f32_lit(float("-inf"))),
                each(u32(0), u32(1), Assign("m", Call("fmax_f32", (M, x), "f32"))), Var("total", f32_lit(0.0, "0.0")),
                each(u32(0), u32(1), Assign("total", Bin("+", TOTAL, e))), each(u32(0), u32(1), store_y)]
        tree = ComputeKernel(buffers(b), WG, tuple(body), module=(*store.module_items(), Blank()))
        return printed(tree), b.bufs, grid(-(-n_rows // WG))

    def tree_steps(op):
        return For(Var("s", u32(WG // 2)), Bin(">", S, u32(0)), Assign("s", Bin(">>", S, u32(1))), (
            If(Bin("<", LID, S), (Assign(_part(LID), op),), inline=True), Barrier()))
    mx, acc = Name("mx", "f32"), Name("acc", "f32")
    body = [Let("row", GROUP), ReturnIf(Bin(">=", ROW, u32(n_rows))), *rows, *head, Var("mx", f32_lit(float("-inf"))),
            each(LID, u32(WG), Assign("mx", Call("fmax_f32", (mx, x), "f32"))), Assign(_part(LID), mx), Barrier(),
            tree_steps(Call("fmax_f32", (_part(LID), _part(add(LID, S))), "f32")), Let("m", _part(ZERO)), Barrier(),
            Var("acc", f32_lit(0.0, "0.0")), each(LID, u32(WG), Assign("acc", Bin("+", acc, e))),
            Assign(_part(LID), acc), Barrier(), tree_steps(Bin("+", _part(LID), _part(add(LID, S)))),
            Let("total", _part(ZERO)), each(LID, u32(WG), store_y)]
    tree = ComputeKernel(buffers(b), WG, tuple(body), module=(*store.module_items(), Shared("part", "f32", WG), Blank()))
    return printed(tree), b.bufs, grid(n_rows)


J, S, ROW = (Name(n, "u32") for n in ("j", "s", "row"))
M, TOTAL = Name("m", "f32"), Name("total", "f32")
IBASE, OBASE, BASE, ZERO = Name("ibase", "u32"), Name("obase", "u32"), Name("base", "u32"), Lit(0, "u32", "0")
XJ, MEAN, INV, CNT, Q = (Name(n, "f32") for n in ("xj", "mean", "inv", "cnt", "q"))


def f32_lit(v, text=""):
    return Lit(v, f32, text)


def _part(i, name="part"):
    return Index(Name(name, f"array<f32, {WG}>"), i, "f32")


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
    stat_vars = {"mean": MEAN, "rstd": INV}
    outs = list(zip(kernel.outs, spec.get("out_stats", ())))
    extra_stats = [(b.index(v.buf, v.dtype, write=True), v, st) for v, st in outs if st != "x"]
    extra = kernel.reads[:pro["first"]] if pro else kernel.reads[1:]
    x_at = Call("x_at", (ROW, J), "u32")
    module = []
    if pro:
        from .reduce import _prologue_load
        items, load_at = _prologue_load(pro, kernel.reads[pro["first"]:pro["first"] + pro["n"]], b, f32)
        # the first pass evaluates (and stores, for other readers) each element and keeps
        # it for the second
        i, v = Name("i", "u32"), Name("v", "f32")
        keep = [Store(b.index(x.buf, x.dtype, write=True), i, v)] if any(st == "x" for _, st in outs) else []
        xrow_j = Index(Name("xrow", f"array<f32, {r}>"), J, "f32")
        module = [*items, Blank(), Function("x_first", (ROW, J), (Let("i", x_at), Let("v", load_at(i)), *keep,
                                                                   Assign(xrow_j, v), Return(v)), "f32"), Blank()]
        xv, xv2 = Call("x_first", (ROW, J), "f32"), xrow_j
    else:
        xb = b.index(x.buf, x.dtype)
        xv = xv2 = Convert("f32", Load(xb, x_at, wgsl_type(x.dtype)))
    wb = b.index(extra[0].buf, extra[0].dtype) if spec["weight"] else None
    bb = b.index(extra[-1].buf, extra[-1].dtype) if spec["bias"] else None
    y = Bin("*", Group(Bin("-", XJ, MEAN)), INV) if spec["kind"] == "layer_norm" else Bin("*", XJ, INV)
    if wb is not None:
        y = Bin("*", y, Convert("f32", Load(wb, add(u32(extra[0].offset), J), wgsl_type(extra[0].dtype))))
    if bb is not None:
        y = Bin("+", y, Convert("f32", Load(bb, add(u32(extra[-1].offset), J), wgsl_type(extra[-1].dtype))))
    center = spec["kind"] == "layer_norm"
    wg = WG if r >= 64 else 1
    assert wg > 1 or not pro, "a norm computing its input needs a workgroup per row"
    rows_n = u32(r)
    if wg == 1:   # short rows: one thread each
        head = [Let("row", add(Bin("*", Group(GROUP), u32(WG)), LID))]
        loop = (u32(0), u32(1))
    else:
        head = [Let("row", GROUP)]
        loop = (LID, u32(WG))
    head += [ReturnIf(Bin(">=", ROW, u32(n_rows))), Let("base", Bin("*", ROW, rows_n))]
    acc = Name("acc", "f32")

    def each(*stmts, inline=True):
        return For(Var("j", loop[0]), Bin("<", J, rows_n), Assign("j", Bin("+", J, loop[1])), stmts, inline=inline)

    def sums(e):
        out = [Var("acc", f32_lit(0.0, "0.0")), each(Let("xj", xv), Assign("acc", Bin("+", acc, e)))]
        if wg > 1:
            s_ = Name("s", "u32")
            out += [Assign(_part(LID), acc), Barrier(),
                    For(Var("s", u32(WG // 2)), Bin(">", s_, u32(0)), Assign("s", Bin(">>", s_, u32(1))), (
                        If(Bin("<", LID, s_), (Assign(_part(LID), Bin("+", _part(LID), _part(add(LID, s_)))),),
                           inline=True), Barrier())),
                    Assign("acc", _part(ZERO)), Barrier()]
        return out
    n = f32_lit(float(r), repr(float(r)))
    var_ = Name("var_", "f32")
    body = head
    if center and wg > 1:
        body += _welford(xv, r)
    elif center:
        body += [Var("mean", f32_lit(0.0, "0.0")), Block((*sums(XJ), Assign("mean", Bin("/", acc, n))), flat=True)]
        body += [Var("var_", f32_lit(0.0, "0.0")),
                 Block((*sums(Bin("*", Group(Bin("-", XJ, MEAN)), Group(Bin("-", XJ, MEAN)))),
                        Assign("var_", Bin("/", acc, n))), flat=True)]
    else:
        body += [Var("var_", f32_lit(0.0, "0.0")), Block((*sums(Bin("*", XJ, XJ)), Assign("var_", Bin("/", acc, n))),
                                                           flat=True)]
    body.append(Let("inv", Call("inverseSqrt", (Bin("+", var_, f32_lit(spec["eps"], repr(spec["eps"]))),), "f32")))
    first = Bin("==", LID, u32(0)) if wg > 1 else Lit(True, "bool", "true")
    stores = [Store(bi, add(u32(v.offset), ROW), Convert(wgsl_type(v.dtype), stat_vars[st])) for bi, v, st in extra_stats]
    if only:
        stores.append(ExprStmt(Call("store_out", (ROW, stat_vars[only]), "")))
    if stores:
        body.append(If(first, tuple(stores), inline=True))
    if not only:
        body.append(each(Let("xj", xv2), ExprStmt(Call("store_out", (add(BASE, J), y), "")), inline=False))
    shared = [Blank()]
    if wg > 1:
        shared = [Blank(), Shared("part", "f32", WG)] + \
            ([Shared("part_n", "f32", WG), Shared("part_q", "f32", WG)] if center else []) + \
            ([Shared("xrow", "f32", r)] if pro else [])
    items = [*store.module_items(), _index_fn(x, r), *shared, *(module or [Blank()])]
    tree = ComputeKernel(buffers(b), WG, tuple(body), module=tuple(items))
    return printed(tree), b.bufs, grid(n_rows if wg > 1 else -(-n_rows // WG))


def _welford(xv, r) -> list:
    """A long row's mean and variance in one pass over it (``mean``, ``var_``): each thread
    keeps Welford's count, mean and sum of squared deviations over its elements, and the
    workgroup merges them pairwise (Chan et al.), so the row is read twice in all
    (statistics, then the normalised write) instead of three times, and the variance needs
    no second reduction. Stable where sum-of-squares formulas cancel."""
    zero = f32_lit(0.0, "0.0")
    d, na, nb, n, s_ = Name("d", "f32"), Name("na", "f32"), Name("nb", "f32"), Name("n", "f32"), Name("s", "u32")
    ls = add(LID, s_)
    pn, pq = (lambda i: _part(i, "part_n")), (lambda i: _part(i, "part_q"))
    return [
        Line((Var("cnt", zero), Var("mean", zero), Var("q", zero))),
        For(Var("j", LID), Bin("<", J, u32(r)), Assign("j", Bin("+", J, u32(WG))), (
            Let("xj", xv), Assign("cnt", Bin("+", CNT, f32_lit(1.0, "1.0"))), Let("d", Bin("-", XJ, MEAN)),
            Assign("mean", Bin("+", MEAN, Bin("/", d, CNT))), Assign("q", Bin("+", Q, Bin("*", d, Group(Bin("-", XJ, MEAN))))))),
        Line((Assign(pn(LID), CNT), Assign(_part(LID), MEAN), Assign(pq(LID), Q))),
        Barrier(),
        For(Var("s", u32(WG // 2)), Bin(">", s_, u32(0)), Assign("s", Bin(">>", s_, u32(1))), (
            If(Bin("<", LID, s_), (
                Line((Let("na", pn(LID)), Let("nb", pn(ls)), Let("n", Bin("+", na, nb)))),
                If(Bin(">", nb, zero), (
                    Let("d", Bin("-", _part(ls), _part(LID))),
                    Assign(_part(LID), Bin("+", _part(LID), Bin("*", d, Group(Bin("/", nb, n))))),
                    Assign(pq(LID), add(pq(LID), pq(ls), Bin("*", Bin("*", d, d), Group(Bin("/", Bin("*", na, nb), n))))),
                    Assign(pn(LID), n))))),
            Barrier())),
        Assign("mean", _part(ZERO)),
        Let("var_", Bin("/", pq(ZERO), f32_lit(float(r), repr(float(r))))),
        Barrier()]


def _index_fn(x, r):
    """``fn x_at(row, j)``: the element of view ``x`` at position j of normalised row
    ``row`` (rows over the leading dims, j over the trailing dims of size ``r``)."""
    if x.is_contiguous():
        return Function("x_at", (ROW, J), (Return(add(u32(x.offset), Bin("*", ROW, u32(r)), J)),), "u32", inline=True)
    k, size = 0, 1
    while size < r:
        k += 1
        size *= x.shape[-k]
    lead, trail = x.shape[:-k], x.shape[-k:]
    stmts = coords(ROW, lead, prefix="a") + coords(J, trail, prefix="t")
    terms = [u32(x.offset)] + [Bin("*", Name(f"a{d}", "u32"), u32(s)) for d, s in enumerate(x.strides[:-k]) if s] + \
        [Bin("*", Name(f"t{d}", "u32"), u32(s)) for d, s in enumerate(x.strides[-k:]) if s]
    return Function("x_at", (ROW, J), (*stmts, Return(add(*terms))), "u32")
