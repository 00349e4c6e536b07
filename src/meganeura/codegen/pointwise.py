"""The pointwise archetype: one thread per output element evaluating a fused expression
tree whose leaves are strided (possibly broadcast) views."""
from __future__ import annotations

from ..ops.registry import OPS
from .common import ENTRY, GROUP_INDEX, WG, Bindings, broadcast_view_strides, coords, grid, literal, offset_expr

# WGSL helpers, included when an expression uses them. erf: Abramowitz-Stegun 7.1.26
# (|error| < 1.5e-7, below f32 resolution of the results); tanh clamps so exp cannot overflow.
HELPERS = {
    "erf_f": """fn erf_f(x: f32) -> f32 {
    let t = 1.0 / (1.0 + 0.3275911 * abs(x));
    let y = 1.0 - (((((1.061405429 * t - 1.453152027) * t) + 1.421413741) * t - 0.284496736) * t + 0.254829592) * t * exp(-x * x);
    return select(-y, y, x >= 0.0);
}""",
    "tanh_f": """fn tanh_f(x: f32) -> f32 {
    let e = exp(2.0 * clamp(x, -15.0, 15.0));
    return (e - 1.0) / (e + 1.0);
}""",
    "gelu_erf": """fn gelu_erf(x: f32) -> f32 { return 0.5 * x * (1.0 + erf_f(x * 0.70710678118654752)); }""",
    "gelu_erf_grad": """fn gelu_erf_grad(x: f32) -> f32 {
    return 0.5 * (1.0 + erf_f(x * 0.70710678118654752)) + x * exp(-0.5 * x * x) * 0.39894228040143268;
}""",
    "gelu_tanh": """fn gelu_tanh(x: f32) -> f32 {
    return 0.5 * x * (1.0 + tanh_f(0.79788456080286536 * (x + 0.044715 * x * x * x)));
}""",
    "gelu_tanh_grad": """fn gelu_tanh_grad(x: f32) -> f32 {
    let c = 0.79788456080286536;
    let t = tanh_f(c * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * c * (1.0 + 3.0 * 0.044715 * x * x);
}""",
}
HELPER_DEPS = {"gelu_erf": ["erf_f"], "gelu_erf_grad": ["erf_f"], "gelu_tanh": ["tanh_f"],
               "gelu_tanh_grad": ["tanh_f"]}


def _op_text(t, args, arg_dtypes, used):
    """WGSL for elementwise node ``t`` applied to argument expressions ``args``."""
    ex = OPS[t.op].extra["wgsl"]
    if t.op == "cast":
        return f"{t.dtype.wgsl}({args[0]})"
    if t.op == "pow":
        e = t.attrs["exponent"]
        if float(e).is_integer() and abs(e) <= 8:
            n = int(abs(e))
            prod = "(" + " * ".join([args[0]] * n) + ")" if n else "1.0"
            return prod if e >= 0 else f"(1.0 / {prod})"
        if e == 0.5:
            return f"sqrt({args[0]})"
        return f"pow({args[0]}, {literal(e, t.dtype)})"
    if t.op in ("gelu", "gelu_grad"):
        ex = ex[t.attrs["approximate"]]
    if t.op == "where" and arg_dtypes[0].name != "u32":
        args = [f"u32({args[0]})"] + list(args[1:])
    if t.op == "tanh":
        ex = "tanh_f({0})"
    if t.op == "erf":
        ex = "erf_f({0})"
    if t.op == "sign" and not t.dtype.is_float:
        ex = "sign({0})"
    for name in HELPERS:
        if name + "(" in ex:
            used.add(name)
            used.update(HELPER_DEPS.get(name, []))
    if t.op == "relu":
        ex = "max({0}, " + literal(0, t.dtype) + ")"
    return ex.format(*args)


def render(kernel) -> tuple[str, list, tuple]:
    """WGSL text, the bound logical buffers (binding order), and the workgroup counts."""
    out, spec = kernel.out, kernel.spec
    n = out.size
    b = Bindings()
    ob = b.index(out.buf, out.dtype)
    lines = coords("i", out.shape)
    leaf_vars = []
    for k, v in enumerate(kernel.reads):
        bi = b.index(v.buf, v.dtype)
        if spec.get("flat_leaf"):       # read in the leaf's own logical order
            lines += coords("i", v.shape, prefix=f"l{k}_")
            idx = offset_expr(v.offset, v.strides, prefix=f"l{k}_")
        else:
            st = broadcast_view_strides(v, out.shape)
            idx = offset_expr(v.offset, st)
        lines.append(f"    let v{k} = b{bi}[{idx}];")
        leaf_vars.append((f"v{k}", v.dtype))
    used: set = set()
    tmp = [0]

    def emit(e):
        """Returns (expression text, dtype); compound nodes become `let` lines."""
        if e[0] == "leaf":
            return leaf_vars[e[1]]
        if e[0] == "lit":
            return literal(e[1], e[2]), e[2]
        if e[0] == "const":
            c = e[1]
            return literal(c.attrs["value"].reshape(-1)[0], c.dtype), c.dtype
        _, t, kids = e
        args = [emit(k) for k in kids]
        text = _op_text(t, [a for a, _ in args], [d for _, d in args], used)
        tmp[0] += 1
        lines.append(f"    let t{tmp[0]} = {text};")
        return f"t{tmp[0]}", t.dtype

    val, dt = emit(spec["expr"])
    if dt is not out.dtype:
        val = f"{out.dtype.wgsl}({val})"
    oidx = offset_expr(out.offset, out.strides)
    helpers = [HELPERS[h] for h in HELPERS if h in used]
    src = "\n".join([b.decls()] + helpers) + "\n\n" + ENTRY.format(wg=WG) + \
        f"    let i = ({GROUP_INDEX}) * {WG}u + lid;\n    if (i >= {n}u) {{ return; }}\n" + \
        "\n".join(lines) + f"\n    b{ob}[{oidx}] = {val};\n}}\n"
    return src, b.bufs, grid(-(-n // WG))
