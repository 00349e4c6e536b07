"""``adaptive_avg_pool2d`` with uneven windows, as torch: output row i averages input rows
floor(i*H/oh) to ceil((i+1)*H/oh) (exclusive), and likewise along the width, so windows may
differ in size and overlap by one.

Not a primitive: each axis is a constant averaging matrix (oh, H) whose row i holds
1/len over its window, applied as ``A_h @ x @ A_w^T`` (two batched matmuls, which have their
own kernels and gradients).
"""
from __future__ import annotations

import numpy as np


def window_matrix(size: int, out: int) -> np.ndarray:
    """(out, size) float32: row i averages torch's i-th adaptive window over ``size``."""
    m = np.zeros((out, size), np.float64)
    for i in range(out):
        start, end = (i * size) // out, -((-(i + 1) * size) // out)
        m[i, start:end] = 1.0 / (end - start)
    return m.astype(np.float32)


def adaptive_avg_pool2d_uneven(x, out):
    """``x`` (..., H, W) pooled to (..., oh, ow) with torch's adaptive windows."""
    from . import matmul
    h, w = x.shape[-2:]
    rows = x.graph.constant(window_matrix(h, out[0]))                 # (oh, H)
    cols = x.graph.constant(np.ascontiguousarray(window_matrix(w, out[1]).T))   # (W, ow)
    return matmul(matmul(rows, x), cols)
