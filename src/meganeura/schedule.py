"""Graph -> ordered kernel launches, each of one archetype.

Values live in logical buffers (``Buf``); layout ops (reshape, permute, slice,
broadcast_to) become strided ``View``s of their input's buffer instead of kernels, and
are folded into whatever kernel reads them. Chains of elementwise ops whose intermediates
have a single consumer (and the same shape) fuse into one pointwise kernel.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from .graph import Tensor
from .ops.registry import OPS
from .reference import needed_nodes


@dataclass(eq=False)
class Buf:
    """A logical device buffer; the memory planner maps intermediates onto shared ones."""
    nbytes: int
    kind: str                       # input | parameter | state | constant | target | temp
    name: str
    dtype: object = None
    value: np.ndarray | None = None  # constants' contents

    def __repr__(self):
        return f"Buf({self.kind}:{self.name}, {self.nbytes}B)"


@dataclass(eq=False)
class View:
    buf: Buf
    shape: tuple
    strides: tuple
    offset: int
    dtype: object

    @staticmethod
    def contiguous(buf, shape, dtype, offset=0):
        return View(buf, tuple(shape), contiguous_strides(shape), offset, dtype)

    @property
    def size(self):
        return int(math.prod(self.shape))

    def is_contiguous(self):
        return all(st == cs for st, cs, n in zip(self.strides, contiguous_strides(self.shape), self.shape) if n != 1)


def reshape_view(v: View, shape) -> View | None:
    """``v``'s elements in row-major order as ``shape`` without a copy (as numpy's reshape
    of a strided array), or None when the layout does not allow it. Runs of old dims that
    are contiguous with each other can be merged and split again; size-1 dims are free."""
    shape = tuple(int(n) for n in shape)
    if v.is_contiguous():
        return View.contiguous(v.buf, shape, v.dtype, v.offset)
    old = [(n, s) for n, s in zip(v.shape, v.strides) if n != 1]
    new = [i for i, n in enumerate(shape) if n != 1]
    strides = [0] * len(shape)
    i = j = 0
    while i < len(old) and j < len(new):
        # the shortest runs old[i:i2] and new[j:j2] with equal element counts
        i2, j2, po, pn = i + 1, j + 1, old[i][0], shape[new[j]]
        while po != pn:
            if po < pn:
                po *= old[i2][0]
                i2 += 1
            else:
                pn *= shape[new[j2]]
                j2 += 1
        if any(old[q][1] != old[q + 1][1] * old[q + 1][0] for q in range(i, i2 - 1)):
            return None             # the old run is not one linear stride: a copy is needed
        st = old[i2 - 1][1]
        for q in reversed(range(j, j2)):
            strides[new[q]] = st
            st *= shape[new[q]]
        i, j = i2, j2
    return View(v.buf, shape, tuple(strides), v.offset, v.dtype)


def contiguous_strides(shape):
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


@dataclass(eq=False)
class Kernel:
    """One launch of an archetype (the kernel IR). ``epilogue``: an expression applied to
    each output value before it is stored, over ("acc",) (the archetype's value) and
    leaves ("leaf", i) indexing ``epi_reads``, Views read at the output's coordinates
    (broadcast like a pointwise kernel's); fusion passes fill it. ``outs``: the further
    outputs of a kernel that writes several (flash attention's output and its log-sum-exp;
    the key and value gradients of its backward), each the value of a node of its own that
    the schedule computes with ``out``'s (see ``build_schedule``); they are stored as they
    are, without an epilogue."""
    name: str                  # the ops it runs, for traces
    archetype: str
    spec: dict                 # what the codegen of that archetype needs
    out: View
    reads: list = field(default_factory=list)  # Views read
    epilogue: tuple | None = None
    epi_reads: list = field(default_factory=list)
    outs: list = field(default_factory=list)

    @property
    def shape(self):
        """The archetype's own output shape (``out`` may be a reshaped fused consumer's)."""
        return self.spec.get("shape", self.out.shape)

    @property
    def dtype(self):
        return self.spec.get("out_dtype", self.out.dtype)

    def written_bufs(self):
        spec = self.spec
        if "parts" in spec:        # a horizontal fusion of independent kernels
            return [b for p in spec["parts"] for b in p.written_bufs()]
        # extra outputs: a multi-output kernel's (outs) and second stores of its value (stores)
        bufs = [self.out.buf]
        if self.outs:
            bufs += [v.buf for v in self.outs]
        if "stores" in spec:
            bufs += [v.buf for v in spec["stores"]]
        return bufs

    def read_views(self):
        spec = self.spec
        if "parts" in spec:
            return [v for p in spec["parts"] for v in p.read_views()]
        virtual = spec.get("gathers")    # operands computed in the loads, never stored
        reads = [v for i, v in enumerate(self.reads) if i not in virtual] if virtual else list(self.reads)
        if self.epi_reads:
            reads += self.epi_reads
        return reads


# ------------------------------------------------------------------------ view algebra
def view_op(t: Tensor, v: View) -> View | None:
    """The view that layout op ``t`` makes of its input's view, or None if not a view."""
    a = t.attrs
    if t.op == "reshape":
        # a strided source is copied (the fusion passes usually turn that copy into the
        # producer's transposed store, which keeps consumers' operands contiguous)
        if not v.is_contiguous():
            return None
        return View.contiguous(v.buf, t.shape, v.dtype, v.offset)
    if t.op == "permute":
        return View(v.buf, t.shape, tuple(v.strides[d] for d in a["dims"]), v.offset, v.dtype)
    if t.op == "slice":
        off = v.offset + sum(s * st for s, st in zip(a["starts"], v.strides))
        return View(v.buf, t.shape, tuple(st * k for st, k in zip(v.strides, a["steps"])), off, v.dtype)
    if t.op == "broadcast_to":
        lead = len(t.shape) - len(v.shape)
        strides = [0] * lead + [0 if (n == 1 and m != 1) else st
                                for n, m, st in zip(v.shape, t.shape[lead:], v.strides)]
        return View(v.buf, t.shape, tuple(strides), v.offset, v.dtype)
    return None


VIEW_OPS = ("reshape", "permute", "slice", "broadcast_to")


# pointwise ops whose operand is read at another index than the output's: the operand is a
# leaf read through that op's index function ("rleaf" in the expression)
INDEXED_READS = ("rotate_half",)


MAX_RECOMPUTE = 256     # output elements per input element when inlining across a broadcast


def _cheap_broadcast(t, consumer) -> bool:
    """t can be evaluated at ``consumer``'s coordinates: its shape broadcasts to the
    consumer's (so every leaf of t does too) and t is small next to it."""
    if len(t.shape) > len(consumer.shape) or t.size == 0:
        return False
    lead = len(consumer.shape) - len(t.shape)
    if any(n != 1 and n != m for n, m in zip(t.shape, consumer.shape[lead:])):
        return False
    return consumer.size <= MAX_RECOMPUTE * t.size and all(i.shape == t.shape or i.size == 1 or
                                                         _broadcasts(i.shape, t.shape) for i in t.inputs)


def _broadcasts(a, b) -> bool:
    lead = len(b) - len(a)
    return lead >= 0 and all(n == 1 or n == m for n, m in zip(a, b[lead:]))


# the deepest elementwise expression a kernel carries (nested ops): the schedule and the
# fusion passes store a value rather than inline past it
MAX_INLINE_DEPTH = 64


def expr_depth(e) -> int:
    """Nesting depth of ops in expression ``e`` (0 for a leaf, literal or None), walked with
    an explicit stack."""
    best, stack = 0, [(e, 0)]
    while stack:
        x, d = stack.pop()
        if x is not None and x[0] == "op":
            best = max(best, d + 1)
            stack.extend((k, d + 1) for k in x[2])
    return best


def is_pointwise(op):
    return OPS[op].extra.get("pointwise", False) and op not in VIEW_OPS


# -------------------------------------------------------------------------- schedule
class Schedule:
    def __init__(self, kernels, values, bufs, targets):
        self.kernels = kernels      # list[Kernel] in launch order
        self.values = values        # tensor id -> View (every materialised or viewed value)
        self.bufs = bufs            # every logical Buf
        self.targets = targets


def build_schedule(graph, targets: list[Tensor], target_kinds=None, max_bindings=8) -> Schedule:
    """Kernels computing ``targets`` (tensors of ``graph``, already lowered to primitives).

    Several outputs: an op whose record has ``multi_output(node) -> key`` shares one kernel
    with the other needed nodes of the same key (the same inputs, by construction). The
    first of them to be scheduled is lowered with the others as ``siblings`` ((node, View)
    pairs whose values the kernel writes too); the graph keeps one output per node."""
    nodes = needed_nodes(targets)
    consumers: dict[int, list[Tensor]] = {t.id: [] for t in nodes}
    groups: dict = {}
    for t in nodes:
        for i in t.inputs:
            consumers[i.id].append(t)
        key_of = OPS[t.op].extra.get("multi_output") if t.inputs else None
        if key_of is not None and key_of(t) is not None:
            groups.setdefault(key_of(t), []).append(t)
    target_ids = {t.id for t in targets}
    values: dict[int, View] = {}
    bufs: list[Buf] = []
    kernels: list[Kernel] = []

    def new_buf(t, kind):
        b = Buf(max(4, t.size * t.dtype.np.itemsize), kind, t.name, t.dtype)
        bufs.append(b)
        return b

    # which elementwise nodes are inlined into their consumer's pointwise kernel
    def inlinable(t):
        if t.id in target_ids or t.op not in OPS or not is_pointwise(t.op):
            return False
        cs = consumers[t.id]
        # ops that read their operand at other indices (INDEXED_READS) need it in memory;
        # a consumer that broadcasts t recomputes it per element, which pays while the
        # broadcast is modest (one new KV-cache row blended into the cache)
        return (len(cs) == 1 and is_pointwise(cs[0].op) and cs[0].op not in INDEXED_READS
                and (cs[0].shape == t.shape or _cheap_broadcast(t, cs[0])))

    # a chain of inlined producers is cut every MAX_INLINE_DEPTH ops (that node is stored):
    # expressions stay shallow for every pass that walks them, and a 10,000-op chain is a
    # few hundred kernels (alike, so rendered once) instead of one that no driver compiles
    depth: dict[int, int] = {}
    for t in nodes:
        if inlinable(t):
            d = 1 + max((depth.get(i.id, 0) for i in t.inputs), default=0)
            depth[t.id] = d if d < MAX_INLINE_DEPTH else 0

    def fusible(t):
        return depth.get(t.id, 0) > 0

    def emit_pointwise(t, kind="temp"):
        """``t``'s pointwise kernel; a producer meant to be inlined that the consumer has no
        binding left for is emitted here first, as its own kernel."""
        k = _pointwise_kernel(t, values, new_buf(t, kind), fusible, max_bindings, emit_pointwise)
        kernels.append(k)
        values[t.id] = k.out

    for t in nodes:
        if t.id in values:
            continue                          # computed already, by a sibling's kernel
        if t.op in ("input", "parameter", "state"):
            values[t.id] = View.contiguous(new_buf(t, t.op), t.shape, t.dtype)
            continue
        if t.op == "constant":
            if t.size == 1 and t.id not in target_ids and all(is_pointwise(c.op) for c in consumers[t.id]):
                continue                      # scalars read only by pointwise kernels are literals
            b = new_buf(t, "constant")
            b.value = t.attrs["value"]
            values[t.id] = View.contiguous(b, t.shape, t.dtype)
            continue
        kind = "target" if t.id in target_ids else "temp"
        if t.op in VIEW_OPS and t.id not in target_ids:
            src = t.inputs[0]
            if src.id in values:
                v = view_op(t, values[src.id])
                if v is not None:
                    values[t.id] = v
                    continue
        if is_pointwise(t.op) or t.op in VIEW_OPS:
            if fusible(t):
                continue                      # emitted inside its consumer
            emit_pointwise(t, kind)
            continue
        lower = OPS[t.op].lower
        if lower is None:
            raise NotImplementedError(f"no GPU kernel for op {t.op!r}")
        out = View.contiguous(new_buf(t, kind), t.shape, t.dtype)
        def materialize(v, tt):
            return _materialize(v, tt, kernels, new_buf)

        def temp(shape, dtype, _t=t):
            """A scratch intermediate for a lowering that needs more than one kernel."""
            b = Buf(max(4, int(np.prod(shape)) * dtype.np.itemsize), "temp", f"{_t.name}.part", dtype)
            bufs.append(b)
            return View.contiguous(b, shape, dtype)
        key_of = OPS[t.op].extra.get("multi_output")
        siblings = [(s, View.contiguous(new_buf(s, "target" if s.id in target_ids else "temp"), s.shape, s.dtype))
                    for s in groups.get(key_of(t) if key_of else None, []) if s is not t]
        more = {"siblings": siblings} if siblings else {}
        kernels.extend(lower(t, [_read(values, i) for i in t.inputs], out, materialize=materialize, temp=temp, **more))
        values[t.id] = out
        values.update((s.id, v) for s, v in siblings)
    del emit_pointwise      # it holds itself through its cell: a cycle holding every kernel
    return Schedule(kernels, values, bufs, targets)


def _read(values, t):
    # scalar constants are inlined only when every consumer is pointwise, so any other
    # kernel finds its inputs here
    if t.id in values:
        return values[t.id]
    raise RuntimeError(f"value of {t.name!r} ({t.op}) was not computed")


def _materialize(v, t, kernels, new_buf):
    """A contiguous copy of a strided view (for kernels that need dense operands)."""
    if v.is_contiguous():
        return v
    out = View.contiguous(new_buf(t, "temp"), t.shape, t.dtype)
    kernels.append(Kernel("copy", "pointwise", {"expr": ("leaf", 0), "dtype": t.dtype}, out, [v]))
    return out


def _pointwise_kernel(t, values, buf, fusible, max_bindings, emit_pointwise) -> Kernel:
    """One kernel evaluating ``t`` and every fusible elementwise producer inlined into it."""
    leaves: list[View] = []
    if t.op in VIEW_OPS:           # a layout op that is not a view: copy through its view
        src = values[t.inputs[0].id]
        v = view_op(t, src)        # only a reshape of a strided view is not a view
        if v is None:
            # reshape of a strided view: read the source in its own logical order
            leaves.append(src)
            out = View.contiguous(buf, t.shape, t.dtype)
            return Kernel(t.op, "pointwise", {"expr": ("leaf", 0), "dtype": t.dtype, "flat_leaf": True}, out, leaves)
        leaves.append(v)
        return Kernel(t.op, "pointwise", {"expr": ("leaf", 0), "dtype": t.dtype},
                      View.contiguous(buf, t.shape, t.dtype), leaves)
    leaf_index: dict[int, int] = {}
    names = []

    def leaf(x: Tensor):
        if x.id not in values:
            raise RuntimeError(f"value of {x.name!r} ({x.op}) was not computed")
        if x.id not in leaf_index:
            leaf_index[x.id] = len(leaves)
            leaves.append(values[x.id])
        return ("leaf", leaf_index[x.id])

    def node(x: Tensor):
        if x.op in INDEXED_READS:
            return ("op", x, [("rleaf",) + leaf(i)[1:] for i in x.inputs])
        return ("op", x, [expr_of(i) for i in x.inputs])

    def expr_of(x: Tensor):
        if x.op == "constant" and x.size == 1 and x.id not in values:
            return ("const", x)
        if x.id not in values and fusible(x):
            if len({id(l.buf) for l in leaves}) < max_bindings - 2:
                names.append(x.op)
                return node(x)
            emit_pointwise(x)         # out of bindings: x runs first, and is read from memory
        return leaf(x)

    names.append(t.op)
    try:
        expr = node(t)
    finally:
        # the recursive closures hold each other through their cells: a cycle the
        # collector would have to find, thousands of them a compile
        del node, expr_of
    out = View.contiguous(buf, t.shape, t.dtype)
    return Kernel("+".join(reversed(names)), "pointwise", {"expr": expr, "dtype": t.dtype}, out, leaves)
