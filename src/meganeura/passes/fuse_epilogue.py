"""The ``epilogue`` fusion pass: a pointwise kernel that is the only reader of another
kernel's output becomes that kernel's epilogue (matmul + bias/activation/residual, reductions
+ scale, softmax/norm + mul, ...), its store permuted where the pointwise kernel transposes,
so the intermediate is never stored; a pointwise producer feeding a single-output kernel's
epilogue is absorbed into it."""
from __future__ import annotations

from ..codegen.common import broadcast_view_strides
from ..schedule import MAX_INLINE_DEPTH, Kernel, View, contiguous_strides, expr_depth, reshape_view
from .fuse_index import EPILOGUE_ARCHETYPES, _has_rleaf, _in_place, _permutes, _relabel, _same_elements, _splice


def _store_permuted(k, p, uses, ki, pi) -> bool:
    """``p`` only copies ``k``'s output into another layout: ``k`` stores there itself."""
    if p.spec["expr"] != ("leaf", 0) or len(p.reads) != 1 or not p.out.is_contiguous():
        return False
    leaf = p.reads[0]
    if not p.spec.get("flat_leaf") and leaf.shape != p.out.shape:
        return False
    if "store_map" in k.spec or not _permutes(k, leaf) or uses.touched_between(p.out.buf, ki, pi):
        return False
    uses.remove(ki, k)
    uses.remove(pi, p)
    k.spec = {**k.spec, "shape": k.shape, "out_dtype": k.dtype,
              "store_map": (leaf.shape, tuple(leaf.strides)), "fd_from": len(k.epi_reads)}
    k.out = p.out
    k.name = f"{k.name}+{p.name}"
    uses.add(ki, k)
    return True


def _pointwise_store_permuted(k, p, leaf, uses, ki, pi) -> bool:
    """``p`` only copies pointwise kernel ``k``'s output into another layout through a
    transpose of its dims: ``k`` writes that layout directly (its output becomes a strided
    view of ``p``'s). ``k`` first iterates the leaf's dims in its own memory order, so a
    dim that the leaf splits (a sequence read back as height x width) is split in ``k``."""
    o = k.out
    if p.spec["expr"] != ("leaf", 0) or len(p.reads) != 1 or not p.out.is_contiguous() \
            or k.out.buf.kind != "temp" or k.spec.get("flat_leaf") or _has_rleaf(k.spec["expr"]) \
            or not o.is_contiguous() or p.out.dtype is not o.dtype:
        return False
    if not p.spec.get("flat_leaf") and leaf.shape != p.out.shape:
        return False
    if not uses.read_only_by(leaf.buf, pi, p.reads) or not _permutes(k, leaf) \
            or uses.touched_between(p.out.buf, ki, pi):
        return False
    # k's elements in memory order are the leaf's dims (size > 1) by falling stride
    order = sorted((d for d, n in enumerate(leaf.shape) if n != 1), key=lambda d: -leaf.strides[d])
    shape = tuple(leaf.shape[d] for d in order) or (1,)
    reads = [reshape_view(View(v.buf, o.shape, tuple(broadcast_view_strides(v, o.shape)), v.offset, v.dtype), shape)
             for v in k.reads]
    if any(v is None for v in reads):
        return False
    dest = contiguous_strides(leaf.shape)
    uses.remove(ki, k)
    uses.remove(pi, p)
    k.reads = reads
    k.out = View(p.out.buf, shape, tuple(dest[d] for d in order) or (0,), p.out.offset, p.out.dtype)
    k.name = f"{k.name}+{p.name}"
    uses.add(ki, k)
    return True


def _compose_pointwise(k, p, li, leaf, uses, ki, pi, max_bindings, kernels):
    """``p`` reads pointwise kernel ``k``'s output at the same elements (possibly through a
    reshape): one kernel evaluates both (for kernels made by lowerings, such as the split-K
    sum, or after views the schedule could not see through). It runs where ``k`` ran when
    ``p``'s other operands are ready there, else where ``p`` ran when ``k``'s operands
    still hold their values there. Returns where it runs, or None."""
    if k.spec.get("flat_leaf") or _has_rleaf(k.spec["expr"]) or k.out.buf.kind != "temp" or k.dtype is not leaf.dtype:
        return None
    if not uses.read_only_by(leaf.buf, pi, p.reads) or not _same_elements(k, leaf):
        return None
    copies = (k.spec["expr"], p.spec["expr"]) == (("leaf", 0), ("leaf", 0)) and len(k.reads) == len(p.reads) == 1
    if p.spec.get("flat_leaf"):
        # a copy into a contiguous layout, then a reshape that reads it in logical order:
        # the reshape reads the copy's source in its logical order instead
        if not copies or leaf.shape != k.out.shape or k.reads[0].shape != k.out.shape \
                or k.reads[0].dtype is not p.out.dtype:
            return None
        k_reads, others = list(k.reads), []
    elif leaf.shape != p.out.shape:
        return None
    else:
        k_reads, others = list(k.reads), [v for j, v in enumerate(p.reads) if j != li]
    if k.out.shape != p.out.shape and not p.spec.get("flat_leaf"):
        # k's operands (broadcast to k's shape) re-viewed in p's
        k_reads = [reshape_view(View(v.buf, k.out.shape, tuple(broadcast_view_strides(v, k.out.shape)),
                                     v.offset, v.dtype), p.out.shape) for v in k.reads]
    if any(v is None for v in k_reads):
        return None
    if len({id(v.buf) for v in k_reads + others} | {id(p.out.buf)}) > max_bindings:
        return None
    at_k = not any(uses.touched_between(v.buf, ki, pi, writes_only=True) for v in others) \
        and not uses.touched_between(p.out.buf, ki, pi)
    if not at_k and any(uses.touched_between(v.buf, ki + 1, pi, writes_only=True) for v in k.reads):
        return None
    leaf_map = _splice(len(p.reads), li, k.spec["expr"], len(k_reads))
    uses.remove(ki, k)
    uses.remove(pi, p)
    spec = {**k.spec, "expr": _relabel(p.spec["expr"], leaf_map), "dtype": p.out.dtype}
    if p.spec.get("flat_leaf"):
        spec["flat_leaf"] = True
    fused = Kernel(f"{k.name}+{p.name}", "pointwise", spec, p.out, k_reads + others)
    at = ki if at_k else pi
    kernels[ki] = kernels[pi] = None
    kernels[at] = fused
    uses.add(at, fused)
    return at


@_in_place
def fuse_epilogues(kernels, uses, max_bindings):
    for start in range(len(kernels)):
        pi = start
        while pi is not None:       # a composed pointwise kernel may absorb more producers
            pi = _absorb_producer(kernels, pi, uses, max_bindings)


def _absorb_producer(kernels, pi, uses, max_bindings):
    """Pointwise kernel ``pi`` joins one producer (as its epilogue, or composed with a
    pointwise producer). Returns the composed kernel's position to try again, else None."""
    p = kernels[pi]
    if p is None or p.archetype != "pointwise" or p.epilogue is not None:
        return None
    if _has_rleaf(p.spec["expr"]):
        return None         # indexed reads need the pointwise kernel's own coordinates
    p_depth = expr_depth(p.spec["expr"])
    for li, leaf in enumerate(p.reads):
        ki = uses.producer(leaf.buf, pi)
        if ki is None:
            continue
        k = kernels[ki]
        # a long chain stays cut where the schedule cut it (shallow expressions)
        if p_depth + expr_depth(k.spec["expr"] if k.archetype == "pointwise" else k.epilogue) > MAX_INLINE_DEPTH:
            continue
        if k.archetype == "pointwise":
            at = _compose_pointwise(k, p, li, leaf, uses, ki, pi, max_bindings, kernels)
            if at is not None:
                return at
            if _pointwise_store_permuted(k, p, leaf, uses, ki, pi):
                kernels[pi] = None
                return None
            continue
        if k.archetype not in EPILOGUE_ARCHETYPES or k.out.buf.kind != "temp" \
                or "index" in k.spec:      # a scatter stores where its data says
            continue
        if not uses.read_only_by(leaf.buf, pi, p.reads):
            continue
        if not _same_elements(k, leaf) or leaf.shape != p.out.shape:
            if _store_permuted(k, p, uses, ki, pi):
                kernels[pi] = None
                return None
            continue
        if k.archetype in ("matmul", "rows", "norm") and k.dtype.name != "f32":
            continue            # the stored value would have been rounded first
        # each operand as a view of p's iteration shape (broadcasts as zero strides): a
        # later fusion may change the kernel's output shape, never its element order
        others = [View(v.buf, p.out.shape, tuple(broadcast_view_strides(v, p.out.shape)), v.offset, v.dtype)
                  for j, v in enumerate(p.reads) if j != li]
        # the other operands must hold their values already where k runs, and the
        # output must not be touched in between
        if any(uses.touched_between(v.buf, ki, pi, writes_only=True) for v in others):
            continue
        if uses.touched_between(p.out.buf, ki, pi):
            continue
        bufs = {id(v.buf) for v in k.read_views() + others + k.outs} | {id(p.out.buf)}
        if len(bufs) > max_bindings:
            continue
        leaf_map = _splice(len(p.reads), li, k.epilogue or ("acc",), len(k.epi_reads))
        uses.remove(ki, k)
        uses.remove(pi, p)
        k.epilogue = _relabel(p.spec["expr"], leaf_map)
        k.epi_reads = list(k.epi_reads) + others
        k.spec = {**k.spec, "shape": k.shape, "out_dtype": k.dtype}
        k.out = p.out
        k.name = f"{k.name}+{p.name}"
        kernels[pi] = None
        uses.add(ki, k)
        return None
    return None
