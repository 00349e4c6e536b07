"""The NumPy interpreter: runs any graph. It is the oracle for every backend.

Floats are computed in ``compute`` precision (f32 by default; f64 for finite differences);
tensors typed f16 are rounded through f16 after every op, as an f16 device would store them.
"""
from __future__ import annotations

import numpy as np

from .graph import Graph, Tensor, f16
from .ops.registry import OPS


def needed_nodes(outputs) -> list[Tensor]:
    """The nodes ``outputs`` depend on, in graph (topological) order."""
    seen, stack = set(), list(outputs)
    while stack:
        t = stack.pop()
        if t.id in seen:
            continue
        seen.add(t.id)
        stack.extend(t.inputs)
    g = outputs[0].graph
    return [g.nodes[i] for i in sorted(seen)]


def _normalize(t: Tensor, v, compute):
    v = np.asarray(v)
    if t.dtype.is_float:
        if t.dtype is f16:
            v = v.astype(np.float16)
        return v.astype(compute, copy=False)
    return v.astype(t.dtype.np, copy=False)


def evaluate(graph: Graph, outputs, values: dict, compute=np.float32) -> list[np.ndarray]:
    """Evaluate ``outputs``. ``values`` maps input and parameter names to arrays."""
    env = {}
    for t in needed_nodes(outputs):
        if t.op in ("input", "parameter", "state"):
            v = values[t.name]
        elif t.op == "constant":
            v = t.attrs["value"]
        else:
            try:
                v = OPS[t.op].ref(*(env[i.id] for i in t.inputs), **t.attrs)
            except Exception as e:  # name the node: a bare NumPy error is hard to place
                raise RuntimeError(f"reference: op {t.op} ({t.name!r}) failed: {e}") from e
        env[t.id] = _normalize(t, v, compute)
    return [env[o.id] for o in outputs]


class NumpyExecutor:
    """The ``numpy`` backend: evaluates a Program with the reference interpreter."""

    def __init__(self, program, values: dict):
        self.program = program
        self.values = values          # shared with the Session: name -> array
        self.grads = {}

    def set_value(self, name, arr):
        self.values[name] = arr

    def get_value(self, name):
        return self.values[name]

    def last_grads(self):
        if not self.grads:
            raise RuntimeError("grads: call compute_grads() first (step() applies its gradients without "
                               "keeping them)")
        return {n: v.copy() for n, v in self.grads.items()}

    def execute(self, feeds: dict, phase: str, fetch: bool = True):
        out = self._execute(feeds, phase)
        self.last_outputs = out
        return out if fetch else None

    def read_outputs(self):
        if getattr(self, "last_outputs", None) is None:
            raise RuntimeError("read_outputs: nothing has run yet")
        return self.last_outputs

    def _execute(self, feeds: dict, phase: str):
        p = self.program
        fetches, grad_names, upd, targets = p.targets(phase)
        vals = evaluate(p.graph, targets, {**self.values, **feeds}) if targets else []
        nf, ng = len(fetches), len(grad_names)
        if grad_names:
            self.grads = {n: v.astype(p.grads[n].dtype.np) for n, v in zip(grad_names, vals[nf:nf + ng])}
        elif phase in ("step", "micro"):
            self.grads = {}           # the parameters moved: older gradients are stale
        for (name, t), v in zip(upd, vals[nf + ng:]):
            self.values[name] = v.astype(t.dtype.np)
        return [v.astype(t.dtype.np) for t, v in zip(fetches, vals[:nf])]
