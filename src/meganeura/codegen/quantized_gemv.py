"""The quantized archetype's GEMV (up to ``quantized.GEMV_MAX_ROWS`` rows of x: decoding).

Each output column is owned by L lanes (L = 256 / columns per workgroup) that stride over
its row's groups of 8 weights, so consecutive lanes read consecutive bytes of the blocks,
then sum through workgroup memory. Two fusions of ``passes/fuse_quantized.py`` shape it:

- ``spec["parts"]``: sibling GEMVs over the same x (the q, k and v projections) as one
  launch, each part owning a range of workgroups, with a weight (and block type) of its own;
- ``spec["pair"]``: a second weight over the same x in the same loop (SwiGLU's gate beside
  up), its product handed to the epilogue as ``acc2`` and never stored;
- ``spec["prologue"]``: x is a layer / RMS norm's input: the workgroup first takes each
  row's statistics, then normalises (and scales, shifts) x as it loads it.
"""
from __future__ import annotations

from .common import GROUP_INDEX, Bindings, grid
from .expr import OutputStore
from .matmul import gemv_columns
from .quantized import HALF, weight_functions, x_loads


def render_gemv(kernel):
    from .kernel_ast import printed
    from .quantized_gemv_ast import gemv_kernel
    made = gemv_kernel(kernel)
    if made is None:            # a store the tree does not build: the template
        return _render_template(kernel)
    tree, bufs, groups = made
    return printed(tree), bufs, groups


def _render_template(kernel):
    """``render_gemv`` as a WGSL template (kernels the tree does not build)."""
    parts = kernel.spec.get("parts", [kernel])
    b = Bindings()
    M, K = parts[0].spec["m"], parts[0].spec["k"]
    xvec = x_loads(b, parts[0].reads[0], K)
    R = max(2 if "pair" in p.spec else 1 for p in parts) * M
    fns, branches, g0 = [], [], 0
    for j, p in enumerate(parts):
        fn, gx = _part(p, b, j, xvec)
        fns.append(fn)
        branches.append(f"    if (gi < {g0 + gx}u) {{ gemv{j}(gi - {g0}u, lid); return; }}")
        g0 += gx
    src = f"""{b.decls()}
{HALF}
{chr(10).join(fns)}
var<workgroup> part: array<f32, {256 * R}>;

@compute @workgroup_size(256)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32, @builtin(num_workgroups) nwg: vec3<u32>) {{
    let gi = {GROUP_INDEX};
{chr(10).join(branches)}
}}
"""
    return src, b.bufs, grid(g0)


def _part(kernel, b, j, xvec):
    """(WGSL of one part's functions and ``gemv{j}(wx, lid)``, its workgroups)."""
    s = kernel.spec
    M, N, K = s["m"], s["n"], s["k"]
    G = K // 8
    store = OutputStore(kernel, b, name=f"store_out{j}")
    weights = [(kernel.reads[1], s["qtype"])]
    if "pair" in s:
        weights.append((kernel.reads[s["pair"]["b_index"]], s["pair"]["qtype"]))
    text = [store.module_text()]
    for w, (wv, qtype) in enumerate(weights):
        if wv.offset:
            raise NotImplementedError("quantized kernels read their weight from the start of its buffer")
        text.append(weight_functions(qtype, K, b.index(wv.buf, wv.dtype), wv.size, f"_{j}_{w}"))
    R = len(weights) * M                  # accumulators: this product's rows, then the paired one's
    C = gemv_columns(N)
    L = 256 // C
    pro, load = _prologue(kernel, b, xvec, M, K)
    xs = "\n".join(f"            let xa{m} = {load(m, 'k')};\n            let xb{m} = {load(m, 'k + 4u')};"
                   for m in range(M))
    fmas = "\n".join(f"            qgroup_{j}_{w}(n, g);\n" + "\n".join(
        f"            acc{w * M + m} = acc{w * M + m} + dot(qlo, xa{m}) + dot(qhi, xb{m});" for m in range(M))
        for w in range(len(weights)))
    slot = lambda r: f"part[{r * 256}u + lid]"        # noqa: E731
    second = (lambda m: f", {slot(M + m)}") if "pair" in s else (lambda m: "")   # noqa: E731
    text.append(f"""fn gemv{j}(wx: u32, lid: u32) {{
    let lane = lid % {L}u;
    let n = wx * {C}u + lid / {L}u;
{pro}
{chr(10).join(f"    var acc{r} = 0.0;" for r in range(R))}
    if (n < {N}u) {{
        for (var g = lane; g < {G}u; g = g + {L}u) {{
            let k = g * 8u;
{xs}
{fmas}
        }}
    }}
{chr(10).join(f"    {slot(r)} = acc{r};" for r in range(R))}
    workgroupBarrier();
    for (var s = {L // 2}u; s > 0u; s = s >> 1u) {{
        if (lane < s) {{
{chr(10).join(f"            {slot(r)} = {slot(r)} + part[{r * 256}u + lid + s];" for r in range(R))}
        }}
        workgroupBarrier();
    }}
    if (lane == 0u && n < {N}u) {{
{chr(10).join(f"        store_out{j}({m * N}u + n, {slot(m)}{second(m)});" for m in range(M))}
    }}
}}
""")
    return "\n".join(text), -(-N // C)


def _prologue(kernel, b, xvec, M, K):
    """(WGSL of the rows' norm statistics, ``load(m, col)``: the vec4 of x the product
    reads at (m, col .. col + 3)), for ``spec["prologue"]`` (else no statistics, plain x)."""
    pro = kernel.spec.get("prologue")
    if pro is None:
        return "", lambda m, col: xvec(f"{m}u", col)
    from .quantized import x_loads
    at = pro["at"]
    w = x_loads(b, kernel.reads[at], K) if pro["w"] else None
    bias = x_loads(b, kernel.reads[at + pro["w"]], K) if pro["b"] else None
    center = pro["kind"] == "layer_norm"

    def tree(term, name, m):           # the row's sum of ``term(v)`` over 256 threads
        return [f"    var t{name}{m} = 0.0;",
                f"    for (var k4 = lid; k4 < {K // 4}u; k4 = k4 + 256u) {{ let v = {xvec(f'{m}u', 'k4 * 4u')}; "
                f"t{name}{m} = t{name}{m} + {term}; }}",
                f"    part[{m * 256}u + lid] = t{name}{m};"]
    reduce = ["    workgroupBarrier();", "    for (var s = 128u; s > 0u; s = s >> 1u) {", "        if (lid < s) {"] + \
        [f"            part[{m * 256}u + lid] = part[{m * 256}u + lid] + part[{m * 256}u + lid + s];" for m in range(M)] + \
        ["        }", "        workgroupBarrier();", "    }"]
    lines = []
    if center:
        lines = [x for m in range(M) for x in tree("v.x + v.y + v.z + v.w", "s", m)] + reduce
        lines += [f"    let mean{m} = part[{m * 256}u] / {float(K)!r};" for m in range(M)] + ["    workgroupBarrier();"]
    dev = (lambda m: f"(v - vec4<f32>(mean{m}))") if center else (lambda m: "v")     # noqa: E731
    lines += [x for m in range(M) for x in tree(f"dot({dev(m)}, {dev(m)})", "q", m)] + reduce
    lines += [f"    let inv{m} = inverseSqrt(part[{m * 256}u] / {float(K)!r} + {pro['eps']!r});" for m in range(M)]
    lines.append("    workgroupBarrier();")

    def load(m, col):
        e = f"({xvec(f'{m}u', col)} - vec4<f32>(mean{m}))" if center else xvec(f"{m}u", col)
        e = f"{e} * inv{m}"
        if w is not None:
            e = f"{e} * {w('0u', col)}"
        if bias is not None:
            e = f"{e} + {bias('0u', col)}"
        return e
    return "\n".join(lines), load
