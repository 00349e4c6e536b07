"""The op registry: every op is one ``OpDef`` record holding all that the stages need.

- ``infer(inputs, **attrs) -> (shape, dtype)``: the shape/dtype rule, run when the node is
  added; it raises ShapeError/TypeError naming the op, the tensors and what was expected.
- ``ref(*arrays, **attrs) -> ndarray``: the NumPy reference (keeps its inputs' float
  dtype, so the same code runs in f32 for the oracle and f64 for finite differences).
- ``vjp(ct, out, *inputs, **attrs) -> [Tensor | None per input]``: the reverse-mode rule,
  emitting ordinary graph ops.
- ``lower``: how the GPU backend runs it (``register_lowering``, called by the code generator:
  an op module never imports one); a pointwise op (``pointwise=True``) needs none, its scalar
  code is the code generator's too.
- ``differentiable``: False for comparisons, integer ops and stop_gradient.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from ..graph import DType, Graph, ShapeError, Tensor, dtype_of, fmt_shape


@dataclass
class OpDef:
    name: str
    infer: Callable
    ref: Callable
    vjp: Callable | None = None
    differentiable: bool = True
    lower: object = None
    extra: dict = field(default_factory=dict)


OPS: dict[str, OpDef] = {}


def register(name, infer, ref, vjp=None, differentiable=True, **extra) -> OpDef:
    if name in OPS:
        raise ValueError(f"op {name!r} registered twice")
    if differentiable and vjp is None:
        raise ValueError(f"op {name!r}: a differentiable op needs a vjp rule")
    od = OpDef(name, infer, ref, vjp, differentiable, extra=extra)
    OPS[name] = od
    return od


def register_lowering(op, rule):
    """``rule`` lowers ``op``'s nodes to kernels on the GPU backend (``OpDef.lower``)."""
    od = OPS.get(op)
    if od is None:
        raise KeyError(f"register_lowering: no op {op!r}")
    if od.lower is not None and od.lower is not rule:
        raise ValueError(f"register_lowering: op {op!r} already has a lowering ({od.lower.__qualname__})")
    od.lower = rule


def op_error(op, msg, *tensors):
    """A ShapeError that names the op and each tensor with its shape and dtype."""
    desc = ", ".join(f"{t.name!r} {fmt_shape(t.shape)} {t.dtype.name}" for t in tensors)
    return ShapeError(f"{op}: {msg}" + (f" (got {desc})" if desc else ""))


def graph_of(*xs) -> Graph:
    g = None
    for x in xs:
        if isinstance(x, Tensor):
            if g is None:
                g = x.graph
            elif x.graph is not g:
                raise ValueError(f"tensors {x.name!r} and another input belong to different graphs")
    if g is None:
        raise TypeError("an op needs at least one Tensor input")
    return g


def as_tensor(x, like: Tensor) -> Tensor:
    """Python scalars and arrays become constants of ``like``'s graph (and float dtype)."""
    if isinstance(x, Tensor):
        return x
    arr = np.asarray(x)
    dt = np.float32 if arr.dtype.kind == "f" and not like.dtype.is_float else like.dtype
    if type(x) in (float, int, bool):      # one node per value and dtype in the graph
        return like.graph.scalar_constant(x, dt)
    return like.graph.constant(arr, dt)     # refuses values the dtype cannot hold


def emit(op: str, inputs, name=None, **attrs) -> Tensor:
    """Add a node: check inputs, run the op's shape/dtype rule, append."""
    od = OPS[op]
    for i, x in enumerate(inputs):
        if not isinstance(x, Tensor):
            raise TypeError(f"{op}: input {i} must be a Tensor, got {type(x).__name__}")
    g = graph_of(*inputs)
    shape, dtype = od.infer(list(inputs), **attrs)
    return g._append(op, inputs, attrs, shape, dtype_of(dtype), name)


# ----------------------------------------------------------------------------- helpers
def broadcast_shapes(op, *tensors) -> tuple:
    """NumPy's broadcasting rule, in Python ints (np.broadcast_shapes refuses shapes whose
    size overflows; those are reported by the graph with their element count)."""
    first = tensors[0].shape
    if all(t.shape == first for t in tensors):
        return first
    shapes = {t.shape for t in tensors} - {()}     # scalar operands (optimizer constants) broadcast to anything
    if len(shapes) == 1:
        return shapes.pop()
    nd = max(t.ndim for t in tensors)
    out = []
    for i in range(nd):
        sizes = {t.shape[i - nd + t.ndim] for t in tensors if i - nd + t.ndim >= 0} - {1}
        if len(sizes) > 1:
            raise op_error(op, "shapes cannot be broadcast together (NumPy rules)", *tensors)
        out.append(sizes.pop() if sizes else 1)
    return tuple(out)


def same_dtype(op, *tensors) -> DType:
    d = tensors[0].dtype
    for t in tensors[1:]:
        if t.dtype is not d:
            raise TypeError(f"{op}: dtypes differ: " + ", ".join(f"{x.name!r} {x.dtype.name}" for x in tensors)
                            + "; cast one first (mg.ops.cast)")
    return d


def require_float(op, *tensors):
    for t in tensors:
        if not t.dtype.is_float:
            raise TypeError(f"{op}: {t.name!r} has dtype {t.dtype.name}, expected a float dtype (f32 or f16)")


def require_int(op, *tensors):
    for t in tensors:
        if t.dtype.is_float:
            raise TypeError(f"{op}: {t.name!r} has dtype {t.dtype.name}, expected an integer dtype (i32 or u32)")


def norm_dim(op, d, ndim, t=None) -> int:
    if not -ndim <= d < max(ndim, 1):
        raise ShapeError(f"{op}: dim {d} out of range for rank {ndim}" + (f" tensor {t.name!r} {fmt_shape(t.shape)}" if t is not None else ""))
    return d % max(ndim, 1)


def norm_dims(op, dim, ndim, t=None) -> tuple:
    """``dim=None`` means all axes; an int or a sequence otherwise. Sorted, unique."""
    if dim is None:
        return tuple(range(ndim))
    if isinstance(dim, (int, np.integer)):
        dim = (int(dim),)
    if ndim == 0:          # torch accepts dim 0 or -1 on a 0-d tensor: nothing to reduce
        for d in dim:
            if int(d) not in (0, -1):
                raise ShapeError(f"{op}: dim {d} out of range for a 0-d tensor" + (f" {t.name!r}" if t is not None else ""))
        return ()
    out = sorted({norm_dim(op, int(d), ndim, t) for d in dim})
    return tuple(out)


def unbroadcast(ct: Tensor, shape: tuple) -> Tensor:
    """Sum a cotangent back down to ``shape`` (undo NumPy broadcasting)."""
    from . import reduce_sum, reshape
    if ct.shape == tuple(shape):
        return ct
    lead = ct.ndim - len(shape)
    axes = list(range(lead)) + [lead + i for i, s in enumerate(shape) if s == 1 and ct.shape[lead + i] != 1]
    r = reduce_sum(ct, tuple(axes), keepdim=False) if axes else ct
    return reshape(r, shape) if r.shape != tuple(shape) else r

