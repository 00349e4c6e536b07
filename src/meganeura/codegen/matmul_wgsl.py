"""WGSL pieces both matmul renderers (tiled, ``matmul``, and GEMV, ``gemv``) write: f16
rounding of f32 operands in the loads, batch offsets, and a norm's affine."""
from __future__ import annotations

from .common import batch_offset_terms


# An operand flagged in ``spec["f16_round"]`` is f32 in memory and holds f16's precision in
# the product (11 significant bits, to nearest even) without f16's range: the tiled kernel
# rounds its bits as it loads it; the cooperative-matrix kernel (codegen.coopmat) scales the
# workgroup's share of it by a power of two into f16's range and converts, which rounds alike.
# So a gradient far below f16's smallest normal needs no max reduction and scaled cast of its
# own before a tensor-core product.
ROUND_F16 = """fn round_f16(x: f32) -> f32 {
    let b = bitcast<u32>(x);
    return bitcast<f32>((b + 0xfffu + ((b >> 13u) & 1u)) & 0xffffe000u);
}
fn round_f16v(x: vec4<f32>) -> vec4<f32> {
    let b = bitcast<vec4<u32>>(x);
    return bitcast<vec4<f32>>((b + vec4<u32>(0xfffu) + ((b >> vec4<u32>(13u)) & vec4<u32>(1u))) & vec4<u32>(0xffffe000u));
}"""


def _batch_offsets(a, b, batch, index):
    """WGSL lines splitting the batch ``index`` into coordinates, and the element offset
    terms of each operand (``common.batch_offset_terms``)."""
    dims, aoff, boff = batch_offset_terms(a, b, batch)
    lines = [f"    var br = {index};"] + [f"    let z{d} = br % {n}u; br = br / {n}u;" for d, n in dims]
    return lines, aoff, boff


def _affine(e, ks, K, weight, bias, ty="f32"):
    """``e * weight[k] + bias[k]`` (each term where present) at the row positions ``ks``
    (one, or four for a vec4), indices clamped to the row."""
    def read(binding, view):
        return ", ".join(f"f32(b{binding}[{view.offset}u + min({k}, {K - 1}u)])" for k in ks)
    if weight[0] is not None:
        e = f"{e} * {ty}({read(*weight)})"
    if bias[0] is not None:
        e = f"{e} + {ty}({read(*bias)})"
    return e
