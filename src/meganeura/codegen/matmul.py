"""The matmul archetype: C[b] = op(A[b]) @ op(B[b]) with batch broadcasting.

A 64x64 output tile per workgroup of 16x16 threads, 4x4 outputs per thread, K in steps
of 16 through workgroup memory; operands dense (strided views are copied first).
"""
from __future__ import annotations

import numpy as np

from ..schedule import Kernel
from .common import Bindings, contiguous_batch_strides


def lower_matmul(t, ins, out, materialize):
    a, b = (materialize(v, x) for v, x in zip(ins, t.inputs))
    return [Kernel("matmul", "matmul", {"ta": t.attrs["ta"], "tb": t.attrs["tb"]}, out, [a, b])]


TM = TN = 64
TK = 16


def render(kernel):
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
    # batch index -> operand offsets
    bl = ["    var br = wid.z;"]
    aoff, boff = [f"{a.offset}u"], [f"{bv.offset}u"]
    for d in range(len(batch) - 1, -1, -1):
        bl.append(f"    let z{d} = br % {batch[d]}u; br = br / {batch[d]}u;")
        if sa[d]:
            aoff.append(f"z{d} * {sa[d]}u")
        if sb[d]:
            boff.append(f"z{d} * {sb[d]}u")
    # element (m, k) of op(A) and (k, n) of op(B) in memory
    a_at = "aoff + gk * {M}u + gm".format(M=M) if ta else "aoff + gm * {K}u + gk".format(K=K)
    b_at = "boff + gn * {K}u + gk".format(K=K) if tb else "boff + gk * {N}u + gn".format(N=N)
    # load order: the contiguous index fastest across threads
    a_load = ("let kk = e / 64u; let mm = e % 64u;" if ta else "let mm = e / 16u; let kk = e % 16u;")
    b_load = ("let nn = e / 16u; let kb = e % 16u;" if tb else "let kb = e / 64u; let nn = e % 64u;")
    src = f"""{bind.decls()}
var<workgroup> As: array<f32, {TK * TM}>;
var<workgroup> Bs: array<f32, {TK * TN}>;

@compute @workgroup_size(16, 16)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {{
    let tx = lid3.x; let ty = lid3.y; let tid = ty * 16u + tx;
    let row0 = wid.y * {TM}u; let col0 = wid.x * {TN}u;
{chr(10).join(bl)}
    let aoff = {" + ".join(aoff)};
    let boff = {" + ".join(boff)};
    let coff = {out.offset}u + wid.z * {M * N}u;
    var acc: array<f32, 16>;
    for (var k0 = 0u; k0 < {K}u; k0 = k0 + {TK}u) {{
        for (var l = 0u; l < 4u; l = l + 1u) {{
            let e = tid + l * 256u;
            {a_load}
            let gm = row0 + mm; let gk = k0 + kk;
            var va = 0.0;
            if (gm < {M}u && gk < {K}u) {{ va = b{ab}[{a_at}]; }}
            As[kk * {TM}u + mm] = va;
            {b_load}
            let gn = col0 + nn; let gk2 = k0 + kb;
            var vb = 0.0;
            if (gn < {N}u && gk2 < {K}u) {{ vb = b{bb}[{b_at.replace("gk", "gk2")}]; }}
            Bs[kb * {TN}u + nn] = vb;
        }}
        workgroupBarrier();
        for (var kk = 0u; kk < {TK}u; kk = kk + 1u) {{
            var ar: array<f32, 4>; var br2: array<f32, 4>;
            for (var i = 0u; i < 4u; i = i + 1u) {{
                ar[i] = As[kk * {TM}u + ty + i * 16u];
                br2[i] = Bs[kk * {TN}u + tx + i * 16u];
            }}
            for (var i = 0u; i < 4u; i = i + 1u) {{
                for (var j = 0u; j < 4u; j = j + 1u) {{
                    acc[i * 4u + j] = fma(ar[i], br2[j], acc[i * 4u + j]);
                }}
            }}
        }}
        workgroupBarrier();
    }}
    for (var i = 0u; i < 4u; i = i + 1u) {{
        let gm = row0 + ty + i * 16u;
        if (gm >= {M}u) {{ continue; }}
        for (var j = 0u; j < 4u; j = j + 1u) {{
            let gn = col0 + tx + j * 16u;
            if (gn < {N}u) {{ b{ob}[coff + gm * {N}u + gn] = acc[i * 4u + j]; }}
        }}
    }}
}}
"""
    return src, bind.bufs, (-(-N // TN), -(-M // TM), nb)
