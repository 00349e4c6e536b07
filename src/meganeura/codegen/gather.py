"""The gather archetype: index primitives where one output element is a small formula
over input indices (one_hot, embedding and its scatter-free gradient, im2col, col2im).

Each lowering supplies the WGSL lines that compute ``val`` from the output coordinates
``c0..`` (dense inputs are bound as ``x0, x1, ...``)."""
from __future__ import annotations

from ..schedule import Kernel
from .expr import OutputStore
from .common import ENTRY, GROUP_INDEX, WG, Bindings, coords, grid, literal


def _kernel(name, body):
    def lower(t, ins, out, materialize, temp):
        dense = [materialize(v, x) for v, x in zip(ins, t.inputs)]
        return [Kernel(name, "gather", {"body": body(t), "inputs": [x.dtype for x in t.inputs]}, out, dense)]
    return lower


def _idx(dt, e):
    return f"i32({e})" if dt.name != "i32" else e


def _one_hot(t):
    lab = _idx(t.inputs[0].dtype, "x0[xo0 + i / {n}u]".format(n=t.attrs["num_classes"]))
    one, zero = literal(1, t.dtype), literal(0, t.dtype)
    return f"    let val = select({zero}, {one}, {lab} == i32(i % {t.attrs['num_classes']}u));"


def _embedding(t):
    d = t.inputs[1].shape[1]
    row = _idx(t.inputs[0].dtype, f"x0[xo0 + i / {d}u]")
    return f"    let row = u32({row});\n    let val = x1[xo1 + row * {d}u + i % {d}u];"


def _im2col(t):
    a = t.attrs
    n, c, h, w = t.inputs[0].shape
    kh, kw = a["kernel"]
    (top, _), (left, _) = a["padding"]
    wo = _out_len(w, kw, a["stride"][1], a["padding"][1], a["dilation"][1])
    return "\n".join(coords("i", t.shape)) + f"""
    let ch = c1 / {kh * kw}u; let ki = (c1 % {kh * kw}u) / {kw}u; let kj = c1 % {kw}u;
    let y = i32(c2 / {wo}u) * {a['stride'][0]}i + i32(ki) * {a['dilation'][0]}i - {top}i;
    let x = i32(c2 % {wo}u) * {a['stride'][1]}i + i32(kj) * {a['dilation'][1]}i - {left}i;
    var val = {literal(a['fill'], t.dtype)};
    if (y >= 0i && y < {h}i && x >= 0i && x < {w}i) {{
        val = x0[xo0 + ((c0 * {c}u + ch) * {h}u + u32(y)) * {w}u + u32(x)];
    }}"""


def _out_len(size, k, s, pad, d):
    return (size + pad[0] + pad[1] - d * (k - 1) - 1) // s + 1


def _col2im(t):
    a = t.attrs
    n, c, h, w = t.shape
    ck, L = t.inputs[0].shape[1:]
    kh, kw = a["kernel"]
    sh, sw = a["stride"]
    dh, dw = a["dilation"]
    (top, _), (left, _) = a["padding"]
    ho = _out_len(h, kh, sh, a["padding"][0], dh)
    wo = _out_len(w, kw, sw, a["padding"][1], dw)
    return "\n".join(coords("i", t.shape)) + f"""
    var val = {literal(0, t.dtype)};
    for (var ki = 0u; ki < {kh}u; ki = ki + 1u) {{
        let ty = i32(c2) + {top}i - i32(ki) * {dh}i;
        if (ty < 0i || ty % {sh}i != 0i || ty / {sh}i >= {ho}i) {{ continue; }}
        for (var kj = 0u; kj < {kw}u; kj = kj + 1u) {{
            let tx = i32(c3) + {left}i - i32(kj) * {dw}i;
            if (tx < 0i || tx % {sw}i != 0i || tx / {sw}i >= {wo}i) {{ continue; }}
            let row = (c1 * {kh}u + ki) * {kw}u + kj;
            val = val + x0[xo0 + (c0 * {ck}u + row) * {L}u + u32(ty / {sh}i) * {wo}u + u32(tx / {sw}i)];
        }}
    }}"""


def _lower_embedding_grad(t, ins, out, materialize, temp):
    """Zero the (vocabulary, dim) gradient, then add each position's row into the row of
    its id: one thread per (position, column) instead of one per vocabulary entry looping
    over every position. Without atomics, the first position of each id sums the rows of
    all positions with that id (loops over positions only)."""
    from .layout import fill
    ids, ct = (materialize(v, x) for v, x in zip(ins, t.inputs))
    d, p = t.inputs[1].shape[-1], t.inputs[0].size
    idv = lambda q: _idx(t.inputs[0].dtype, f"x0[xo0 + {q}]")   # noqa: E731
    body = (f"    let q0 = i / {d}u; let j = i % {d}u;\n    let v = {idv('q0')};\n"
            f"    if (v < 0i || v >= {t.shape[0]}i) {{ return; }}\n"
            f"    for (var q = 0u; q < q0; q = q + 1u) {{ if ({idv('q')} == v) {{ return; }} }}\n"
            f"    var val = {literal(0, t.dtype)};\n"
            f"    for (var q = q0; q < {p}u; q = q + 1u) {{\n"
            f"        if ({idv('q')} == v) {{ val = val + x1[xo1 + q * {d}u + j]; }}\n    }}\n"
            f"    let oi = u32(v) * {d}u + j;")
    scatter = Kernel("embedding_grad", "gather", {"body": body, "threads": p * d, "index": "oi"}, out, [ids, ct])
    return [fill(out, 0, "embedding_grad.zero"), scatter]


LOWER = {"one_hot": _kernel("one_hot", _one_hot), "embedding": _kernel("embedding", _embedding),
         "embedding_grad": _lower_embedding_grad, "im2col": _kernel("im2col", _im2col),
         "col2im": _kernel("col2im", _col2im)}


def render(kernel):
    n = kernel.spec.get("threads", kernel.out.size)
    b = Bindings()
    store = OutputStore(kernel, b, kernel.dtype)
    lines = []
    for k, v in enumerate(kernel.reads):
        bi = b.index(v.buf, v.dtype)
        lines.append(f"    let xo{k} = {v.offset}u;  // x{k} is b{bi}")
    body = kernel.spec["body"]
    for k, v in enumerate(kernel.reads):
        body = body.replace(f"x{k}[", f"b{b.index(v.buf, v.dtype)}[")
    src = b.decls() + "\n" + store.module_text() + "\n\n" + ENTRY.format(wg=WG) + \
        f"    let i = ({GROUP_INDEX}) * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n" + \
        "\n".join(lines) + "\n" + body + f"\n    store_out({kernel.spec.get('index', 'i')}, val);\n}}\n"
    return src, b.bufs, grid(-(-n // WG))

