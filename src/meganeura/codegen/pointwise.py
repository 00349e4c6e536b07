"""The pointwise archetype: one thread per output element evaluating a fused expression
tree whose leaves are strided (possibly broadcast) views."""
from __future__ import annotations

import os

from .common import (ENTRY, GROUP_INDEX, NOWHERE, WG, Bindings, bind_roles, broadcast_view_strides, coalesce, coords,
                     form_key, grid, offset_expr)
from .expr import HELPERS, ExprWriter, Node, store_lines
from .pointwise_ast import ast_kernel, ast_multi, printed


def sum_kernel(name, leaves, out):
    """A pointwise kernel writing ``out`` = the sum of the views ``leaves`` (the partial
    results of a kernel split over its reduction: split-K, the flash backward's splits),
    which fusion treats like any other: epilogues, merging."""
    from ..schedule import Kernel
    total = ("leaf", 0)
    for j in range(1, len(leaves)):
        total = ("op", Node("add", out.dtype), [total, ("leaf", j)])
    return Kernel(name, "pointwise", {"expr": total, "dtype": out.dtype}, out, list(leaves))


def _body(kernel, b: Bindings):
    """(helper functions, WGSL lines computing and storing element ``i``) of one pointwise
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
    lines = coords("i", shape)
    for k, v in enumerate(kernel.reads):
        bi = b.index(v.buf, v.dtype)
        if spec.get("flat_leaf"):       # read in the leaf's own logical order
            lines += coords("i", v.shape, prefix=f"l{k}_")
            idx = offset_expr(v.offset, v.strides, prefix=f"l{k}_")
        else:
            st = read_strides[k]
            idx = offset_expr(v.offset, st)
        lines.append(f"    let v{k} = b{bi}[{idx}];")
        leaf_vars.append((f"v{k}", v.dtype))
        if k in rotated:    # rotate_half's operand: the last coordinate moved by half
            d, n2 = len(out.shape) - 1, out.shape[-1]
            cs = [f"((c{i} + {n2 // 2}u) % {n2}u)" if i == d else f"c{i}" for i in range(len(st))]
            terms = ([f"{v.offset}u"] if v.offset else []) + [c if s == 1 else f"{c} * {s}u" for c, s in zip(cs, st) if s]
            lines.append(f"    let r{k} = b{bi}[{' + '.join(terms) or '0u'}];")
    w = ExprWriter(lambda e: (f"r{e[1]}", kernel.reads[e[1]].dtype) if e[0] == "rleaf" else leaf_vars[e[1]],
                   last_coord=f"c{len(out.shape) - 1}")
    val, dt = w.emit(spec["expr"])
    if dt is not out.dtype:
        val = f"{out.dtype.wgsl}({val})"
    stored = store_lines(b, ob, offset_expr(out.offset, out_strides), val, out.dtype, stores,
                         store_strides=store_strides)
    # further outputs (``fuse.fuse_producer_outputs``): each the value of its own expression
    # over the same leaves, stored at the same coordinates
    for (view, e), st in zip(outs, outs_strides):
        v, dt = w.emit(e)
        if dt is not view.dtype:
            v = f"{view.dtype.wgsl}({v})"
        stored.append(f"    b{b.index(view.buf, view.dtype, write=True)}[{offset_expr(view.offset, st)}] = {v};")
    return w.helpers(b), lines + w.lines + stored


def as_function(operand_spec, reads, bind: Bindings, name) -> str:
    """WGSL ``fn name(i: u32) -> f32``: the value a pointwise kernel would have stored at flat
    index ``i`` of its (contiguous) output, for a matmul that computes its operand in its
    loads instead of reading a stored one (``fuse.fuse_pointwise_operands``). Helpers the
    expression calls are emitted once per module, before the function."""
    shape = operand_spec["shape"]
    strides = [broadcast_view_strides(v, shape) for v in reads]
    if not _uses_coords(operand_spec["expr"]):
        shape, strides = coalesce(shape, strides)
    lines = [f"    let i = min(i0, {operand_spec['size'] - 1}u);"] + coords("i", shape)
    leaf_vars = []
    for k, v in enumerate(reads):
        bi = bind.index(v.buf, v.dtype)
        bind.scalar.add(bi)
        lines.append(f"    let v{k} = b{bi}[{offset_expr(v.offset, strides[k])}];")
        leaf_vars.append((f"v{k}", v.dtype))
    w = ExprWriter(lambda e: leaf_vars[e[1]], last_coord=f"c{len(shape) - 1}")
    val, _ = w.emit(operand_spec["expr"])
    return "\n".join(w.helpers(bind) + [f"fn {name}(i0: u32) -> f32 {{"] + lines + w.lines
                     + [f"    return f32({val});", "}"]) + "\n"


def render(kernel) -> tuple[str, list, tuple]:
    """WGSL text, the bound logical buffers (binding order), and the workgroup counts."""
    if kernel.archetype == "multi":
        return render_multi(kernel)
    n = kernel.out.size
    tree = ast_kernel(kernel)
    if tree is not None:        # (its GLSL: ``kernel_ast.print_glsl``)
        return printed(tree[0]), tree[1], grid(-(-n // WG))
    return _render_template(kernel)


def _render_template(kernel) -> tuple[str, list, tuple]:
    """``render`` of a pointwise kernel from the WGSL template (``_body``)."""
    n = kernel.out.size
    b = Bindings()
    helpers, lines = _body(kernel, b)
    src = "\n".join([b.decls()] + helpers) + "\n\n" + ENTRY.format(wg=WG) + \
        f"    let i = ({GROUP_INDEX}) * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n" + \
        "\n".join(lines) + "\n}\n"
    return src, b.bufs, grid(-(-n // WG))


def render_multi(kernel, array_limit=0):
    """Independent pointwise kernels and reductions in one dispatch: each owns a range of
    workgroups (horizontal fusion: one launch and one barrier instead of one per kernel).
    ``array_limit``: the runtime binds arrays of buffers, at most this many buffers a kernel,
    and parts alike but for their buffers share one body (``_render_shared``) where that
    stays within the limit (an array binds a buffer two parts share twice, which the fusion
    passes counted once)."""
    if array_limit:
        shared = _render_shared(kernel)
        if shared is not None and len(shared[1]) <= array_limit:
            return shared
    tree = ast_multi(kernel)
    if tree is not None:        # (its GLSL: ``kernel_ast.print_glsl``)
        return printed(tree[0]), tree[1], grid(tree[2])
    return _render_multi_template(kernel)


def _render_multi_template(kernel):
    """``render_multi`` of a merged launch from the WGSL template (one function per part)."""
    from . import reduce
    b = Bindings()
    fns, helpers, branches, g0, scratch = [], {}, [], 0, ""
    for j, part in enumerate(kernel.spec["parts"]):
        if part.archetype == "reduce":
            module, fn, n_groups = reduce.part(part, b, str(j))
            helpers[module] = None
            fns.append(fn)
            scratch = reduce.SCRATCH
            call = f"red{j}(g - {g0}u, lid)"
        else:
            hs, lines = _body(part, b)
            helpers.update((h, None) for h in hs)
            n = part.out.size
            n_groups = -(-n // WG)
            fns.append(f"fn part{j}(i: u32) {{\n    if (i >= {n}u) {{ return; }}\n" + "\n".join(lines) + "\n}")
            call = f"part{j}((g - {g0}u) * {WG}u + lid)"
        g1 = g0 + n_groups
        branches.append(f"    if (g < {g1}u) {{ {call}; return; }}")
        g0 = g1
    src = "\n".join([b.decls()] + list(helpers) + [scratch] + fns) + "\n\n" + ENTRY.format(wg=WG) + \
        f"    let g = {GROUP_INDEX};\n" + "\n".join(branches) + "\n}\n"
    return src, b.bufs, grid(g0)


SHARED_MAX_ELEMENTS = int(os.environ.get("MEGANEURA_SHARED_MAX_ELEMENTS", 1 << 16))


def _render_shared(kernel):
    """``render_multi`` with one body per form: pointwise parts whose bodies differ only in
    the buffers they bind and in their size (the optimizer's update of each parameter; every
    layer's copy of an elementwise step) become one function ``form{f}(p, i, n)`` that reads
    and writes its buffers through arrays of buffers indexed by ``p``, the part's position in
    its form (a role every part binds to the same buffer stays a plain binding). The driver
    then compiles each body once instead of once per part (the U-Net's copies, zero fills and
    small parameters' updates); parts past ``SHARED_MAX_ELEMENTS`` keep their own bodies.
    ``locate(g)`` maps the workgroup to (form or reduction, position, first workgroup, size);
    the index is uniform over the workgroup, as arrays of buffers require. None where no two
    parts are alike."""
    from . import reduce
    b = Bindings()
    parts = kernel.spec["parts"]
    forms, bodies = {}, {}
    for j, part in enumerate(parts):
        if part.archetype != "reduce":
            pb = Bindings()
            hs, lines = _body(part, pb)
            # a large part keeps a body of its own: reading buffers through an array costs each
            # element a descriptor fetch (H200: SmolLM2's train step 1% slower with its optimizer
            # updates of 0.1-28 M elements shared), which only small parts make up for in compile time
            key = form_key(pb, (tuple(hs), tuple(lines))) + ((j,) if part.out.size > SHARED_MAX_ELEMENTS else ())
            members = forms.setdefault(key, [])
            bodies[j] = key, len(members)       # the form, the part's position in it
            members.append(pb)
    if all(len(members) == 1 for members in forms.values()):
        return None         # nothing alike: the launch keeps ``render_multi``'s text
    fns, helpers, ranges, ids, scratch, g0 = [], {}, [], {}, "", 0
    for j, part in enumerate(parts):
        if part.archetype == "reduce":
            module, fn, n_groups = reduce.part(part, b, str(j))
            helpers[module] = None
            fns.append(fn)
            scratch = reduce.SCRATCH
            ids[j] = len(ids)
            call = f"red{j}(g - at.z, lid)"
            ranges.append((g0 + n_groups, ids[j], 0, g0, 0, call))
        else:
            key, slot = bodies[j]
            members = forms[key]
            if key not in ids:          # the form's body, bound at its first part
                ids[key] = len(ids)
                hs, lines = key[0]
                # each helper once in the module: the reductions' modules skip those emitted
                new = [h for h in HELPERS if HELPERS[h] in hs and h not in b.helpers_done]
                b.helpers_done.update(new)
                helpers.update((HELPERS[h], None) for h in new)
                b.enable_f16 |= key[3]
                body = bind_roles(b, members, "\n".join(lines), "p")
                fns.append(f"fn form{ids[key]}(p: u32, i: u32, n: u32) {{\n    if (i >= n) {{ return; }}\n{body}\n}}")
            n_groups = -(-part.out.size // WG)
            call = f"form{ids[key]}(at.y, (g - at.z) * {WG}u + lid, at.w)"
            ranges.append((g0 + n_groups, ids[key], slot, g0, part.out.size, call))
        g0 += n_groups
    where = [f"    if (g < {end}u) {{ return vec4<u32>({i}u, {slot}u, {start}u, {n}u); }}"
             for end, i, slot, start, n, _ in ranges]
    locate = "fn locate(g: u32) -> vec4<u32> {\n" + "\n".join(where) + \
        f"\n    return vec4<u32>({NOWHERE}u, 0u, 0u, 0u);\n}}"
    calls = {i: call for _, i, _, _, _, call in ranges}
    branches = [f"    if (at.x == {i}u) {{ {call}; return; }}" for i, call in sorted(calls.items())]
    src = "\n".join([b.decls()] + list(helpers) + [scratch] + fns + [locate]) + "\n\n" + ENTRY.format(wg=WG) + \
        f"    let g = {GROUP_INDEX};\n    let at = locate(g);\n" + "\n".join(branches) + "\n}\n"
    return src, b.flat(), grid(g0)


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
