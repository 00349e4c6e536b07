"""The typed static graph: dtypes, Tensor handles and the Graph that owns them.

A graph is an append-only list of nodes; each node produces exactly one Tensor, so the
list order is a valid topological order. Nodes are built through ``emit`` (ops/registry),
which checks shapes and dtypes against the op's rule when the node is added.
"""
from __future__ import annotations

import math

import numpy as np

# Element counts must fit the int64 that NumPy and the buffer sizes use.
MAX_ELEMENTS = np.iinfo(np.int64).max


class ShapeError(ValueError):
    """A tensor's shape does not fit the op it is given to."""


class DeviceLimitError(ValueError):
    """A tensor is larger than the device can bind (checked when a GPU session compiles)."""


class DType:
    __slots__ = ("name", "np", "is_float")

    def __init__(self, name, np_dtype, is_float):
        self.name, self.np, self.is_float = name, np.dtype(np_dtype), is_float

    def __repr__(self):
        return f"mg.{self.name}"

    def __reduce__(self):
        return (dtype_of, (self.name,))


f32 = DType("f32", np.float32, True)
f16 = DType("f16", np.float16, True)
u32 = DType("u32", np.uint32, False)
i32 = DType("i32", np.int32, False)
DTYPES = {d.name: d for d in (f32, f16, u32, i32)}
_FROM_NUMPY = {d.np: d for d in DTYPES.values()}


def dtype_of(x) -> DType:
    """mg dtype from a DType, its name, or a numpy dtype (f64 -> f32, i64 -> i32, bool -> u32)."""
    if isinstance(x, DType):
        return x
    if isinstance(x, str) and x in DTYPES:
        return DTYPES[x]
    if type(x).__module__ == "torch":           # torch.float32 and the like, by name
        x = str(x).removeprefix("torch.")
    dt = np.dtype(x)
    if dt in _FROM_NUMPY:
        return _FROM_NUMPY[dt]
    if dt.kind == "f":
        return f32
    if dt.kind in "iu":
        return i32 if dt.kind == "i" else u32
    if dt.kind == "b":
        return u32
    raise TypeError(f"unsupported dtype {x!r}; meganeura has {sorted(DTYPES)}")


def fmt_shape(shape) -> str:
    return "(" + ", ".join(str(s) for s in shape) + ("," if len(shape) == 1 else "") + ")"


class Tensor:
    """A handle to one node's output: its shape, dtype, name, and how it was made."""

    __slots__ = ("graph", "id", "op", "inputs", "attrs", "shape", "dtype", "name", "__weakref__")

    def __init__(self, graph, id, op, inputs, attrs, shape, dtype, name):
        self.graph, self.id, self.op, self.inputs, self.attrs = graph, id, op, inputs, attrs
        # the graph passes shapes checked by check_dims (a tuple of Python ints) already
        self.shape = shape if type(shape) is tuple else tuple(int(s) for s in shape)
        self.dtype, self.name = dtype, name

    @property
    def ndim(self):
        return len(self.shape)

    @property
    def size(self):
        return math.prod(self.shape)

    def __repr__(self):
        return f"Tensor({self.name!r}, shape={fmt_shape(self.shape)}, dtype={self.dtype.name}, op={self.op})"

    __hash__ = object.__hash__

    # operators delegate to mg.ops (imported lazily: ops depend on this module)
    def __add__(self, o): return _ops().add(self, o)
    def __radd__(self, o): return _ops().add(o, self)
    def __sub__(self, o): return _ops().sub(self, o)
    def __rsub__(self, o): return _ops().sub(o, self)
    def __mul__(self, o): return _ops().mul(self, o)
    def __rmul__(self, o): return _ops().mul(o, self)
    def __truediv__(self, o): return _ops().div(self, o)
    def __rtruediv__(self, o): return _ops().div(o, self)
    def __matmul__(self, o): return _ops().matmul(self, o)
    def __rmatmul__(self, o): return _ops().matmul(o, self)
    def __neg__(self): return _ops().neg(self)
    def __pow__(self, p): return _ops().pow(self, p)
    def __lt__(self, o): return _ops().lt(self, o)
    def __le__(self, o): return _ops().le(self, o)
    def __gt__(self, o): return _ops().gt(self, o)
    def __ge__(self, o): return _ops().ge(self, o)

    def __getitem__(self, idx):
        return _ops().getitem(self, idx)

    def reshape(self, *shape):
        return _ops().reshape(self, shape[0] if len(shape) == 1 and isinstance(shape[0], (tuple, list)) else shape)

    def permute(self, *dims):
        return _ops().permute(self, dims[0] if len(dims) == 1 and isinstance(dims[0], (tuple, list)) else dims)

    def transpose(self, dim0, dim1):
        return _ops().transpose(self, dim0, dim1)

    def sum(self, dim=None, keepdim=False): return _ops().sum(self, dim, keepdim)
    def mean(self, dim=None, keepdim=False): return _ops().mean(self, dim, keepdim)

    @property
    def T(self):
        return _ops().permute(self, tuple(reversed(range(self.ndim))))


_ops_module = None


def _ops():
    global _ops_module
    if _ops_module is None:
        from . import ops
        _ops_module = ops
    return _ops_module


SOURCE_OPS = ("input", "parameter", "state", "constant")


class Graph:
    """Holds the nodes of one model. Inputs and parameters are named and unique."""

    def __init__(self):
        self.nodes: list[Tensor] = []
        self.inputs: dict[str, Tensor] = {}
        self.parameters: dict[str, Tensor] = {}
        self.states: dict[str, Tensor] = {}
        self.updates: dict[Tensor, Tensor] = {}     # {state: its value after a training step}
        self._names: set[str] = set()
        self._counter = 0
        self._scalars: dict = {}      # (dtype, repr) -> the constant node of a Python scalar
        self.backward_ids: set[int] = set()   # nodes autodiff added (accelerated precision's backward matmuls)

    def __repr__(self):
        return f"Graph({len(self.nodes)} nodes, {len(self.inputs)} inputs, {len(self.parameters)} parameters)"

    def _drop_nodes(self):
        """Forget every node: for a graph the compiler made and no longer reads (a lowering
        step's copy). Its tensors point back at it, a cycle per node that only the cycle
        collector would free, thousands of objects a compile; once the graph lets go of
        them they go as soon as nothing else holds them."""
        for held in (self.nodes, self.inputs, self.parameters, self.states, self.updates, self._scalars):
            held.clear()

    def _claim(self, name, kind):
        if not isinstance(name, str) or not name:
            raise ValueError(f"{kind} name must be a non-empty string, got {name!r}")
        if name in self._names:
            raise ValueError(f"duplicate name {name!r}: a tensor with that name already exists in this graph")
        self._names.add(name)
        return name

    def _auto_name(self, op):
        while True:
            self._counter += 1
            name = f"{op}_{self._counter}"
            if name not in self._names:
                self._names.add(name)
                return name

    def _append(self, op, inputs, attrs, shape, dtype, name=None):
        shape = check_dims(op if name is None else f"{op} {name!r}", shape)
        t = Tensor(self, len(self.nodes), op, tuple(inputs), attrs, shape, dtype,
                   name if name is not None else self._auto_name(op))
        self.nodes.append(t)
        return t

    def _append_known(self, op, inputs, attrs, shape, dtype) -> Tensor:
        """A copy of a node already checked in another graph (same op, attrs and input
        shapes): its shape and dtype are known, so no rule or check runs again."""
        t = Tensor(self, len(self.nodes), op, tuple(inputs), attrs, shape, dtype, self._auto_name(op))
        self.nodes.append(t)
        return t

    def input(self, name, shape, dtype=f32) -> Tensor:
        """A value fed at every run, by name."""
        t = self._append("input", (), {}, _check_shape(shape, name), dtype_of(dtype), self._claim(name, "input"))
        self.inputs[name] = t
        return t

    def parameter(self, name, shape, dtype=f32, init=None, requires_grad=True) -> Tensor:
        """A trainable value kept by the session. ``init``: None (default rule), 'zeros',
        'ones', 'normal' (std 0.02), a float (filled), or an array. ``requires_grad=False``:
        frozen, kept but never differentiated nor updated (see ``trainable``)."""
        shape = _check_shape(shape, name)
        dtype = dtype_of(dtype)
        if isinstance(init, np.ndarray) and tuple(init.shape) != shape:
            raise ShapeError(f"parameter {name!r}: init array has shape {fmt_shape(init.shape)}, expected {fmt_shape(shape)}")
        t = self._append("parameter", (), {"init": init}, shape, dtype, self._claim(name, "parameter"))
        if not requires_grad:
            t.attrs["requires_grad"] = False
        self.parameters[name] = t
        return t

    def state(self, name, shape, dtype=f32, init=0.0) -> Tensor:
        """A non-trainable value kept by the session across steps (optimizer moments,
        running statistics); ``init`` is a float or an array."""
        t = self._append("state", (), {"init": init}, _check_shape(shape, name), dtype_of(dtype), self._claim(name, "state"))
        self.states[name] = t
        return t

    def update(self, state: Tensor, value: Tensor):
        """After every training step (and every micro-step of an accumulating one),
        ``state`` takes ``value``: what a training-mode forward maintains, such as batch
        norm's running statistics and batch counter. The step applies these itself, beside
        the optimizer's updates. A second update of one state replaces the first, so build
        it on ``pending(state)`` to chain them (a module called twice)."""
        if not isinstance(state, Tensor) or state.graph is not self or state.op != "state":
            raise ValueError(f"update: {state!r} is not a state tensor of this graph (g.state)")
        if not isinstance(value, Tensor) or value.graph is not self:
            raise ValueError(f"update of {state.name!r}: the new value must be a tensor of this graph, got {value!r}")
        if value.shape != state.shape or value.dtype is not state.dtype:
            raise ShapeError(f"update of {state.name!r}: new value {value.name!r} is {fmt_shape(value.shape)} "
                             f"{value.dtype.name}, the state is {fmt_shape(state.shape)} {state.dtype.name}")
        self.updates[state] = value

    def pending(self, state: Tensor) -> Tensor:
        """The value ``state`` will have after the step: its recorded update, else itself."""
        return self.updates.get(state, state)

    def constant(self, value, dtype=None, name=None) -> Tensor:
        """A fixed value baked into the graph; refused if ``dtype`` cannot represent it
        (an integer out of range, a fraction or NaN into an integer, a finite float that
        would overflow to infinity)."""
        arr = np.asarray(value)
        if arr.dtype == object:
            raise TypeError(f"constant{'' if name is None else ' ' + repr(name)}: {value!r} is not numeric")
        dt = dtype_of(dtype if dtype is not None else arr.dtype)
        arr = cast_exact(arr, dt, f"constant{'' if name is None else ' ' + repr(name)}")
        if name is not None:
            self._claim(name, "constant")
        return self._append("constant", (), {"value": arr}, arr.shape, dt, name)

    def scalar_constant(self, value, dtype) -> Tensor:
        """The constant node of a Python scalar operand (``x * 0.9``), one per value and
        dtype in the graph: an optimizer's update reads the same few constants for every
        parameter, and a node each cost compile time for nothing."""
        key = (dtype_of(dtype).name, type(value).__name__, repr(value))     # -0.0 is not 0.0
        t = self._scalars.get(key)
        if t is None:
            t = self._scalars[key] = self.constant(value, dtype)
        return t

    def __getitem__(self, name) -> Tensor:
        if name in self.inputs:
            return self.inputs[name]
        if name in self.parameters:
            return self.parameters[name]
        if name in self.states:
            return self.states[name]
        for t in self.nodes:
            if t.name == name:
                return t
        raise KeyError(f"no tensor named {name!r} in this graph")


def trainable(t: Tensor) -> bool:
    """A float parameter not frozen (``requires_grad=False``): what training differentiates."""
    return t.op == "parameter" and t.dtype.is_float and t.attrs.get("requires_grad", True)


def _check_shape(shape, name):
    return check_dims(repr(name), shape)


def is_int(v) -> bool:
    """An integer, not a bool (True is an int to Python, never a size)."""
    return isinstance(v, (int, np.integer)) and not isinstance(v, (bool, np.bool_))


def int_dims(what, shape, allow=()) -> tuple:
    """``shape`` (an int or a sequence of ints) as a tuple of ints; a float such as 4.7 (or
    4.0) is refused rather than truncated. ``allow``: special values kept (e.g. -1)."""
    if type(shape) is tuple and all(type(s) is int and s >= 0 for s in shape):
        return shape            # the common case, checked cheaply (every node's shape passes here)
    if is_int(shape):
        shape = (shape,)
    try:
        dims = tuple(shape)
    except TypeError:
        raise ShapeError(f"{what}: shape must be a tuple of ints, got {shape!r}") from None
    for s in dims:
        if not is_int(s):
            raise ShapeError(f"{what}: shape {shape!r} has a non-integer dimension {s!r} "
                             f"({type(s).__name__}); dimensions must be ints")
        if s < 0 and s not in allow:
            raise ShapeError(f"{what}: shape {fmt_shape(dims)} has a negative dimension")
    return tuple(int(s) for s in dims)


def check_dims(what, shape) -> tuple:
    """A node's shape: non-negative ints whose product fits int64."""
    dims = int_dims(what, shape)
    n = math.prod(dims)
    if n > MAX_ELEMENTS:
        raise ShapeError(f"{what}: shape {fmt_shape(dims)} has {n} elements, more than int64 can count "
                         f"({MAX_ELEMENTS})")
    return dims


def cast_exact(arr, dt: DType, what) -> np.ndarray:
    """``arr`` as ``dt`` (C order), refusing values the cast would change beyond rounding:
    integers out of range, fractions, NaN or infinity into an integer dtype, and finite
    floats that overflow to infinity."""
    arr = np.asarray(arr)
    if arr.dtype.kind not in "fiub":
        raise TypeError(f"{what}: dtype {arr.dtype} cannot become {dt.name}")
    with np.errstate(over="ignore", invalid="ignore"):   # checked below, with a better message
        out = np.asarray(arr, dtype=dt.np, order="C")
    if arr.size == 0 or arr.dtype == dt.np:
        return out
    if not dt.is_float:
        info = np.iinfo(dt.np)
        if arr.dtype.kind == "f":
            bad = ~np.isfinite(arr) | (arr != np.trunc(arr))
            if bad.any():
                raise ValueError(f"{what}: value {arr[bad].flat[0].item()!r} is not an integer, cannot become {dt.name}")
        lo, hi = arr.min(), arr.max()
        if lo < info.min or hi > info.max:
            raise ValueError(f"{what}: value {(hi if hi > info.max else lo).item()!r} is out of range for {dt.name} "
                             f"[{info.min}, {info.max}]")
    elif arr.dtype.kind in "fiu":
        overflow = np.isinf(out) & np.isfinite(arr)
        if overflow.any():
            raise ValueError(f"{what}: value {arr[overflow].flat[0].item()!r} overflows {dt.name} "
                             f"(largest {np.finfo(dt.np).max})")
    return out
