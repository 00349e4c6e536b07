"""The row-reduction archetype: sum / mean / max of a strided view over any set of axes.

Short rows: one thread per output, or LANES threads per output when there are too few
outputs to occupy the GPU. Long rows: one workgroup per output, threads stride over the
row and combine through workgroup memory.
"""
from __future__ import annotations

import numpy as np

from ..graph import f32
from ..schedule import Kernel, View
from .common import WG, Bindings, grid, wgsl_type
from .expr import ExprWriter, OutputStore, read_leaves
from .expr_ast import call, coords
from .kernel_ast import (GROUP, LID, Assign, Barrier, Bin, Blank, Call, ComputeKernel, Convert, ExprStmt, For, Function, If,
                         Index, Let, Line, Lit, Load, Name, Return, ReturnIf, Shared, Var, add, buffers, printed, u32)


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
    pointwise kernel's output, evaluated from that kernel's operands instead of memory:
    (the helper functions it calls and it, on the kernel AST; a builder of its call)."""
    pout = pro["out"]
    reads, vals = read_leaves(leaves, pout.shape, b, "p", ast=True)
    stmts = [Let("f", Bin("-", I, u32(pout.offset)))] + coords(Name("f", "u32"), pout.shape, "p") + reads
    w = ExprWriter(lambda e: vals[e[1]], ast=True)
    val, vdt = w.emit(pro["expr"])
    if vdt is not dt:
        val = Convert(wgsl_type(dt), val)
    fn = Function(name, (I,), tuple(stmts + w.stmts + [Return(val)]), wgsl_type(dt))
    return w.helper_functions(b) + [fn], (lambda idx: Call(name, (idx,), wgsl_type(dt)))


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
    module, fn, groups = part_tree(kernel, b, "")
    v = kernel.spec["prologue"]["view"] if "prologue" in kernel.spec else kernel.reads[0]
    scratch = SCRATCH_AST[0] if v.dtype.is_float else Shared("part", wgsl_type(v.dtype), WG)
    tree = ComputeKernel(buffers(b), WG, (ExprStmt(Call("red", (GROUP, LID), "")),),
                         module=(*module, scratch, Blank(), fn, Blank()), enable_f16=b.enable_f16)
    return printed(tree), b.bufs, grid(groups)


# the workgroup scratch of every reduction (float data accumulates in f32), and the empty line after it
SCRATCH_AST = (Shared("part", "f32", WG), Blank())
I, O, G, J = Name("i", "u32"), Name("o", "u32"), Name("g", "u32"), Name("j", "u32")
LANE, BASE = Name("lane", "u32"), Name("base", "u32")


def _k(prefix, i):
    return Name(f"{prefix}{i}", "u32")


def part_tree(kernel, b, suffix):
    """(module items: the store's and the input's functions, ``fn red{suffix}(g: u32, lid:
    u32)`` reducing for workgroup ``g`` of this kernel's range, its workgroup count), on the
    kernel AST. Module names carry ``suffix`` so that several reductions can share one launch
    (``pointwise.render_multi``); they all use the module's workgroup scratch ``part``."""
    spec = kernel.spec
    pro = spec.get("prologue")
    v = pro["view"] if pro else kernel.reads[0]
    dims, kind = spec["dims"], spec["kind"]
    kept = [d for d in range(len(v.shape)) if d not in dims]
    kshape, rshape = [v.shape[d] for d in kept], [v.shape[d] for d in dims]
    n_out, r = int(np.prod(kshape, dtype=np.int64)), int(np.prod(rshape, dtype=np.int64))
    dt = f32 if v.dtype.is_float else v.dtype      # f16 data accumulates in f32
    ty = wgsl_type(dt)
    if not dt.is_float:
        init = Lit(-2**31 if dt.name == "i32" else 0, dt) if kind == "max" else Lit(0, dt)
    else:
        init = Lit(float("-inf"), dt) if kind == "max" else Lit(0.0, dt, "0.0")
    store = OutputStore(kernel, b, dt, name=f"store_out{suffix}")
    st = f"store_out{suffix}"
    if pro:
        load_items, load_at = _prologue_load(pro, kernel.reads, b, dt, name=f"load_in{suffix}")
    else:
        ib = b.index(v.buf, v.dtype)
        load_items = []
        load_at = (lambda idx: Load(ib, idx, ty)) if v.dtype is dt else \
            (lambda idx: Convert(ty, Load(ib, idx, wgsl_type(v.dtype))))   # noqa: E731
    acc, acc2, part = Name("acc", ty), Name("acc2", ty), Name("part", f"array<{ty}, {WG}>")
    base = add(u32(v.offset), *[Bin("*", _k("k", i), u32(v.strides[d])) for i, d in enumerate(kept)])
    step = [u32(0), *[Bin("*", _k("r", i), u32(v.strides[d])) for i, d in enumerate(dims)]]

    def comb(a, c):
        if kind == "max" and dt.is_float:      # a NaN anywhere in the row gives NaN, as torch
            return Call(f"fmax_{dt.name}", (a, c), ty)
        return call("max", (a, c)) if kind == "max" else Bin("+", a, c)
    if kind == "max" and dt.is_float:
        store.require(f"fmax_{dt.name}")
    count = spec.get("count", r)

    def fin(x):     # the mean of no elements is NaN (0 / 0), as torch's
        if kind != "mean":
            return x
        return Bin("*", x, Lit(1.0 / count, dt)) if count else Lit(float("nan"), dt)
    rows = coords(O, kshape, prefix="k") or [Blank()]
    read = [*coords(J, rshape, prefix="r"), Assign("acc", comb(acc, load_at(add(BASE, *step))))]
    module = store.module_items() + load_items
    head = (Name("g", "u32"), LID)

    def tree_steps(var, half, active):
        s_ = Name(var, "u32")
        return [Assign(Index(part, LID, ty), acc), Barrier(),
                For(Var(var, u32(half)), Bin(">", s_, u32(0)), Assign(var, Bin(">>", s_, u32(1))), (
                    If(Bin("<", active, s_), (Assign(Index(part, LID, ty), comb(Index(part, LID, ty),
                                                                                 Index(part, add(LID, s_), ty))),),
                       inline=True),
                    Barrier()))]
    if spec.get("chunks"):
        S = spec["chunks"]
        C = -(-r // S)
        s_, jend = Name("s", "u32"), Name("jend", "u32")
        body = [ReturnIf(Bin(">=", G, u32(n_out * S))),
                Line((Let("o", Bin("/", G, u32(S))), Let("s", Bin("%", G, u32(S))))),
                *rows, Let("base", base), Var("acc", init),
                Let("jend", call("min", (add(Bin("*", s_, u32(C)), u32(C)), u32(r)))),
                For(Var("j", add(Bin("*", s_, u32(C)), LID)), Bin("<", J, jend), Assign("j", Bin("+", J, u32(WG))), read),
                *tree_steps("t", WG // 2, LID),
                If(Bin("==", LID, u32(0)), (ExprStmt(Call(st, (G, Index(part, Lit(0, "u32", "0"), ty)), "")),),
                   inline=True)]
        return module, Function(f"red{suffix}", head, tuple(body)), groups(kernel)
    form = _form(n_out, r)
    if form == "lanes":
        per = WG // LANES
        body = [Line((Let("o", add(Bin("*", G, u32(per)), Bin("/", LID, u32(LANES)))),
                      Let("lane", Bin("%", LID, u32(LANES))))),
                Var("acc", init),
                If(Bin("<", O, u32(n_out)), (
                    *rows, Let("base", base),
                    For(Var("j", LANE), Bin("<", J, u32(r)), Assign("j", Bin("+", J, u32(LANES))), read))),
                *tree_steps("s", LANES // 2, LANE),
                If(Bin("&&", Bin("==", LANE, u32(0)), Bin("<", O, u32(n_out))),
                   (Let("acc2", Index(part, LID, ty)), ExprStmt(Call(st, (O, fin(acc2)), ""))), inline=True)]
        return module, Function(f"red{suffix}", head, tuple(body)), groups(kernel)
    if form == "threads":
        body = [Let("o", add(Bin("*", G, u32(WG)), LID)), ReturnIf(Bin(">=", O, u32(n_out))),
                *rows, Let("base", base), Var("acc", init),
                For(Var("j", u32(0)), Bin("<", J, u32(r)), Assign("j", Bin("+", J, u32(1))), read),
                ExprStmt(Call(st, (O, fin(acc)), ""))]
        return module, Function(f"red{suffix}", head, tuple(body)), groups(kernel)
    body = [Let("o", G), ReturnIf(Bin(">=", O, u32(n_out))),
            *rows, Let("base", base), Var("acc", init),
            For(Var("j", LID), Bin("<", J, u32(r)), Assign("j", Bin("+", J, u32(WG))), read),
            *tree_steps("s", WG // 2, LID),
            If(Bin("==", LID, u32(0)), (Let("acc2", Index(part, Lit(0, "u32", "0"), ty)),
                                        ExprStmt(Call(st, (O, fin(acc2)), ""))), inline=True)]
    return module, Function(f"red{suffix}", head, tuple(body)), groups(kernel)
