"""Layout ops: reshape, permute/transpose, slice/getitem, concat/split, broadcast_to.

They move data without arithmetic; their gradients are their inverses.
"""
from __future__ import annotations

import builtins
import math

import numpy as np

from ..graph import Tensor, fmt_shape, int_dims
from .registry import broadcast_shapes, emit, norm_dim, op_error, register, unbroadcast

_py_slice = builtins.slice  # the name `slice` below is our op


# --------------------------------------------------------------------------- reshape
def _reshape_infer(ins, shape):
    x = ins[0]
    if math.prod(shape) != x.size:
        raise op_error("reshape", f"cannot reshape {x.size} elements to {fmt_shape(shape)}", x)
    return shape, x.dtype


register("reshape", _reshape_infer, lambda x, shape: np.reshape(x, shape),
         lambda ct, y, x, shape: [reshape(ct, x.shape)], layout=True)


def reshape(x, shape):
    """torch.reshape; one dimension may be -1."""
    shape = int_dims("reshape", shape, allow=(-1,))
    if shape.count(-1) > 1:
        raise op_error("reshape", f"only one -1 allowed in {fmt_shape(shape)}", x)
    if -1 in shape:
        rest = math.prod(s for s in shape if s != -1)
        if rest == 0 or x.size % rest:
            raise op_error("reshape", f"cannot infer -1 in {fmt_shape(shape)}", x)
        shape = tuple(x.size // rest if s == -1 else s for s in shape)
    if shape == x.shape:
        return x
    return emit("reshape", [x], shape=shape)


def flatten(x, start_dim=0, end_dim=-1):
    """torch.flatten (a 0-d tensor becomes shape (1,), as torch)."""
    if x.ndim == 0:
        norm_dim("flatten", start_dim, 1, x), norm_dim("flatten", end_dim, 1, x)
        return reshape(x, (1,))
    s, e = norm_dim("flatten", start_dim, x.ndim, x), norm_dim("flatten", end_dim, x.ndim, x)
    return reshape(x, x.shape[:s] + (math.prod(x.shape[s:e + 1]),) + x.shape[e + 1:])


def unsqueeze(x, dim):
    d = norm_dim("unsqueeze", dim, x.ndim + 1, x)
    return reshape(x, x.shape[:d] + (1,) + x.shape[d:])


def squeeze(x, dim=None):
    """torch.squeeze: drop size-1 axes (all of them, the one ``dim``, or a tuple of dims);
    a named axis whose size is not 1 is kept, as torch."""
    if dim is None:
        dims = range(x.ndim)
    elif x.ndim == 0:
        for d in (dim if isinstance(dim, (tuple, list)) else (dim,)):
            norm_dim("squeeze", d, 1, x)
        return x
    else:
        dims = {norm_dim("squeeze", int(d), x.ndim, x) for d in (dim if isinstance(dim, (tuple, list)) else (dim,))}
    drop = {d for d in dims if x.shape[d] == 1}
    return reshape(x, tuple(n for i, n in enumerate(x.shape) if i not in drop))


# --------------------------------------------------------------------------- permute
def _permute_infer(ins, dims):
    x = ins[0]
    if sorted(dims) != list(range(x.ndim)):
        raise op_error("permute", f"dims {dims} are not a permutation of 0..{x.ndim - 1}", x)
    return tuple(x.shape[d] for d in dims), x.dtype


register("permute", _permute_infer, lambda x, dims: np.ascontiguousarray(np.transpose(x, dims)),
         lambda ct, y, x, dims: [permute(ct, tuple(int(i) for i in np.argsort(dims)))], layout=True)


def permute(x, dims):
    """torch.permute."""
    dims = tuple(norm_dim("permute", int(d), x.ndim, x) for d in dims)
    if len(dims) != x.ndim:
        raise op_error("permute", f"got {len(dims)} dims for a rank-{x.ndim} tensor", x)
    if dims == tuple(range(x.ndim)):
        return x
    return emit("permute", [x], dims=dims)


def transpose(x, dim0, dim1):
    """torch.transpose: swap two axes (on a 0-d tensor, dims 0/-1 give it back)."""
    if x.ndim == 0:
        norm_dim("transpose", dim0, 1, x), norm_dim("transpose", dim1, 1, x)
        return x
    d = list(range(x.ndim))
    a, b = norm_dim("transpose", dim0, x.ndim, x), norm_dim("transpose", dim1, x.ndim, x)
    d[a], d[b] = d[b], d[a]
    return permute(x, d)


# ----------------------------------------------------------------------------- slice
def _slice_infer(ins, starts, stops, steps):
    x = ins[0]
    out = []
    for i, (a, b, s) in enumerate(zip(starts, stops, steps)):
        if not (0 <= a <= b <= x.shape[i]) or s < 1:
            raise op_error("slice", f"axis {i}: [{a}:{b}:{s}] is not inside size {x.shape[i]}", x)
        out.append(max(0, -(-(b - a) // s)))
    return tuple(out), x.dtype


def _slice_ref(x, starts, stops, steps):
    return np.ascontiguousarray(x[tuple(_py_slice(a, b, s) for a, b, s in zip(starts, stops, steps))])


register("slice", _slice_infer, _slice_ref,
         lambda ct, y, x, starts, stops, steps: [emit("slice_grad", [ct], shape=x.shape, starts=starts, steps=steps)],
         layout=True)


def _slice_grad_ref(ct, shape, starts, steps):
    out = np.zeros(shape, dtype=ct.dtype)
    out[tuple(_py_slice(a, a + s * n, s) for a, s, n in zip(starts, steps, ct.shape))] = ct
    return out


register("slice_grad", lambda ins, shape, starts, steps: (shape, ins[0].dtype), _slice_grad_ref,
         lambda ct, y, g, shape, starts, steps: [
             emit("slice", [ct], starts=starts, stops=tuple(a + s * n for a, s, n in zip(starts, steps, g.shape)),
                  steps=steps)], layout=True)


def _axis(op, dim, x):
    """``dim`` of ``x`` as an index into its shape (a 0-d tensor has none, as in torch)."""
    if x.ndim == 0:
        raise op_error(op, f"dim {dim}: a zero-dimensional tensor has no dimension to index", x)
    return norm_dim(op, dim, x.ndim, x)


def slice(x, dim, start=None, end=None, step=1):
    """x[..., start:end:step, ...] along ``dim`` (Python slice rules, step > 0)."""
    d = _axis("slice", dim, x)
    a, b, s = _py_slice(start, end, step).indices(x.shape[d])
    if s < 1:
        raise op_error("slice", f"step must be positive, got {step}", x)
    b = max(a, b)
    starts, stops, steps = [0] * x.ndim, list(x.shape), [1] * x.ndim
    starts[d], stops[d], steps[d] = a, b, s
    if (a, b, s) == (0, x.shape[d], 1):
        return x
    return emit("slice", [x], starts=tuple(starts), stops=tuple(stops), steps=tuple(steps))




_CMP_OPS = ("lt", "le", "gt", "ge", "eq", "ne")


def _is_advanced(i) -> bool:
    return isinstance(i, (list, Tensor)) or (isinstance(i, np.ndarray) and i.ndim > 0)


def getitem(x, idx):
    """Indexing as torch: ints, slices (positive step), None and Ellipsis, and one advanced
    index: a list or array of ints, an integer Tensor (negative positions count from the
    end), or a NumPy boolean mask over one or more dims (its True positions, known when
    the graph is built). A boolean mask Tensor selects a number of elements known only when
    it runs, which a static graph cannot hold: use where(mask, x, 0) instead."""
    if not isinstance(idx, tuple):
        idx = (idx,)
    adv = [k for k, i in enumerate(idx) if _is_advanced(i)]
    if adv:
        return _advanced_getitem(x, idx, adv)
    return _basic_getitem(x, idx)


def _advanced_getitem(x, idx, adv):
    if len(adv) > 1:
        raise NotImplementedError(f"getitem: {len(adv)} list/tensor indices in one subscript; index one dim at a "
                                  "time (or use mg.ops.gather)")
    k, a = adv[0], idx[adv[0]]
    if isinstance(a, Tensor):
        if a.dtype.is_float:
            raise TypeError(f"getitem: index tensor {a.name!r} has dtype {a.dtype.name}, expected an integer dtype")
        if a.op in _CMP_OPS:
            raise TypeError(f"getitem: {a.name!r} is a boolean mask tensor: it selects a number of elements known "
                            "only at run time, which a static graph cannot hold; use mg.ops.where(mask, x, 0), "
                            "or a NumPy mask")
        m = 1
    else:
        a = np.asarray(a)
        if a.dtype == object or a.dtype.kind not in "biu":
            raise TypeError(f"getitem: an index list/array must hold ints or bools, got dtype {a.dtype}")
        m = a.ndim if a.dtype == np.bool_ else 1
    # basic indexing with the advanced entry kept as whole dims; p: where they are in its result
    y = _basic_getitem(x, idx[:k] + (_py_slice(None),) * m + idx[k + 1:])
    before = idx[:k]
    if Ellipsis in before:
        n_real = sum(1 for i in idx if i is not None and i is not Ellipsis and not _is_advanced(i)) + m
        before = before[:before.index(Ellipsis)] + (_py_slice(None),) * (x.ndim - n_real) + \
            before[before.index(Ellipsis) + 1:]
    p = sum(1 for i in before if i is None or isinstance(i, _py_slice))
    dims = y.shape[p:p + m]
    if isinstance(a, Tensor):
        from .elementwise import where
        n = dims[0]
        flat = reshape(a, (-1,))
        flat = where(flat < 0, flat + n, flat) if a.dtype.name == "i32" else flat
        out = index_select(y, p, flat)
        return reshape(out, y.shape[:p] + a.shape + y.shape[p + 1:])
    if a.dtype == np.bool_:
        if a.shape != dims:
            raise op_error("getitem", f"boolean mask of shape {fmt_shape(a.shape)} does not match the indexed dims "
                                      f"{fmt_shape(dims)}", x)
        pos, shape = np.flatnonzero(a), (len(np.flatnonzero(a)),)
        y = reshape(y, y.shape[:p] + (int(np.prod(dims)),) + y.shape[p + m:])
    else:
        n = dims[0]
        if a.size and not (-n <= a.min() and a.max() < n):
            bad = a[(a < -n) | (a >= n)].flat[0]
            raise op_error("getitem", f"index {bad} out of range for a dim of size {n}", x)
        pos, shape = (a.astype(np.int64) % max(n, 1)).ravel(), a.shape
    if pos.size == 0:
        return broadcast_to(reshape(slice(y, p, 0, 0), y.shape[:p] + (0,) + y.shape[p + 1:]),
                            y.shape[:p] + shape + y.shape[p + 1:])
    return reshape(_take(y, p, pos), y.shape[:p] + shape + y.shape[p + 1:])


def _basic_getitem(x, idx):
    n_real = len([i for i in idx if i is not None and i is not Ellipsis])
    if Ellipsis in idx:
        k = idx.index(Ellipsis)
        idx = idx[:k] + (_py_slice(None),) * (x.ndim - n_real) + idx[k + 1:]
    elif n_real > x.ndim:
        raise op_error("getitem", f"too many indices ({n_real}) for rank {x.ndim}", x)
    else:
        idx = idx + (_py_slice(None),) * (x.ndim - n_real)
    out, axis, final = x, 0, []
    for i in idx:
        if i is None:
            final.append(1)
            continue
        if isinstance(i, (int, np.integer)):
            n = x.shape[axis]
            if not -n <= i < n:
                raise op_error("getitem", f"index {i} out of range for axis {axis} of size {n}", x)
            out = slice(out, axis, i % n, i % n + 1)
        elif isinstance(i, _py_slice):
            out = slice(out, axis, i.start, i.stop, 1 if i.step is None else i.step)
            final.append(out.shape[axis])
        else:
            raise TypeError(f"getitem: unsupported index {i!r} (for tensor indices use mg.ops.gather, "
                            "mg.ops.index_select or mg.ops.embedding)")
        axis += 1
    return reshape(out, tuple(final))


# ----------------------------------------------------------------------------- concat
def _concat_infer(ins, dim):
    x0 = ins[0]
    if x0.ndim == 0:
        raise op_error("concat", "zero-dimensional tensors cannot be concatenated (unsqueeze them first)", *ins)
    for t in ins[1:]:
        if t.ndim != x0.ndim or any(a != b for i, (a, b) in enumerate(zip(t.shape, x0.shape)) if i != dim):
            raise op_error("concat", f"shapes must match except along dim {dim}", *ins)
        if t.dtype is not x0.dtype:
            raise TypeError("concat: dtypes differ: " + ", ".join(f"{t.name!r} {t.dtype.name}" for t in ins))
    shape = list(x0.shape)
    shape[dim] = sum(t.shape[dim] for t in ins)
    return tuple(shape), x0.dtype


def _concat_vjp(ct, y, *ins, dim):
    out, off = [], 0
    for t in ins:
        out.append(slice(ct, dim, off, off + t.shape[dim]))
        off += t.shape[dim]
    return out


register("concat", _concat_infer, lambda *xs, dim: np.concatenate(xs, axis=dim), _concat_vjp, layout=True)


def concat(tensors, dim=0):
    """torch.cat(tensors, dim)."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("concat: needs at least one tensor")
    if any(t.ndim != 1 for t in tensors):       # torch skips 1-D empty tensors beside others
        tensors = [t for t in tensors if t.shape != (0,)] or tensors[:1]
    if len(tensors) == 1:
        return tensors[0]
    return emit("concat", tensors, dim=norm_dim("concat", dim, tensors[0].ndim, tensors[0]))


cat = concat


def stack(tensors, dim=0):
    """torch.stack: join same-shaped tensors along a new axis ``dim``."""
    tensors = list(tensors)
    if not tensors:
        raise ValueError("stack: needs at least one tensor")
    for t in tensors[1:]:
        if t.shape != tensors[0].shape:
            raise op_error("stack", "every tensor must have the same shape", *tensors)
    d = norm_dim("stack", dim, tensors[0].ndim + 1, tensors[0])
    return concat([unsqueeze(t, d) for t in tensors], d)


def gather(input, dim, index):
    """torch.gather: out[..., j, ...] = input[..., index[..., j, ...], ...] along ``dim``;
    ``index`` (integer) has input's rank and sizes at most input's on the other axes.
    Built as a one-hot product over the gathered axis (O(out * input.shape[dim]) work), so
    it runs on every backend and differentiates with respect to ``input``."""
    from .elementwise import cast
    from .nn import one_hot
    from .reduce import reduce_sum
    if index.dtype.is_float:
        raise TypeError(f"gather: index {index.name!r} has dtype {index.dtype.name}, expected an integer dtype")
    if index.size == 0 and index.ndim != input.ndim:     # as torch: an empty index is not checked
        return broadcast_to(reshape(reduce_sum(input, tuple(range(input.ndim))), ()), index.shape)
    if index.ndim != input.ndim and max(index.ndim, input.ndim) == 1:     # as torch: a 0-d tensor is 1-D here
        norm_dim("gather", dim, 1, input)
        return reshape(gather(reshape(input, (input.size,)), 0, reshape(index, (index.size,))), index.shape)
    if index.ndim != input.ndim:
        raise op_error("gather", "index must have the same rank as input", input, index)
    if input.ndim == 0:
        return input
    d = norm_dim("gather", dim, input.ndim, input)
    if any(index.shape[a] > input.shape[a] for a in range(input.ndim) if a != d):
        raise op_error("gather", f"index may not be larger than input on axes other than {d}", input, index)
    x = input
    for a in range(input.ndim):        # only the part of input that index addresses
        if a != d and x.shape[a] != index.shape[a]:
            x = slice(x, a, 0, index.shape[a])
    n = input.shape[d]
    if index.size == 0:                 # nothing gathered (from an empty axis too): empty
        return broadcast_to(reshape(reduce_sum(input, tuple(range(input.ndim))), (1,) * input.ndim), index.shape)
    oh = one_hot(index, n, input.dtype)                  # index.shape + (n,)
    return reduce_sum(oh * _align_for_gather(x, d), (input.ndim,))


def _align_for_gather(x, d):
    """x with axis d moved to a new last axis and a size-1 axis left in its place."""
    perm = tuple(a for a in range(x.ndim) if a != d) + (d,)
    moved = permute(x, perm)                                      # (..others.., n)
    return unsqueeze(moved, d)                                    # (..others with 1 at d.., n)


def index_select(input, dim, index):
    """torch.index_select: whole slices of ``input`` along ``dim`` picked by a 1-D (or, as
    torch, 0-d: one slice, the axis kept) integer ``index``."""
    if index.ndim == 0:
        index = reshape(index, (1,))
    if index.ndim != 1:
        raise op_error("index_select", "index must be 1-D (or 0-d)", index)
    d = norm_dim("index_select", dim, input.ndim, input)
    shape = tuple(index.shape[0] if a == d else s for a, s in enumerate(input.shape))
    idx = broadcast_to(reshape(index, tuple(index.shape[0] if a == d else 1 for a in range(input.ndim))), shape)
    return gather(input, d, idx)


def split(x, split_size_or_sections, dim=0):
    """torch.split: chunks of a given size, or of the listed sizes."""
    d = _axis("split", dim, x)
    n = x.shape[d]
    if isinstance(split_size_or_sections, (int, np.integer)):
        k = int(split_size_or_sections)
        if k <= 0:
            raise op_error("split", f"split size must be positive, got {k}", x)
        sizes = [min(k, n - i) for i in range(0, n, k)]
    else:
        sizes = list(int_dims("split", split_size_or_sections))
        if sum(sizes) != n:
            raise op_error("split", f"sections {sizes} sum to {sum(sizes)}, expected {n} along dim {d}", x)
    out, off = [], 0
    for s in sizes:
        out.append(slice(x, d, off, off + s))
        off += s
    return out


def chunk(x, chunks, dim=0):
    d = _axis("chunk", dim, x)
    return split(x, -(-x.shape[d] // chunks), d)


# ----------------------------------------------------------------------- broadcast_to
def _bcast_infer(ins, shape):
    x = ins[0]
    try:
        if tuple(np.broadcast_shapes(x.shape, shape)) != tuple(shape):
            raise ValueError
    except ValueError:
        raise op_error("broadcast_to", f"cannot broadcast to {fmt_shape(shape)}", x) from None
    return tuple(shape), x.dtype


register("broadcast_to", _bcast_infer, lambda x, shape: np.ascontiguousarray(np.broadcast_to(x, shape)),
         lambda ct, y, x, shape: [unbroadcast(ct, x.shape)], layout=True)


def broadcast_to(x, shape):
    """torch.broadcast_to (-1 keeps a dimension, as in expand)."""
    shape = int_dims("broadcast_to", shape, allow=(-1,))
    lead = len(shape) - x.ndim
    shape = tuple(x.shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(shape))
    if shape == x.shape:
        return x
    return emit("broadcast_to", [x], shape=shape)


expand = broadcast_to


def broadcast_tensors(*ts: Tensor):
    shape = broadcast_shapes("broadcast_tensors", *ts)
    return [broadcast_to(t, shape) for t in ts]


# ---------------------------------------------------- flip, roll, repeat, pad, tril/triu
# Built from the layout ops above (their gradients come with them): index_select with a
# constant index, slices joined by concat, broadcasts of inserted axes.
def _const_index(x, idx):
    return x.graph.constant(np.asarray(idx, np.int32))


def _dims(op, dims, x):
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    out = [norm_dim(op, int(d), x.ndim, x) for d in dims]
    if len(set(out)) != len(out):
        raise op_error(op, f"dims {dims} name a dimension twice", x)
    return out


def flip(x, dims):
    """torch.flip: reverse the order along each of ``dims``."""
    for d in _dims("flip", dims, x):
        if x.shape[d] > 1:
            x = index_select(x, d, _const_index(x, np.arange(x.shape[d] - 1, -1, -1)))
    return x


def roll(x, shifts, dims=None):
    """torch.roll: elements shifted along ``dims`` (flattened first where dims is None),
    those pushed past the end coming back at the start."""
    if dims is None:
        if not isinstance(shifts, (int, np.integer)) and len(shifts) != 1:
            raise op_error("roll", f"without dims, shifts must be one number, got {shifts!r}", x)
        s = int(shifts if isinstance(shifts, (int, np.integer)) else shifts[0])
        return reshape(roll(reshape(x, (-1,)), s, 0), x.shape)
    shifts = (shifts,) if isinstance(shifts, (int, np.integer)) else tuple(shifts)
    dims = (dims,) if isinstance(dims, (int, np.integer)) else tuple(dims)
    if len(shifts) != len(dims):
        raise op_error("roll", f"shifts {shifts} and dims {dims} differ in length", x)
    for s, dim in zip(shifts, dims):
        d = _axis("roll", dim, x)
        n = x.shape[d]
        k = int(s) % n if n else 0
        if k:
            x = concat([slice(x, d, n - k, n), slice(x, d, 0, n - k)], d)
    return x


def repeat(x, *sizes):
    """torch.Tensor.repeat: tile ``x`` sizes[i] times along dim i (extra leading sizes
    add dimensions)."""
    sizes = tuple(sizes[0]) if len(sizes) == 1 and isinstance(sizes[0], (tuple, list)) else sizes
    sizes = int_dims("repeat", sizes)
    if len(sizes) < x.ndim:
        raise op_error("repeat", f"{len(sizes)} repeat sizes for a rank-{x.ndim} tensor (need at least {x.ndim})", x)
    shape = (1,) * (len(sizes) - x.ndim) + x.shape
    spread = reshape(x, tuple(v for d in shape for v in (1, d)))
    tiled = broadcast_to(spread, tuple(v for r, d in zip(sizes, shape) for v in (r, d)))
    return reshape(tiled, tuple(r * d for r, d in zip(sizes, shape)))


def _pad_index(n, lo, hi, mode):
    j = np.arange(-lo, n + hi)
    if mode == "replicate":
        return np.clip(j, 0, n - 1)
    if mode == "circular":
        return j % n
    period = 2 * (n - 1)                    # reflect: the edge itself is not repeated
    j = np.abs(j) % period if period else np.zeros_like(j)
    return np.where(j >= n, period - j, j)


def pad(x, pad, mode="constant", value=None):
    """torch.nn.functional.pad: ``pad`` = (left, right) of the last dim, then of the one
    before, ...; negative amounts crop. Modes constant (``value``, default 0), reflect,
    replicate, circular."""
    pad = tuple(int(p) for p in pad)
    if len(pad) % 2 or len(pad) // 2 > x.ndim:
        raise op_error("pad", f"pad {pad} must have an even length of at most 2 x rank ({2 * x.ndim})", x)
    if mode not in ("constant", "reflect", "replicate", "circular"):
        raise ValueError(f"pad: mode must be 'constant', 'reflect', 'replicate' or 'circular', got {mode!r}")
    if mode != "constant" and value:
        raise ValueError(f"pad: value is for mode 'constant', not {mode!r}")
    for i in range(len(pad) // 2):
        d, lo, hi = x.ndim - 1 - i, pad[2 * i], pad[2 * i + 1]
        n = x.shape[d]
        if not lo and not hi:
            continue
        if mode in ("constant", "circular") and (lo < 0 or hi < 0):     # a negative amount crops first
            x = slice(x, d, max(-lo, 0), n - max(-hi, 0))
            lo, hi, n = max(lo, 0), max(hi, 0), x.shape[d]
        if mode == "constant":
            def block(k):
                fill = x.graph.constant(np.asarray(0 if value is None else value), x.dtype)
                return broadcast_to(fill, tuple(k if a == d else s for a, s in enumerate(x.shape)))
            x = concat(([block(lo)] if lo else []) + [x] + ([block(hi)] if hi else []), d)
        else:
            # each output position's index in the input (replicate and reflect crop with it)
            if n == 0 or n + lo + hi < 0 or (mode == "reflect" and max(lo, hi) >= n) or \
                    (mode == "circular" and max(lo, hi) > n):
                raise op_error("pad", f"{mode} padding ({lo}, {hi}) of dim {d} needs a larger size than {n}", x)
            x = _take(x, d, _pad_index(n, lo, hi, mode))
    return x


def _take(x, d, idx, max_pieces=16):
    """x's slices at the constant positions ``idx`` along ``d``: runs of consecutive
    positions as slices and repeats as broadcasts, joined by concat (index_select, a
    one-hot product over the axis, only where there would be more pieces than that)."""
    pieces, k = [], 0
    while k < len(idx):
        j = k + 1
        if j < len(idx) and idx[j] == idx[k]:
            while j < len(idx) and idx[j] == idx[k]:
                j += 1
            one = slice(x, d, int(idx[k]), int(idx[k]) + 1)
            pieces.append(broadcast_to(one, tuple(j - k if a == d else v for a, v in enumerate(x.shape))))
        else:
            while j < len(idx) and idx[j] == idx[j - 1] + 1:
                j += 1
            pieces.append(slice(x, d, int(idx[k]), int(idx[j - 1]) + 1))
        k = j
    if len(pieces) > max_pieces:
        return index_select(x, d, _const_index(x, idx))
    return pieces[0] if len(pieces) == 1 else concat(pieces, d)


def _triangle(op, x, diagonal, lower):
    if x.ndim < 2:
        raise op_error(op, "needs a tensor of at least 2 dimensions", x)
    r, c = x.shape[-2:]
    i, j = np.arange(r)[:, None], np.arange(c)[None, :]
    keep = (j - i <= diagonal) if lower else (j - i >= diagonal)
    from .elementwise import where
    return where(x.graph.constant(keep.astype(np.uint32)), x, 0)


def tril(x, diagonal=0):
    """torch.tril: the elements on and below the ``diagonal``-th diagonal, zeros elsewhere."""
    return _triangle("tril", x, int(diagonal), True)


def triu(x, diagonal=0):
    """torch.triu: the elements on and above the ``diagonal``-th diagonal, zeros elsewhere."""
    return _triangle("triu", x, int(diagonal), False)
