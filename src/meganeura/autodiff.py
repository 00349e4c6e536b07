"""Reverse-mode automatic differentiation over the graph.

``grad(loss, wrt)`` walks the nodes in reverse order and calls each op's VJP rule, which
emits ordinary graph ops: the backward graph can be optimised and run like the forward.

Activation checkpointing (``checkpoint(fn, *args)``, torch.utils.checkpoint's): the nodes
``fn`` adds form a region whose values the backward pass does not read. When the backward
walk reaches the region, its forward nodes are emitted again from the region's inputs
(read through ``recompute`` identities, so the copies stay apart from the originals) and
the VJP rules read those copies: the forward values inside die as soon as the forward pass
is done with them, and only the region's inputs live on to the backward pass.
"""
from __future__ import annotations

import weakref

from .graph import SOURCE_OPS, Tensor, fmt_shape
from .ops.registry import OPS

# per graph: [(first node index, end index)] of each checkpointed region
_REGIONS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()
_ACTIVE: list = []          # graphs of the checkpoint calls in progress


def _graph_of(args, kwargs):
    from .nn.module import _find_graph, current_graph
    return _find_graph((list(args), kwargs)) or current_graph()


def checkpoint(fn, *args, **kwargs):
    """``fn(*args, **kwargs)``, its activations recomputed in the backward pass instead of
    kept (torch.utils.checkpoint.checkpoint): less memory for some more forward work. A
    module with ``activation_checkpointing = True`` runs its forward so. Nested calls are
    part of the outer region."""
    g = _graph_of(args, kwargs)
    if g is None:
        raise TypeError("checkpoint: call it on mg Tensors (inside a traced function or a graph build)")
    if g in _ACTIVE:
        return fn(*args, **kwargs)
    first = len(g.nodes)
    _ACTIVE.append(g)
    try:
        out = fn(*args, **kwargs)
    finally:
        _ACTIVE.remove(g)
    if len(g.nodes) > first:
        _REGIONS.setdefault(g, []).append((first, len(g.nodes)))
    return out


def checkpointed_regions(g) -> list:
    """[(first, end)] node ranges of ``g`` that ``checkpoint`` made."""
    return list(_REGIONS.get(g, ()))


class _Recompute:
    """The forward nodes of each region emitted again (once, when the backward walk first
    needs one), by original node id."""

    def __init__(self, g, upto):
        self.g, self.region_of, self.copies = g, {}, {}
        self.regions = [(a, min(b, upto)) for a, b in _REGIONS.get(g, ()) if a < upto]
        for k, (a, b) in enumerate(self.regions):
            for t in g.nodes[a:b]:
                if t.op not in SOURCE_OPS:
                    self.region_of[t.id] = k

    def __bool__(self):
        return bool(self.region_of)

    def value(self, t):
        """The tensor a VJP reads for forward value ``t``: its recomputed copy if ``t`` is
        inside a region, else ``t``."""
        k = self.region_of.get(t.id)
        return t if k is None else self._region(k)[t.id]

    def _region(self, k):
        m = self.copies.get(k)
        if m is not None:
            return m
        from .ops.elementwise import recompute
        m, entry = {}, {}
        a, b = self.regions[k]
        for t in self.g.nodes[a:b]:
            if t.op in SOURCE_OPS:
                continue
            ins = []
            for x in t.inputs:
                if x.id in m:
                    ins.append(m[x.id])
                elif x.op in SOURCE_OPS:
                    ins.append(x)       # kept by the session anyway
                else:                   # the region's input: kept, read through the barrier
                    if x.id not in entry:
                        entry[x.id] = recompute(x, k)
                    ins.append(entry[x.id])
            m[t.id] = self.g._append_known(t.op, ins, dict(t.attrs), t.shape, t.dtype)
        self.copies[k] = m
        return m


def grad(loss: Tensor, wrt, cotangent: Tensor | None = None) -> list[Tensor | None]:
    """Gradients of ``loss`` with respect to each tensor of ``wrt``.

    ``loss`` must be a scalar unless ``cotangent`` (same shape) is given. Integer tensors
    get ``None``; float tensors that ``loss`` does not depend on get zeros.
    """
    from . import ops
    wrt = list(wrt)
    g = loss.graph
    first = len(g.nodes)      # the nodes from here on are the backward pass's (Graph.backward_ids)
    for w in wrt:
        if not isinstance(w, Tensor) or w.graph is not g:
            raise ValueError(f"grad: {w!r} is not a tensor of the loss's graph")
    if cotangent is None:
        if loss.size != 1:
            raise ValueError(f"grad: loss {loss.name!r} has shape {fmt_shape(loss.shape)}; "
                             "a non-scalar loss needs an explicit cotangent")
        if not loss.dtype.is_float:
            raise TypeError(f"grad: loss {loss.name!r} has dtype {loss.dtype.name}, expected a float")
        cotangent = g.constant(1.0, dtype=loss.dtype) if loss.shape == () else \
            ops.broadcast_to(g.constant(1.0, dtype=loss.dtype), loss.shape)
    elif cotangent.shape != loss.shape:
        raise ValueError(f"grad: cotangent shape {fmt_shape(cotangent.shape)} differs from loss shape {fmt_shape(loss.shape)}")

    # only nodes on a path from some wrt tensor to the loss carry gradients
    wrt_ids = {w.id for w in wrt}
    depends = set()
    for t in g.nodes[:loss.id + 1]:
        if t.id in wrt_ids or any(i.id in depends for i in t.inputs):
            if t.dtype.is_float and (t.op in SOURCE_OPS or OPS[t.op].differentiable):
                depends.add(t.id)
    cts: dict[int, Tensor] = {loss.id: cotangent}
    again = _Recompute(g, loss.id + 1)
    for t in reversed(g.nodes[:loss.id + 1]):
        ct = cts.pop(t.id, None) if t.id not in wrt_ids else cts.get(t.id)
        if ct is None or not t.inputs or t.id not in depends:
            continue
        od = OPS[t.op]
        if not od.differentiable:
            continue
        if again and t.id in again.region_of:
            in_cts = od.vjp(ct, again.value(t), *[again.value(x) for x in t.inputs], **t.attrs)
        else:
            in_cts = od.vjp(ct, t, *t.inputs, **t.attrs)
        if len(in_cts) != len(t.inputs):
            raise RuntimeError(f"vjp of {t.op} returned {len(in_cts)} cotangents for {len(t.inputs)} inputs")
        for x, c in zip(t.inputs, in_cts):
            if c is None or x.id not in depends:
                continue
            if c.shape != x.shape:
                raise RuntimeError(f"vjp of {t.op} gave a cotangent of shape {fmt_shape(c.shape)} "
                                   f"for input {x.name!r} of shape {fmt_shape(x.shape)}")
            if c.dtype is not x.dtype:
                c = ops.cast(c, x.dtype)
            cts[x.id] = cts[x.id] + c if x.id in cts else c
    out = []
    for w in wrt:
        if not w.dtype.is_float:
            out.append(None)
        elif w.id in cts:
            out.append(cts[w.id])
        else:
            out.append(ops.broadcast_to(g.constant(0.0, dtype=w.dtype), w.shape) if w.shape else g.constant(0.0, dtype=w.dtype))
    g.backward_ids.update(range(first, len(g.nodes)))
    return out
