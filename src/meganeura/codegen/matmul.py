"""The matmul archetype: C[b] = op(A[b]) @ op(B[b]) with batch broadcasting.

A TM x TN output tile per workgroup of WY x WX threads (the block, ``BLOCKS``), each thread
holding (TM / WY) x (TN / WX) outputs as vec4 rows in 4 x 4 groups; K in steps of 8 or 16
through double-buffered workgroup memory laid out as vec4, so each step of K reads one
vector per 4 rows or columns a thread owns. Shapes are baked in, so bounds checks are
emitted only for dimensions that are not tile multiples. Operands are dense (strided views
are copied first).

The lowering and tile planning are in ``matmul_tiles``, the GEMV kernels in ``gemv``, WGSL
pieces both kernels use in ``matmul_wgsl``; this module re-exports their names.
"""
from __future__ import annotations

import numpy as np

from .expr import OutputStore
from .common import NOWHERE, Bindings, bind_roles, form_key
from .gather import as_function as gather_function
from .pointwise import as_function as pointwise_function
from .gemv import render_gemv
from .matmul_tiles import (BLOCKS, DEEP_BLOCK, DEEP_MIN_K, DEEP_MIN_OUTPUTS, GEMV_MAX_ROWS, GEMV_TARGET_GROUPS, K_STEPS,
                           MAX_SPLIT, SHALLOW_K, SHALLOW_MIN_GROUPS, TARGET_GROUPS, accelerate, block_of, gemv_columns,
                           gemv_split, k_step, lower_matmul, parse_block, plan_tiles, rounded_operands, split_k)
from .matmul_wgsl import ROUND_F16, _affine, _batch_offsets

# the names of the matmul modules, as ``matmul.<name>``
__all__ = ["BLOCKS", "DEEP_BLOCK", "DEEP_MIN_K", "DEEP_MIN_OUTPUTS", "GEMV_MAX_ROWS", "GEMV_TARGET_GROUPS", "K_STEPS",
           "MAX_SPLIT", "PEELED_ROWS", "ROUND_F16", "SHALLOW_K", "SHALLOW_MIN_GROUPS", "TARGET_GROUPS", "_affine",
           "_batch_offsets", "accelerate", "block_of", "gemv_columns", "gemv_split", "k_step", "lower_matmul",
           "operand_function", "parse_block", "peeled", "plan_tiles", "render", "render_gemv", "rounded_operands",
           "split_k"]


def _ind(lines, n):
    return "\n".join(" " * n + ln for ln in lines)


def _operand(name, view, trans_contig_t, dim_t, K, T, V, tile0, binding, off, chk_t, chk_k, reg, allow_vec=True,
             threads=256, transform=None, load=None, *, TK, SV=None):
    """WGSL that fetches one operand's K-step tile into register ``reg`` and stores it into
    workgroup memory ``name`` (laid out [k][t] as vec4 over t) from the element ``{name}0``
    (the double buffer's half).

    ``trans_contig_t``: the operand is contiguous along the tile's T dimension (A stored
    (K, M) or B stored (K, N)); else contiguous along K. ``transform(value, vec)`` rewrites
    each loaded value (a norm prologue); ``load(index)`` replaces the buffer read (scalar).
    ``SV``: vec4s per staged row in workgroup memory (``V`` plus padding; ``V`` by default).
    Returns (vec4 binding?, fetch, store)."""
    SV = V if SV is None else SV
    vec = (dim_t % 4 == 0) if trans_contig_t else (K % 4 == 0)
    vec = vec and allow_vec and load is None and view.offset % 4 == 0 and view.dtype.name == "f32"
    total = T * TK // 4 if vec else T * TK
    per = -(-total // threads)
    guard = f"v < {total}u" if total % threads else ""
    ld = dim_t if trans_contig_t else K
    if trans_contig_t:
        idx = f"let kk = v / {V if vec else T}u; let tt = (v % {V if vec else T}u){' * 4u' if vec else ''};"
    else:
        idx = f"let tt = v / {TK // 4 if vec else TK}u; let kk = (v % {TK // 4 if vec else TK}u){' * 4u' if vec else ''};"
    at = f"{off} + (k0 + kk) * {ld}u + {tile0} + tt" if trans_contig_t else f"{off} + ({tile0} + tt) * {K}u + k0 + kk"
    conds = [c for c, on in ((f"{tile0} + tt < {dim_t}u", chk_t), ("k0 + kk < kend", chk_k)) if on]
    last = view.offset + view.size - 1
    if vec:
        read = f"b{binding}[({at}) / 4u]"
        zero = "vec4<f32>(0.0)"
        lastv = last // 4
    else:
        read = f"f32(b{binding}[{at}])"
        zero = "0.0"
        lastv = last
    if load is not None:          # an operand computed in the load (a gather's formula)
        read = load(at)
    if transform is not None:
        read = transform(read, vec)
    if conds:
        read = read.replace(f"[({at}) / 4u]", f"[min(({at}) / 4u, {lastv}u)]") if vec else \
            read.replace(f"[{at}]", f"[min({at}, {lastv}u)]")
        read = f"select({zero}, {read}, {' && '.join(conds)})"
    ty = "vec4<f32>" if vec else "f32"
    fetch = [f"for (var l = 0u; l < {per}u; l = l + 1u) {{", f"    let v = tid + l * {threads}u;"]
    fetch += ([f"    if ({guard}) {{"] if guard else []) + [f"    {idx}", f"    {reg}[l] = {read};"] + (["    }"] if guard else []) + ["}"]
    if vec and trans_contig_t:
        st = [f"    {name}[{name}0 + kk * {SV}u + tt / 4u] = {reg}[l];"]
    elif vec:
        st = [f"    {name}[{name}0 + (kk + {j}u) * {SV}u + tt / 4u][tt % 4u] = {reg}[l][{j}];" for j in range(4)]
    else:
        st = [f"    {name}[{name}0 + kk * {SV}u + tt / 4u][tt % 4u] = {reg}[l];"]
    store = [f"for (var l = 0u; l < {per}u; l = l + 1u) {{", f"    let v = tid + l * {threads}u;"]
    store += ([f"    if ({guard}) {{"] if guard else []) + [f"    {idx}"] + st + (["    }"] if guard else []) + ["}"]
    return vec, f"array<{ty}, {per}>", fetch, store


# Products with A read along K from a buffer (not transposed, not gathered) on the blocks of
# at least PEELED_ROWS rows (128 threads, 16 x 8 or 8 x 8 outputs each) take two changes:
# - A is staged transposed ([k][m]) by four scalar stores per vec4 read along K; one vec4 of
#   padding per staged row of A puts the two rows a warp writes at once on different banks;
# - the K loop's first fetch and last product are peeled off, so its body has no branches.
# H200, GPU TFLOP/s: 1024^3 30.1 -> 33.7, 4096^3 43.6 -> 44.1, Whisper-tiny's 1500 x 384 x 1536
# (B transposed) 22.5 -> 27.3. Elsewhere they lost (GPU us a dispatch): the 64 tile of 256
# threads, SmolVLA's matmuls 14.3 -> 21.5; A transposed, ResNet-50's input gradients 36 -> 58
# and weight gradients with their bias sums 20 -> 30; im2col gathers, ResNet-50's
# convolutions 49 -> 52 and Whisper-tiny's 61 -> 80.
PEELED_ROWS = 128


def peeled(TM, ta, gathers) -> bool:
    return TM >= PEELED_ROWS and not ta and not gathers


def a_padding(peel) -> int:
    """vec4s of padding per staged row of A: one in the peeled form."""
    return 1 if peel else 0


def _main_loop(nk, TK, SA, VN, fetch, store, fma, peel):
    """The K loop over double-buffered tiles: the next K step is fetched into registers
    while this one is multiplied, then stored into the other half; one barrier per step.
    ``peel``: the first fetch and the last product outside the loop (no branches in it);
    else one loop of nk + 1 steps, each part under its condition."""
    def product(buf, pad):
        return [f"{pad}{{ let As0 = {buf} * {TK * SA}u; let Bs0 = {buf} * {TK * VN}u;",
                f"{pad}    for (var kk = 0u; kk < {TK}u; kk = kk + 1u) {{"] + [pad + f for f in fma] + [f"{pad}    }}", f"{pad}}}"]
    ind = lambda lines, n: [" " * n + x for x in lines]  # noqa: E731
    if not peel:
        lines = [f"for (var t = 0u; t <= {nk}u; t = t + 1u) {{", f"    if (t < {nk}u) {{",
                 f"        let k0 = kbeg + t * {TK}u;"] + ind(fetch, 8) + ["    }", "    if (t > 0u) {"]
        lines += product("((t - 1u) % 2u)", "        ") + ["    }", f"    if (t < {nk}u) {{",
                                                          f"        let As0 = (t % 2u) * {TK * SA}u; let Bs0 = (t % 2u) * {TK * VN}u;"]
        lines += ind(store, 8) + ["    }", "    workgroupBarrier();", "}"]
        return _ind(lines, 4)
    lines = ["{ let k0 = kbeg; let As0 = 0u; let Bs0 = 0u;"] + ind(fetch + store, 4) + ["}", "workgroupBarrier();"]
    lines += [f"for (var t = 1u; t < {nk}u; t = t + 1u) {{", f"    {{ let k0 = kbeg + t * {TK}u;"]
    lines += ind(fetch, 8) + ["    }"] + product("((t - 1u) % 2u)", "    ")
    lines += [f"    {{ let As0 = (t % 2u) * {TK * SA}u; let Bs0 = (t % 2u) * {TK * VN}u;"] + ind(store, 8)
    lines += ["    }", "    workgroupBarrier();", "}"] + product(f"{(nk - 1) % 2}u", "")
    return _ind(lines, 4)


def _launch_form(parts) -> tuple:
    """(each part's block, peeled): one workgroup memory layout and loop form for a launch,
    peeled when every part is."""
    blocks = [_block(p) for p in parts]
    return blocks, all(peeled(blk[0], p.spec["ta"], p.spec.get("gathers")) for blk, p in zip(blocks, parts))


def _workgroup_memory(parts, block, TK, peel) -> tuple:
    """(the double-buffered A and B tiles, the norm prologue's statistics and the f16 rounding
    helper where a part has them) of a launch on ``block`` with K step ``TK``."""
    TM, TN, WY, WX = block
    tiles = f"var<workgroup> As: array<vec4<f32>, {2 * TK * (TM // 4 + a_padding(peel))}>;\n" \
        f"var<workgroup> Bs: array<vec4<f32>, {2 * TK * TN // 4}>;"
    stats = "" if not any("prologue" in p.spec for p in parts) else \
        f"var<workgroup> pm: array<f32, {TM}>;\nvar<workgroup> pinv: array<f32, {TM}>;\n" \
        f"var<workgroup> pred: array<f32, {WX * WY}>;\n"
    if any(p.spec.get("f16_round") for p in parts):
        stats += ROUND_F16 + "\n"
    return tiles, stats


def render(kernel, array_limit=0):
    """Tiled matmul; sibling matmuls that share A (``spec["parts"]``, q/k/v or gate/up
    projections) run as one launch, each owning a range of x workgroups. ``array_limit``:
    the runtime binds arrays of buffers, at most this many buffers a kernel, and alike parts
    share one body (``_render_shared``) where that stays within the limit. Built on the
    typed kernel AST (``matmul_ast``) where every part is (``matmul_ast.supported``: not an
    im2col computed in the loads while the gather has no tree), else by the templates
    (``_render_template``)."""
    if kernel.spec.get("gemv"):
        return render_gemv(kernel)
    from .kernel_ast import printed
    from .matmul_ast import render_shared_tree, render_tree, supported
    parts = kernel.spec.get("parts", [kernel])
    if array_limit and len(parts) > 1:
        if supported(kernel):
            made = render_shared_tree(kernel, _launch_form)
            if made is not None and len(made[1]) <= array_limit:
                return printed(made[0]), made[1], made[2]
        else:
            shared = _render_shared(kernel)
            if shared is not None and len(shared[1]) <= array_limit:
                return shared
    made = render_tree(kernel, _launch_form)
    if made is None:
        return _render_template(kernel)
    tree, bufs, groups = made
    return printed(tree), bufs, groups


def _render_template(kernel, array_limit=0):
    """``render`` as WGSL templates (kernels the tree does not build)."""
    if kernel.spec.get("gemv"):
        return render_gemv(kernel)
    parts = kernel.spec.get("parts", [kernel])
    if array_limit and len(parts) > 1:
        shared = _render_shared(kernel)
        if shared is not None and len(shared[1]) <= array_limit:
            return shared
    bind = Bindings()
    fns, branches, x0, tks = [], [], 0, set()
    blocks, peel = _launch_form(parts)
    for j, (part, block) in enumerate(zip(parts, blocks)):
        fn, (gx, gy, gz), TK = _tiled_part(part, bind, j, block, peel)
        tks.add((block, TK))
        fns.append(fn)
        branches.append(f"    if (wid.x < {x0 + gx}u) {{ mm{j}(vec3<u32>(wid.x - {x0}u, wid.y, wid.z), lid3); return; }}")
        x0 += gx
    assert len(tks) == 1, f"merged matmuls with different tiles or K steps: {tks}"   # one workgroup memory layout
    (block, TK), = tks
    tiles, stats = _workgroup_memory(parts, block, TK, peel)
    WY, WX = block[2:]
    src = f"""{bind.decls()}
{tiles}
{stats}{chr(10).join(fns)}

@compute @workgroup_size({WX}, {WY})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {{
{chr(10).join(branches)}
}}
"""
    return src, bind.bufs, (x0, gy, gz)


def _render_shared(kernel):
    """``render`` of a merged launch whose parts alike but for their buffers (the same shapes:
    the U-Net's key and value projections of one context, a layer's weight gradients) share
    one body ``mms{f}``, reading their buffers through arrays indexed by the module's ``mp``
    (the part's position in its form, set from the workgroup: uniform over it, as arrays of
    buffers require); None where no two parts are alike."""
    from .expr import HELPERS
    parts = kernel.spec["parts"]
    blocks, peel = _launch_form(parts)
    forms, where = {}, []
    for part, block in zip(parts, blocks):
        pb = Bindings()
        fn, groups, TK = _tiled_part(part, pb, "_", block, peel)
        key = form_key(pb, fn) + (block, TK)
        members = forms.setdefault(key, [])
        where.append((key, len(members), groups))
        members.append(pb)
    if len(forms) == len(parts):
        return None
    b = Bindings()
    fns, ids, ranges, x0 = [], {}, [], 0
    for (key, slot, (gx, gy, gz)), part, block in zip(where, parts, blocks):
        if key not in ids:          # the form's body, named for it, bound at its first part
            f = ids[key] = len(ids)
            pb = Bindings()
            fn, _, _ = _tiled_part(part, pb, f"s{f}", block, peel)
            for h in HELPERS:       # each helper once in the module
                if h in pb.helpers_done:
                    if h in b.helpers_done:
                        fn = fn.replace(HELPERS[h] + "\n", "", 1)
                    b.helpers_done.add(h)
            b.enable_f16 |= pb.enable_f16
            fns.append(bind_roles(b, [pb] + forms[key][1:], fn, "mp"))
        ranges.append((x0 + gx, ids[key], slot, x0))
        x0 += gx
    block, TK = key[-2:]
    WY, WX = block[2:]
    branch = [f"    if (x < {end}u) {{ return vec3<u32>({f}u, {slot}u, {start}u); }}" for end, f, slot, start in ranges]
    calls = [f"    if (at.x == {f}u) {{ mms{f}(vec3<u32>(wid.x - at.z, wid.y, wid.z), lid3); return; }}"
             for f in range(len(ids))]
    tiles, stats = _workgroup_memory(parts, block, TK, peel)
    nl = "\n"
    src = f"""{b.decls()}
{tiles}
var<private> mp: u32;
{stats}{nl.join(fns)}
fn locate(x: u32) -> vec3<u32> {{
{nl.join(branch)}
    return vec3<u32>({NOWHERE}u, 0u, 0u);
}}

@compute @workgroup_size({WX}, {WY})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid3: vec3<u32>) {{
    let at = locate(wid.x);
    mp = at.y;
{nl.join(calls)}
}}
"""
    return src, b.flat(), (x0, gy, gz)


NORM_LOADS_IN_FLIGHT = 4


def _tiled_norm_prologue(kernel, bind, M, K, T, th, ab, a_vec):
    """A norm fused into the tiled matmul that reads it as A (rows of K): each workgroup
    computes its T rows' statistics into workgroup memory, and A values are normalised as
    they are loaded. Returns (statistics lines, transform for ``_operand``)."""
    pro = kernel.spec["prologue"]
    extra = kernel.reads[2:]
    w = extra[0] if pro["has_w"] else None
    bb_ = extra[-1] if pro["has_b"] else None
    wb = bind.index(w.buf, w.dtype) if w is not None else None
    bbi = bind.index(bb_.buf, bb_.dtype) if bb_ is not None else None
    center = pro["kind"] == "layer_norm"
    if a_vec:
        load, n, total, sq = f"b{ab}[(aoff + gr * {K}u) / 4u + k + {{}}u]", K // 4, "dot(q, vec4<f32>(1.0))", "dot(d, d)"
        dev = "let d = q - vec4<f32>(mean);"
    else:
        load, n, total, sq = f"f32(b{ab}[aoff + gr * {K}u + k + {{}}u])", K, "q", "d * d"
        dev = "let d = q - mean;"
    # P threads share each of the T rows, each summing every P-th element (a thread walking
    # a whole row alone made the tile wait for K / 4 dependent loads); the P partial sums
    # meet in workgroup memory
    P = max(1, th // T)
    rows = -(-T // (th // P))          # rows each thread group takes (1 when th >= T)
    # each thread's loads go U at a time into U sums, so that U are in flight at once
    U = NORM_LOADS_IN_FLIGHT

    def pass_(acc_line, fin, centred):
        step = [" ".join(f"{{ let q = {load.format(j * P)}; {acc_line.replace('acc', f'acc{j}')} }}" for j in range(U))]
        body = [f"    for (var r = 0u; r < {rows}u; r = r + 1u) {{",
                f"        let rr = r * {th // P}u + tid / {P}u; let gr = row0 + rr;",
                "        " + " ".join(f"var acc{j} = 0.0;" for j in range(U)),
                f"        if (rr < {T}u && gr < {M}u) {{",
                f"            let mean = {'pm[rr]' if centred else '0.0'};",
                f"            var k = tid % {P}u;",
                f"            for (; k + {(U - 1) * P}u < {n}u; k = k + {U * P}u) {{ {step[0]} }}",
                f"            for (; k < {n}u; k = k + {P}u) {{ let q = {load.format(0)}; {acc_line.replace('acc', 'acc0')} }}",
                "        }",
                "        let acc = " + " + ".join(f"acc{j}" for j in range(U)) + ";",
                "        pred[tid] = acc;",
                "        workgroupBarrier();",
                f"        if (tid % {P}u == 0u && rr < {T}u) {{",
                "            var tot = 0.0;",
                f"            for (var j = 0u; j < {P}u; j = j + 1u) {{ tot = tot + pred[tid + j]; }}",
                f"            {fin}",
                "        }",
                "        workgroupBarrier();",
                "    }"]
        return body
    lines = []
    if center:
        lines += pass_(f"acc = acc + {total};", f"pm[rr] = tot / {float(K)!r};", False)
    else:
        lines += [f"    for (var rr = tid; rr < {T}u; rr = rr + {th}u) {{ pm[rr] = 0.0; }}"]
    lines += pass_(f"{dev} acc = acc + {sq};", f"pinv[rr] = inverseSqrt(tot / {float(K)!r} + {pro['eps']!r});", center)
    lines += ["    workgroupBarrier();"]

    def transform(x, vec):
        ks = [f"k0 + kk + {c}u" for c in range(4)] if vec else ["k0 + kk"]
        return _affine(f"(({x}) - {'vec4<f32>' if vec else 'f32'}(pm[tt])) * pinv[tt]", ks, K,
                       (wb, w), (bbi, bb_), "vec4<f32>" if vec else "f32")
    return lines, transform


def _block(kernel) -> tuple:
    """(TM, TN, WY, WX) of one tiled matmul: as lowering chose it, else as ``plan_tiles`` would."""
    if "tile" in kernel.spec:
        return block_of(kernel.spec)
    a = kernel.reads[0]
    M, N = kernel.shape[-2:]
    K = a.shape[-2] if kernel.spec["ta"] else a.shape[-1]
    nb = int(np.prod(kernel.spec.get("batch", kernel.shape[:-2]), dtype=np.int64))
    return plan_tiles(M, N, K, nb)[1]


def operand_function(kernel, j, op, gs, bind):
    """(name, WGSL) of the function that computes operand ``op`` of part ``j`` in its loads
    (``spec["gathers"][op]`` is ``gs``: a gather's formula or a pointwise expression); its
    reads are bound on ``bind`` now, so call it where the kernel's bindings are numbered."""
    fname = f"gat{j}_{op}"
    make = pointwise_function if "expr" in gs else gather_function
    return fname, make(gs, kernel.reads[gs["first"]:gs["first"] + gs["n"]], bind, fname)


def _round_f16_load(value, vec):
    """``_operand``'s transform of an operand rounded to f16 precision (``ROUND_F16``)."""
    return f"round_f16v({value})" if vec else f"round_f16({value})"


def _tiled_part(kernel, bind, j, block, peel):
    """(WGSL function ``mm{j}``, its workgroup counts, K step) of one tiled matmul on
    ``block`` (TM, TN, WY, WX); ``peel``: the padded, peeled form (``peeled``)."""
    a, bv = kernel.reads[:2]
    ta, tb = kernel.spec["ta"], kernel.spec["tb"]
    M, N = kernel.shape[-2:]
    K = a.shape[-2] if ta else a.shape[-1]
    batch = kernel.spec.get("batch", kernel.shape[:-2])   # split-K writes (batch, splits, M, N)
    nb = int(np.prod(batch, dtype=np.int64))
    S = kernel.spec.get("split", 1)
    TM, TN, WY, WX = block
    GM, GN = TM // (4 * WY), TN // (4 * WX)   # groups of 4 rows (columns) per thread, 4*WY (4*WX) apart
    VM, VN = TM // 4, TN // 4                 # vec4s per tile row of A (B) in workgroup memory
    SA = VM + a_padding(peel)                # vec4s per staged row of A
    TK = kernel.spec.get("tk") or k_step(TM)
    KC = split_k(K, S, TK)
    # static shapes: bounds checks only where a dimension is not a multiple of its tile
    chk_m, chk_n, chk_k = M % TM != 0, N % TN != 0, K % KC != 0 or KC % TK != 0
    bl, aoff, boff = _batch_offsets(a, bv, batch, f"wid.z / {S}u")
    bl = [f"    let split = wid.z % {S}u;", f"    let kbeg = split * {KC}u; let kend = min(kbeg + {KC}u, {K}u);"] + bl
    # operand bindings: vec4 arrays where the layout allows 16-byte loads; an operand
    # that a gather computes (implicit-GEMM convolution) is a function, not a binding
    gathers = kernel.spec.get("gathers", {})
    loads, fns = {}, []
    for op, gs in gathers.items():
        fname, fn = operand_function(kernel, j, op, gs, bind)
        fns.append(fn)
        loads[op] = (lambda at, f=fname, o=gs["offset"]: f"{f}(({at}) - {o}u)")
    ab = None if 0 in loads else bind.index(a.buf, a.dtype)
    bb = None if 1 in loads else bind.index(bv.buf, bv.dtype)
    th = WX * WY
    pro_lines, transform, a_vec0 = [], None, True
    if "prologue" in kernel.spec:
        a_vec0 = K % 4 == 0 and a.offset % 4 == 0 and a.dtype.name == "f32" and ab != bb
        pro_lines, transform = _tiled_norm_prologue(kernel, bind, M, K, TM, th, ab, a_vec0)
    round_a, round_b = rounded_operands(kernel.spec)
    b_transform = _round_f16_load if round_b else None
    if round_a:
        assert transform is None, f"{kernel.name}: a norm prologue on an operand rounded to f16"
        transform = _round_f16_load
    a_vec, a_reg, a_fetch, a_store = _operand("As", a, ta, M, K, TM, VM, "row0", ab, "aoff", chk_m, chk_k, "ra", SV=SA,
                                              threads=th, allow_vec=(transform is None or a_vec0) and ab not in bind.scalar,
                                              transform=transform, load=loads.get(0), TK=TK)
    b_vec, b_reg, b_fetch, b_store = _operand("Bs", bv, not tb, N, K, TN, VN, "col0", bb, "boff", chk_n, chk_k, "rb",
                                              threads=th, allow_vec=bb not in bind.scalar, load=loads.get(1), TK=TK,
                                              transform=b_transform)
    if ab == bb and ab is not None and a_vec != b_vec:   # one buffer, one declared type: scalars
        a_vec, a_reg, a_fetch, a_store = _operand("As", a, ta, M, K, TM, VM, "row0", ab, "aoff", chk_m, chk_k, "ra",
                                                  False, threads=th, transform=transform, TK=TK, SV=SA)
        b_vec, b_reg, b_fetch, b_store = _operand("Bs", bv, not tb, N, K, TN, VN, "col0", bb, "boff", chk_n, chk_k,
                                                  "rb", False, threads=th, TK=TK, transform=b_transform)
    if a_vec:
        bind.types[ab] = "vec4<f32>"
    if b_vec:
        bind.types[bb] = "vec4<f32>"
    store = OutputStore(kernel, bind, name=f"store_out{j}")   # after the operand types are fixed
    fma = []
    for g in range(GM):
        fma.append(f"            let a{g} = As[As0 + kk * {SA}u + {WY * g}u + ty];")
    for g in range(GN):
        fma.append(f"            let b{g} = Bs[Bs0 + kk * {VN}u + {WX * g}u + tx];")
    for gr in range(GM):
        for r in range(4):
            for gc in range(GN):
                fma.append(f"            acc[{(gr * 4 + r) * GN + gc}] = fma(vec4<f32>(a{gr}[{r}]), b{gc}, "
                           f"acc[{(gr * 4 + r) * GN + gc}]);")
    writes = []
    for gr in range(GM):
        for r in range(4):
            row = f"row0 + {4 * WY * gr + r}u + ty * 4u"
            for gc in range(GN):
                col = f"col0 + {4 * WX * gc}u + tx * 4u"
                v = f"acc[{(gr * 4 + r) * GN + gc}]"
                for c in range(4):
                    cond = " && ".join(x for x, on in ((f"gm < {M}u", chk_m), (f"gn + {c}u < {N}u", chk_n)) if on)
                    st = f"store_out{j}(coff + gm * {N}u + gn + {c}u, {v}[{c}]);"
                    writes.append(f"        {{ let gm = {row}; let gn = {col}; " + (f"if ({cond}) {{ {st} }}" if cond else st) + " }")
    nk = KC // TK
    src = f"""{store.module_text()}
{chr(10).join(fns)}
fn mm{j}(wid: vec3<u32>, lid3: vec3<u32>) {{
    let tx = lid3.x; let ty = lid3.y; let tid = ty * {WX}u + tx;
    let row0 = wid.y * {TM}u; let col0 = wid.x * {TN}u;
{chr(10).join(bl)}
    let aoff = {" + ".join(aoff)};
    let boff = {" + ".join(boff)};
    let coff = wid.z * {M * N}u;
{chr(10).join(pro_lines)}
    var acc: array<vec4<f32>, {4 * GM * GN}>;
    var ra: {a_reg};
    var rb: {b_reg};
{_main_loop(nk, TK, SA, VN, a_fetch + b_fetch, a_store + b_store, fma, peel)}
{chr(10).join(writes)}
}}
"""
    return src, (-(-N // TN), -(-M // TM), nb * S), TK
