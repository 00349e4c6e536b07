"""Rewrite a graph so that only ops the GPU backend has kernels for remain.

Composite ops (softmax, norms, attention, ...) carry ``decompose`` in their registry
record; an op with a kernel of its own is kept as it is. The rewrite copies the needed
part of the graph into a new Graph, decomposing until a fixpoint is reached.
"""
from __future__ import annotations

from ..graph import Graph, Tensor
from ..ops.registry import OPS, emit
from ..reference import needed_nodes


def _copy(targets: list[Tensor], keep, rewrite=None) -> tuple[Graph, list[Tensor], bool]:
    g = Graph()
    m: dict[int, Tensor] = {}
    changed = False
    for t in needed_nodes(targets):
        if t.op == "input":
            n = g.input(t.name, t.shape, t.dtype)
        elif t.op == "parameter":
            n = g.parameter(t.name, t.shape, t.dtype, init=t.attrs.get("init"))
        elif t.op == "state":
            n = g.state(t.name, t.shape, t.dtype, init=t.attrs.get("init"))
        elif t.op == "constant":
            n = g.constant(t.attrs["value"], t.dtype)
        else:
            ins = [m[i.id] for i in t.inputs]
            dec = OPS[t.op].extra.get("decompose")
            n = rewrite(t, ins) if rewrite is not None else None
            if n is not None:
                pass
            elif keep(t) or dec is None:
                n = emit(t.op, ins, **t.attrs)
            else:
                n = dec(*ins, **t.attrs)
                changed = True
                if n.shape != t.shape or n.dtype is not t.dtype:
                    raise RuntimeError(f"decompose of {t.op} gave {n.shape} {n.dtype}, expected {t.shape} {t.dtype}")
        m[t.id] = n
    return g, [m[t.id] for t in targets], changed


def lower_to_primitives(targets: list[Tensor], keep, rewrite=None) -> tuple[Graph, list[Tensor]]:
    """A new graph computing ``targets`` where every node satisfies ``keep(node)`` or has no
    decomposition. Returns the graph and the targets' counterparts, in order.
    ``rewrite(node, new_inputs)`` may replace a node of the original graph (first pass only)."""
    g, new, changed = _copy(targets, keep, rewrite)
    for _ in range(8):
        if not changed:
            break
        g, new, changed = _copy(new, keep)
    missing = sorted({t.op for t in needed_nodes(new) if t.op not in ("input", "parameter", "state", "constant")
                      and not keep(t)})
    if missing:
        raise NotImplementedError(f"no GPU kernel or decomposition for op(s) {missing}")
    return g, new
