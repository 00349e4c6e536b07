"""Reverse-mode automatic differentiation over the graph.

``grad(loss, wrt)`` walks the nodes in reverse order and calls each op's VJP rule, which
emits ordinary graph ops: the backward graph can be optimised and run like the forward.
"""
from __future__ import annotations

from .graph import SOURCE_OPS, Tensor, fmt_shape
from .ops.registry import OPS


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
    for t in reversed(g.nodes[:loss.id + 1]):
        ct = cts.pop(t.id, None) if t.id not in wrt_ids else cts.get(t.id)
        if ct is None or not t.inputs or t.id not in depends:
            continue
        od = OPS[t.op]
        if not od.differentiable:
            continue
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
