"""Layout ops that are not views: they write into strided views of their output with
pointwise copy kernels (concat: one copy per input; slice_grad: zero fill, then a copy)."""
from __future__ import annotations

from ..schedule import Kernel, View


def copy_into(src, dst: View, name) -> Kernel:
    return Kernel(name, "pointwise", {"expr": ("leaf", 0), "dtype": dst.dtype}, dst, [src])


def fill(dst: View, value, name) -> Kernel:
    return Kernel(name, "pointwise", {"expr": ("lit", value, dst.dtype), "dtype": dst.dtype}, dst, [])


def lower_concat(t, ins, out, materialize, temp):
    dim, off, ks = t.attrs["dim"], 0, []
    for x, v in zip(t.inputs, ins):
        dst = View(out.buf, x.shape, out.strides, out.offset + off * out.strides[dim], out.dtype)
        ks.append(copy_into(v, dst, "concat"))
        off += x.shape[dim]
    return ks


def lower_slice_grad(t, ins, out, materialize, temp):
    a = t.attrs
    off = out.offset + sum(s * st for s, st in zip(a["starts"], out.strides))
    dst = View(out.buf, t.inputs[0].shape, tuple(st * k for st, k in zip(out.strides, a["steps"])), off, out.dtype)
    return [fill(out, 0, "slice_grad.zero"), copy_into(ins[0], dst, "slice_grad")]
