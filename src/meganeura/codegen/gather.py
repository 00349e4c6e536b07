"""The gather archetype: index primitives where one output element is a small formula
over input indices (one_hot, embedding and its scatter-free gradient, im2col, col2im).

Each lowering supplies the WGSL lines that compute ``val`` from the output coordinates
``c0..`` (dense inputs are bound as ``x0, x1, ...``)."""
from __future__ import annotations

from ..schedule import Kernel
from . import gather_ast
from .common import coords, literal


def _kernel(name, body, checks=None, geometry=None):
    """``body``: the WGSL lines of the value (not printed: they stay in the spec, which a
    kernel's identity covers); ``spec["form"]``: what builds its statements on the kernel
    AST when the kernel is rendered (``gather_ast.body_tree``: the builder's name and the node)."""
    def lower(t, ins, out, materialize, temp):
        dense = [materialize(v, x) for v, x in zip(ins, t.inputs)]
        spec = {"body": body(t), "inputs": [x.dtype for x in t.inputs], "form": (name, t)}
        if checks:
            spec["checks"] = checks(t)
        if geometry:
            spec[name] = geometry(t)
        return [Kernel(name, "gather", spec, out, dense)]
    return lower


# Index checks: a body calls ``report_err(k, value)`` for a bad index of its check k
# (``spec["checks"][k]``: op, tensor, what, bound). In checked mode the runtime binds an
# error buffer and raises after the step; otherwise the function does nothing. Either way
# the kernel never reads or writes out of bounds: a bad index gives a zero row.
def _check(op, tensor, what, bound):
    return {"op": op, "tensor": tensor, "what": what, "bound": int(bound)}


def _one_hot_checks(t):
    op, name = t.attrs.get("caller") or ("one_hot", t.inputs[0].name)
    return [_check(op, name, "label", t.attrs["num_classes"])]


def _embedding_checks(t):
    return [_check("embedding", t.inputs[0].name, "id", t.inputs[1].shape[0])]


def _idx(dt, e):
    return f"i32({e})" if dt.name != "i32" else e


def _one_hot(t):
    c = t.attrs["num_classes"]
    lab = _idx(t.inputs[0].dtype, f"x0[xo0 + i / {c}u]")
    one, zero = literal(1, t.dtype), literal(0, t.dtype)
    ign = t.attrs.get("ignore_index")
    ign = int(ign) if ign is not None and -2**31 <= ign < 2**31 else None
    ok = f"(lab >= 0i && lab < {c}i)" + (f" || lab == {ign}i" if ign is not None else "")
    hot = f"lab == i32(i % {c}u)" + (f" && lab != {ign}i" if ign is not None and 0 <= ign < c else "")
    return (f"    let lab = {lab};\n"
            f"    if (i % {c}u == 0u && !({ok})) {{ report_err(0u, lab); }}\n"
            f"    let val = select({zero}, {one}, {hot});")


def _embedding(t):
    n, d = t.inputs[1].shape
    raw = _idx(t.inputs[0].dtype, f"x0[xo0 + i / {d}u]")
    return (f"    let id = {raw};\n    let ok = id >= 0i && id < {n}i;\n"
            f"    if (i % {d}u == 0u && !ok) {{ report_err(0u, id); }}\n"
            f"    let row = select(0u, u32(id), ok);\n"
            f"    let val = select({literal(0, t.dtype)}, x1[xo1 + row * {d}u + i % {d}u], ok);")


def _im2col(t):
    a = t.attrs
    n, c, h, w = t.inputs[0].shape
    kh, kw = a["kernel"]
    (top, _), (left, _) = a["padding"]
    wo = _out_len(w, kw, a["stride"][1], a["padding"][1], a["dilation"][1])
    if a.get("fold_batch"):      # (C*kh*kw, N*L): c0 the image, c1 the row, c2 the position as below
        L = t.shape[1] // n
        index = f"    let c1 = i / {t.shape[1]}u; let c0 = (i % {t.shape[1]}u) / {L}u; let c2 = i % {L}u;"
    else:
        index = "\n".join(coords("i", t.shape))
    return index + f"""
    let ch = c1 / {kh * kw}u; let ki = (c1 % {kh * kw}u) / {kw}u; let kj = c1 % {kw}u;
    let y = i32(c2 / {wo}u) * {a['stride'][0]}i + i32(ki) * {a['dilation'][0]}i - {top}i;
    let x = i32(c2 % {wo}u) * {a['stride'][1]}i + i32(kj) * {a['dilation'][1]}i - {left}i;
    var val = {literal(a['fill'], t.dtype)};
    if (y >= 0i && y < {h}i && x >= 0i && x < {w}i) {{
        val = x0[xo0 + ((c0 * {c}u + ch) * {h}u + u32(y)) * {w}u + u32(x)];
    }}"""


def _im2col_geometry(t) -> dict:
    """What a consumer computing im2col in its loads needs besides the body: the input's
    (N, C, H, W), the kernel, stride, dilation, top / left padding, output width and fill."""
    a = t.attrs
    n, c, h, w = t.inputs[0].shape
    return {"nchw": (n, c, h, w), "kernel": tuple(a["kernel"]), "stride": tuple(a["stride"]),
            "dilation": tuple(a["dilation"]), "pad": (a["padding"][0][0], a["padding"][1][0]),
            "wo": _out_len(w, a["kernel"][1], a["stride"][1], a["padding"][1], a["dilation"][1]), "fill": a["fill"],
            "fold_batch": bool(a.get("fold_batch"))}


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
    scatter = Kernel("embedding_grad", "gather", {"body": body, "form": ("embedding_grad", t),
                                                  "threads": p * d, "index": "oi"}, out, [ids, ct])
    return [fill(out, 0, "embedding_grad.zero"), scatter]


LOWER = {"one_hot": _kernel("one_hot", _one_hot, _one_hot_checks),
         "embedding": _kernel("embedding", _embedding, _embedding_checks),
         "embedding_grad": _lower_embedding_grad, "im2col": _kernel("im2col", _im2col, geometry=_im2col_geometry),
         "col2im": _kernel("col2im", _col2im)}


def inlinable(kernel) -> bool:
    """A gather another kernel can evaluate in its loads (``gather_ast.function_tree``): its
    value is a formula of the output index alone, with no index checks, scatter or epilogue
    other than a cast of the value (to its output's dtype, which the loads round to)."""
    return kernel.archetype == "gather" and kernel.name.split("+")[0] == "im2col" \
        and (kernel.epilogue is None or _cast_only(kernel)) \
        and not kernel.spec.get("checks") and "index" not in kernel.spec and "threads" not in kernel.spec


def _cast_only(kernel) -> bool:
    """The epilogue is a cast of the gathered value and nothing else (no further stores)."""
    e = kernel.epilogue
    return e[0] == "op" and e[1].op == "cast" and list(e[2]) == [("acc",)] and not kernel.epi_reads \
        and not kernel.spec.get("stores")


def render(kernel, errors=None):
    """``errors``: (buffer, first slot) of checked mode's error buffer: check k of this
    kernel writes slots 2 (first + k) (a flag) and 2 (first + k) + 1 (the bad index).
    Printed from the kernel's tree (``gather_ast``)."""
    from .kernel_ast import printed_made
    return printed_made(kernel, gather_ast.kernel_tree(kernel, errors),
                        "its output store (or a body without spec['form'])")
