"""Rematerialisation: recompute cheap forward values in the backward pass instead of
keeping them alive across it.

A forward elementwise value that the backward pass reads again (batch norm's centred input
``x - mean`` and its square, kept because the backward rule rebuilds them and common
subexpressions are merged) would otherwise stay in memory from the forward pass to the end
of backward. Here the backward readers get a clone of its elementwise expression, computed
next to them from the expression's leaves: the outputs of real kernels (matmuls, norms,
reductions), persistent values and small broadcast operands.

The trade is made per group of values that share leaves, and only where it saves memory:
the leaves that the backward pass would not keep anyway must take fewer bytes than the
values they replace (batch norm: the convolution output instead of ``x - mean`` and
``(x - mean)^2``). The cost is some extra elementwise work, which the schedule mostly fuses
into the backward kernels that read the clones.
"""
from __future__ import annotations

from ..graph import Graph, Tensor
from ..ops.registry import OPS
from ..reference import needed_nodes
from .lower import copy_leaf

PERSISTENT = ("input", "parameter", "state", "constant")
VIEW_OPS = ("reshape", "permute", "slice", "broadcast_to")
MAX_CLONE = 16          # elementwise nodes recomputed per value, at most
SMALL = 8               # a leaf this many times smaller than the value is free to keep
BYTES_PER_LAUNCH = 2 ** 20   # the least saving that pays for a launch of its own (~7 us on an H200)


INDEX_OPS = ("im2col",)  # pure gathers, as cheap to redo as to read back (a max pool's windows)


def _elementwise(t) -> bool:
    return t.op in VIEW_OPS or t.op in INDEX_OPS or (t.op in OPS and OPS[t.op].extra.get("pointwise", False))


def _absorbs(reader) -> bool:
    """A clone read by ``reader`` is computed inside its kernel (an elementwise consumer,
    a reduction's prologue), costing no launch of its own."""
    return _elementwise(reader) or reader.op.startswith("reduce_")


def rematerialize(targets: list[Tensor], n_forward: int) -> tuple[Graph | None, list[Tensor]]:
    """``targets``: a lowered graph's targets, the first ``n_forward`` of them the forward
    outputs (and loss). Returns (new graph, its targets), or (None, targets) when nothing
    is worth recomputing."""
    if n_forward >= len(targets) or n_forward == 0:
        return None, targets
    nodes = needed_nodes(targets)
    pos = {t.id: i for i, t in enumerate(nodes)}
    boundary = max(pos[t.id] for t in targets[:n_forward])
    late_readers: dict = {}          # forward node id -> its consumers after the boundary
    for t in nodes[boundary + 1:]:
        for i in t.inputs:
            if pos[i.id] <= boundary:
                late_readers.setdefault(i.id, []).append(t)
    target_ids = {t.id for t in targets}

    def candidate(t):
        return _elementwise(t) and t.op not in PERSISTENT and t.id not in target_ids and t.size > 0

    # values alive after the boundary anyway: a clone reads them for free
    late = {tid: len(rs) for tid, rs in late_readers.items()}

    def closure(t):
        """(nodes recomputed for t, leaves they read), or None if too deep: recomputation
        goes through elementwise producers of t's size down to values alive anyway,
        real kernels' outputs, persistent values and small operands."""
        inner, leaves, stack = [], {}, [t]
        seen = {t.id}
        while stack:
            u = stack.pop()
            inner.append(u)
            for i in u.inputs:
                if i.id in seen:
                    continue
                seen.add(i.id)
                if candidate(i) and i.size * SMALL > t.size and i.id not in late:
                    stack.append(i)
                else:
                    leaves[i.id] = i
            if len(inner) > MAX_CLONE:
                return None
        return inner, leaves

    def nbytes(t):
        return t.size * t.dtype.np.itemsize

    # latest values first: a value's clone may read an earlier one that stays alive
    chosen = {}
    for tid in sorted(late_readers, key=lambda i: -pos[i]):
        t = nodes[pos[tid]]
        if not candidate(t):
            continue
        c = closure(t)
        if c is None:
            continue
        new = [leaf for leaf in c[1].values()
               if leaf.op not in PERSISTENT and leaf.size * SMALL > t.size and leaf.id not in late]
        saved = nbytes(t) - sum(nbytes(leaf) for leaf in new)
        # a clone that no reader absorbs is one more launch: worth it for a large saving
        if saved <= 0 or (saved < BYTES_PER_LAUNCH and not all(_absorbs(r) for r in late_readers[tid])):
            continue
        chosen[tid] = c[1]
        del late[tid]
        for leaf in c[1].values():
            late[leaf.id] = late.get(leaf.id, 0) + 1
    if not chosen:
        return None, targets
    return _rebuild(nodes, boundary, chosen, targets)


def _rebuild(nodes, boundary, chosen, targets):
    """Copy the graph; each backward reader of a chosen value reads its own clone, emitted
    just before it, so that a clone with one reader can fuse into it."""
    g = Graph()
    m: dict = {}             # old id -> its copy
    shared: dict = {}        # old id -> the clone that readers which cannot absorb it share

    def clone(t, leaves, memo):
        c = memo.get(t.id)
        if c is None:
            ins = [m[i.id] if i.id in leaves else clone(i, leaves, memo) for i in t.inputs]
            c = memo[t.id] = g._append(t.op, ins, t.attrs, t.shape, t.dtype, t.name + ".remat")
        return c

    for i, t in enumerate(nodes):
        if t.op in ("input", "parameter", "state"):
            n = copy_leaf(g, t)
        else:
            # a reader that absorbs its clone gets its own; the others share one per value
            memo = {} if _absorbs(t) else shared
            ins = [clone(x, chosen[x.id], memo) if i > boundary and x.id in chosen else m[x.id] for x in t.inputs]
            n = g._append(t.op, ins, t.attrs, t.shape, t.dtype, t.name)
        m[t.id] = n
    del clone               # it holds itself through its cell: a cycle holding every copy
    return g, [m[t.id] for t in targets]
