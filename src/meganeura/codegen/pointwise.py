"""The pointwise archetype: one thread per output element evaluating a fused expression
tree whose leaves are strided (possibly broadcast) views."""
from __future__ import annotations

import os

from .common import WG, Bindings, broadcast_view_strides, coalesce, grid, wgsl_type
from .expr import ExprWriter, Node
from .expr_ast import call, coords, offset_expr
from .kernel_ast import Convert, Function, Let, Load, Name, Return, printed, u32
from .pointwise_ast import _uses_coords, kernel_tree, multi_tree, shared_tree


def sum_kernel(name, leaves, out):
    """A pointwise kernel writing ``out`` = the sum of the views ``leaves`` (the partial
    results of a kernel split over its reduction: split-K, the flash backward's splits),
    which fusion treats like any other: epilogues, merging."""
    from ..schedule import Kernel
    total = ("leaf", 0)
    for j in range(1, len(leaves)):
        total = ("op", Node("add", out.dtype), [total, ("leaf", j)])
    return Kernel(name, "pointwise", {"expr": total, "dtype": out.dtype}, out, list(leaves))


def operand_function(operand_spec, reads, bind: Bindings, name) -> list:
    """``fn name(i0: u32) -> f32``: the value a pointwise kernel would have stored at flat index
    ``i`` of its (contiguous) output, for a matmul that computes its operand in its loads
    instead of reading a stored one (``fuse.fuse_pointwise_operands``): the helper functions
    the expression calls, then it."""
    shape = operand_spec["shape"]
    strides = [broadcast_view_strides(v, shape) for v in reads]
    if not _uses_coords(operand_spec["expr"]):
        shape, strides = coalesce(shape, strides)
    stmts = [Let("i", call("min", (Name("i0", "u32"), u32(operand_spec["size"] - 1))))] + coords(Name("i", "u32"), shape)
    leaf_vars = []
    for k, v in enumerate(reads):
        bi = bind.index(v.buf, v.dtype)
        bind.scalar.add(bi)
        stmts.append(Let(f"v{k}", Load(bi, offset_expr(v.offset, strides[k]), wgsl_type(v.dtype))))
        leaf_vars.append((Name(f"v{k}", wgsl_type(v.dtype)), v.dtype))
    w = ExprWriter(lambda e: leaf_vars[e[1]], last_coord=Name(f"c{len(shape) - 1}", "u32"), ast=True)
    val, _ = w.emit(operand_spec["expr"])
    fn = Function(name, (Name("i0", "u32"),), tuple(stmts + w.stmts + [Return(Convert("f32", val))]), "f32")
    return w.helper_functions(bind) + [fn]


def render(kernel) -> tuple[str, list, tuple]:
    """WGSL text, the bound logical buffers (binding order), and the workgroup counts."""
    if kernel.archetype == "multi":
        return render_multi(kernel)
    n = kernel.out.size
    tree, bufs = kernel_tree(kernel)        # (its GLSL: ``kernel_ast.print_glsl``)
    return printed(tree), bufs, grid(-(-n // WG))


def render_multi(kernel, array_limit=0):
    """Independent pointwise kernels and reductions in one dispatch: each owns a range of
    workgroups (horizontal fusion: one launch and one barrier instead of one per kernel).
    ``array_limit``: the runtime binds arrays of buffers, at most this many buffers a kernel,
    and parts alike but for their buffers share one body where that stays within the limit
    (an array binds a buffer two parts share twice, which the fusion passes counted once):
    pointwise parts whose bodies differ only in the buffers they bind and in their size (the
    optimizer's update of each parameter; every layer's copy of an elementwise step) become
    one function ``form{f}(p, i, n)`` that reads and writes its buffers through arrays of
    buffers indexed by ``p``, the part's position in its form (a role every part binds to the
    same buffer stays a plain binding). The driver then compiles each body once instead of
    once per part (the U-Net's copies, zero fills and small parameters' updates); parts past
    ``SHARED_MAX_ELEMENTS`` keep their own bodies. ``locate(g)`` maps the workgroup to (form
    or reduction, position, first workgroup, size); the index is uniform over the workgroup,
    as arrays of buffers require (``pointwise_ast.shared_tree``)."""
    if array_limit:
        # a large part keeps a body of its own: reading buffers through an array costs each
        # element a descriptor fetch (H200: SmolLM2's train step 1% slower with its optimizer
        # updates of 0.1-28 M elements shared), which only small parts make up for in compile time
        shared = shared_tree(kernel, SHARED_MAX_ELEMENTS)
        if shared is not None and len(shared[1]) <= array_limit:
            return printed(shared[0]), shared[1], grid(shared[2])
    tree, bufs, groups = multi_tree(kernel)
    return printed(tree), bufs, grid(groups)


SHARED_MAX_ELEMENTS = int(os.environ.get("MEGANEURA_SHARED_MAX_ELEMENTS", 1 << 16))
