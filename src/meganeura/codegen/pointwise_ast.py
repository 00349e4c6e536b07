"""The pointwise archetype's kernels as trees of the typed kernel AST (``kernel_ast``): one
pointwise kernel (``body``: split the flat index into coordinates, read the operands,
evaluate the fused expression with ``expr.ExprWriter``, store the value and its second
stores and further outputs), a merged launch of pointwise kernels and reductions (one
function per part, ``multi_tree``) and one whose alike parts share a body over arrays of
buffers (``shared_tree``). ``pointwise.render`` prints their WGSL (``kernel_ast.printed``) and
the Vulkan compile stage their GLSL."""
from __future__ import annotations

import dataclasses

from .common import NOWHERE, WG, Bindings, broadcast_view_strides, coalesce, form_key, wgsl_type
from .expr import ExprWriter, store_stmts
from .expr_ast import coords, offset_expr
from .kernel_ast_matmul import remap
from .kernel_ast import (GROUP, LID, Bin, Blank, Call, CallIf, ComputeKernel, Construct, Convert, Field,
                         Function, Group, If, Let, Lit, Load, Name, Return, ReturnIf, Store, WgslPrinter, add, buffers,
                         printed, u32)

__all__ = ["ast_kernel", "ast_multi", "body", "kernel_tree", "multi_tree", "shared_tree", "printed", "GROUP", "buffers"]

I, G = Name("i", "u32"), Name("g", "u32")


def body(kernel, b: Bindings):
    """(helper functions, statements computing and storing element ``i``) of one pointwise
    kernel, its buffers registered on ``b``."""
    out, spec = kernel.out, kernel.spec
    ob = b.index(out.buf, out.dtype, write=True)
    leaf_vars = []
    rotated = _rleaves(spec["expr"])
    stores, outs = spec.get("stores", ()), list(zip(kernel.outs, spec.get("out_exprs", ())))
    # per view, the strides it is indexed by at the output's coordinates: the output, the
    # reads (broadcast), second stores and further outputs
    views = [[out.strides], [broadcast_view_strides(v, out.shape) for v in kernel.reads],
             [s.strides for s in stores], [v.strides for v, _ in outs]]
    shape = out.shape
    # coordinates merged, except where the expression needs them as they are: rotate_half's
    # (the last one, and its operands' read through it)
    if not rotated and not _uses_coords(spec["expr"]) and not spec.get("flat_leaf") and \
            all(len(st) == len(shape) for group in views for st in group):
        shape, merged = coalesce(out.shape, [st for group in views for st in group])
        it = iter(merged)
        views = [[next(it) for _ in group] for group in views]
    (out_strides,), read_strides, store_strides, outs_strides = views
    stmts = coords(I, shape)
    for k, v in enumerate(kernel.reads):
        bi = b.index(v.buf, v.dtype)
        if spec.get("flat_leaf"):       # read in the leaf's own logical order
            stmts += coords(I, v.shape, prefix=f"l{k}_")
            idx = offset_expr(v.offset, v.strides, prefix=f"l{k}_")
        else:
            st = read_strides[k]
            idx = offset_expr(v.offset, st)
        stmts.append(Let(f"v{k}", Load(bi, idx, wgsl_type(v.dtype))))
        leaf_vars.append((Name(f"v{k}", wgsl_type(v.dtype)), v.dtype))
        if k in rotated:    # rotate_half's operand: the last coordinate moved by half
            d, n2 = len(out.shape) - 1, out.shape[-1]
            cs = [Group(Bin("%", Group(Bin("+", _c(i), u32(n2 // 2))), u32(n2))) if i == d else _c(i)
                  for i in range(len(st))]
            terms = ([u32(v.offset)] if v.offset else []) + [c if s == 1 else Bin("*", c, u32(s))
                                                             for c, s in zip(cs, st) if s]
            stmts.append(Let(f"r{k}", Load(bi, add(*terms) if terms else u32(0), wgsl_type(v.dtype))))
    w = ExprWriter(lambda e: (Name(f"r{e[1]}", wgsl_type(kernel.reads[e[1]].dtype)), kernel.reads[e[1]].dtype)
                   if e[0] == "rleaf" else leaf_vars[e[1]], last_coord=_c(len(out.shape) - 1), ast=True)
    val, dt = w.emit(spec["expr"])
    if dt is not out.dtype:
        val = Convert(wgsl_type(out.dtype), val)
    stored = store_stmts(b, ob, offset_expr(out.offset, out_strides), val, out.dtype, stores,
                         store_strides=store_strides)
    # further outputs (``fuse.fuse_producer_outputs``): each the value of its own expression
    # over the same leaves, stored at the same coordinates
    for (view, e), st in zip(outs, outs_strides):
        v, dt = w.emit(e)
        if dt is not view.dtype:
            v = Convert(wgsl_type(view.dtype), v)
        stored.append(Store(b.index(view.buf, view.dtype, write=True), offset_expr(view.offset, st), v))
    return w.helper_functions(b), stmts + w.stmts + stored


def _c(d):
    return Name(f"c{d}", "u32")


def kernel_tree(kernel):
    """(``ComputeKernel``, bound logical buffers) of one pointwise kernel."""
    b = Bindings()
    helpers, stmts = body(kernel, b)
    head = [Let("i", add(Bin("*", Group(GROUP), u32(WG)), LID)), ReturnIf(Bin(">=", I, u32(kernel.out.size)))]
    return ComputeKernel(buffers(b), WG, tuple(head + stmts), module=(*helpers, Blank())), b.bufs


def multi_tree(kernel):
    """(``ComputeKernel``, bound logical buffers, workgroups) of a merged launch of pointwise
    kernels and reductions, each part a function owning a range of workgroups."""
    from .reduce import part_tree, SCRATCH_AST
    b = Bindings()
    fns, helpers, branches, g0, scratch = [], [], [], 0, None
    for j, part in enumerate(kernel.spec["parts"]):
        if part.archetype == "reduce":
            items, fn, n_groups = part_tree(part, b, str(j))
            helpers += [*items, Blank()]
            fns += [fn, Blank()]
            scratch = SCRATCH_AST
            call = (Bin("-", G, u32(g0)), LID)
            name = f"red{j}"
        else:
            hs, stmts = body(part, b)
            helpers += hs
            n = part.out.size
            n_groups = -(-n // WG)
            fns.append(Function(f"part{j}", (I,), (ReturnIf(Bin(">=", I, u32(n))), *stmts)))
            call = (add(Bin("*", Group(Bin("-", G, u32(g0))), u32(WG)), LID),)
            name = f"part{j}"
        g1 = g0 + n_groups
        branches.append(CallIf(Bin("<", G, u32(g1)), name, call))
        g0 = g1
    module = helpers + list(scratch or [Blank()]) + fns + [Blank()]
    return ComputeKernel(buffers(b), WG, (Let("g", GROUP), *branches), module=tuple(module),
                         enable_f16=b.enable_f16), b.bufs, g0


def shared_tree(kernel, max_elements):
    """``multi_tree`` with one body per form (``pointwise.render_multi`` says when and
    why): (``ComputeKernel``, the buffers bound, one per descriptor, workgroups), or None
    where no two parts are alike."""
    from .reduce import part_tree, SCRATCH_AST
    b = Bindings()
    parts = kernel.spec["parts"]
    # parts alike print the same body for buffers of the same types, and none past
    # ``max_elements`` is alike: without two such candidates, no body is built to compare
    rough = [(len(q.reads), q.out.dtype, tuple(v.dtype for v in q.reads)) for q in parts
             if q.archetype != "reduce" and q.out.size <= max_elements]
    if len(set(rough)) == len(rough):
        return None
    forms, bodies = {}, {}
    p = WgslPrinter()
    for j, part in enumerate(parts):
        if part.archetype != "reduce":
            pb = Bindings()
            hs, stmts = body(part, pb)
            text = (tuple(p.function(h) for h in hs), tuple(ln for s in stmts for ln in p.lines(s)))
            key = form_key(pb, text) + ((j,) if part.out.size > max_elements else ())
            members = forms.setdefault(key, [])
            bodies[j] = key, len(members), (hs, stmts)       # the form, the part's position in it
            members.append(pb)
    if all(len(members) == 1 for members in forms.values()):
        return None         # nothing alike: the launch keeps ``multi_tree``
    fns, helpers, ranges, ids, scratch, g0 = [], [], [], {}, None, 0
    P, N, AT = Name("p", "u32"), Name("n", "u32"), Name("at", "vec4<u32>")
    for j, part in enumerate(parts):
        if part.archetype == "reduce":
            items, fn, n_groups = part_tree(part, b, str(j))
            helpers += [*items, Blank()]
            fns += [fn, Blank()]
            scratch = SCRATCH_AST
            ids[j] = len(ids)
            call = (f"red{j}", (Bin("-", G, Field(AT, "z")), LID))
            ranges.append((g0 + n_groups, ids[j], 0, g0, 0, call))
        else:
            key, slot, (hs, stmts) = bodies[j]
            members = forms[key]
            if key not in ids:          # the form's body, bound at its first part
                ids[key] = len(ids)
                # each helper once in the module: the reductions' modules skip those emitted
                new = [h for h in hs if h.name not in b.helpers_done]
                b.helpers_done.update(h.name for h in new)
                helpers += new
                b.enable_f16 |= key[3]
                roles = _bind_roles(b, members, P)
                fns.append(Function(f"form{ids[key]}", (P, I, N),
                                    (ReturnIf(Bin(">=", I, N)), *(_rebind(s, roles) for s in stmts))))
            n_groups = -(-part.out.size // WG)
            call = (f"form{ids[key]}", (Field(AT, "y"), add(Bin("*", Group(Bin("-", G, Field(AT, "z"))), u32(WG)), LID),
                                        Field(AT, "w")))
            ranges.append((g0 + n_groups, ids[key], slot, g0, part.out.size, call))
        g0 += n_groups
    where = [If(Bin("<", G, u32(end)), (Return(Construct("vec4<u32>", (u32(i), u32(slot), u32(start), u32(n)))),),
                inline=True) for end, i, slot, start, n, _ in ranges]
    locate = Function("locate", (G,), (*where, Return(Construct("vec4<u32>", (u32(NOWHERE), u32(0), u32(0), u32(0))))),
                      "vec4<u32>")
    calls = {i: call for _, i, _, _, _, call in ranges}
    branches = [CallIf(Bin("==", Field(AT, "x"), u32(i)), *call) for i, call in sorted(calls.items())]
    head = (Let("g", GROUP), Let("at", Call("locate", (G,), "vec4<u32>")))
    module = helpers + list(scratch or [Blank()]) + fns + [locate, Blank()]
    return ComputeKernel(buffers(b), WG, head + tuple(branches), module=tuple(module),
                         enable_f16=b.enable_f16), b.flat(), g0


def _bind_roles(b: Bindings, members, index):
    """``common.bind_roles`` for trees: binding -> (binding on ``b``, member index or None)."""
    first, roles = members[0], {}
    for r, ty in enumerate(first.types):
        bufs = [m.bufs[r] for m in members]
        written = id(first.bufs[r]) in first.written
        if all(x is bufs[0] for x in bufs):
            roles[r] = (b.slot(bufs[0], ty, written), None)
        else:
            roles[r] = (b.array(bufs, ty, written), index)
    return roles


def _rebind(node, roles):
    """``node`` with its buffer uses bound as ``roles`` says (a new node where something
    under it changed; names and literals as they are)."""
    def bound(n):
        if type(n) is Load or type(n) is Store:
            to, member = roles[n.binding]
            return dataclasses.replace(n, binding=to, member=member)
        return n
    return remap(node, bound)


def ast_kernel(kernel):
    """``kernel_tree`` of a pointwise kernel, else None."""
    return kernel_tree(kernel) if kernel.archetype == "pointwise" else None


def ast_multi(kernel):
    """``multi_tree`` of a merged launch."""
    return multi_tree(kernel)


def _rleaves(e) -> set:
    """Leaves read through rotate_half's index function."""
    if e[0] == "rleaf":
        return {e[1]}
    if e[0] == "op":
        return set().union(*(_rleaves(k) for k in e[2]))
    return set()


def _uses_coords(e) -> bool:
    """The expression reads an output coordinate (rotate_half's sign: the last one)."""
    if e[0] != "op":
        return False
    return e[1].op == "rotate_half" or any(_uses_coords(k) for k in e[2])
