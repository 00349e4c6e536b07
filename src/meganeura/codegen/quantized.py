"""The quantized archetype: products with a weight kept in GGUF's packed blocks
(``ops/quantized.py`` has the layouts), dequantized in the operand loads.

The weight is bound as u32 words. Every block type reads as groups of 8 weights that are
consecutive in a row (group g holds columns 8g .. 8g + 7): ``qgroup(n, g)`` sets the
module's ``qlo`` / ``qhi`` to the 8 dequantized weights of group g of row n, from the
group's block scale(s) (and offset) and 8 bytes (Q8_0), 4 bytes of nibbles (Q4_*) and
their high bits (Q5_*: 1 each, Q6_K: 2 each), or 2-bit q (Q2_K, Q3_K with a high bit each).
Q4_0, Q5_0, Q8_0, Q3_K and Q6_K blocks (18, 22, 34, 110 and 210 bytes) are not word aligned: ``qword(p)`` reads the 4 bytes at any byte address from
the word(s) holding them. f16 scales (at even bytes, so in one word) are decoded from their bits.

Kernels (``spec["mode"]``):
- ``gemv`` (up to ``GEMV_MAX_ROWS`` rows of x, decoding): ``quantized_gemv.py``;
- ``tiled`` (more rows, prompt processing): 64 x 64 output tiles (``quantized_tiled.py``);
- ``dequant``: the (N, K) f32 weight, one thread per group (the gradient to x reads it);
- ``embed``: the rows picked by integer ids (a quantized token embedding), likewise.
"""
from __future__ import annotations

from ..schedule import Kernel

GEMV_MAX_ROWS = 4
TK = 32        # the tiled kernel's K step (quantized_tiled.py)
# loop trips of one thread: the K loop of the tiled kernel (TK + 1 per step) and the
# group loop of the GEMV stay below lavapipe's 65535 back-edges per invocation
MAX_TRIPS = 60000


def _lower(t, ins, out, materialize, temp):
    from ..ops.quantized import row_bytes
    if t.attrs["n"] * row_bytes(t.attrs["qtype"], t.attrs["k"]) >= 1 << 32:
        raise NotImplementedError(f"{t.op} {t.name!r}: the kernels address a weight's bytes in 32 bits; "
                                  f"({t.attrs['n']}, {t.attrs['k']}) {t.attrs['qtype']} is 4 GiB or more")
    if t.op == "dequantize":
        return [Kernel("dequantize", "quantized", {"mode": "dequant", **t.attrs}, out, [materialize(ins[0], t.inputs[0])])]
    if t.op == "quantized_embedding":
        ids, w = (materialize(v, i) for v, i in zip(ins, t.inputs))
        return [Kernel("quantized_embedding", "quantized", {"mode": "embed", **t.attrs}, out, [ids, w])] if ids.size else []
    x, w = (materialize(v, i) for v, i in zip(ins, t.inputs))
    m, k = t.inputs[0].shape
    if m == 0:
        return []
    mode = "gemv" if m <= GEMV_MAX_ROWS else "tiled"
    if (k // TK) * (TK + 1) > MAX_TRIPS:
        raise NotImplementedError(f"quantized_matmul {t.name!r}: in_features {k} is past the "
                                  f"{MAX_TRIPS * TK // (TK + 1)} one kernel loops over")
    return [Kernel(f"quantized_{mode}", "quantized", {"mode": mode, "m": m, **t.attrs}, out, [x, w])]


LOWER = {"quantized_matmul": _lower, "dequantize": _lower, "quantized_embedding": _lower}


def render(kernel):
    s = kernel.spec
    if s["mode"] == "gemv":
        from .quantized_gemv import render_gemv
        return render_gemv(kernel)
    if s["mode"] == "tiled":
        from .quantized_tiled import render_tiled
        return render_tiled(kernel)
    from .kernel_ast import printed_made
    from .quantized_ast import dequant_kernel
    return printed_made(kernel, dequant_kernel(kernel), "its output store")
