"""The ONNX op table: each supported operator (default domain, opset 13 and later) mapped
onto meganeura ops, one small rule a row.

A rule takes ``(cx, ins, at)``: ``ins`` the node's inputs in order (meganeura Tensors for
values that depend on the model's inputs or weights, NumPy arrays for values known at
import, None for an omitted optional input) and ``at`` its attributes by name (ints,
floats, lists, strings, NumPy arrays). It returns a value or a tuple of them, one per node
output. Nodes whose inputs are all known at import never reach a rule: the importer
evaluates them with ``onnx.reference`` (shape arithmetic, masks, position ids), so the
table only needs what a model's inputs or weights can reach. ``Shape`` and ``Size`` read
only a tensor's static shape, so they always give import-time values.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import Tensor, f16, f32, i32, u32
from .errors import Unavailable, rule_table

TABLE, rule = rule_table()


# ONNX TensorProto element types -> meganeura dtypes (int64 and friends run as i32, bool as u32)
_FLOATS = {1: f32, 10: f16, 11: f32, 16: f32}
_BOOL = 9


def mg_dtype(onnx_type: int):
    if onnx_type in _FLOATS:
        return _FLOATS[onnx_type]
    return u32 if onnx_type == _BOOL else i32


def _ints(v) -> list:
    return [int(a) for a in np.asarray(v).reshape(-1)]


def _known(v, what):
    """An input that must be known at import (a shape, axes, sizes)."""
    if isinstance(v, Tensor):
        raise NotImplementedError(f"{what} computed from the model's inputs or weights (it must be known at import)")
    return v


def _operands(cx, *vals):
    """Tensors for the graph, NumPy constants as Python numbers where they are one value
    that adds no axis, else as graph constants in the tensor's dtype."""
    like = next((v for v in vals if isinstance(v, Tensor)), None)
    out = []
    for v in vals:
        if isinstance(v, np.ndarray) and v.size == 1 and (like is None or v.ndim <= like.ndim) and v.dtype != bool:
            s = v.reshape(()).item()
            out.append(float(s) if like is not None and like.dtype.is_float else s)
        else:
            out.append(cx.t(v, like=like))
    return out


def _binary(fn):
    def run(cx, ins, at):
        a, b = _operands(cx, ins[0], ins[1])
        return fn(a, b)
    return run


for _name, _fn in (("Add", ops.add), ("Sub", ops.sub), ("Mul", ops.mul), ("Equal", ops.eq), ("Less", ops.lt),
                   ("LessOrEqual", ops.le), ("Greater", ops.gt), ("GreaterOrEqual", ops.ge)):
    TABLE[_name] = _binary(_fn)


@rule("Div")
def _div(cx, ins, at):
    a, b = _operands(cx, ins[0], ins[1])
    if isinstance(a, Tensor) and not a.dtype.is_float:       # integer division truncates
        q = ops.trunc(ops.div(ops.cast(a, f32), ops.cast(b, f32) if isinstance(b, Tensor) else float(b)))
        return ops.cast(q, a.dtype)
    return ops.div(a, b)


@rule("Pow")
def _pow(cx, ins, at):
    x, e = _operands(cx, ins[0], ins[1])
    return ops.pow(x, float(e) if isinstance(e, (int, float)) else e)


@rule("Max", "Min")
def _extreme(cx, ins, at):
    fn = ops.maximum if cx.op_type == "Max" else ops.minimum
    vals = _operands(cx, *ins)
    out = vals[0]
    for v in vals[1:]:
        out = fn(out, v)
    return out


for _name, _fn in (("Sqrt", ops.sqrt), ("Erf", ops.erf), ("Tanh", ops.tanh), ("Relu", ops.relu),
                   ("Sigmoid", ops.sigmoid), ("Exp", ops.exp), ("Log", ops.log), ("Neg", ops.neg),
                   ("Abs", ops.abs), ("Reciprocal", ops.reciprocal), ("Sign", ops.sign)):
    TABLE[_name] = (lambda f: lambda cx, ins, at: f(ins[0]))(_fn)


@rule("HardSigmoid")
def _hardsigmoid(cx, ins, at):
    """max(0, min(1, alpha x + beta)); torch exports alpha = 1/6 (F.hardsigmoid)."""
    return ops.clamp(ins[0] * float(at.get("alpha", 0.2)) + float(at.get("beta", 0.5)), 0.0, 1.0)


@rule("HardSwish")
def _hardswish(cx, ins, at):
    return ops.hardswish(ins[0])


@rule("Gelu")
def _gelu(cx, ins, at):
    return ops.gelu(ins[0], approximate=at.get("approximate", "none"))


@rule("Softmax", "LogSoftmax")
def _softmax(cx, ins, at):
    fn = ops.softmax if cx.op_type == "Softmax" else ops.log_softmax
    return fn(ins[0], int(at.get("axis", -1)))


@rule("Where")
def _where(cx, ins, at):
    cond = cx.t(ins[0]) if not isinstance(ins[0], Tensor) else ins[0]
    a, b = ins[1], ins[2]
    if not isinstance(a, Tensor) and not isinstance(b, Tensor):      # a mask's two fills
        a = cx.t(a)
    a, b = _operands(cx, a, b)
    return ops.where(cond, a, b)


@rule("Not")
def _not(cx, ins, at):
    return ops.eq(ins[0], 0)


@rule("And", "Or")
def _logical(cx, ins, at):
    a, b = (ops.cast(v, u32) if isinstance(v, Tensor) else v for v in _operands(cx, ins[0], ins[1]))
    s = ops.add(a, b)
    return ops.ge(s, 2) if cx.op_type == "And" else ops.ge(s, 1)


@rule("Clip")
def _clip(cx, ins, at):
    lo = None if len(ins) < 2 or ins[1] is None else _operands(cx, ins[0], ins[1])[1]
    hi = None if len(ins) < 3 or ins[2] is None else _operands(cx, ins[0], ins[2])[1]
    return ops.clamp(ins[0], lo, hi)


@rule("Cast", "CastLike")
def _cast(cx, ins, at):
    x = ins[0]
    to = mg_dtype(at["to"]) if cx.op_type == "Cast" else \
        (ins[1].dtype if isinstance(ins[1], Tensor) else cx.dtype_of_array(ins[1]))
    if not isinstance(x, Tensor):                # a known value cast like a tensor: known still
        return np.asarray(x).astype(bool if to is u32 else to.np if to.is_float else np.int64)
    if to is u32 and x.dtype is not u32:          # to bool: nonzero
        return ops.ne(x, 0)
    return x if x.dtype is to else ops.cast(x, to)


@rule("Identity")
def _identity(cx, ins, at):
    return ins[0]


@rule("Dropout")
def _dropout(cx, ins, at):
    training = len(ins) > 2 and ins[2] is not None and bool(np.asarray(_known(ins[2], "training_mode")))
    if training:
        raise NotImplementedError("Dropout in training mode (randomness is not supported)")
    return ins[0], Unavailable("dropout's mask")


# ------------------------------------------------------------------------ shapes
@rule("Reshape")
def _reshape(cx, ins, at):
    x, shape = ins[0], _ints(_known(ins[1], "Reshape's shape"))
    if not at.get("allowzero", 0):
        shape = [x.shape[i] if s == 0 else s for i, s in enumerate(shape)]
    return ops.reshape(x, tuple(shape))


@rule("Transpose")
def _transpose(cx, ins, at):
    x = ins[0]
    perm = at.get("perm") or list(reversed(range(x.ndim)))
    return ops.permute(x, tuple(int(p) for p in perm))


@rule("Flatten")
def _flatten(cx, ins, at):
    x = ins[0]
    axis = int(at.get("axis", 1)) % (x.ndim + 1) if x.ndim else 0
    return ops.reshape(x, (int(np.prod(x.shape[:axis])), int(np.prod(x.shape[axis:]))))


def _axes(cx, ins, at, k=1):
    if len(ins) > k and ins[k] is not None:
        return _ints(_known(ins[k], f"{cx.op_type}'s axes"))
    return [int(a) for a in at["axes"]] if "axes" in at else None


@rule("Squeeze")
def _squeeze(cx, ins, at):
    x, axes = ins[0], _axes(cx, ins, at)
    if axes is None:
        axes = [i for i, s in enumerate(x.shape) if s == 1]
    keep = [s for i, s in enumerate(x.shape) if i not in {a % x.ndim for a in axes}]
    return ops.reshape(x, tuple(keep))


@rule("Unsqueeze")
def _unsqueeze(cx, ins, at):
    x, axes = ins[0], _axes(cx, ins, at)
    rank = x.ndim + len(axes)
    shape, src = [], iter(x.shape)
    where = {a % rank for a in axes}
    for i in range(rank):
        shape.append(1 if i in where else next(src))
    return ops.reshape(x, tuple(shape))


@rule("Concat")
def _concat(cx, ins, at):
    like = next(v for v in ins if isinstance(v, Tensor))
    ts = [v if isinstance(v, Tensor) else cx.t(v, like=like) for v in ins if v is not None]
    ts = [t for t in ts if t.size]
    return ts[0] if len(ts) == 1 else ops.concat(ts, int(at["axis"]))


@rule("Slice")
def _slice(cx, ins, at):
    x = ins[0]
    starts, ends = _ints(_known(ins[1], "Slice's starts")), _ints(_known(ins[2], "Slice's ends"))
    axes = _ints(_known(ins[3], "Slice's axes")) if len(ins) > 3 and ins[3] is not None else list(range(len(starts)))
    steps = _ints(_known(ins[4], "Slice's steps")) if len(ins) > 4 and ins[4] is not None else [1] * len(starts)
    for s, e, a, st in zip(starts, ends, axes, steps):
        a %= x.ndim
        idx = range(*slice(s, e, st).indices(x.shape[a]))
        if len(idx) == 0:
            raise NotImplementedError(f"a slice of axis {a} with no elements (zero-size tensors)")
        if len(idx) == x.shape[a] and st == 1:
            continue
        first, step = idx[0], idx.step
        if step < 0:                      # a reversed slice: forward on the flipped axis
            x, first, step = ops.flip(x, (a,)), x.shape[a] - 1 - idx[0], -step
        x = ops.slice(x, a, first, first + (len(idx) - 1) * step + 1, step)
    return x


@rule("Gather")
def _gather(cx, ins, at):
    x, ix = ins[0], ins[1]
    if not isinstance(x, Tensor):
        x = cx.t(x)
    axis = int(at.get("axis", 0)) % x.ndim
    if isinstance(ix, np.ndarray):
        ix = np.where(ix < 0, ix + x.shape[axis], ix)
        if ix.ndim == 0:
            i = int(ix)
            return ops.squeeze(ops.slice(x, axis, i, i + 1), axis)
        ix = cx.t(ix)
    if axis == 0 and x.ndim == 2 and x.dtype.is_float:       # an embedding table
        return ops.embedding(ix, x)
    flat = ops.index_select(x, axis, ops.reshape(ix, (ix.size,)))
    return ops.reshape(flat, x.shape[:axis] + ix.shape + x.shape[axis + 1:])


def _row_strides(lead):
    """Row strides of leading axes ``lead`` flattened into one (GatherND, ScatterND)."""
    return np.array([int(np.prod(lead[j + 1:])) for j in range(len(lead))], dtype=np.int64)


def _rows_of(ix, lead):
    """The flat row of each index tuple (the last axis of constant ``ix``, negative from the
    end) into axes ``lead`` flattened."""
    return (np.where(ix < 0, ix + np.array(lead), ix) * _row_strides(lead)).sum(-1).reshape(-1)


@rule("GatherND")
def _gather_nd(cx, ins, at):
    """data[tuple(index)] for each index of the last axis: a gather of rows of ``data`` with
    its leading ``k`` axes flattened."""
    x, ix = (ins[0] if isinstance(ins[0], Tensor) else cx.t(ins[0])), ins[1]
    if int(at.get("batch_dims", 0)):
        raise NotImplementedError(f"GatherND with batch_dims={at['batch_dims']}")
    k = ix.shape[-1]
    lead, rest = x.shape[:k], x.shape[k:]
    if isinstance(ix, np.ndarray):
        flat = cx.t(_rows_of(ix, lead))
    else:
        flat = ops.reshape(ops.sum(ix * cx.t(_row_strides(lead)), -1), (int(np.prod(ix.shape[:-1])),))
    rows = ops.index_select(ops.reshape(x, (int(np.prod(lead)),) + rest), 0, flat)
    return ops.reshape(rows, tuple(ix.shape[:-1]) + rest)


@rule("ScatterND")
def _scatter_nd(cx, ins, at):
    """``data`` with the slices ``data[tuple(index)]`` replaced by (``reduction="add"``: plus)
    the rows of ``updates``, for indices the model does not compute (torch exports slice
    assignment so: Swin's attention masks). With ``data``'s leading ``k`` axes flattened into
    rows, each row is kept or taken from one row of ``updates``: a gather and a select, both
    differentiable in ``data`` and ``updates``."""
    data, ix, upd = ins
    reduction = at.get("reduction", "none")
    reduction = reduction.decode() if isinstance(reduction, bytes) else reduction
    if not isinstance(ix, np.ndarray):
        raise NotImplementedError("ScatterND with indices the model computes (only constant indices import)")
    if reduction not in ("none", "add"):
        raise NotImplementedError(f"ScatterND with reduction={reduction!r} (none and add import)")
    x = data if isinstance(data, Tensor) else cx.t(data)
    u = upd if isinstance(upd, Tensor) else cx.t(upd)
    k = ix.shape[-1]
    lead, rest = x.shape[:k], x.shape[k:]
    n_rows, n_upd = int(np.prod(lead)), int(np.prod(ix.shape[:-1]))
    flat = _rows_of(ix, lead)
    if flat.size and (flat.min() < 0 or flat.max() >= n_rows):
        raise ValueError(f"ScatterND: an index lies outside data of shape {tuple(x.shape)}")
    if reduction == "add" and len(np.unique(flat)) != flat.size:
        raise NotImplementedError("ScatterND with reduction='add' and repeated indices")
    src = np.full(n_rows, -1, dtype=np.int64)
    src[flat] = np.arange(n_upd)          # a repeated index: its last update, as the reference does
    rows_x = ops.reshape(x, (n_rows,) + rest)
    rows_u = ops.reshape(u, (n_upd,) + rest)
    taken = ops.index_select(rows_u, 0, cx.t(np.maximum(src, 0).astype(np.int32)))
    hit = (src >= 0).reshape((n_rows,) + (1,) * len(rest))
    if reduction == "add":
        out = rows_x + ops.where(cx.t(hit), taken, 0.0)
    elif hit.all():
        out = taken
    else:
        out = ops.where(cx.t(hit), taken, rows_x)
    return ops.reshape(out, x.shape)


@rule("Split")
def _split(cx, ins, at):
    x = ins[0]
    axis = int(at.get("axis", 0)) % x.ndim
    if len(ins) > 1 and ins[1] is not None:
        sizes = _ints(_known(ins[1], "Split's sizes"))
    elif "split" in at:
        sizes = [int(s) for s in at["split"]]
    else:
        k = int(at.get("num_outputs", cx.n_outputs))
        step = -(-x.shape[axis] // k)
        sizes = [min(step, x.shape[axis] - i * step) for i in range(k)]
    return tuple(ops.split(x, sizes, axis))


@rule("Expand")
def _expand(cx, ins, at):
    x = ins[0]
    shape = tuple(np.broadcast_shapes(x.shape, tuple(_ints(_known(ins[1], "Expand's shape")))))
    return x if shape == x.shape else ops.broadcast_to(x, shape)


@rule("Shape")
def _shape(cx, ins, at):
    dims = np.array(ins[0].shape, dtype=np.int64)
    n = len(dims)
    start, end = int(at.get("start", 0)), int(at.get("end", n))
    return dims[start:end]


@rule("Size")
def _size(cx, ins, at):
    return np.array(int(np.prod(ins[0].shape)), dtype=np.int64)


@rule("SplitToSequence")
def _split_to_sequence(cx, ins, at):
    x = ins[0]
    axis = int(at.get("axis", 0)) % x.ndim
    if len(ins) > 1 and ins[1] is not None:
        sizes = _ints(_known(ins[1], "SplitToSequence's split"))
        if len(sizes) == 1 and np.asarray(ins[1]).ndim == 0:
            n = x.shape[axis]
            sizes = [min(sizes[0], n - i) for i in range(0, n, sizes[0])]
        parts = ops.split(x, sizes, axis)
    else:
        parts = ops.split(x, 1, axis)
        if not at.get("keepdims", 1):
            parts = [ops.squeeze(p, axis) for p in parts]
    return list(parts)


@rule("SequenceAt")
def _sequence_at(cx, ins, at):
    seq, i = ins[0], int(np.asarray(_known(ins[1], "SequenceAt's position")))
    return seq[i]


# ------------------------------------------------------------------------ reductions
def _reduce(fn):
    def run(cx, ins, at):
        x, axes = ins[0], _axes(cx, ins, at)
        keep = bool(at.get("keepdims", 1))
        if not axes:
            if at.get("noop_with_empty_axes", 0):
                return x
            axes = list(range(x.ndim))
        return fn(x, tuple(a % x.ndim for a in axes), keep)
    return run


TABLE["ReduceMean"] = _reduce(ops.mean)
TABLE["ReduceSum"] = _reduce(ops.sum)
TABLE["ReduceMax"] = _reduce(ops.amax)
TABLE["ReduceMin"] = _reduce(ops.amin)


# ------------------------------------------------------------------------ linear algebra
@rule("MatMul")
def _matmul(cx, ins, at):
    a, b = (v if isinstance(v, Tensor) else cx.t(v) for v in ins[:2])
    return ops.matmul(a, b)


@rule("Gemm")
def _gemm(cx, ins, at):
    a, b = (v if isinstance(v, Tensor) else cx.t(v) for v in ins[:2])
    c = ins[2] if len(ins) > 2 else None
    alpha, beta = float(at.get("alpha", 1.0)), float(at.get("beta", 1.0))
    if at.get("transA", 0):
        a = ops.transpose(a, 0, 1)
    if at.get("transB", 0) and alpha == 1.0:                     # x @ W.T (+ b): a linear layer
        bias = None
        if c is not None and beta == 1.0:
            bias = c if isinstance(c, Tensor) else cx.t(c, like=a)
            if bias.shape != (b.shape[0],):
                bias = None
        y = ops.linear(a, b, bias)
        if bias is not None or c is None:
            return y
    else:
        y = ops.matmul(a, ops.transpose(b, 0, 1) if at.get("transB", 0) else b)
        y = y if alpha == 1.0 else y * alpha
        if c is None:
            return y
    c = c if isinstance(c, Tensor) else cx.t(c, like=a)
    return y + (c if beta == 1.0 else c * beta)


# ------------------------------------------------------------------------ normalisation
@rule("BatchNormalization")
def _batch_norm(cx, ins, at):
    x, scale, bias, mean, var = (v if isinstance(v, Tensor) or v is None else cx.t(v, like=ins[0]) for v in ins[:5])
    eps, momentum = float(at.get("epsilon", 1e-5)), float(at.get("momentum", 0.9))
    if at.get("training_mode", 0):
        y = ops.batch_norm(x, None, None, scale, bias, True, 1.0 - momentum, eps)
        return y, Unavailable("batch normalization's running mean"), Unavailable("batch normalization's running var")
    return ops.batch_norm(x, mean, var, scale, bias, False, 1.0 - momentum, eps)


@rule("LayerNormalization")
def _layer_norm(cx, ins, at):
    x = ins[0]
    axis = int(at.get("axis", -1)) % x.ndim
    scale, bias = (v if isinstance(v, Tensor) or v is None else cx.t(v, like=x)
                   for v in (ins[1], ins[2] if len(ins) > 2 else None))
    y = ops.layer_norm(x, tuple(x.shape[axis:]), scale, bias, float(at.get("epsilon", 1e-5)))
    return y, Unavailable("layer normalization's mean"), Unavailable("layer normalization's inverse std")


# ------------------------------------------------------------------------ convolution and pooling
def _window(cx, at, x, kernel):
    """(strides, dilations, ((top, bottom), (left, right))) of a 2-D window op."""
    k = len(kernel)
    strides = [int(s) for s in at.get("strides", [1] * k)]
    dil = [int(d) for d in at.get("dilations", [1] * k)]
    pad = at.get("auto_pad", "NOTSET")
    if pad in ("SAME_UPPER", "SAME_LOWER"):
        pads = []
        for n, kk, s, d in zip(x.shape[2:], kernel, strides, dil):
            total = max(0, (-(-n // s) - 1) * s + d * (kk - 1) + 1 - n)
            lo = total // 2 if pad == "SAME_UPPER" else total - total // 2
            pads.append((lo, total - lo))
    elif pad == "VALID":
        pads = [(0, 0)] * k
    else:
        p = [int(v) for v in at.get("pads", [0] * 2 * k)]
        pads = [(p[i], p[i + k]) for i in range(k)]
    return strides, dil, pads


def _padded(x, pads, value=None):
    """``x`` with the asymmetric part of ``pads`` added explicitly; returns (x, symmetric pads)."""
    if all(lo == hi for lo, hi in pads):
        return x, [lo for lo, _ in pads]
    flat = [p for lo_hi in reversed(pads) for p in lo_hi]          # torch order: last axis first
    return ops.pad(x, flat, value=value), [0] * len(pads)


def _conv_1d_to_2d(x):
    return ops.unsqueeze(x, 2)


@rule("Conv")
def _conv(cx, ins, at):
    x, w = ins[0], ins[1] if isinstance(ins[1], Tensor) else cx.t(ins[1], like=ins[0])
    b = ins[2] if len(ins) > 2 else None
    b = b if b is None or isinstance(b, Tensor) else cx.t(b, like=x)
    if w.ndim not in (3, 4):
        raise NotImplementedError(f"{w.ndim - 2}-D convolution (1-D and 2-D are supported)")
    one_d = w.ndim == 3
    if one_d:
        x, w = _conv_1d_to_2d(x), _conv_1d_to_2d(w)
    stride, dil, pads = _window(cx, at if not one_d else _as_2d(at), x, w.shape[2:])
    x, sym = _padded(x, pads, value=0.0)
    y = ops.conv2d(x, w, b, tuple(stride), tuple(sym), tuple(dil), int(at.get("group", 1)))
    return ops.squeeze(y, 2) if one_d else y


def _as_2d(at):
    """A 1-D window op's attributes as the 2-D op's on a height-1 view."""
    out = dict(at)
    for key in ("strides", "dilations", "kernel_shape"):
        if key in at:
            out[key] = [1] + list(at[key])
    if "pads" in at:
        out["pads"] = [0, at["pads"][0], 0, at["pads"][1]]
    return out


def _require_2d(cx, x):
    if x.ndim != 4:
        raise NotImplementedError(f"{cx.op_type} of a {x.ndim}-D input (2-D pooling of (N, C, H, W) is supported)")


@rule("MaxPool")
def _max_pool(cx, ins, at):
    x = ins[0]
    _require_2d(cx, x)
    kernel = [int(k) for k in at["kernel_shape"]]
    stride, dil, pads = _window(cx, at, x, kernel)
    x, sym = _padded(x, pads, value=float("-inf"))
    y = ops.max_pool2d(x, tuple(kernel), tuple(stride), tuple(sym), tuple(dil), bool(at.get("ceil_mode", 0)))
    return y, Unavailable("max pooling's indices")


@rule("AveragePool")
def _avg_pool(cx, ins, at):
    x = ins[0]
    _require_2d(cx, x)
    kernel = [int(k) for k in at["kernel_shape"]]
    stride, dil, pads = _window(cx, at, x, kernel)
    if any(d != 1 for d in dil):
        raise NotImplementedError(f"AveragePool with dilations {dil}")
    include = bool(at.get("count_include_pad", 0))
    if not include and any(lo != hi for lo, hi in pads):
        raise NotImplementedError(f"AveragePool with asymmetric pads {pads} and count_include_pad=0")
    x, sym = _padded(x, pads, value=0.0)
    return ops.avg_pool2d(x, tuple(kernel), tuple(stride), tuple(sym), bool(at.get("ceil_mode", 0)), include)


@rule("GlobalAveragePool", "GlobalMaxPool")
def _global_pool(cx, ins, at):
    x = ins[0]
    fn = ops.mean if cx.op_type == "GlobalAveragePool" else ops.amax
    return fn(x, tuple(range(2, x.ndim)), True)


_PAD_MODES = {"constant": "constant", "reflect": "reflect", "edge": "replicate", "wrap": "circular"}


@rule("Pad")
def _pad(cx, ins, at):
    x = ins[0]
    pads = _ints(_known(ins[1], "Pad's pads"))
    value = ins[2] if len(ins) > 2 else None
    value = 0.0 if value is None else float(np.asarray(_known(value, "Pad's constant_value")).reshape(()))
    axes = list(range(x.ndim)) if len(ins) < 4 or ins[3] is None else \
        [a % x.ndim for a in _ints(_known(ins[3], "Pad's axes"))]
    mode = at.get("mode", "constant")
    if mode not in _PAD_MODES:
        raise NotImplementedError(f"Pad mode {mode!r} (constant, reflect, edge, wrap are supported)")
    begin = dict(zip(axes, pads[:len(axes)]))
    end = dict(zip(axes, pads[len(axes):]))
    torch_pads = []                   # torch's order: (before, after) of the last axis first
    for d in reversed(range(min(axes), x.ndim)):
        torch_pads += [begin.get(d, 0), end.get(d, 0)]
    return ops.pad(x, tuple(torch_pads), mode=_PAD_MODES[mode], value=value if mode == "constant" else None)


@rule("Resize")
def _resize(cx, ins, at):
    """Resize of the last two axes of (N, C, H, W): linear (half_pixel, pytorch_half_pixel or
    align_corners coordinates, as torch's bilinear interpolate) or nearest at integer scales
    (asymmetric coordinates rounded down, as torch's nearest)."""
    x = ins[0]
    scales = ins[2] if len(ins) > 2 and ins[2] is not None and np.asarray(ins[2]).size else None
    sizes = ins[3] if len(ins) > 3 and ins[3] is not None else None
    if at.get("axes") is not None or x.ndim != 4:
        raise NotImplementedError("Resize of other axes than the last two of a 4-D input")
    if scales is not None:
        scales = [float(s) for s in np.asarray(_known(scales, "Resize's scales")).reshape(-1)]
        out = [int(np.floor(n * s)) for n, s in zip(x.shape, scales)]
    else:
        out = _ints(_known(sizes, "Resize's sizes"))
    if tuple(out[:2]) != tuple(x.shape[:2]):
        raise NotImplementedError(f"Resize of the batch or channel axes (to {out} from {x.shape})")
    mode = at.get("mode", "nearest")
    coords = at.get("coordinate_transformation_mode", "half_pixel")
    if mode == "linear" and not at.get("antialias", 0) and coords in ("half_pixel", "pytorch_half_pixel",
                                                                       "align_corners"):
        if coords == "pytorch_half_pixel" and min(out[2:]) == 1:
            raise NotImplementedError("Resize with pytorch_half_pixel coordinates to a size of 1")
        if scales is not None and coords != "align_corners":
            return ops.upsample_bilinear2d(x, scale_factor=tuple(scales[2:]))
        return ops.upsample_bilinear2d(x, tuple(out[2:]), align_corners=coords == "align_corners")
    integer = all(o % n == 0 for o, n in zip(out[2:], x.shape[2:]))
    if mode == "nearest" and coords == "asymmetric" and at.get("nearest_mode", "round_prefer_floor") == "floor" \
            and integer:
        return ops.upsample_nearest2d(x, tuple(o // n for o, n in zip(out[2:], x.shape[2:])))
    raise NotImplementedError(f"Resize mode={mode!r} with coordinate_transformation_mode={coords!r} (linear with "
                              "half_pixel, pytorch_half_pixel or align_corners; nearest at integer scales with "
                              "asymmetric coordinates rounded down)")
