"""The matmul archetype: C[b] = op(A[b]) @ op(B[b]) with batch broadcasting.

A 128x128 (or 64x64) output tile per workgroup of 16x16 threads, 8x8 (or 4x4) outputs per
thread held as vec4 rows, K in steps of 16 through double-buffered workgroup memory laid out as vec4 so each
step reads 4 (or 2) vectors for 64 (or 16) FMAs. Shapes are baked in, so bounds checks are
emitted only for dimensions that are not tile multiples. Operands are dense (strided views
are copied first).
"""
from __future__ import annotations

import os

import numpy as np

from ..schedule import Kernel
from .common import Bindings, contiguous_batch_strides


def lower_matmul(t, ins, out, materialize):
    a, b = (materialize(v, x) for v, x in zip(ins, t.inputs))
    m, n = t.shape[-2:]
    kind = "gemv" if m <= GEMV_MAX_ROWS and -(-n // 8) <= 65535 else "matmul"
    return [Kernel(kind, "matmul", {"ta": t.attrs["ta"], "tb": t.attrs["tb"], "gemv": kind == "gemv"}, out, [a, b])]


def accelerate(a, b, ta, tb):
    """Forward matmul in accelerated precision: f16 operands, f32 accumulation and output."""
    from ..ops import cast, emit
    return emit("matmul", [cast(a, "f16"), cast(b, "f16")], ta=ta, tb=tb, out_dtype="f32")


TK = int(os.environ.get("MEGANEURA_MATMUL_TK", "8"))


def choose_tile(M, N, nb):
    """128x128 tiles when there are enough of them to fill a large GPU, else 64x64."""
    forced = os.environ.get("MEGANEURA_MATMUL_TILE")
    if forced:
        return int(forced)
    return 128 if -(-M // 128) * -(-N // 128) * nb >= 128 else 64


def render(kernel):
    if kernel.spec.get("gemv"):
        return render_gemv(kernel)
    a, bv = kernel.reads
    out, ta, tb = kernel.out, kernel.spec["ta"], kernel.spec["tb"]
    M, N = out.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    batch = out.shape[:-2]
    nb = int(np.prod(batch, dtype=np.int64))
    T = choose_tile(M, N, nb)
    G = T // 64                  # groups of 4 rows (and columns) per thread, 64 apart
    V = T // 4                   # vec4s per tile row in workgroup memory
    sa = contiguous_batch_strides(a.shape[:-2], batch, a.shape[-2] * a.shape[-1])
    sb = contiguous_batch_strides(bv.shape[:-2], batch, bv.shape[-2] * bv.shape[-1])
    bind = Bindings()
    ob, ab, bb = bind.index(out.buf, out.dtype), bind.index(a.buf, a.dtype), bind.index(bv.buf, bv.dtype)
    bl = ["    var br = wid.z;"]
    aoff, boff = [f"{a.offset}u"], [f"{bv.offset}u"]
    for d in range(len(batch) - 1, -1, -1):
        bl.append(f"    let z{d} = br % {batch[d]}u; br = br / {batch[d]}u;")
        if sa[d]:
            aoff.append(f"z{d} * {sa[d]}u")
        if sb[d]:
            boff.append(f"z{d} * {sb[d]}u")
    # static shapes: bounds checks only where a dimension is not a multiple of its tile
    chk_m, chk_n, chk_k = M % T != 0, N % T != 0, K % TK != 0
    loads = T * TK // 256        # elements of each operand tile per thread per K step
    if ta:                       # A stored (K, M): consecutive threads walk m
        a_idx = f"let kk = e / {T}u; let mm = e % {T}u;"
        a_at = f"aoff + gk * {M}u + gm"
    else:                        # A stored (M, K): consecutive threads walk k
        a_idx = f"let mm = e / {TK}u; let kk = e % {TK}u;"
        a_at = f"aoff + gm * {K}u + gk"
    if tb:
        b_idx = f"let nn = e / {TK}u; let kb = e % {TK}u;"
        b_at = f"boff + gn * {K}u + gkb"
    else:
        b_idx = f"let kb = e / {T}u; let nn = e % {T}u;"
        b_at = f"boff + gkb * {N}u + gn"
    a_cond = " && ".join(c for c, on in (("gm < %du" % M, chk_m), ("gk < %du" % K, chk_k)) if on)
    b_cond = " && ".join(c for c, on in (("gn < %du" % N, chk_n), ("gkb < %du" % K, chk_k)) if on)
    a_load = f"f32(b{ab}[{a_at}])" if not a_cond else f"select(0.0, f32(b{ab}[min({a_at}, {a.offset + a.size - 1}u)]), {a_cond})"
    b_load = f"f32(b{bb}[{b_at}])" if not b_cond else f"select(0.0, f32(b{bb}[min({b_at}, {bv.offset + bv.size - 1}u)]), {b_cond})"
    fma = []
    for g in range(G):
        fma.append(f"            let a{g} = As[kk * {V}u + {16 * g}u + ty];")
        fma.append(f"            let b{g} = Bs[kk * {V}u + {16 * g}u + tx];")
    for gr in range(G):
        for r in range(4):
            for gc in range(G):
                fma.append(f"            acc[{(gr * 4 + r) * G + gc}] = fma(vec4<f32>(a{gr}[{r}]), b{gc}, "
                           f"acc[{(gr * 4 + r) * G + gc}]);")
    writes = []
    for gr in range(G):
        for r in range(4):
            row = f"row0 + {64 * gr + r}u + ty * 4u"
            for gc in range(G):
                col = f"col0 + {64 * gc}u + tx * 4u"
                v = f"acc[{(gr * 4 + r) * G + gc}]"
                for c in range(4):
                    cond = " && ".join(x for x, on in ((f"gm < {M}u", chk_m), (f"gn + {c}u < {N}u", chk_n)) if on)
                    st = f"b{ob}[coff + gm * {N}u + gn + {c}u] = {out.dtype.wgsl}({v}[{c}]);"
                    writes.append(f"        {{ let gm = {row}; let gn = {col}; " + (f"if ({cond}) {{ {st} }}" if cond else st) + " }")
    nk = -(-K // TK)
    src = f"""{bind.decls()}
var<workgroup> As: array<vec4<f32>, {2 * TK * V}>;
var<workgroup> Bs: array<vec4<f32>, {2 * TK * V}>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {{
    let tx = lid3.x; let ty = lid3.y; let tid = ty * 16u + tx;
    let row0 = wid.y * {T}u; let col0 = wid.x * {T}u;
{chr(10).join(bl)}
    let aoff = {" + ".join(aoff)};
    let boff = {" + ".join(boff)};
    let coff = {out.offset}u + wid.z * {M * N}u;
    var acc: array<vec4<f32>, {4 * G * G}>;
    var ra: array<f32, {loads}>;
    var rb: array<f32, {loads}>;
    // double-buffered tiles: the next K step is fetched into registers while this one
    // is multiplied, then stored into the other half; one barrier per step
    for (var t = 0u; t <= {nk}u; t = t + 1u) {{
        if (t < {nk}u) {{
            let k0 = t * {TK}u;
            for (var l = 0u; l < {loads}u; l = l + 1u) {{
                let e = tid + l * 256u;
                {a_idx}
                let gm = row0 + mm; let gk = k0 + kk;
                ra[l] = {a_load};
                {b_idx}
                let gn = col0 + nn; let gkb = k0 + kb;
                rb[l] = {b_load};
            }}
        }}
        if (t > 0u) {{
            let base = ((t - 1u) % 2u) * {TK * V}u;
            for (var kk = 0u; kk < {TK}u; kk = kk + 1u) {{
{chr(10).join("    " + f.replace("kk * ", "base + kk * ") for f in fma)}
            }}
        }}
        if (t < {nk}u) {{
            let base = (t % 2u) * {TK * V}u;
            for (var l = 0u; l < {loads}u; l = l + 1u) {{
                let e = tid + l * 256u;
                {a_idx}
                As[base + kk * {V}u + mm / 4u][mm % 4u] = ra[l];
                {b_idx}
                Bs[base + kb * {V}u + nn / 4u][nn % 4u] = rb[l];
            }}
        }}
        workgroupBarrier();
    }}
{chr(10).join(writes)}
}}
"""
    return src, bind.bufs, (-(-N // T), -(-M // T), nb)


GEMV_MAX_ROWS = 4


def render_gemv(kernel):
    """Few-row products (one-token decoding): the weight is streamed once, coalesced.

    B transposed ([N, K], the linear layout): 32 lanes share one output column and stride
    over K, then combine through workgroup memory (8 columns per workgroup). B plain
    ([K, N]): one thread per output column walks K."""
    a, bv = kernel.reads
    out, ta, tb = kernel.out, kernel.spec["ta"], kernel.spec["tb"]
    M, N = out.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    batch = out.shape[:-2]
    nb = int(np.prod(batch, dtype=np.int64))
    sa = contiguous_batch_strides(a.shape[:-2], batch, a.shape[-2] * a.shape[-1])
    sb = contiguous_batch_strides(bv.shape[:-2], batch, bv.shape[-2] * bv.shape[-1])
    bind = Bindings()
    ob, ab, bb = bind.index(out.buf, out.dtype), bind.index(a.buf, a.dtype), bind.index(bv.buf, bv.dtype)
    bl = ["    var br = wid.z;"]
    aoff, boff = [f"{a.offset}u"], [f"{bv.offset}u"]
    for d in range(len(batch) - 1, -1, -1):
        bl.append(f"    let z{d} = br % {batch[d]}u; br = br / {batch[d]}u;")
        if sa[d]:
            aoff.append(f"z{d} * {sa[d]}u")
        if sb[d]:
            boff.append(f"z{d} * {sb[d]}u")
    a_at = (lambda m, k: f"aoff + {k} * {M}u + {m}") if ta else (lambda m, k: f"aoff + {m} * {K}u + {k}")
    head = f"""{bind.decls()}
var<workgroup> part: array<f32, {256 * M}>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
{chr(10).join(bl)}
    let aoff = {" + ".join(aoff)};
    let boff = {" + ".join(boff)};
    let coff = {out.offset}u + wid.z * {M * N}u;
"""
    accs = "\n".join(f"    var acc{m} = 0.0;" for m in range(M))
    if tb:
        fmas = "\n".join(f"            acc{m} = fma(f32(b{ab}[{a_at(str(m) + 'u', 'k')}]), w, acc{m});" for m in range(M))
        parts = "\n".join(f"    part[{m * 256}u + lid] = acc{m};" for m in range(M))
        reduce = "\n".join(f"            part[{m * 256}u + lid] = part[{m * 256}u + lid] + part[{m * 256}u + lid + s];"
                           for m in range(M))
        writes = "\n".join(f"        b{ob}[coff + {m * N}u + n] = {out.dtype.wgsl}(part[{m * 256}u + lid]);" for m in range(M))
        body = f"""    let lane = lid % 32u;
    let n = wid.x * 8u + lid / 32u;
{accs}
    if (n < {N}u) {{
        for (var k = lane; k < {K}u; k = k + 32u) {{
            let w = f32(b{bb}[boff + n * {K}u + k]);
{fmas}
        }}
    }}
{parts}
    workgroupBarrier();
    for (var s = 16u; s > 0u; s = s >> 1u) {{
        if (lane < s) {{
{reduce}
        }}
        workgroupBarrier();
    }}
    if (lane == 0u && n < {N}u) {{
{writes}
    }}
}}
"""
        return head + body, bind.bufs, (-(-N // 8), 1, nb)
    fmas = "\n".join(f"        acc{m} = fma(f32(b{ab}[{a_at(str(m) + 'u', 'k')}]), w, acc{m});" for m in range(M))
    writes = "\n".join(f"    b{ob}[coff + {m * N}u + n] = {out.dtype.wgsl}(acc{m});" for m in range(M))
    body = f"""    let n = wid.x * 256u + lid;
    if (n >= {N}u) {{ return; }}
{accs}
    for (var k = 0u; k < {K}u; k = k + 1u) {{
        let w = f32(b{bb}[boff + k * {N}u + n]);
{fmas}
    }}
{writes}
}}
"""
    return head.replace(f"var<workgroup> part: array<f32, {256 * M}>;\n", "") + body, bind.bufs, (-(-N // 256), 1, nb)
