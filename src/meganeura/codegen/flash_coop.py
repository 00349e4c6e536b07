"""Flash attention forward on tensor cores: GLSL on ``GL_KHR_cooperative_matrix`` for the
direct Vulkan backend in accelerated precision, a drop-in for the f32 kernel of ``flash.py``
(same bindings in the same order, same outputs: the split partials and their log-sum-exps
included, the epilogue through ``store_out``). q, k and v stay f32 in memory; the kernel
rounds them to f16 as it stages them, multiplies f16 x f16 with f32 accumulation, and keeps
the softmax, its running statistics and the output in f32.

A workgroup owns BQ = 16 x NSG query rows of one (batch, head): subgroup ``sg`` (32 lanes)
the 16 rows from 16 sg on, its Q fragments held in registers for the whole walk. Keys come in
tiles of BKV = 64: the workgroup stages the tile's K and V as f16 rows in workgroup memory
(the next tile is fetched into registers meanwhile), then each subgroup

1. multiplies its S = Q K^T (16 x 64) into accumulator fragments and stores them to its own
   f32 scratch rows: which lane holds which element of a fragment is the driver's choice, so
   the row-wise softmax reads S back from memory;
2. runs the online softmax with two lanes per row (lane l: row l % 16, the vec4 column groups
   of parity l / 16, so 8 consecutive lanes read distinct banks): the row max, exchanged with
   a shuffle, and the row's reference max and sum live in the two lanes' registers; P goes to
   workgroup memory as f16;
3. accumulates O += P V in its output fragments. The exponents are taken against a reference
   max that is kept while the row's max stays within TAU of it (so P stays below e^TAU; exact,
   since the sum shares the reference), and only a row past it makes the subgroup rescale its
   output: through the scratch, once or twice a row in practice, instead of every tile. At
   the end the output goes through the scratch once more, divided by the row's sum.

Head dims are padded to multiples of 16 with zeros (scores and outputs unchanged); the kernel
takes Dv and D up to 128 where the tiles fit the device's workgroup memory.

Masks, causal tile skipping, grouped heads, strided views and the split over keys are
``flash.py``'s, with the same conventions (a fully masked row gives zeros and a +inf
log-sum-exp, a split that saw no key -inf).
"""
from __future__ import annotations

import numpy as np

from .common import Bindings, broadcast_view_strides, grid
from .coop_library import glsl_library
from .coopmat_ops import ROW, CoopOps, EmulatedOps
from .expr import OutputStore

BKV = 64            # keys per tile
TAU = 8.0           # how far past its reference a row's max may go before the output is rescaled
SUBGROUPS = (4, 2, 1)   # subgroups per workgroup (16 query rows each): the most that fit
MAX_DIM = 128
NEG_INF = "uintBitsToFloat(0xff800000u)"
POS_INF = "uintBitsToFloat(0x7f800000u)"


def _pad16(n):
    return -(-n // 16) * 16


class FlashCoopOps(CoopOps):
    """The fragment operations (``coopmat.CoopOps``), with f16 data in one workgroup array
    ``H`` (uvec4: 8 halves) and accumulators stored to the f32 scratch ``Cs`` (vec4)."""
    header = CoopOps.header + "\n#extension GL_KHR_shader_subgroup_shuffle : require" + \
        "\n#extension GL_KHR_shader_subgroup_vote : require"

    def partner(self, x):
        """``x`` of the lane 16 away (the other lane of the row)."""
        return f"subgroupShuffleXor({x}, 16u)"

    def any(self, cond):
        """Whether ``cond`` holds on some lane of the subgroup."""
        return f"subgroupAny({cond})"

    def load_acc(self, acc, buf, at, stride):
        return f"coopMatLoad({acc}, {buf}, {at}, {stride}u, {ROW});"


class FlashEmulatedOps(EmulatedOps):
    """``coopmat.EmulatedOps`` over ``H`` and ``Cs``: a fragment is its offset in ``H``, lane
    ``l`` of 32 invocations holds elements ``l + 32 q`` of an accumulator; the shuffle goes
    through workgroup memory. For devices without cooperative matrices (the tests)."""
    helpers = """float h_elem(uvec4 v, uint e) {
    vec2 p = unpackHalf2x16(v[e >> 1u]);
    return (e & 1u) == 0u ? p.x : p.y;
}
// element (r, c) of the 16x16 fragment at uvec4 offset ``at`` of H
float frag_h(uint at, uint stride, bool row_major, uint r, uint c) {
    return row_major ? h_elem(H[at + r * stride + c / 8u], c % 8u) : h_elem(H[at + c * stride + r / 8u], r % 8u);
}
"""

    frag_fns = ("frag_h", "frag_h")

    def store(self, acc, buf, at, stride):
        return (f"for (uint q = 0u; q < 8u; ++q) {{ uint e = lane + q * 32u; "
                f"{buf}[{at} + (e / 16u) * {stride}u + (e % 16u) / 4u][e % 4u] = {acc}[q]; }}")

    def partner(self, x):
        return f"xchg({x})"

    def any(self, cond):
        return f"any_wg({cond})"     # over the workgroup: uniform, as its barriers need

    def load_acc(self, acc, buf, at, stride):
        return (f"for (uint q = 0u; q < 8u; ++q) {{ uint e = lane + q * 32u; "
                f"{acc}[q] = {buf}[{at} + (e / 16u) * {stride}u + (e % 16u) / 4u][e % 4u]; }}")


def _layout(d, dv, nsg, emulate):
    """Offsets (uvec4) of the f16 areas in H, their row strides, and the sizes of H and of
    the scratch (vec4): K (also Q's staging on tensor cores, where Q moves to registers), V,
    each subgroup's P; Q has an area of its own when emulated (its fragments stay in H)."""
    dp, dvp = _pad16(d), _pad16(dv)
    ks, vs, ps = dp // 8 + 1, dvp // 8 + 1, BKV // 8 + 1
    bq = 16 * nsg
    k_at = bq * ks if emulate else 0
    k_rows = BKV if emulate else max(BKV, bq)
    v_at = k_at + k_rows * ks
    p_at = v_at + BKV * vs
    h_size = p_at + bq * ps
    cw = max(BKV, dvp) // 4 + 1         # scratch row stride in vec4 (16 bytes of padding)
    return dict(dp=dp, dvp=dvp, ks=ks, vs=vs, ps=ps, q_at=0, k_at=k_at, v_at=v_at, p_at=p_at,
                h_size=h_size, cw=cw, c_size=bq * cw)


def workgroup_bytes(d, dv, nsg, emulate=False) -> int:
    lay = _layout(d, dv, nsg, emulate)
    return 16 * (lay["h_size"] + lay["c_size"]) + (4 * 32 * nsg if emulate else 0)


def fitting_subgroups(need, workgroup_storage) -> int | None:
    """Subgroups per workgroup: the most of ``SUBGROUPS`` whose tiles (``need(n)`` bytes) fit
    ``workgroup_storage`` (an H200's 48 KiB takes 4 up to head dim 64), or None."""
    return next((n for n in SUBGROUPS if need(n) <= workgroup_storage), None)


def subgroups(d, dv, workgroup_storage, emulate=False) -> int | None:
    return fitting_subgroups(lambda n: workgroup_bytes(d, dv, n, emulate), workgroup_storage)


def check(kernel, not_this_kind, need, workgroup_storage) -> str:
    """Why the flash kernel ``kernel`` cannot run on cooperative matrices ('' when it can):
    it needs flash attention IR, the renderer's kind (``not_this_kind(spec)``: why not, or
    ''), head dims up to MAX_DIM and tiles (``need(subgroups)`` bytes) that fit."""
    s = kernel.spec
    if kernel.archetype != "attention" or "scale" not in s:
        return "no flash attention IR" if kernel.archetype == "attention" else f"archetype {kernel.archetype!r}"
    why = not_this_kind(s)
    if why:
        return why
    q, v = kernel.reads[0], kernel.reads[2]
    if max(q.shape[-1], v.shape[-1]) > MAX_DIM:
        return f"head dims {q.shape[-1]}, {v.shape[-1]} (at most {MAX_DIM})"
    if fitting_subgroups(need, workgroup_storage) is None:
        return f"{need(SUBGROUPS[-1])} B of workgroup memory (the device allows {workgroup_storage})"
    return ""


def select(kernel, workgroup_storage=49152, emulate=False) -> str:
    """Why ``kernel`` cannot run here ('' when it can): a flash attention forward (not a
    backward kernel) with head dims up to MAX_DIM whose tiles fit ``workgroup_storage``."""
    def need(n):
        q, v = kernel.reads[0], kernel.reads[2]
        return workgroup_bytes(q.shape[-1], v.shape[-1], n, emulate)
    return check(kernel, lambda s: "not a flash attention forward" if s.get("grad") or not s.get("flash") else "",
                 need, workgroup_storage)


def _vec4_ok(view) -> bool:
    """Whether a q, k or v view can be read 4 head-dim elements at a time."""
    return view.strides[-1] == 1 and view.offset % 4 == 0 and view.shape[-1] % 4 == 0 and \
        all(s % 4 == 0 for s in view.strides[:-1])


class Frame:
    """What the flash kernels on cooperative matrices (forward here, backward in
    ``flash_grad_coop``) share: the fragment operations, the bindings' declarations and
    ``store_out`` in GLSL (``reads``, (binding, view) pairs of q, k, v or dO, declared vec4
    where every view of their binding allows it and no binding in ``others`` is theirs),
    a head's base offset, accumulator declarations and the assembled source."""

    def __init__(self, kernel, b, store, reads, others, nbd, emulate):
        self.ops = FlashEmulatedOps() if emulate else FlashCoopOps()
        self.emulate, self.nbd = emulate, nbd
        views = {}
        for bi, x in reads:
            views.setdefault(bi, []).append(x)
        self.vec = {bi: bi not in others and bi not in b.scalar and all(map(_vec4_ok, xs)) for bi, xs in views.items()}
        for bi, on in self.vec.items():
            if on:
                b.types[bi] = "vec4<f32>"
        self.lib = glsl_library(b, store.module_items())

    def base(self, x, head):
        """The element offset of view ``x`` at batch coordinates z0.. and head ``head``."""
        st, nbd = x.strides, self.nbd
        terms = [f"{x.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nbd) if st[n]]
        return " + ".join(terms + ([f"{head} * {st[nbd]}u"] if st[nbd] else []))

    @staticmethod
    def batch_coords(index, batch):
        """GLSL lines splitting ``index`` into batch coordinates z0.."""
        if not batch:
            return []
        lines = [f"uint zr = {index};"]
        for dd in range(len(batch) - 1, 0, -1):
            lines.append(f"uint z{dd} = zr % {batch[dd]}u; zr = zr / {batch[dd]}u;")
        return lines + ["uint z0 = zr;"]

    def acc_decl(self, name, n):
        """``n`` zeroed accumulator fragments ``name[]``."""
        if self.emulate:
            return [f"float {name}[{n}][8];", f"[[unroll]] for (uint i = 0u; i < {n}u; ++i) "
                    f"[[unroll]] for (uint e = 0u; e < 8u; ++e) {name}[i][e] = 0.0;"]
        return [f"{self.ops.acc_t} {name}[{n}];",
                f"[[unroll]] for (uint i = 0u; i < {n}u; ++i) {name}[i] = {self.ops.acc_t}(0.0);"]

    def held(self, name, at, stride, width):
        """GLSL: ``name[]``, the A fragments of this subgroup's 16 rows (``width`` columns)
        staged in H at ``at`` with row stride ``stride``, held for the whole walk (emulated:
        their offsets, the rows staying in H)."""
        n = width // 16
        if self.emulate:
            return [f"uint {name}[{n}];"] + [f"{name}[{kk}] = {at}u + sg * {16 * stride}u + {2 * kk}u;" for kk in range(n)]
        return [self.ops.frag_decl("A", f"{name}[{n}]")] + [
            self.ops.load(f"{name}[{kk}]", "H", f"{at}u + sg * {16 * stride}u + {2 * kk}u", stride, True)
            for kk in range(n)]

    def scores(self, held, at, stride, width, keys, cw):
        """GLSL: ``held`` (16 x ``width``) times the transpose of the ``keys`` rows staged in H
        at ``at`` (row stride ``stride``, read column-major), into fragments ``sc`` stored to
        this subgroup's scratch rows (row stride ``cw`` vec4)."""
        ops = self.ops
        return self.acc_decl("sc", keys // 16) + [
            f"[[unroll]] for (uint kk = 0u; kk < {width // 16}u; ++kk) {{",
            f"    [[unroll]] for (uint jn = 0u; jn < {keys // 16}u; ++jn) {{",
            "        " + ops.frag_decl("B", "fb"),
            "        " + ops.load("fb", "H", f"{at}u + jn * {16 * stride}u + kk * 2u", stride, False),
            "        " + ops.mma(f"{held}[kk]", (stride, True), "fb", (stride, False), "sc[jn]"),
            "    }", "}",
            f"[[unroll]] for (uint jn = 0u; jn < {keys // 16}u; ++jn) " + ops.store("sc[jn]", "Cs", "cs + jn * 4u", cw)]

    @staticmethod
    def write_rows(values, at, stride, n):
        """GLSL: this lane's vec4s ``values[j]`` (row r, columns 4 (2j + hh)..) as f16 into its
        subgroup's rows in H at ``at`` (row stride ``stride``): the A operand of a product."""
        return [f"[[unroll]] for (uint j = 0u; j < {n}u; ++j) {{",
                f"    uvec2 ph = uvec2(packHalf2x16({values}[j].xy), packHalf2x16({values}[j].zw));",
                f"    uint pp = {at}u + (sg * 16u + r) * {stride}u + j;",
                "    if (hh == 0u) { H[pp].xy = ph; } else { H[pp].zw = ph; }", "}"]

    def accumulate(self, acc, a_at, a_stride, b_at, b_stride, keys, width):
        """GLSL: ``acc[]`` += this subgroup's 16 x ``keys`` rows in H at ``a_at`` times the
        ``keys`` x ``width`` rows at ``b_at`` (row strides ``a_stride``, ``b_stride``)."""
        ops = self.ops
        return [f"[[unroll]] for (uint kk = 0u; kk < {keys // 16}u; ++kk) {{",
                "    " + ops.frag_decl("A", "fa"),
                "    " + ops.load("fa", "H", f"{a_at}u + sg * {16 * a_stride}u + kk * 2u", a_stride, True),
                f"    [[unroll]] for (uint jn = 0u; jn < {width // 16}u; ++jn) {{",
                "        " + ops.frag_decl("B", "fb"),
                "        " + ops.load("fb", "H", f"{b_at}u + kk * {16 * b_stride}u + jn * 2u", b_stride, True),
                "        " + ops.mma("fa", (a_stride, True), "fb", (b_stride, True), f"{acc}[jn]"),
                "    }", "}"]

    def mask_terms(self, mask, scores_shape, head):
        """(offset terms of ``mask`` at batch coordinates z0.. and query head ``head``, its
        strides broadcast to ``scores_shape``)."""
        st, nbd = broadcast_view_strides(mask, scores_shape), self.nbd
        terms = [f"{mask.offset}u"] + [f"z{n} * {st[n]}u" for n in range(nbd) if st[n]]
        return terms + ([f"{head} * {st[nbd]}u"] if st[nbd] else []), st

    def source(self, threads, shared, helpers, body):
        ops = self.ops
        src = "\n".join([ops.header, f"layout(local_size_x = {threads}) in;", self.lib.rstrip()] + shared
                        + [ops.helpers] + helpers + ["void main() {"] + ["    " + x for x in body] + ["}"]) + "\n"
        # emulated, the loops stay: unrolled, the emulated fragments take LLVM minutes to compile
        return src.replace("[[unroll]]", "[[dont_unroll]]") if self.emulate else src


def _pack8(view, bi, vec, base, row, rows, col0):
    """GLSL lines packing elements ``col0 .. col0 + 7`` of row ``row`` of a q/k/v view (head
    base offset ``base``) into the uvec4 ``u`` as f16, zeros past ``rows`` rows or the head dim
    (staged padded to a multiple of 16)."""
    n = view.shape[-1]
    rs, cs = view.strides[-2], view.strides[-1]
    at = f"{base} + min({row}, {view.shape[-2] - 1}u) * {rs}u"
    ok_row = f"{row} < {rows}u"
    if vec:
        lines = []
        for half in range(2):
            ok = [ok_row] + ([f"{col0} + {4 * half}u < {n}u"] if n % 16 else [])
            load = f"b{bi}[({at} + min({col0} + {4 * half}u, {n - 4}u)) / 4u]"
            lines.append(f"vec4 f{half} = ({' && '.join(ok)}) ? {load} : vec4(0.0);")
        lines.append("u = uvec4(packHalf2x16(f0.xy), packHalf2x16(f0.zw), packHalf2x16(f1.xy), packHalf2x16(f1.zw));")
        return lines
    lines = ["float f[8];"]
    for i in range(8):
        ok = [ok_row] + ([f"{col0} + {i}u < {n}u"] if n % 16 else [])
        load = f"b{bi}[{at} + min({col0} + {i}u, {n - 1}u) * {cs}u]"
        lines.append(f"f[{i}] = ({' && '.join(ok)}) ? {load} : 0.0;")
    lines.append("u = uvec4(" + ", ".join(f"packHalf2x16(vec2(f[{2 * i}], f[{2 * i + 1}]))" for i in range(4)) + ");")
    return lines


def _stage(view, bi, vec, base, row0, rows, width, nt, reg=None, dst=None):
    """GLSL staging ``rows`` x ``width`` (a multiple of 8) elements of a view from row
    ``row0`` on: into registers ``reg[]`` (``dst`` None) or straight into H at ``dst`` with
    row stride ``width / 8 + 1``; returns (lines, registers per thread). With ``reg`` and
    ``dst`` both given, the lines store the registers into H instead of fetching."""
    per_row = width // 8
    total = rows * per_row
    per = -(-total // nt)
    lines = [f"[[unroll]] for (uint l = 0u; l < {per}u; ++l) {{",
             f"    uint v = t + l * {nt}u, r = v / {per_row}u, c = v % {per_row}u;"]
    body = []
    if reg is not None and dst is not None:
        body.append(f"H[{dst} + r * {per_row + 1}u + c] = {reg}[l];")
    else:
        body.append("uvec4 u;")
        body += _pack8(view, bi, vec, base, f"{row0} + r", view.shape[-2], "c * 8u")
        body.append(f"{reg}[l] = u;" if dst is None else f"H[{dst} + r * {per_row + 1}u + c] = u;")
    if total % nt:
        body = [f"if (v < {total}u) {{"] + ["    " + b for b in body] + ["}"]
    lines += ["    " + b for b in body] + ["}"]
    return lines, per


def render(kernel, workgroup_storage=49152, emulate=False):
    """(GLSL text, bound logical buffers in binding order, workgroup counts) of the flash
    attention forward ``kernel`` on cooperative matrices; raises ValueError when it cannot
    (see ``select``). ``emulate``: the fragment operations as plain loops."""
    why = select(kernel, workgroup_storage, emulate)
    if why:
        raise ValueError(f"kernel {kernel.name!r} cannot run flash attention on cooperative matrices: {why}")
    q, k, v = kernel.reads[:3]
    spec = kernel.spec
    *batch, hq, lq, d = q.shape
    hkv, lk, dv = k.shape[-3], k.shape[-2], v.shape[-1]
    group = hq // hkv
    nb = int(np.prod(batch, dtype=np.int64))
    nbd = len(batch)
    S = spec.get("split", 1)
    NSG = subgroups(d, dv, workgroup_storage, emulate)
    BQ, NT = 16 * NSG, 32 * NSG
    NQT, NKT, NBH = -(-lq // BQ), -(-lk // BKV), nb * hq
    lay = _layout(d, dv, NSG, emulate)
    DP, DVP, KS, VS, PS, CW = (lay[x] for x in ("dp", "dvp", "ks", "vs", "ps", "cw"))
    # bindings in the WGSL kernel's order: the store's, q, k, v, the mask, the log-sum-exp
    b = Bindings()
    store = OutputStore(kernel, b)
    qb, kb, vb = (b.index(x.buf, x.dtype) for x in (q, k, v))
    mb = b.index(kernel.reads[3].buf, kernel.reads[3].dtype) if spec["masked"] else None
    lse = kernel.outs[0] if kernel.outs else None
    lb = b.index(lse.buf, lse.dtype, write=True) if lse is not None else None
    others = {store.ob, mb, lb} | {b.index(x.buf, x.dtype) for x in kernel.epi_reads}
    fr = Frame(kernel, b, store, ((qb, q), (kb, k), (vb, v)), others, nbd, emulate)
    ops, vec, base, acc_decl, emu, sync = fr.ops, fr.vec, fr.base, fr.acc_decl, emulate, fr.ops.sync
    L = [f"uint t = gl_LocalInvocationIndex;", ops.ids,
         "uint r = lane % 16u, hh = lane / 16u;     // this lane's row of the subgroup's 16, and column parity",
         "uint gi = gl_WorkGroupID.x + gl_WorkGroupID.y * gl_NumWorkGroups.x;",
         f"if (gi >= {NBH * NQT * S}u) return;",
         f"uint qt = gi % {NQT}u, bh = (gi / {NQT}u) % {NBH}u, h = bh % {hq}u, bz = bh / {hq}u;"]
    if S > 1:
        L.append(f"uint sp = gi / {NQT * NBH}u;")
    L += fr.batch_coords("bz", batch)
    L += [f"uint hk = h / {group}u, q0 = qt * {BQ}u;",
          f"uint qoff = {base(q, 'h')}, koff = {base(k, 'hk')}, voff = {base(v, 'hk')};"]
    # Q, once: staged as f16 rows, then (on tensor cores) into this subgroup's A fragments
    L += _stage(q, qb, vec[qb], "qoff", "q0", BQ, DP, NT, dst=f"{lay['q_at']}u")[0]
    L.append("barrier();")
    L += fr.held("qf", lay["q_at"], KS, DP)
    if not emu:
        L.append("barrier();      // Q's area becomes K's")
    L += [f"float m = {NEG_INF}, lsum = 0.0;     // the row's reference max; this lane's share of its sum"]
    L += acc_decl("oacc", DVP // 16) + [f"uint cs = sg * {16 * CW}u;     // this subgroup's scratch rows"]
    if spec["causal"]:     # top-left aligned: row i sees keys j <= i
        L.append(f"uint nt = min({NKT}u, (q0 + {BQ - 1}u) / {BKV}u + 1u);")
    else:
        L.append(f"uint nt = {NKT}u;")
    L.append(f"uint t0 = sp * nt / {S}u, t1 = (sp + 1u) * nt / {S}u;" if S > 1 else "uint t0 = 0u, t1 = nt;")
    fk, pk = _stage(k, kb, vec[kb], "koff", "kt0", BKV, DP, NT, reg="rk")
    fv, pv = _stage(v, vb, vec[vb], "voff", "kt0", BKV, DVP, NT, reg="rv")
    put_k = _stage(k, kb, vec[kb], "", "", BKV, DP, NT, reg="rk", dst=f"{lay['k_at']}u")[0]
    put_v = _stage(v, vb, vec[vb], "", "", BKV, DVP, NT, reg="rv", dst=f"{lay['v_at']}u")[0]
    L += [f"uvec4 rk[{pk}];", f"uvec4 rv[{pv}];",
          "if (t0 < t1) {", f"    uint kt0 = t0 * {BKV}u;"] + ["    " + x for x in fk + fv] + ["}"]
    if spec["masked"]:
        terms, st = fr.mask_terms(kernel.reads[3], tuple(batch) + (hq, lq, lk), "h")
        L.append(f"uint moff = {' + '.join(terms)};")
    # the loop over key tiles
    body = put_k + put_v + ["barrier();",
                            f"if (kt + 1u < t1) {{", f"    uint kt0 = (kt + 1u) * {BKV}u;"]
    body += ["    " + x for x in fk + fv] + ["}", f"uint kt0 = kt * {BKV}u;"]
    # 1. S = Q K^T into the scratch (K^T: K's rows read column-major)
    body += fr.scores("qf", lay["k_at"], KS, DP, BKV, CW)
    body += sync
    # 2. the online softmax: this lane's 32 scores of row r
    score = []
    if spec["masked"]:
        mv = f"b{mb}[moff + min(i, {lq - 1}u) * {st[-2]}u + min(jj, {lk - 1}u) * {st[-1]}u]"
        score.append(f"x[j][e] = ({mv} != 0) ? x[j][e] : {NEG_INF};" if spec["int_mask"] else f"x[j][e] += {mv};")
    if spec["causal"]:
        score.append(f"if (jj > i) x[j][e] = {NEG_INF};")
    if lk % BKV:
        score.append(f"if (jj >= {lk}u) x[j][e] = {NEG_INF};")
    body += [f"vec4 x[{BKV // 8}];", f"float mx = {NEG_INF};", f"uint i = q0 + sg * 16u + r;",
             f"[[unroll]] for (uint j = 0u; j < {BKV // 8}u; ++j) {{",
             f"    x[j] = Cs[cs + r * {CW}u + 2u * j + hh] * {float(np.float32(spec['scale']))!r};"]
    if score:
        body += ["    [[unroll]] for (uint e = 0u; e < 4u; ++e) {",
                 "        uint jj = kt0 + (2u * j + hh) * 4u + e;"] + ["        " + s for s in score] + ["    }"]
    body += ["    mx = max(mx, max(max(x[j].x, x[j].y), max(x[j].z, x[j].w)));", "}"]
    body.append(f"mx = max(mx, {ops.partner('mx')});")
    # the reference max m: kept while the tile's max stays within TAU of it, so the
    # exponents stay below e^TAU and the output stays in its fragments (exact: the sum and
    # the output share the reference); past it the subgroup rescales its output through
    # the scratch. A row's first unmasked keys set m with nothing to rescale (O and the sum
    # are still zero).
    body += [f"bool first = m == {NEG_INF};",
             f"float alpha = 1.0;",
             f"if ({ops.any(f'!first && mx > m + {TAU!r}')}) {{"]
    body += ["    " + x for x in sync + [
        "float mnew = max(m, mx);",
        "alpha = first ? 0.0 : exp(m - mnew);",
        "m = mnew;",
        f"[[unroll]] for (uint jn = 0u; jn < {DVP // 16}u; ++jn) " + ops.store("oacc[jn]", "Cs", "cs + jn * 4u", CW)]
        + sync + [f"[[unroll]] for (uint j = 0u; j < {DVP // 8}u; ++j) Cs[cs + r * {CW}u + 2u * j + hh] *= alpha;"]
        + sync + [f"[[unroll]] for (uint jn = 0u; jn < {DVP // 16}u; ++jn) " + ops.load_acc("oacc[jn]", "Cs", "cs + jn * 4u", CW)]]
    body += ["} else if (first) {", "    m = mx;", "}",
             "// a row masked so far keeps max -inf: exponents against 0 give zeros, not NaN",
             f"float mref = m == {NEG_INF} ? 0.0 : m;",
             "float psum = 0.0;",
             f"[[unroll]] for (uint j = 0u; j < {BKV // 8}u; ++j) {{",
             "    x[j] = exp(x[j] - vec4(mref));     // P",
             "    psum += dot(x[j], vec4(1.0));",
             "}",
             "lsum = lsum * alpha + psum;"]
    body += fr.write_rows("x", lay["p_at"], PS, BKV // 8) + sync
    # 3. O += P V
    body += fr.accumulate("oacc", lay["p_at"], PS, lay["v_at"], VS, BKV, DVP)
    body.append("barrier();      // K, V, P and the scratch are read: the next tile may overwrite them")
    L += ["for (uint kt = t0; kt < t1; ++kt) {"] + ["    " + x for x in body] + ["}"]
    # the row sums of both lanes, then the normalised output
    L += sync + [f"[[unroll]] for (uint jn = 0u; jn < {DVP // 16}u; ++jn) " + ops.store("oacc[jn]", "Cs", "cs + jn * 4u", CW)]
    L += sync + [f"lsum += {ops.partner('lsum')};",
          "float inv = lsum != 0.0 ? 1.0 / lsum : 0.0;     // a fully masked row: zeros",
          "uint i = q0 + sg * 16u + r;"]
    row0 = f"(sp * {NBH}u + bh) * {lq}u" if S > 1 else f"bh * {lq}u"
    if lse is not None:
        assert lse.is_contiguous() and lse.shape == (S,) * (S > 1) + tuple(batch) + (hq, lq), lse.shape
        empty = NEG_INF if S > 1 else POS_INF
        L.append(f"if (hh == 0u && i < {lq}u) b{lb}[{lse.offset}u + {row0} + i] = lsum != 0.0 ? m + log(lsum) : {empty};")
    L += [f"if (i < {lq}u) {{",
          f"    [[unroll]] for (uint j = 0u; j < {DVP // 8}u; ++j) {{",
          "        [[unroll]] for (uint e = 0u; e < 4u; ++e) {",
          "            uint col = (2u * j + hh) * 4u + e;",
          f"            if (col < {dv}u) store_out(({row0} + i) * {dv}u + col, Cs[cs + r * {CW}u + 2u * j + hh][e] * inv);",
          "        }", "    }", "}"]
    shared = [f"shared uvec4 H[{lay['h_size']}];", f"shared vec4 Cs[{lay['c_size']}];"]
    helpers = []
    if emu:
        shared += [f"shared float Xs[{NT}];", "shared uint any_flag;"]
        helpers.append("float xchg(float x) {\n    uint t = gl_LocalInvocationIndex;\n    barrier();\n    Xs[t] = x;\n"
                       "    barrier();\n    float y = Xs[t ^ 16u];\n    barrier();\n    return y;\n}")
        helpers.append("bool any_wg(bool c) {\n    barrier();\n    if (gl_LocalInvocationIndex == 0u) any_flag = 0u;\n"
                       "    barrier();\n    if (c) any_flag = 1u;\n    barrier();\n    bool r = any_flag != 0u;\n"
                       "    barrier();\n    return r;\n}")
    return fr.source(NT, shared, helpers, L), b.bufs, grid(NBH * NQT * S)
