"""The matmul archetype's few-row kernels (GEMV, up to ``matmul_tiles.GEMV_MAX_ROWS`` rows
of A: one-token decoding), with a norm of A's rows computed in the loads where fusion put
one there (``spec["prologue"]``)."""
from __future__ import annotations

import numpy as np

from .expr import OutputStore
from .common import Bindings
from .matmul_tiles import gemv_columns
from .matmul_wgsl import _affine, _batch_offsets


def render_gemv(kernel):
    """Few-row products (one-token decoding): the weight is streamed once, coalesced.
    Built on the typed kernel AST (``gemv_ast``) where its output store is
    (``kernel_ast_matmul.store_supported``), else written by the template, ``_render_template``.

    B transposed ([N, K], the linear layout): 32 lanes share one output column and stride
    over K, then combine through workgroup memory (8 columns per workgroup). B plain
    ([K, N]): one thread per output column walks K. Sibling GEMVs that share A (q, k and v
    projections) run as one launch (``spec["parts"]``): each owns a range of workgroups."""
    from .gemv_ast import gemv_kernel
    from .kernel_ast import printed
    made = gemv_kernel(kernel)
    if made is None:
        return _render_template(kernel)
    tree, bufs, groups = made
    return printed(tree), bufs, groups


def _render_template(kernel):
    """``render_gemv`` as a WGSL template (the reference the tree is checked against)."""
    parts = kernel.spec.get("parts", [kernel])
    bind = Bindings()
    fns, branches, g0 = [], [], 0
    per_group = 8 if parts[0].spec["tb"] else 256
    for j, part in enumerate(parts):
        fn, gx, nb = _gemv_part(part, bind, j)     # nb: batch x K splits, alike for merged parts
        fns.append(fn)
        branches.append(f"    if (wid.x < {g0 + gx}u) {{ gemv{j}(wid.x - {g0}u, wid.z, lid); return; }}")
        g0 += gx
    M = parts[0].shape[-2]
    paired = 2 if any("pair" in p.spec for p in parts) else 1
    shared = f"var<workgroup> part: array<f32, {256 * M * paired}>;\n" if per_group == 8 else ""
    src = f"""{bind.decls()}
{shared}{chr(10).join(fns)}

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {{
{chr(10).join(branches)}
}}
"""
    return src, bind.bufs, (g0, 1, nb)


def _norm_prologue(kernel, bind, M, K, a_at, ab):
    """WGSL computing each A row's normalisation statistics (a norm fused into the GEMV
    that reads it, ``spec["prologue"]``), and the normalised A element as a function of
    (m, k)."""
    pro = kernel.spec["prologue"]
    extra = kernel.reads[2:kernel.spec.get("pair", {}).get("b_index", len(kernel.reads))]
    w = extra[0] if pro["has_w"] else None
    b = extra[-1] if pro["has_b"] else None
    wb = bind.index(w.buf, w.dtype) if w is not None else None
    bb = bind.index(b.buf, b.dtype) if b is not None else None
    center = pro["kind"] == "layer_norm"
    lines = []

    def tree(expr, m):
        return ["    { var s = 0.0;",
                f"      for (var k = lid; k < {K}u; k = k + 256u) {{ let x = f32(b{ab}[{a_at(str(m) + 'u', 'k')}]); s = s + {expr}; }}",
                f"      part[{m * 256}u + lid] = s; }}"]
    for m in range(M):
        if center:
            lines += tree("x", m)
        else:
            lines.append(f"    let mean{m} = 0.0;")
    red = lambda: ["    workgroupBarrier();", "    for (var s = 128u; s > 0u; s = s >> 1u) {",  # noqa: E731
                   "        if (lid < s) {"] + [f"            part[{m * 256}u + lid] = part[{m * 256}u + lid] + "
                                                f"part[{m * 256}u + lid + s];" for m in range(M)] + \
        ["        }", "        workgroupBarrier();", "    }"]
    if center:
        lines += red() + [f"    let mean{m} = part[{m * 256}u] / {float(K)!r};" for m in range(M)] + ["    workgroupBarrier();"]
    for m in range(M):
        lines += tree(f"(x - mean{m}) * (x - mean{m})", m)
    lines += red() + [f"    let inv{m} = inverseSqrt(part[{m * 256}u] / {float(K)!r} + {pro['eps']!r});" for m in range(M)]
    lines.append("    workgroupBarrier();")

    def elem(m, k):
        return _affine(f"(f32(b{ab}[{a_at(str(m) + 'u', k)}]) - mean{m}) * inv{m}", [k], K, (wb, w), (bb, b))
    return lines, elem


def _gemv_part(kernel, bind, j):
    """(WGSL functions of one GEMV, its x workgroups, its batch workgroups)."""
    a, bv = kernel.reads[:2]
    ta, tb = kernel.spec["ta"], kernel.spec["tb"]
    M, N = kernel.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    S = kernel.spec.get("split", 1)      # K splits: the output is (batch, S, M, N) partials
    batch = kernel.spec["batch"] if S > 1 else kernel.shape[:-2]
    nb = int(np.prod(batch, dtype=np.int64))
    KC = -(-K // S)
    store = OutputStore(kernel, bind, name=f"store_out{j}")
    ab, bb = bind.index(a.buf, a.dtype), bind.index(bv.buf, bv.dtype)
    bl, aoff, boff = _batch_offsets(a, bv, batch, f"wz / {S}u" if S > 1 else "wz")
    bl.append(f"    let kbeg = (wz % {S}u) * {KC}u; let kend = min(kbeg + {KC}u, {K}u);")
    a_at = (lambda m, k: f"aoff + {k} * {M}u + {m}") if ta else (lambda m, k: f"aoff + {m} * {K}u + {k}")
    head = f"""{store.module_text()}
fn gemv{j}(wx: u32, wz: u32, lid: u32) {{
{chr(10).join(bl)}
    let aoff = {" + ".join(aoff)};
    let boff = {" + ".join(boff)};
    let coff = wz * {M * N}u;
"""
    accs = "\n".join(f"    var acc{m} = 0.0;" for m in range(M))
    if tb:
        pro_lines, elem = [], (lambda m, k: f"f32(b{ab}[{a_at(str(m) + 'u', k)}])")
        if "prologue" in kernel.spec:
            pro_lines, elem = _norm_prologue(kernel, bind, M, K, a_at, ab)
        head += "\n".join(pro_lines) + "\n"
        pair = kernel.spec.get("pair")
        R = 2 * M if pair else M          # accumulators: this product's, then the paired one's
        if pair:
            # a paired GEMV (gate beside up): the same A against a second weight in the same
            # loop, its result handed to this one's epilogue as acc2
            pv = kernel.reads[pair["b_index"]]
            pbb = bind.index(pv.buf, pv.dtype)
            boff2 = _batch_offsets(a, pv, batch, "wz")[2]
            head += f"    let boff2 = {' + '.join(boff2)};\n"
            fmas = "\n".join(f"            let a{m} = {elem(m, 'k')};\n            acc{m} = fma(a{m}, w, acc{m});\n"
                             f"            acc{M + m} = fma(a{m}, w2, acc{M + m});" for m in range(M))
            fmas = f"            let w2 = f32(b{pbb}[boff2 + n * {K}u + k]);\n" + fmas
        else:
            fmas = "\n".join(f"            acc{m} = fma({elem(m, 'k')}, w, acc{m});" for m in range(M))
        accs = "\n".join(f"    var acc{m} = 0.0;" for m in range(R))
        parts = "\n".join(f"    part[{m * 256}u + lid] = acc{m};" for m in range(R))
        reduce = "\n".join(f"            part[{m * 256}u + lid] = part[{m * 256}u + lid] + part[{m * 256}u + lid + s];"
                           for m in range(R))
        second = (lambda m: f", part[{(M + m) * 256}u + lid]") if pair else (lambda m: "")  # noqa: E731
        writes = "\n".join(f"        store_out{j}(coff + {m * N}u + n, part[{m * 256}u + lid]{second(m)});"
                           for m in range(M))
        C = gemv_columns(N)
        L = 256 // C
        body = f"""    let lane = lid % {L}u;
    let n = wx * {C}u + lid / {L}u;
{accs}
    if (n < {N}u) {{
        for (var k = kbeg + lane; k < kend; k = k + {L}u) {{
            let w = f32(b{bb}[boff + n * {K}u + k]);
{fmas}
        }}
    }}
{parts}
    workgroupBarrier();
    for (var s = {L // 2}u; s > 0u; s = s >> 1u) {{
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
        return head + body, -(-N // C), nb * S
    fmas = "\n".join(f"        acc{m} = fma(f32(b{ab}[{a_at(str(m) + 'u', 'k')}]), w, acc{m});" for m in range(M))
    writes = "\n".join(f"    store_out{j}(coff + {m * N}u + n, acc{m});" for m in range(M))
    body = f"""    let n = wx * 256u + lid;
    if (n >= {N}u) {{ return; }}
{accs}
    for (var k = kbeg; k < kend; k = k + 1u) {{
        let w = f32(b{bb}[boff + k * {N}u + n]);
{fmas}
    }}
{writes}
}}
"""
    return head + body, -(-N // 256), nb * S
