"""Rewrite a graph so that only ops the GPU backend has kernels for remain.

Composite ops (softmax, norms, attention, ...) carry ``decompose`` in their registry
record; an op with a kernel of its own is kept as it is. The rewrite copies the needed
part of the graph into a new Graph, decomposing until a fixpoint is reached.
"""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Tensor
from ..ops.registry import OPS, emit
from ..reference import needed_nodes


def _frozen(x):
    """A hashable stand-in for an attribute value (None where it has none)."""
    if isinstance(x, (str, int, float, bool, type(None))):
        return x
    if isinstance(x, (list, tuple)):
        items = tuple(_frozen(i) for i in x)
        return None if any(i is None and j is not None for i, j in zip(items, x)) else ("seq", items)
    if isinstance(x, np.ndarray):
        return ("array", x.dtype.str, x.shape, x.tobytes())
    if isinstance(x, dict):
        items = tuple((k, _frozen(v)) for k, v in sorted(x.items()))
        return None if any(v is None and x[k] is not None for k, v in items) else ("map", items)
    return None


def _cse_key(t: Tensor, ins):
    """Nodes with equal keys compute the same value: one is kept (common subexpressions,
    such as a forward quantity that a backward rule rebuilds)."""
    attrs = _frozen(t.attrs)
    if attrs is None:
        return None
    return (t.op, tuple(i.id for i in ins), t.dtype.name, attrs)


LEAVES = ("input", "parameter", "state", "constant")


def copy_leaf(g: Graph, t: Tensor) -> Tensor:
    """Leaf ``t`` (input, parameter, state or constant) declared again in graph ``g``."""
    if t.op == "input":
        return g.input(t.name, t.shape, t.dtype)
    if t.op == "parameter":
        return g.parameter(t.name, t.shape, t.dtype, init=t.attrs.get("init"))
    if t.op == "state":
        return g.state(t.name, t.shape, t.dtype, init=t.attrs.get("init"))
    return g.constant(t.attrs["value"], t.dtype)


def _copy(targets: list[Tensor], keep, rewrite=None) -> tuple[Graph, list[Tensor], bool]:
    """``targets`` copied into a new graph, each node decomposed once where its op has a
    decomposition and ``keep`` refuses it; ``changed``: something was decomposed."""
    g = Graph()
    m: dict[int, Tensor] = {}
    changed = False
    for t in needed_nodes(targets):
        if t.op in LEAVES:
            n = copy_leaf(g, t)
        else:
            ins = [m[i.id] for i in t.inputs]
            dec = OPS[t.op].extra.get("decompose")
            n = rewrite(t, ins) if rewrite is not None else None
            if n is not None:
                pass
            elif keep(t) or dec is None:
                n = _same_op(g, t, ins)
            else:
                n = dec(*ins, **t.attrs)
                changed = True
                if n.shape != t.shape or n.dtype is not t.dtype:
                    raise RuntimeError(f"decompose of {t.op} gave {n.shape} {n.dtype}, expected {t.shape} {t.dtype}")
        m[t.id] = n
    return g, [m[t.id] for t in targets], changed


def _merge_common(targets: list[Tensor]) -> list[Tensor]:
    """Common subexpressions of the lowered graph merged in place: each needed node, in
    order, whose key (``_cse_key``, over its inputs as merged so far) an earlier needed node
    has, is replaced by that node in its readers. The first needed occurrence is kept, so
    the graph's order is what a copy without the duplicates would have; the lowering's own
    graph is rewired rather than copied once more (SmolLM2's training step: 5.5k nodes)."""
    seen: dict = {}
    merged: dict[int, Tensor] = {}          # node id -> the earlier node standing for it
    for t in needed_nodes(targets):
        if merged:
            ins = tuple(merged.get(i.id, i) for i in t.inputs)
            if any(a is not b for a, b in zip(ins, t.inputs)):
                t.inputs = ins
        if t.op in ("input", "parameter", "state"):
            continue
        key = _cse_key(t, t.inputs)
        if key is None:
            continue
        found = seen.get(key)
        if found is None:
            seen[key] = t
        else:
            merged[t.id] = found
    return [merged.get(t.id, t) for t in targets]


def _same_op(g: Graph, t: Tensor, ins) -> Tensor:
    """``t``'s op over ``ins`` in ``g``; when the inputs have the shapes and dtypes of
    ``t``'s, the node is copied without running the shape rule again."""
    if all(a.shape == b.shape and a.dtype is b.dtype for a, b in zip(ins, t.inputs)):
        return g._append_known(t.op, ins, dict(t.attrs), t.shape, t.dtype)
    return emit(t.op, ins, **t.attrs)


def _lowerable(g: Graph, keep) -> bool:
    """Some node of ``g`` still has to be decomposed (a decomposition emitted a composite)."""
    return any(t.inputs and OPS[t.op].extra.get("decompose") is not None and not keep(t) for t in g.nodes)


def lower_to_primitives(targets: list[Tensor], keep, rewrite=None) -> tuple[Graph, list[Tensor]]:
    """A new graph computing ``targets`` where every node satisfies ``keep(node)`` or has no
    decomposition. Returns the graph and the targets' counterparts, in order.
    ``rewrite(node, new_inputs)`` may replace a node of the original graph (first pass only)."""
    g, new, changed = _copy(targets, keep, rewrite)
    for _ in range(8):
        if not changed or not _lowerable(g, keep):
            break
        done = g
        g, new, changed = _copy(new, keep)
        done._drop_nodes()
    new = _merge_common(new)
    missing = sorted({t.op for t in needed_nodes(new) if t.op not in ("input", "parameter", "state", "constant")
                      and not keep(t)})
    if missing:
        raise NotImplementedError(f"no GPU kernel or decomposition for op(s) {missing}")
    return g, new
