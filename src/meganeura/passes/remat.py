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

PERSISTENT = ("input", "parameter", "state", "constant")
VIEW_OPS = ("reshape", "permute", "slice", "broadcast_to")
MAX_CLONE = 16          # elementwise nodes recomputed per value, at most
SMALL = 8               # a leaf this many times smaller than the value is free to keep


def _elementwise(t) -> bool:
    return t.op in VIEW_OPS or (t.op in OPS and "wgsl" in OPS[t.op].extra)


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

    def closure(t):
        """(elementwise nodes recomputed for t, leaves they read), or None if too deep."""
        inner, leaves, stack = [], {}, [t]
        seen = {t.id}
        while stack:
            u = stack.pop()
            inner.append(u)
            for i in u.inputs:
                if i.id in seen:
                    continue
                seen.add(i.id)
                if candidate(i) and i.size * SMALL > t.size:
                    stack.append(i)
                else:
                    leaves[i.id] = i
            if len(inner) > MAX_CLONE:
                return None
        return inner, leaves

    def large(leaf, t):
        return leaf.op not in PERSISTENT and leaf.size * SMALL > t.size

    cands = {}
    for tid in late_readers:
        t = nodes[pos[tid]]
        if candidate(t) and t.op not in VIEW_OPS:
            c = closure(t)
            if c is not None:
                cands[tid] = c
    if not cands:
        return None, targets
    # group values whose recomputation reads the same large leaves; a group is recomputed
    # when its new large leaves (those not read late anyway) are smaller than its values
    parent = {tid: tid for tid in cands}

    def find(x):
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x
    owner = {}
    for tid, (_, leaves) in cands.items():
        for leaf in leaves.values():
            if large(leaf, nodes[pos[tid]]):
                o = owner.setdefault(leaf.id, tid)
                parent[find(tid)] = find(o)
    groups: dict = {}
    for tid in cands:
        groups.setdefault(find(tid), []).append(tid)
    chosen = set()
    for members in groups.values():
        saved = sum(nodes[pos[m]].size * nodes[pos[m]].dtype.np.itemsize for m in members)
        new_leaves = {}
        for m in members:
            for leaf in cands[m][1].values():
                if large(leaf, nodes[pos[m]]) and (leaf.id not in late_readers or leaf.id in cands):
                    new_leaves[leaf.id] = leaf.size * leaf.dtype.np.itemsize
        if sum(new_leaves.values()) < saved:
            chosen.update(members)
    if not chosen:
        return None, targets
    return _rebuild(nodes, pos, boundary, chosen, cands, targets)


def _rebuild(nodes, pos, boundary, chosen, cands, targets):
    """Copy the graph; backward readers of a chosen value read its clone, emitted (with
    the clones of the elementwise nodes between it and its leaves) just before its first
    backward reader."""
    g = Graph()
    m: dict = {}             # old id -> its copy
    clones: dict = {}        # old id -> its recomputation

    def clone(t, leaves):
        c = clones.get(t.id)
        if c is None:
            ins = [m[i.id] if i.id in leaves else clone(i, leaves) for i in t.inputs]
            c = clones[t.id] = g._append(t.op, ins, t.attrs, t.shape, t.dtype, t.name + ".remat")
        return c

    for i, t in enumerate(nodes):
        if t.op == "input":
            n = g.input(t.name, t.shape, t.dtype)
        elif t.op == "parameter":
            n = g.parameter(t.name, t.shape, t.dtype, init=t.attrs.get("init"))
        elif t.op == "state":
            n = g.state(t.name, t.shape, t.dtype, init=t.attrs.get("init"))
        else:
            ins = [clone(x, cands[x.id][1]) if i > boundary and x.id in chosen else m[x.id] for x in t.inputs]
            n = g._append(t.op, ins, t.attrs, t.shape, t.dtype, t.name)
        m[t.id] = n
    return g, [m[t.id] for t in targets]
