"""Updates applied as soon as their gradients are complete (the fused backward + optimizer
step).

A training step's graph lists the optimizer's update after the whole backward pass, so in
launch order every gradient would stay alive until the last one is done: the whole model's
gradients at once (SmolLM2-135M: 513 MiB). Here the update's own nodes (the moments, the
decayed and the new weight) move up to just after the gradient they read is computed, so
a gradient is consumed, and its buffer free again, soon after the backward pass has
finished it (PyTorch's optimizer step in a gradient hook). Updates wait until the
gradients ready make 1/UPDATE_GROUPS of all of them by bytes (MIN_GROUP_BYTES at least),
so that they still share launches with each other (a merged launch of updates instead of
one per parameter); a model whose gradients are smaller keeps its updates at the end. The
rest of the graph keeps its order.

An update's own nodes are found from the graph alone: the nodes that read an input or
state that no other target needs (an optimizer's moment, the learning rate) or such a
node, and the elementwise nodes all
of whose readers are own nodes that read a parameter being updated (SGD's weight decay
``g + wd * p``). A gradient itself, and everything it is computed from, stays where the
backward pass puts it.

The graph is pure, so any topological order computes the same values; the only care is
for the in-place writes (``compilation.inplace``): a new value of a parameter or state
is written over the old one only if nothing reads the old one afterwards, so a moved node
that reads a parameter or state being updated waits for that tensor's other readers.
"""
from __future__ import annotations

from ..graph import Graph, Tensor
from ..reference import needed_nodes
from .lower import LEAVES, copy_leaf
from .remat import _elementwise

UPDATE_GROUPS = 8       # updates wait for this fraction of the gradients' bytes, to share launches
MIN_GROUP_BYTES = 16 * 2 ** 20   # and for this many at least: a group is a launch of its own (~7 us on an H200)


def _ancestors(targets) -> set:
    seen, stack = set(), list(targets)
    while stack:
        t = stack.pop()
        if t.id not in seen:
            seen.add(t.id)
            stack.extend(t.inputs)
    return seen


def _nbytes(t) -> int:
    return t.size * t.dtype.np.itemsize


def _own_nodes(nodes, main, readers_of, updated) -> set:
    """Ids of the updates' own nodes (see the module doc)."""
    own = set()
    for t in nodes:
        if t.id not in main and t.op not in LEAVES and \
                any(x.id in own or (x.op in ("input", "state") and x.id not in main) for x in t.inputs):
            own.add(t.id)
    # nodes before them that only they read and that are elementwise in an updated parameter
    # (directly or through such nodes): weight decay added to the gradient (a matmul's input
    # gradient reads the weight too, but is no elementwise function of it)
    derived = set(updated)
    for t in nodes:
        if t.id not in main and _elementwise(t) and any(x.id in derived for x in t.inputs):
            derived.add(t.id)
    for t in reversed(nodes):
        rs = readers_of.get(t.id, ())
        if t.id in derived and t.id not in own and rs and all(r.id in own for r in rs):
            own.add(t.id)
    return own


def early_update_order(targets: list[Tensor], update_positions, updated_names=()) -> list[Tensor] | None:
    """The needed nodes of ``targets`` in a launch order where the updates' own nodes come
    soon after their inputs; None if that is the graph's own order. ``update_positions``:
    the targets that are new values of parameters or states (named ``updated_names``)."""
    upd = set(update_positions)
    if not upd or len(upd) == len(targets):
        return None
    nodes = needed_nodes(targets)
    main = _ancestors([t for i, t in enumerate(targets) if i not in upd])
    readers_of: dict = {}
    for t in nodes:
        for x in t.inputs:
            readers_of.setdefault(x.id, []).append(t)
    names = set(updated_names)
    updated = {t.id for t in nodes if t.op in ("parameter", "state") and t.name in names}
    own = _own_nodes(nodes, main, readers_of, updated)
    if not own:
        return None
    # "free" own nodes read only leaves and other free nodes (1 - lr * weight_decay): placed
    # with their first reader, as the leaves are. The others wait for their value inputs
    # and for the other readers of an updated parameter or state they read.
    # Own nodes that a forward value makes ready (a running statistic's blend) are placed at
    # once; the others wait for a group.
    free, waits, users, grads = set(), {}, {}, {}
    for t in nodes:
        if t.id not in own:
            continue
        vals = [x for x in t.inputs if x.op not in LEAVES and x.id not in free]
        anti = set().union(*(_late_readers(x, readers_of, own) for x in t.inputs if x.id in updated))
        if not vals and not anti:
            free.add(t.id)
            continue
        deps = {x.id for x in vals} | anti
        waits[t.id] = len(deps)
        for d in deps:
            users.setdefault(d, []).append(t)
        grads[t.id] = [(x.id, _nbytes(x)) for x in vals if x.id not in own]
    group_bytes = max(sum(dict(b for v in grads.values() for b in v).values()) / UPDATE_GROUPS, MIN_GROUP_BYTES)
    order, placed, held, counted = [], set(), [], set()
    pending = [0]                         # bytes of the gradients whose updates are held
    forward_left = [len([t for t in nodes if t.id in main])]

    def put(t):
        for x in t.inputs:                # leaves and free nodes come with their first reader
            if (x.op in LEAVES or x.id in free) and x.id not in placed:
                put(x)
        order.append(t)
        placed.add(t.id)
        forward_left[0] -= t.id in main

    def release(ready, flush=False):
        """Place ``ready`` and what their placements make ready, in graph order; own nodes
        of the backward pass are held until enough gradients are ready, or ``flush``."""
        while ready:
            ready.sort(key=lambda u: -u.id)
            u = ready.pop()
            if u.id not in placed:
                put(u)
            for w in users.get(u.id, ()):
                waits[w.id] -= 1
                if waits[w.id] == 0:
                    if flush or (forward_left[0] > 0 and grads[w.id]):
                        ready.append(w)
                        continue
                    held.append(w)
                    for x, n in grads[w.id]:
                        if x not in counted:
                            counted.add(x)
                            pending[0] += n
        if held and (flush or pending[0] >= group_bytes):
            pending[0] = 0
            batch = held[:]
            held.clear()
            release(batch, flush=True)

    try:
        for t in nodes:
            if t.id in placed or t.id in own or (t.op in LEAVES and t.id not in main):
                continue
            release([t])
        release([], flush=True)
        for t in nodes:                   # free nodes that no other own node reads, unread leaves
            if t.id not in placed:
                release([t], flush=True)
    finally:
        # the two recursive closures hold themselves through their cells: emptied, they are
        # freed by reference counting instead of left as cycles for the collector
        del put, release
    if len(order) != len(nodes):
        raise RuntimeError(f"early_update_order: placed {len(order)} of {len(nodes)} nodes")
    if all(a is b for a, b in zip(order, nodes)):
        return None
    return order


def _late_readers(x, readers_of, own) -> set:
    """Ids of the nodes outside ``own`` that read leaf ``x``, directly or through views and
    elementwise nodes (which the schedule computes inside their readers' kernels), those
    readers included: the launches that read ``x``'s buffer are among them."""
    out, stack = set(), [x]
    while stack:
        u = stack.pop()
        for r in readers_of.get(u.id, ()):
            if r.id not in own and r.id not in out:
                out.add(r.id)
                if _elementwise(r):
                    stack.append(r)
    return out


def reorder(targets: list[Tensor], order: list[Tensor]) -> tuple[Graph, list[Tensor]]:
    """``targets``' graph copied with its nodes in ``order`` (a topological order)."""
    g = Graph()
    m: dict = {}
    for t in order:
        if t.op in ("input", "parameter", "state"):
            n = copy_leaf(g, t)
        else:
            n = g._append(t.op, [m[x.id] for x in t.inputs], t.attrs, t.shape, t.dtype, t.name)
        m[t.id] = n
    return g, [m[t.id] for t in targets]
