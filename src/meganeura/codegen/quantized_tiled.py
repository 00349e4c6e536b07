"""The quantized archetype's tiled product (more than ``quantized.GEMV_MAX_ROWS`` rows of
x: prompt processing).

A 64 x 64 output tile per workgroup of 256 threads, each thread holding a 4 x 4 block of
it (4 rows, 4 columns as a vec4). K advances 32 columns a step: each thread dequantizes
one group of 8 weights (``qgroup``) of one of the tile's 64 weight rows into workgroup
memory, and loads 2 vec4s of the 64 x 32 tile of x, both stored [k][64] as vec4s; then
each step of k is two vec4 reads and four vec4 FMAs a thread. 16 KiB of workgroup memory
(WebGPU's default limit).
"""
from __future__ import annotations

from .common import Bindings
from .expr import OutputStore
from .quantized import HALF, TK, weight_functions, x_loads

T = 64          # rows and columns of the output tile


def render_tiled(kernel):
    s = kernel.spec
    M, N = s["m"], s["n"]
    if -(-M // T) > 65535 or -(-N // T) > 65535:
        raise NotImplementedError(f"quantized_matmul: ({M}, {N}) outputs is past one launch's 65535 x 65535 tiles")
    from .kernel_ast import printed
    from .quantized_tiled_ast import tiled_kernel
    made = tiled_kernel(kernel)
    if made is None:            # a store the tree does not build: the template
        return _render_template(kernel)
    tree, bufs, groups = made
    return printed(tree), bufs, groups


def _render_template(kernel):
    """``render_tiled`` as a WGSL template (kernels the tree does not build)."""
    s = kernel.spec
    qtype, M, N, K = s["qtype"], s["m"], s["n"], s["k"]
    b = Bindings()
    store = OutputStore(kernel, b)
    wv = kernel.reads[1]
    if wv.offset:
        raise NotImplementedError("quantized kernels read their weight from the start of its buffer")
    fns = HALF + weight_functions(qtype, K, b.index(wv.buf, wv.dtype), wv.size)
    xvec = x_loads(b, kernel.reads[0], K)
    V = T // 4          # vec4s per staged k row
    # x: 64 rows x 8 vec4s, two per thread, stored transposed (x[k][m])
    xloads = "\n".join(f"""        {{
            let e = lid + {256 * q}u;
            let r = e / {TK // 4}u;
            let kq = (e % {TK // 4}u) * 4u;
            var v = vec4<f32>(0.0);
            if (m0 + r < {M}u) {{ v = {xvec("(m0 + r)", "k0 + kq")}; }}
            xs[kq * {V}u + r / 4u][r % 4u] = v.x;
            xs[(kq + 1u) * {V}u + r / 4u][r % 4u] = v.y;
            xs[(kq + 2u) * {V}u + r / 4u][r % 4u] = v.z;
            xs[(kq + 3u) * {V}u + r / 4u][r % 4u] = v.w;
        }}""" for q in range(T * TK // 4 // 256))
    wstores = "\n".join(f"        ws[(c8 + {i}u) * {V}u + c / 4u][c % 4u] = {v}.{f};" for i, (v, f) in
                        enumerate([("lo", f) for f in "xyzw"] + [("hi", f) for f in "xyzw"]))
    fmas = "\n".join(f"            acc{r} = fma(vec4<f32>(xv.{f}), wv, acc{r});" for r, f in enumerate("xyzw"))
    writes = "\n".join(f"""    if (m0 + ty * 4u + {r}u < {M}u) {{
        let f = (m0 + ty * 4u + {r}u) * {N}u + n;
        for (var j = 0u; j < 4u; j = j + 1u) {{ if (n + j < {N}u) {{ store_out(f + j, acc{r}[j]); }} }}
    }}""" for r in range(4))
    src = f"""{b.decls()}
{store.module_text()}
{fns}
var<workgroup> ws: array<vec4<f32>, {TK * V}>;
var<workgroup> xs: array<vec4<f32>, {TK * V}>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
    let n0 = wid.x * {T}u;
    let m0 = wid.y * {T}u;
    let tx = lid % {V}u;
    let ty = lid / {V}u;
    let c = lid / 4u;
    let c8 = (lid % 4u) * 8u;
{chr(10).join(f"    var acc{r} = vec4<f32>(0.0);" for r in range(4))}
    for (var kb = 0u; kb < {K // TK}u; kb = kb + 1u) {{
        let k0 = kb * {TK}u;
        var lo = vec4<f32>(0.0);
        var hi = vec4<f32>(0.0);
        if (n0 + c < {N}u) {{
            qgroup(n0 + c, kb * {TK // 8}u + lid % 4u);
            lo = qlo;
            hi = qhi;
        }}
{wstores}
{xloads}
        workgroupBarrier();
        for (var kk = 0u; kk < {TK}u; kk = kk + 1u) {{
            let wv = ws[kk * {V}u + tx];
            let xv = xs[kk * {V}u + ty];
{fmas}
        }}
        workgroupBarrier();
    }}
    let n = n0 + tx * 4u;
{writes}
}}
"""
    return src, b.bufs, (-(-N // T), -(-M // T), 1)
