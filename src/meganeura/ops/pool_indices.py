"""The indices of ``max_pool2d(..., return_indices=True)``, as torch gives them: for each
output, the position of its window's first maximum (scan order over the kernel) in the
flattened (H, W) plane of the input, as i32.

Not a primitive: the window's first-maximum mask (the one the pooling gradient uses)
selects, per output, a constant table of flat input positions, summed over the kernel.
"""
from __future__ import annotations

import numpy as np


def flat_positions(size, kernel, stride, padding, dilation):
    """(kh*kw, Hout*Wout) float32: the flat input position h*W + w each kernel offset of
    each output's window reads (padding positions give their virtual index; a window's
    first maximum never lies there, since a window always holds a real element, which is
    larger than the -inf fill unless all its real elements are -inf)."""
    from .conv import _out_len
    h, w = size
    if h * w > 1 << 24:     # the positions are summed in f32, exact up to 2**24
        raise ValueError(f"max_pool2d: return_indices needs an input plane of at most 2**24 elements, got {h}*{w}")
    ho, wo = (_out_len(size[a], kernel[a], stride[a], padding[a][0], padding[a][1], dilation[a]) for a in (0, 1))
    i, j = np.arange(kernel[0]), np.arange(kernel[1])
    rows = np.arange(ho)[None, :] * stride[0] - padding[0][0] + i[:, None] * dilation[0]     # (kh, Ho)
    cols = np.arange(wo)[None, :] * stride[1] - padding[1][0] + j[:, None] * dilation[1]     # (kw, Wo)
    flat = rows[:, None, :, None] * w + cols[None, :, None, :]                               # (kh, kw, Ho, Wo)
    return flat.reshape(kernel[0] * kernel[1], ho * wo).astype(np.float32)


def max_pool2d_indices(x, kernel, stride, padding, dilation):
    """i32 (N, C, Hout, Wout) indices of a 4-D ``x``'s max pooling (see the module)."""
    from . import cast, reduce_sum, reshape, where
    from .conv import _first_max_mask, _out_hw
    n, c = x.shape[:2]
    ho, wo = _out_hw("max_pool2d", x.shape[2:], kernel, stride, padding, dilation, x)
    table = x.graph.constant(flat_positions(x.shape[2:], kernel, stride, padding, dilation))
    sel = _first_max_mask(x, kernel, stride, padding, dilation)                             # (N, C, k, L)
    index = reduce_sum(where(sel, table, 0.0), (2,))
    return reshape(cast(index, "i32"), (n, c, ho, wo))
