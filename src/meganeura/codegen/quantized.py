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

import re

from ..schedule import Kernel
from .common import ENTRY, GROUP_INDEX, Bindings, grid
from .expr import OutputStore

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

HALF = """fn qhalf(h: u32) -> f32 {
    let e = (h >> 10u) & 31u;
    let m = h & 1023u;
    let s = (h & 32768u) << 16u;
    if (e == 0u) { return select(1.0, -1.0, s != 0u) * f32(m) * 5.9604644775390625e-08; }
    if (e == 31u) { return bitcast<f32>(s | 2139095040u | (m << 13u)); }
    return bitcast<f32>(s | ((e + 112u) << 23u) | (m << 13u));
}
fn qs8(w: u32) -> vec4<f32> {
    return vec4<f32>(f32(i32(((w >> 0u) & 255u) ^ 128u) - 128i), f32(i32(((w >> 8u) & 255u) ^ 128u) - 128i),
                     f32(i32(((w >> 16u) & 255u) ^ 128u) - 128i), f32(i32((w >> 24u) ^ 128u) - 128i));
}
fn qb4(h: u32) -> vec4<f32> {
    return vec4<f32>(f32(h & 1u), f32((h >> 1u) & 1u), f32((h >> 2u) & 1u), f32((h >> 3u) & 1u));
}
fn q6(w: u32, sl: u32, h: u32, sh: u32) -> vec4<f32> {
    return vec4<f32>(f32(((w >> sl) & 15u) | (((h >> sh) & 3u) << 4u)),
                     f32(((w >> (8u + sl)) & 15u) | (((h >> (8u + sh)) & 3u) << 4u)),
                     f32(((w >> (16u + sl)) & 15u) | (((h >> (16u + sh)) & 3u) << 4u)),
                     f32(((w >> (24u + sl)) & 15u) | (((h >> (24u + sh)) & 3u) << 4u)));
}
fn qbit(w: u32, j: u32) -> vec4<f32> {
    return vec4<f32>(f32((w >> j) & 1u), f32((w >> (8u + j)) & 1u), f32((w >> (16u + j)) & 1u),
                     f32((w >> (24u + j)) & 1u));
}
fn q2(w: u32, s: u32) -> vec4<f32> {
    return vec4<f32>(f32((w >> s) & 3u), f32((w >> (8u + s)) & 3u), f32((w >> (16u + s)) & 3u),
                     f32((w >> (24u + s)) & 3u));
}
fn qn4(w: u32, s: u32) -> vec4<f32> {
    return vec4<f32>(f32((w >> s) & 15u), f32((w >> (8u + s)) & 15u), f32((w >> (16u + s)) & 15u),
                     f32((w >> (24u + s)) & 15u));
}
var<private> qlo: vec4<f32>;
var<private> qhi: vec4<f32>;
"""


def weight_functions(qtype, k, wb, nwords, sfx="") -> str:
    """WGSL ``qgroup{sfx}(n, g)`` of one weight (binding ``wb``, ``nwords`` words, rows of
    ``k`` weights) and the byte readers it calls (``HALF``'s helpers come once a module)."""
    from ..ops.quantized import QTYPES, row_bytes
    rb = row_bytes(qtype, k)
    read = f"""fn qword(p: u32) -> u32 {{
    let i = p >> 2u;
    let s = (p & 3u) * 8u;
    if (s == 0u) {{ return b{wb}[i]; }}
    return (b{wb}[i] >> s) | (b{wb}[min(i + 1u, {nwords - 1}u)] << (32u - s));
}}
fn qbyte(p: u32) -> u32 {{
    return (b{wb}[p >> 2u] >> ((p & 3u) * 8u)) & 255u;
}}
fn qscale(p: u32) -> f32 {{
    return qhalf((b{wb}[p >> 2u] >> ((p & 2u) * 8u)) & 65535u);
}}
"""
    bs, nb = QTYPES[qtype]
    base = f"    let base = n * {rb}u + (g / {bs // 8}u) * {nb}u;\n"
    if qtype == "Q8_0":     # f16 scales sit at even bytes: one word holds each
        body = base + """    let d = qscale(base);
    let p = base + 2u + (g % 4u) * 8u;
    qlo = d * qs8(qword(p));
    qhi = d * qs8(qword(p + 4u));"""
    elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        # d (and m), then Q5's fifth bits (bit j of a u32: weight j's), then 16 bytes whose
        # low nibbles are weights 0..15 and high ones 16..31: group g reads 8 of them
        five, ofs = qtype[1] == "5", 2 if qtype[3] == "0" else 4
        q = [f"(qn4(qword(p{a}), s){f' + 16.0 * qb4(h{sh})' if five else ''})" for a, sh in (("", ""), (" + 4u", " >> 4u"))]
        if ofs == 2:
            off = 8.0 if qtype == "Q4_0" else 16.0
            vals = [f"d * ({x} - vec4<f32>({off}))" for x in q]
        else:
            vals = [f"d * {x} + vec4<f32>(qscale(base + 2u))" for x in q]
        body = base + f"""    let d = qscale(base);
{f'    let h = (qword(base + {ofs}u) >> ((g % 4u) * 8u)) & 255u;' if five else ''}
    let p = base + {ofs + 4 * five}u + (g % 2u) * 8u;
    let s = ((g / 2u) % 2u) * 4u;
    qlo = {vals[0]};
    qhi = {vals[1]};"""
    elif qtype == "Q6_K":   # group g: weights e .. e + 7 of super-block g / 32, one scale
        body = base + """    let e = (g % 32u) * 8u;
    let r = e % 128u;
    let ds = qscale(base + 208u) * f32(i32(qbyte(base + 192u + e / 16u) ^ 128u) - 128i);
    let pl = base + (e / 128u) * 64u + r % 64u;
    let ph = base + 128u + (e / 128u) * 32u + r % 32u;
    let sl = (r / 64u) * 4u;
    let sh = (r / 32u) * 2u;
    qlo = ds * (q6(qword(pl), sl, qword(ph), sh) - vec4<f32>(32.0));
    qhi = ds * (q6(qword(pl + 4u), sl, qword(ph + 4u), sh) - vec4<f32>(32.0));"""
    elif qtype == "Q2_K":   # word-aligned; weights e .. e + 7 share a scale and a min
        body = base + f"""    let e = (g % 32u) * 8u;
    let dw = b{wb}[(base + 80u) >> 2u];
    let sc = qbyte(base + e / 16u);
    let dl = qhalf(dw & 65535u) * f32(sc & 15u);
    let ml = qhalf(dw >> 16u) * f32(sc >> 4u);
    let p = (base + 16u + (e / 128u) * 32u + e % 32u) >> 2u;
    let s = ((e % 128u) / 32u) * 2u;
    qlo = dl * q2(b{wb}[p], s) - vec4<f32>(ml);
    qhi = dl * q2(b{wb}[p + 1u], s) - vec4<f32>(ml);"""
    elif qtype == "Q3_K":   # 6-bit scale s = e / 16: low nibble of byte s % 8, high pair of 8 + s % 4
        body = base + """    let e = (g % 32u) * 8u;
    let si = e / 16u;
    let sc = ((qbyte(base + 96u + si % 8u) >> ((si / 8u) * 4u)) & 15u)
        | (((qbyte(base + 104u + si % 4u) >> ((si / 4u) * 2u)) & 3u) << 4u);
    let ds = qscale(base + 108u) * f32(i32(sc) - 32i);
    let p = base + 32u + (e / 128u) * 32u + e % 32u;
    let s = ((e % 128u) / 32u) * 2u;
    let u = e / 32u;
    qlo = ds * (q2(qword(p), s) + 4.0 * qbit(qword(base + e % 32u), u) - vec4<f32>(4.0));
    qhi = ds * (q2(qword(p + 4u), s) + 4.0 * qbit(qword(base + e % 32u + 4u), u) - vec4<f32>(4.0));"""
    else:   # Q4_K, Q5_K: word-aligned super-blocks; group g: sub-block j, quarter g % 4
        five = qtype == "Q5_K"
        q = [f"qn4(b{wb}[p{a}], s)" + (f" + 16.0 * qbit(b{wb}[ph{a}], j)" if five else "") for a in ("", " + 1u")]
        body = base + f"""    let j = (g / 4u) % 8u;
    let dw = b{wb}[base >> 2u];
    let d = qhalf(dw & 65535u);
    let dmin = qhalf(dw >> 16u);
    let hi = qbyte(base + 8u + j);
    let lo = qbyte(base + 4u + j);
    let sc = select((hi & 15u) | ((qbyte(base + j) >> 6u) << 4u), lo & 63u, j < 4u);
    let mn = select((hi >> 4u) | ((lo >> 6u) << 4u), hi & 63u, j < 4u);
    let ds = d * f32(sc);
    let dm = dmin * f32(mn);
    let p = (base + {48 if five else 16}u + (j / 2u) * 32u + (g % 4u) * 8u) >> 2u;
    let ph = (base + 16u + (g % 4u) * 8u) >> 2u;
    let s = (j % 2u) * 4u;
    qlo = ds * ({q[0]}) - vec4<f32>(dm);
    qhi = ds * ({q[1]}) - vec4<f32>(dm);"""
    text = read + f"fn qgroup(n: u32, g: u32) {{\n{body}\n}}\n"
    return re.sub(r"\b(qword|qbyte|qscale|qgroup)\(", lambda m: f"{m.group(1)}{sfx}(", text)


def x_loads(b, xv, K):
    """``xvec(row, col)``: WGSL of the 4 floats of x (view ``xv``, rows of K) at
    (row, col .. col + 3), col a multiple of 4: one vec4 load where the view starts on a
    vec4 (rows of K, a multiple of 32, keep it there), else 4 scalar loads."""
    vec = xv.offset % 4 == 0
    xb = b.slot(xv.buf, "vec4<f32>") if vec else b.index(xv.buf, xv.dtype)

    def xvec(row, col):
        if vec:
            return f"b{xb}[{xv.offset // 4}u + {row} * {K // 4}u + ({col}) / 4u]"
        at = f"{xv.offset}u + {row} * {K}u + {col}"
        return "vec4<f32>(" + ", ".join(f"b{xb}[{at} + {i}u]" for i in range(4)) + ")"
    return xvec


def render(kernel):
    s = kernel.spec
    if s["mode"] == "gemv":
        from .quantized_gemv import render_gemv
        return render_gemv(kernel)
    if s["mode"] == "tiled":
        from .quantized_tiled import render_tiled
        return render_tiled(kernel)
    from .kernel_ast import printed
    from .quantized_ast import dequant_kernel
    made = dequant_kernel(kernel)
    if made is None:            # a store the tree does not build: the template
        return _render_template(kernel)
    tree, bufs, groups = made
    return printed(tree), bufs, groups


def _render_template(kernel):
    """The dequantize / embedding kernel as a WGSL template (kernels the tree does not build)."""
    s = kernel.spec
    qtype, N, K = s["qtype"], s["n"], s["k"]
    b = Bindings()
    store = OutputStore(kernel, b)
    wv = kernel.reads[-1]
    wb = b.index(wv.buf, wv.dtype)
    if wv.offset:
        raise NotImplementedError("quantized kernels read their weight from the start of its buffer")
    fns = HALF + weight_functions(qtype, K, wb, wv.size)
    G = K // 8                 # groups per row
    if s["mode"] in ("dequant", "embed"):
        # one thread per group of 8 weights: of every row, or of the rows the ids pick
        rows = N if s["mode"] == "dequant" else kernel.reads[0].size
        total = rows * G
        pick = "    qgroup(n, g);"
        if s["mode"] == "embed":      # a bad id gives a zero row
            iv = kernel.reads[0]
            ib = b.index(iv.buf, iv.dtype)
            raw = f"b{ib}[{iv.offset}u + n]"
            pick = f"""    let id = {raw if iv.dtype.name == 'i32' else f'i32({raw})'};
    qlo = vec4<f32>(0.0);
    qhi = vec4<f32>(0.0);
    if (id >= 0i && id < {N}i) {{ qgroup(u32(id), g); }}"""
        src = f"""{b.decls()}
{store.module_text()}
{fns}
{ENTRY.format(wg=256)}    let t = ({GROUP_INDEX}) * 256u + lid;
    if (t >= {total}u) {{ return; }}
    let n = t / {G}u;
    let g = t % {G}u;
{pick}
    let f = n * {K}u + g * 8u;
    store_out(f, qlo.x); store_out(f + 1u, qlo.y); store_out(f + 2u, qlo.z); store_out(f + 3u, qlo.w);
    store_out(f + 4u, qhi.x); store_out(f + 5u, qhi.y); store_out(f + 6u, qhi.z); store_out(f + 7u, qhi.w);
}}
"""
        return src, b.bufs, grid(-(-total // 256))
