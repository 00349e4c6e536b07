"""2-D convolution, pooling and nearest upsampling in NCHW, with torch.nn.functional's signatures.

``conv2d`` is one op record (without bias) so that a GPU implicit-GEMM kernel can replace
it; its gradients are two ops of their own, ``conv2d_input_grad`` and ``conv2d_weight_grad``.
For a backend without such kernels every op here decomposes (``extra['decompose']``) into
two index primitives, ``im2col`` and its adjoint ``col2im``, plus matmul, reductions,
layout and elementwise ops.

Attribute conventions shared by the records: ``kernel``, ``stride``, ``dilation`` are
(h, w) pairs; ``padding`` is ((top, bottom), (left, right)) so that asymmetric 'same'
padding fits; ``size`` is the (H, W) of the un-convolved image.
"""
from __future__ import annotations

import math

import numpy as np

from ..graph import Tensor, fmt_shape
from .registry import emit, op_error, register, require_float, same_dtype

__all__ = ["conv1d", "conv2d", "max_pool2d", "avg_pool2d", "adaptive_avg_pool2d", "upsample_nearest2d", "unfold", "fold"]


# ----------------------------------------------------------------------------- helpers
def _pair(op, what, v, minimum):
    if isinstance(v, (int, np.integer)):
        v = (int(v), int(v))
    else:
        try:
            v = tuple(int(a) for a in v)
        except TypeError:
            raise TypeError(f"{op}: {what} must be an int or a pair of ints, got {v!r}") from None
        if len(v) == 1:
            v = v * 2
    if len(v) != 2:
        raise ValueError(f"{op}: {what} must be an int or a pair of ints, got {v!r}")
    if any(a < minimum for a in v):
        raise ValueError(f"{op}: {what} must be >= {minimum}, got {v!r}")
    return v


def _sym(p):
    """(ph, pw) -> ((ph, ph), (pw, pw))."""
    return ((p[0], p[0]), (p[1], p[1]))


def _out_len(n, k, s, p0, p1, d):
    return (n + p0 + p1 - d * (k - 1) - 1) // s + 1


def _out_hw(op, size, kernel, stride, padding, dilation, *tensors):
    """Output (Hout, Wout); a clear error when the (dilated) kernel exceeds the padded input."""
    out = tuple(_out_len(size[a], kernel[a], stride[a], padding[a][0], padding[a][1], dilation[a]) for a in (0, 1))
    if min(out) < 1:
        eff = tuple(dilation[a] * (kernel[a] - 1) + 1 for a in (0, 1))
        padded = tuple(size[a] + padding[a][0] + padding[a][1] for a in (0, 1))
        raise op_error(op, f"kernel {fmt_shape(kernel)} (dilated extent {fmt_shape(eff)}) is larger than the "
                           f"padded input {fmt_shape(padded)}", *tensors)
    return out


def _windows(x, kernel, stride, padding, dilation, fill):
    """x (N, C, H, W) -> (N, C, kh, kw, Hout, Wout): one strided slice per kernel offset."""
    (kh, kw), (sh, sw), ((pt, pb), (pl, pr)), (dh, dw) = kernel, stride, padding, dilation
    n, c, h, w = x.shape
    ho, wo = _out_len(h, kh, sh, pt, pb, dh), _out_len(w, kw, sw, pl, pr, dw)
    xp = np.full((n, c, h + pt + pb, w + pl + pr), fill, dtype=x.dtype)
    xp[:, :, pt:pt + h, pl:pl + w] = x
    out = np.empty((n, c, kh, kw, ho, wo), dtype=x.dtype)
    for i in range(kh):
        for j in range(kw):
            out[:, :, i, j] = xp[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw]
    return out


def _unwindows(win, size, stride, padding, dilation):
    """Adjoint of _windows: (N, C, kh, kw, Hout, Wout) summed back onto (N, C, H, W)."""
    n, c, kh, kw, ho, wo = win.shape
    (h, w), (sh, sw), ((pt, pb), (pl, pr)), (dh, dw) = size, stride, padding, dilation
    xp = np.zeros((n, c, h + pt + pb, w + pl + pr), dtype=win.dtype)
    for i in range(kh):
        for j in range(kw):
            xp[:, :, i * dh:i * dh + sh * (ho - 1) + 1:sh, j * dw:j * dw + sw * (wo - 1) + 1:sw] += win[:, :, i, j]
    return np.ascontiguousarray(xp[:, :, pt:pt + h, pl:pl + w])


def _require4(op, what, t):
    if t.ndim != 4:
        raise op_error(op, f"{what} must be 4-D (N, C, H, W)", t)


def _unbatched(x, fn):
    """torch accepts a (C, H, W) image as a batch of one."""
    from . import reshape
    if x.ndim == 3:
        y = fn(reshape(x, (1,) + x.shape))
        return reshape(y, y.shape[1:])
    if x.ndim != 4:
        raise op_error(fn.__name__, "input must be 3-D (C, H, W) or 4-D (N, C, H, W)", x)
    return fn(x)


# ---------------------------------------------------------------------- im2col / col2im
# im2col (primitive): x (N, C, H, W) -> cols (N, C*kh*kw, Hout*Wout), torch.unfold's layout.
# Output element [n, (c*kh + i)*kw + j, oh*Wout + ow] reads x[n, c, oh*sh - top + i*dh, ow*sw - left + j*dw],
# or is ``fill`` when that lies in the padding (0 for convolutions, -inf for max pooling).
# ``fold_batch``: the columns of every image side by side instead, (C*kh*kw, N*Hout*Wout), so
# that one matmul sums a convolution's weight gradient over the batch (lowering only).
def _im2col_infer(ins, kernel, stride, padding, dilation, fill, fold_batch=False):
    x = ins[0]
    require_float("im2col", x)
    _require4("im2col", "input", x)
    ho, wo = _out_hw("im2col", x.shape[2:], kernel, stride, padding, dilation, x)
    rows = x.shape[1] * kernel[0] * kernel[1]
    return ((rows, x.shape[0] * ho * wo) if fold_batch else (x.shape[0], rows, ho * wo)), x.dtype


def _im2col_ref(x, kernel, stride, padding, dilation, fill, fold_batch=False):
    win = _windows(x, kernel, stride, padding, dilation, fill)
    n, c, kh, kw, ho, wo = win.shape
    cols = win.reshape(n, c * kh * kw, ho * wo)
    return np.swapaxes(cols, 0, 1).reshape(c * kh * kw, n * ho * wo) if fold_batch else cols


def _im2col_vjp(ct, y, x, kernel, stride, padding, dilation, fill, fold_batch=False):
    if fold_batch:
        raise NotImplementedError("im2col with fold_batch is a lowering form: it has no gradient")
    return [_col2im(ct, x.shape[2:], kernel, stride, padding, dilation)]


register("im2col", _im2col_infer, _im2col_ref, _im2col_vjp)


# col2im (primitive, the adjoint of im2col with fill 0): cols (N, C*kh*kw, Hout*Wout) -> (N, C, H, W).
# Written as a gather: output element [n, c, h, w] sums, over kernel offsets (i, j) with
# oh = (h + top - i*dh) / sh and ow = (w + left - j*dw) / sw both exact and inside
# [0, Hout) x [0, Wout), the column element cols[n, (c*kh + i)*kw + j, oh*Wout + ow].
def _col2im_infer(ins, size, kernel, stride, padding, dilation):
    cols = ins[0]
    require_float("col2im", cols)
    k = kernel[0] * kernel[1]
    if cols.ndim != 3 or cols.shape[1] % k:
        raise op_error("col2im", f"columns must be 3-D (N, C*{kernel[0]}*{kernel[1]}, L) with the middle size a "
                                 f"multiple of the kernel size {k}", cols)
    ho, wo = _out_hw("col2im", size, kernel, stride, padding, dilation, cols)
    if cols.shape[2] != ho * wo:
        raise op_error("col2im", f"expected {ho * wo} = {ho}*{wo} columns (blocks) for output size {fmt_shape(size)}, "
                                 f"kernel {fmt_shape(kernel)}, stride {fmt_shape(stride)}", cols)
    return (cols.shape[0], cols.shape[1] // k) + tuple(size), cols.dtype


def _col2im_ref(cols, size, kernel, stride, padding, dilation):
    n, ck, _ = cols.shape
    kh, kw = kernel
    ho, wo = (_out_len(size[a], kernel[a], stride[a], padding[a][0], padding[a][1], dilation[a]) for a in (0, 1))
    return _unwindows(cols.reshape(n, ck // (kh * kw), kh, kw, ho, wo), size, stride, padding, dilation)


register("col2im", _col2im_infer, _col2im_ref,
         lambda ct, y, cols, size, kernel, stride, padding, dilation: [
             _im2col(ct, kernel, stride, padding, dilation)])


def _im2col(x, kernel, stride, padding, dilation, fill=0.0, fold_batch=False):
    extra = {"fold_batch": True} if fold_batch else {}
    return emit("im2col", [x], kernel=tuple(kernel), stride=tuple(stride), padding=tuple(map(tuple, padding)),
                dilation=tuple(dilation), fill=float(fill), **extra)


def _col2im(cols, size, kernel, stride, padding, dilation):
    return emit("col2im", [cols], size=tuple(int(s) for s in size), kernel=tuple(kernel), stride=tuple(stride),
                padding=tuple(map(tuple, padding)), dilation=tuple(dilation))


def unfold(input, kernel_size, dilation=1, padding=0, stride=1):
    """torch.nn.functional.unfold: (N, C, H, W) -> (N, C*kh*kw, L) sliding blocks ((C, H, W)
    -> (C*kh*kw, L) unbatched)."""
    args = (_pair("unfold", "kernel_size", kernel_size, 1), _pair("unfold", "stride", stride, 1),
            _sym(_pair("unfold", "padding", padding, 0)), _pair("unfold", "dilation", dilation, 1))

    def run(x):
        return _im2col(x, *args)
    run.__name__ = "unfold"
    return _unbatched(input, run)


def fold(input, output_size, kernel_size, dilation=1, padding=0, stride=1):
    """torch.nn.functional.fold: sums sliding blocks (N, C*kh*kw, L) back into (N, C, H, W)."""
    from . import reshape
    size = _pair("fold", "output_size", output_size, 1)
    args = (_pair("fold", "kernel_size", kernel_size, 1), _pair("fold", "stride", stride, 1),
            _sym(_pair("fold", "padding", padding, 0)), _pair("fold", "dilation", dilation, 1))
    if input.ndim == 2:
        y = _col2im(reshape(input, (1,) + input.shape), size, *args)
        return reshape(y, y.shape[1:])
    return _col2im(input, size, *args)


# ----------------------------------------------------------------------------- conv2d
def _conv_groups_check(op, x_ch, o_ch, cg, groups, *tensors):
    if groups < 1:
        raise op_error(op, f"groups must be >= 1, got {groups}", *tensors)
    if x_ch % groups:
        raise op_error(op, f"groups={groups} does not divide the input's {x_ch} channels", *tensors)
    if o_ch % groups:
        raise op_error(op, f"groups={groups} does not divide the weight's {o_ch} output channels", *tensors)
    if cg * groups != x_ch:
        raise op_error(op, f"input has {x_ch} channels but the weight expects {cg * groups} "
                           f"(weight.shape[1]={cg} x groups={groups})", *tensors)


def _conv2d_infer(ins, stride, padding, dilation, groups):
    x, w = ins
    require_float("conv2d", x, w)
    dt = same_dtype("conv2d", x, w)
    _require4("conv2d", "input", x)
    if w.ndim != 4:
        raise op_error("conv2d", "weight must be 4-D (C_out, C_in / groups, kH, kW)", w)
    _conv_groups_check("conv2d", x.shape[1], w.shape[0], w.shape[1], groups, x, w)
    ho, wo = _out_hw("conv2d", x.shape[2:], w.shape[2:], stride, padding, dilation, x, w)
    return (x.shape[0], w.shape[0], ho, wo), dt


def _conv2d_ref(x, w, stride, padding, dilation, groups):
    o, cg, kh, kw = w.shape
    win = _windows(x, (kh, kw), stride, padding, dilation, 0)
    n, ho, wo = x.shape[0], win.shape[4], win.shape[5]
    cols = win.reshape(n, groups, cg * kh * kw, ho * wo)
    y = np.matmul(w.reshape(groups, o // groups, cg * kh * kw), cols)   # (N, g, O/g, L)
    return y.reshape(n, o, ho, wo)


def _conv2d_vjp(ct, y, x, w, stride, padding, dilation, groups):
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return [emit("conv2d_input_grad", [ct, w], size=x.shape[2:], **kw),
            emit("conv2d_weight_grad", [x, ct], kernel=w.shape[2:], **kw)]


def _product(a, b, ta=False, tb=False):
    from . import mm
    return mm(a, b, ta=ta, tb=tb)


# The decompositions take the matmul as ``product(a, b, ta, tb)``: accelerated precision
# passes its own (f16 operands, f32 accumulation and output).
def _conv2d_decompose(x, w, stride, padding, dilation, groups, product=_product):
    from . import reshape
    o, cg, kh, kw = w.shape
    cols = _im2col(x, (kh, kw), stride, padding, dilation)            # (N, C*kh*kw, L)
    n, _, l = cols.shape
    k = cg * kh * kw
    y = product(reshape(w, (groups, o // groups, k)), reshape(cols, (n, groups, k, l)))   # (N, g, O/g, L)
    return reshape(y, (n, o) + _out_hw("conv2d", x.shape[2:], (kh, kw), stride, padding, dilation, x))


register("conv2d", _conv2d_infer, _conv2d_ref, _conv2d_vjp, decompose=_conv2d_decompose)


# conv2d_input_grad(ct, w) -> dx: the transposed convolution of the output cotangent.
def _input_grad_infer(ins, size, stride, padding, dilation, groups):
    ct, w = ins
    require_float("conv2d_input_grad", ct, w)
    dt = same_dtype("conv2d_input_grad", ct, w)
    _require4("conv2d_input_grad", "cotangent", ct)
    if w.ndim != 4 or ct.shape[1] != w.shape[0]:
        raise op_error("conv2d_input_grad", "weight must be 4-D with shape[0] equal to the cotangent's channels", ct, w)
    _conv_groups_check("conv2d_input_grad", w.shape[1] * groups, w.shape[0], w.shape[1], groups, ct, w)
    hw = _out_hw("conv2d_input_grad", size, w.shape[2:], stride, padding, dilation, ct, w)
    if tuple(ct.shape[2:]) != hw:
        raise op_error("conv2d_input_grad", f"cotangent spatial size must be {fmt_shape(hw)} for input size "
                                            f"{fmt_shape(size)}", ct, w)
    return (ct.shape[0], w.shape[1] * groups) + tuple(size), dt


def _input_grad_ref(ct, w, size, stride, padding, dilation, groups):
    o, cg, kh, kw = w.shape
    n, _, ho, wo = ct.shape
    k = cg * kh * kw
    wt = np.swapaxes(w.reshape(groups, o // groups, k), 1, 2)             # (g, K, O/g)
    cols = np.matmul(wt, ct.reshape(n, groups, o // groups, ho * wo))     # (N, g, K, L)
    return _unwindows(cols.reshape(n, groups * cg, kh, kw, ho, wo), size, stride, padding, dilation)


def _input_grad_decompose(ct, w, size, stride, padding, dilation, groups, product=_product):
    from . import reshape
    o, cg, kh, kw = w.shape
    n, _, ho, wo = ct.shape
    k = cg * kh * kw
    cols = product(reshape(w, (groups, o // groups, k)), reshape(ct, (n, groups, o // groups, ho * wo)), ta=True)
    return _col2im(reshape(cols, (n, groups * k, ho * wo)), size, (kh, kw), stride, padding, dilation)


def _input_grad_vjp(u, dx, ct, w, size, stride, padding, dilation, groups):
    # linear in each argument: <u, dx(ct, w)> = <conv2d(u, w), ct> = <weight_grad(u, ct), w>
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return [emit("conv2d", [u, w], **kw), emit("conv2d_weight_grad", [u, ct], kernel=w.shape[2:], **kw)]


register("conv2d_input_grad", _input_grad_infer, _input_grad_ref, _input_grad_vjp, decompose=_input_grad_decompose)


# conv2d_weight_grad(x, ct) -> dw: correlation of the input with the output cotangent, summed over the batch.
def _weight_grad_infer(ins, kernel, stride, padding, dilation, groups):
    x, ct = ins
    require_float("conv2d_weight_grad", x, ct)
    dt = same_dtype("conv2d_weight_grad", x, ct)
    _require4("conv2d_weight_grad", "input", x)
    _require4("conv2d_weight_grad", "cotangent", ct)
    if x.shape[0] != ct.shape[0]:
        raise op_error("conv2d_weight_grad", "input and cotangent batch sizes differ", x, ct)
    if groups < 1 or x.shape[1] % groups or ct.shape[1] % groups:
        raise op_error("conv2d_weight_grad", f"groups={groups} must divide both channel counts", x, ct)
    hw = _out_hw("conv2d_weight_grad", x.shape[2:], kernel, stride, padding, dilation, x, ct)
    if tuple(ct.shape[2:]) != hw:
        raise op_error("conv2d_weight_grad", f"cotangent spatial size must be {fmt_shape(hw)}", x, ct)
    return (ct.shape[1], x.shape[1] // groups) + tuple(kernel), dt


def _weight_grad_ref(x, ct, kernel, stride, padding, dilation, groups):
    n, c = x.shape[:2]
    o, ho, wo = ct.shape[1:]
    k = c // groups * kernel[0] * kernel[1]
    cols = _windows(x, kernel, stride, padding, dilation, 0).reshape(n, groups, k, ho * wo)
    dw = np.matmul(ct.reshape(n, groups, o // groups, ho * wo), np.swapaxes(cols, 2, 3)).sum(axis=0)
    return dw.reshape((o, c // groups) + tuple(kernel))


def _folds_batch(n, k, positions, groups) -> bool:
    """A weight gradient with more weights (``k`` a group) than positions per image takes one
    matmul over the whole batch (K = N*L) instead of N products written out and summed."""
    return groups == 1 and n > 1 and k > positions


def gradient_product_depth(t) -> int:
    """K of the matmul that the decomposition of convolution gradient ``t`` forms: the
    input gradient's contracts a group's output channels, the weight gradient's the positions
    of an image, or of the whole batch where it folds it (``_folds_batch``)."""
    if t.op == "conv2d_input_grad":
        return t.inputs[1].shape[0] // t.attrs["groups"]
    x, ct = t.inputs
    groups, (kh, kw) = t.attrs["groups"], t.attrs["kernel"]
    positions = ct.shape[2] * ct.shape[3]
    folds = _folds_batch(x.shape[0], x.shape[1] // groups * kh * kw, positions, groups)
    return x.shape[0] * positions if folds else positions


def _weight_grad_decompose(x, ct, kernel, stride, padding, dilation, groups, product=_product):
    from . import permute, reduce_sum, reshape
    n, c = x.shape[:2]
    o, ho, wo = ct.shape[1:]
    k = c // groups * kernel[0] * kernel[1]
    if _folds_batch(n, k, ho * wo, groups):
        # the cotangent is transposed to (O, N, L) for the one matmul over the batch (a copy
        # of N*O*L, against N*O*K partials)
        ct_t = reshape(permute(reshape(ct, (n, o, ho * wo)), (1, 0, 2)), (o, n * ho * wo))
        dw = product(ct_t, _im2col(x, kernel, stride, padding, dilation, fold_batch=True), tb=True)
        return reshape(dw, (o, c) + tuple(kernel))
    cols = reshape(_im2col(x, kernel, stride, padding, dilation), (n, groups, k, ho * wo))
    dw = product(reshape(ct, (n, groups, o // groups, ho * wo)), cols, tb=True)   # (N, g, O/g, K)
    return reshape(reduce_sum(dw, (0,)), (o, c // groups) + tuple(kernel))


def _weight_grad_vjp(v, dw, x, ct, kernel, stride, padding, dilation, groups):
    # linear in each argument: <v, dw(x, ct)> = <conv2d(x, v), ct> = <input_grad(ct, v), x>
    kw = dict(stride=stride, padding=padding, dilation=dilation, groups=groups)
    return [emit("conv2d_input_grad", [ct, v], size=x.shape[2:], **kw), emit("conv2d", [x, v], **kw)]


register("conv2d_weight_grad", _weight_grad_infer, _weight_grad_ref, _weight_grad_vjp,
         decompose=_weight_grad_decompose)


def _conv_padding(padding, kernel, stride, dilation):
    if isinstance(padding, str):
        if padding == "valid":
            return ((0, 0), (0, 0))
        if padding == "same":
            if stride != (1, 1):
                raise ValueError(f"conv2d: padding='same' needs stride 1, got stride {stride}")
            # as torch: the odd extra row/column of padding goes to the bottom/right
            tot = [dilation[a] * (kernel[a] - 1) for a in (0, 1)]
            return tuple((t // 2, t - t // 2) for t in tot)
        raise ValueError(f"conv2d: padding must be an int, a pair, 'same' or 'valid', got {padding!r}")
    return _sym(_pair("conv2d", "padding", padding, 0))


def conv2d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv2d: input (N, C_in, H, W) or (C_in, H, W), weight
    (C_out, C_in / groups, kH, kW), optional bias (C_out,)."""
    from . import reshape
    stride = _pair("conv2d", "stride", stride, 1)
    dilation = _pair("conv2d", "dilation", dilation, 1)
    if not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"conv2d: groups must be a positive int, got {groups!r}")
    if not isinstance(weight, Tensor) or weight.ndim != 4:
        if isinstance(weight, Tensor):
            raise op_error("conv2d", "weight must be 4-D (C_out, C_in / groups, kH, kW)", weight)
        raise TypeError(f"conv2d: weight must be a Tensor, got {type(weight).__name__}")
    pads = _conv_padding(padding, weight.shape[2:], stride, dilation)
    if bias is not None and (not isinstance(bias, Tensor) or bias.shape != (weight.shape[0],)):
        raise op_error("conv2d", f"bias must have shape ({weight.shape[0]},) (the weight's output channels)",
                       *(t for t in (bias, weight) if isinstance(t, Tensor)))

    def run(x):
        y = emit("conv2d", [x, weight], stride=stride, padding=pads, dilation=dilation, groups=int(groups))
        return y + reshape(bias, (weight.shape[0], 1, 1)) if bias is not None else y
    run.__name__ = "conv2d"
    return _unbatched(input, run)


def conv1d(input, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
    """torch.nn.functional.conv1d: input (N, C_in, L) or (C_in, L), weight
    (C_out, C_in / groups, k); runs as conv2d on a height-1 view."""
    from . import reshape
    if not isinstance(weight, Tensor) or weight.ndim != 3:
        if isinstance(weight, Tensor):
            raise op_error("conv1d", "weight must be 3-D (C_out, C_in / groups, k)", weight)
        raise TypeError(f"conv1d: weight must be a Tensor, got {type(weight).__name__}")
    if input.ndim not in (2, 3):
        raise op_error("conv1d", "input must be 2-D (C_in, L) or 3-D (N, C_in, L)", input)

    def one(v, what, minimum):
        t = tuple(v) if isinstance(v, (tuple, list)) else (v,)
        if len(t) != 1 or not isinstance(t[0], (int, np.integer)):
            raise ValueError(f"conv1d: {what} must be an int or a 1-tuple, got {v!r}")
        if t[0] < minimum:
            raise ValueError(f"conv1d: {what} must be >= {minimum}, got {v!r}")
        return (1 if what != "padding" else 0, int(t[0]))
    stride, dilation = one(stride, "stride", 1), one(dilation, "dilation", 1)
    # checked here so that errors name conv1d and its own (1-D) arguments
    if isinstance(padding, str):
        if padding not in ("same", "valid"):
            raise ValueError(f"conv1d: padding must be an int, a 1-tuple, 'same' or 'valid', got {padding!r}")
        if padding == "same" and stride != (1, 1):
            raise ValueError(f"conv1d: padding='same' needs stride 1, got stride {stride[1]}")
        pad = padding
    else:
        pad = one(padding, "padding", 0)
    if not isinstance(groups, (int, np.integer)) or groups < 1:
        raise ValueError(f"conv1d: groups must be a positive int, got {groups!r}")
    x = reshape(input, input.shape[:-1] + (1, input.shape[-1]))
    w = reshape(weight, weight.shape[:2] + (1, weight.shape[2]))
    y = conv2d(x, w, bias, stride, pad, dilation, groups)
    return reshape(y, y.shape[:-2] + y.shape[-1:])


# ------------------------------------------------------------------------- max_pool2d
def _pool_window_check(op, kernel, padding, *tensors):
    for a in (0, 1):
        if padding[a][0] > kernel[a] // 2:
            raise op_error(op, f"padding {padding[a][0]} must be at most half the kernel size {kernel[a]}", *tensors)


def _max_pool_infer(ins, kernel, stride, padding, dilation):
    x = ins[0]
    require_float("max_pool2d", x)
    _require4("max_pool2d", "input", x)
    _pool_window_check("max_pool2d", kernel, padding, x)
    ho, wo = _out_hw("max_pool2d", x.shape[2:], kernel, stride, padding, dilation, x)
    return x.shape[:2] + (ho, wo), x.dtype


def _max_pool_ref(x, kernel, stride, padding, dilation):
    return _windows(x, kernel, stride, padding, dilation, -np.inf).max(axis=(2, 3))


def _max_pool_decompose(x, kernel, stride, padding, dilation):
    from . import amax, reshape
    n, c = x.shape[:2]
    ho, wo = _out_hw("max_pool2d", x.shape[2:], kernel, stride, padding, dilation, x)
    cols = _im2col(x, kernel, stride, padding, dilation, fill=-math.inf)
    return reshape(amax(reshape(cols, (n, c, kernel[0] * kernel[1], ho * wo)), 2), (n, c, ho, wo))


register("max_pool2d", _max_pool_infer, _max_pool_ref,
         lambda ct, y, x, **a: [emit("max_pool2d_grad", [x, ct], **a)], decompose=_max_pool_decompose)


# max_pool2d_grad(x, ct) -> dx: each output's cotangent goes to the first maximum of its
# window in scan order (row-major over the kernel), as torch does.
def _max_pool_grad_infer(ins, kernel, stride, padding, dilation):
    x, ct = ins
    same_dtype("max_pool2d_grad", x, ct)
    shape, _ = _max_pool_infer([x], kernel, stride, padding, dilation)
    if ct.shape != shape:
        raise op_error("max_pool2d_grad", f"cotangent must have the pooled shape {fmt_shape(shape)}", x, ct)
    return x.shape, x.dtype


def _max_pool_grad_ref(x, ct, kernel, stride, padding, dilation):
    win = _windows(x, kernel, stride, padding, dilation, -np.inf)
    n, c, kh, kw, ho, wo = win.shape
    first = np.argmax(win.reshape(n, c, kh * kw, ho, wo), axis=2)      # argmax picks the first maximum
    sel = (first[:, :, None] == np.arange(kh * kw)[:, None, None]).reshape(n, c, kh, kw, ho, wo)
    return _unwindows(np.where(sel, ct[:, :, None, None], 0).astype(ct.dtype), x.shape[2:], stride, padding, dilation)


def _first_max_mask(x, kernel, stride, padding, dilation):
    """u32 (N, C, kh*kw, L): 1 at the first maximum of each pooling window."""
    from . import amax, eq, reshape, where
    n, c = x.shape[:2]
    k = kernel[0] * kernel[1]
    cols = _im2col(x, kernel, stride, padding, dilation, fill=-math.inf)
    cols = reshape(cols, (n, c, k, cols.shape[-1]))          # spelled out: an empty batch cannot infer -1
    hit = eq(cols, amax(cols, 2, keepdim=True))
    negk = x.graph.constant(-np.arange(k, dtype=np.float64).reshape(k, 1), dtype=x.dtype)
    # the first hit has the smallest offset: the largest -offset among hits
    first = amax(where(hit, negk, float(-k)), 2, keepdim=True)
    return eq(negk, first)


def _max_pool_grad_decompose(x, ct, kernel, stride, padding, dilation):
    from . import reshape, where
    n, c, ho, wo = ct.shape
    sel = _first_max_mask(x, kernel, stride, padding, dilation)
    cols = where(sel, reshape(ct, (n, c, 1, ho * wo)), 0.0)
    return _col2im(reshape(cols, (n, c * kernel[0] * kernel[1], ho * wo)), x.shape[2:], kernel, stride, padding,
                   dilation)


def _max_pool_grad_vjp(u, dx, x, ct, kernel, stride, padding, dilation):
    # linear in ct (the selection is piecewise constant in x): gather u at each window's first maximum
    from . import reduce_sum, reshape, where
    n, c, ho, wo = ct.shape
    sel = _first_max_mask(x, kernel, stride, padding, dilation)
    cols = reshape(_im2col(u, kernel, stride, padding, dilation), sel.shape)
    return [None, reshape(reduce_sum(where(sel, cols, 0.0), (2,)), ct.shape)]


register("max_pool2d_grad", _max_pool_grad_infer, _max_pool_grad_ref, _max_pool_grad_vjp,
         decompose=_max_pool_grad_decompose)


def _ceil_padding(size, k, s, p, d):
    """ceil_mode as extra right/bottom padding. torch's rule: round the output size up, but
    the last window must start inside the (left-padded) input."""
    extra = []
    for a in (0, 1):
        span = size[a] + 2 * p[a][0] - d[a] * (k[a] - 1) - 1
        out = -(-span // s[a]) + 1 if span >= 0 else 1
        if (out - 1) * s[a] >= size[a] + p[a][0]:
            out -= 1
        extra.append(max(0, (out - 1) * s[a] + d[a] * (k[a] - 1) + 1 - (size[a] + 2 * p[a][0])))
    return tuple((p[a][0], p[a][1] + extra[a]) for a in (0, 1))


def _pool_args(op, kernel_size, stride, padding, dilation=1):
    k = _pair(op, "kernel_size", kernel_size, 1)
    s = k if stride is None or (not isinstance(stride, (int, np.integer)) and len(stride) == 0) else \
        _pair(op, "stride", stride, 1)
    return k, s, _sym(_pair(op, "padding", padding, 0)), _pair(op, "dilation", dilation, 1)


def max_pool2d(input, kernel_size, stride=None, padding=0, dilation=1, ceil_mode=False, return_indices=False):
    """torch.nn.functional.max_pool2d (padding acts as -inf; stride defaults to kernel_size).
    ``return_indices=True`` gives (values, i32 indices into each flattened input plane)."""
    k, s, p, d = _pool_args("max_pool2d", kernel_size, stride, padding, dilation)
    if ceil_mode:
        p = _ceil_padding(input.shape[-2:], k, s, p, d)      # the overhang is padding (-inf)

    def run(x):
        return emit("max_pool2d", [x], kernel=k, stride=s, padding=p, dilation=d)
    run.__name__ = "max_pool2d"
    if not return_indices:
        return _unbatched(input, run)
    from .pool_indices import max_pool2d_indices

    def indices(x):
        return max_pool2d_indices(x, k, s, p, d)
    indices.__name__ = "max_pool2d"
    return _unbatched(input, run), _unbatched(input, indices)


# ------------------------------------------------------------------------- avg_pool2d
def _avg_divisor(size, kernel, stride, padding, count_include_pad, divisor):
    """(Hout, Wout) float64 divisors: the override, the window inside the padded input (the
    window size, less a ceil_mode overhang past torch's symmetric padding), or the in-bounds
    count."""
    ho, wo = (_out_len(size[a], kernel[a], stride[a], padding[a][0], padding[a][1], 1) for a in (0, 1))
    if divisor:
        return np.full((ho, wo), float(divisor))
    counts = []
    for a, m in ((0, ho), (1, wo)):
        start = np.arange(m) * stride[a] - padding[a][0]
        if count_include_pad:
            counts.append(np.minimum(start + kernel[a], size[a] + padding[a][0]) - start)
        else:
            counts.append(np.minimum(start + kernel[a], size[a]) - np.maximum(start, 0))
    return np.outer(counts[0], counts[1]).astype(np.float64)


def _avg_pool_infer(ins, kernel, stride, padding, count_include_pad, divisor):
    x = ins[0]
    require_float("avg_pool2d", x)
    _require4("avg_pool2d", "input", x)
    _pool_window_check("avg_pool2d", kernel, padding, x)
    ho, wo = _out_hw("avg_pool2d", x.shape[2:], kernel, stride, padding, (1, 1), x)
    return x.shape[:2] + (ho, wo), x.dtype


def _avg_pool_ref(x, kernel, stride, padding, count_include_pad, divisor):
    s = _windows(x, kernel, stride, padding, (1, 1), 0).sum(axis=(2, 3), dtype=x.dtype)
    return s / _avg_divisor(x.shape[2:], kernel, stride, padding, count_include_pad, divisor).astype(x.dtype)


def _divisor_const(x, kernel, stride, padding, count_include_pad, divisor):
    # divisors are integers, exact in any float dtype, so every precision divides by the same values
    return x.graph.constant(_avg_divisor(x.shape[2:], kernel, stride, padding, count_include_pad, divisor),
                            dtype=x.dtype)


def _avg_pool_vjp(ct, y, x, kernel, stride, padding, count_include_pad, divisor):
    from . import broadcast_to, reshape
    n, c, ho, wo = ct.shape
    k = kernel[0] * kernel[1]
    g = reshape(ct / _divisor_const(x, kernel, stride, padding, count_include_pad, divisor), (n, c, 1, ho * wo))
    cols = reshape(broadcast_to(g, (n, c, k, ho * wo)), (n, c * k, ho * wo))
    return [_col2im(cols, x.shape[2:], kernel, stride, padding, (1, 1))]


def _avg_pool_decompose(x, kernel, stride, padding, count_include_pad, divisor):
    from . import reduce_sum, reshape
    n, c = x.shape[:2]
    ho, wo = _out_hw("avg_pool2d", x.shape[2:], kernel, stride, padding, (1, 1), x)
    cols = reshape(_im2col(x, kernel, stride, padding, (1, 1)), (n, c, kernel[0] * kernel[1], ho, wo))
    return reduce_sum(cols, (2,)) / _divisor_const(x, kernel, stride, padding, count_include_pad, divisor)


register("avg_pool2d", _avg_pool_infer, _avg_pool_ref, _avg_pool_vjp, decompose=_avg_pool_decompose)


def avg_pool2d(input, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
               divisor_override=None):
    """torch.nn.functional.avg_pool2d (stride defaults to kernel_size)."""
    if divisor_override is not None and int(divisor_override) == 0:      # torch takes a negative one
        raise ValueError(f"avg_pool2d: divisor_override must be a nonzero int, got {divisor_override!r}")
    k, s, p, d = _pool_args("avg_pool2d", kernel_size, stride, padding)
    if ceil_mode:
        p = _ceil_padding(input.shape[-2:], k, s, p, d)      # zeros, left out of every divisor

    def run(x):
        return emit("avg_pool2d", [x], kernel=k, stride=s, padding=p, count_include_pad=bool(count_include_pad),
                    divisor=int(divisor_override or 0))
    run.__name__ = "avg_pool2d"
    return _unbatched(input, run)


# ------------------------------------------------------------- adaptive pool, upsample
def adaptive_avg_pool2d(input, output_size):
    """torch.nn.functional.adaptive_avg_pool2d; None keeps that dimension. Output sizes that
    divide the input pool as avg_pool2d, others with torch's uneven windows (``adaptive_pool``)."""
    from . import mean
    if input.ndim not in (3, 4):
        raise op_error("adaptive_avg_pool2d", "input must be 3-D (C, H, W) or 4-D (N, C, H, W)", input)
    h, w = input.shape[-2:]
    if isinstance(output_size, (int, np.integer)):
        output_size = (output_size, output_size)
    out = tuple(int(dim if o is None else o) for o, dim in zip(output_size, (h, w)))
    if len(tuple(output_size)) != 2 or min(out) < 1:
        raise ValueError(f"adaptive_avg_pool2d: output_size must be a positive int or pair, got {output_size!r}")
    if out == (1, 1):
        return mean(input, (-2, -1), keepdim=True)
    if h % out[0] or w % out[1]:
        from .adaptive_pool import adaptive_avg_pool2d_uneven
        return adaptive_avg_pool2d_uneven(input, out)
    k = (h // out[0], w // out[1])
    return avg_pool2d(input, k, k)


def upsample_nearest2d(input, scale_factor=2):
    """torch.nn.functional.interpolate(input, scale_factor=s, mode='nearest') for integer s
    (an int or an (sh, sw) pair): each pixel becomes an sh x sw block."""
    from . import broadcast_to, reshape
    sf = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor, scale_factor)
    if len(sf) != 2 or any(float(s) != int(s) or int(s) < 1 for s in sf):
        raise NotImplementedError(f"upsample_nearest2d: scale_factor must be a positive integer or pair of "
                                  f"integers, got {scale_factor!r}")
    sh, sw = (int(s) for s in sf)
    if input.ndim not in (3, 4):
        raise op_error("upsample_nearest2d", "input must be 3-D (C, H, W) or 4-D (N, C, H, W)", input)
    lead, (h, w) = input.shape[:-2], input.shape[-2:]
    y = broadcast_to(reshape(input, lead + (h, 1, w, 1)), lead + (h, sh, w, sw))
    return reshape(y, lead + (h * sh, w * sw))
