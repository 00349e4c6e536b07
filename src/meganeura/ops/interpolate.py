"""``upsample_bilinear2d``: torch.nn.functional.interpolate(mode='bilinear') to any size.

Not a primitive: bilinear interpolation is separable and linear, so each axis is a constant
(out, in) matrix whose row i holds the two weights of output pixel i, applied as
``A_h @ x @ A_w^T`` (two batched matmuls, with their own kernels and gradients), as
``adaptive_pool`` does for uneven average pooling.
"""
from __future__ import annotations

import math

import numpy as np

from .registry import op_error


def bilinear_matrix(size: int, out: int, align_corners: bool, scale: float | None = None) -> np.ndarray:
    """(out, size) float32: row i interpolates torch's source coordinate of output pixel i.
    ``scale``: torch's input-per-output step where a scale factor was given (1 / factor);
    else size / out."""
    m = np.zeros((out, size), np.float64)
    for i in range(out):
        if align_corners:
            src = i * (size - 1) / (out - 1) if out > 1 else 0.0
        else:
            step = size / out if scale is None else scale
            src = max((i + 0.5) * step - 0.5, 0.0)
        lo = min(int(math.floor(src)), size - 1)
        hi = min(lo + 1, size - 1)
        frac = src - lo
        m[i, lo] += 1.0 - frac
        m[i, hi] += frac
    return m.astype(np.float32)


def upsample_bilinear2d(input, size=None, scale_factor=None, align_corners=False):
    """torch.nn.functional.interpolate(input, size, scale_factor, mode='bilinear',
    align_corners): ``input`` (N, C, H, W) or (C, H, W) resized to ``size`` (an int or an
    (oh, ow) pair), or by ``scale_factor`` (a number or a pair; the output floor(H * s) as
    torch, which samples at steps of 1 / s)."""
    from . import matmul
    if input.ndim not in (3, 4):
        raise op_error("upsample_bilinear2d", "input must be 3-D (C, H, W) or 4-D (N, C, H, W)", input)
    h, w = input.shape[-2:]
    if (size is None) == (scale_factor is None):
        raise ValueError(f"upsample_bilinear2d: give exactly one of size and scale_factor, got size={size!r}, "
                         f"scale_factor={scale_factor!r}")
    scales = (None, None)
    if size is not None:
        out = tuple(int(s) for s in (size if isinstance(size, (tuple, list)) else (size, size)))
    else:
        sf = tuple(float(s) for s in (scale_factor if isinstance(scale_factor, (tuple, list))
                                      else (scale_factor, scale_factor)))
        out = (int(math.floor(h * sf[0])), int(math.floor(w * sf[1]))) if len(sf) == 2 else ()
        scales = tuple(1.0 / s if s > 0 else None for s in sf)
    if len(out) != 2 or min(out) < 1:
        raise ValueError(f"upsample_bilinear2d: the output size must be two positive ints, got {out} "
                         f"(size={size!r}, scale_factor={scale_factor!r}, input {h}x{w})")
    g = input.graph
    rows = g.constant(bilinear_matrix(h, out[0], align_corners, scales[0]))                       # (oh, H)
    cols = g.constant(np.ascontiguousarray(bilinear_matrix(w, out[1], align_corners, scales[1]).T))  # (W, ow)
    return matmul(matmul(rows, input), cols)
