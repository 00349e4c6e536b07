"""The tiled matmul archetype on tensor cores: GLSL on ``GL_KHR_cooperative_matrix`` for the
direct Vulkan backend, rendered from the same kernel IR as ``codegen.matmul``.

In accelerated precision forward matmuls read f16 operands and accumulate in f32. On a device
with a 16x16x16 f16 x f16 -> f32 subgroup shape the Vulkan runtime runs those tiled kernels
from here instead of the f32 FMA tiles (``select`` says which kernels qualify). What the plan
around a kernel relies on stays as the WGSL kernel has it: batch broadcasting, transposes
(``ta``, ``tb``), K splits (partials side by side, summed by the next kernel), sibling matmuls
merged into one launch (``parts``), the bindings in the same order, and the epilogue:
``store_out`` of ``codegen.expr.OutputStore`` (its tree, printed as GLSL with the buffer
declarations by ``coop_library``), called per element once an accumulator
fragment has gone through workgroup memory (a plain f32 output is stored straight from the
fragments instead). The output tile of a workgroup, and so the grid, may differ: it
comes from ``CONFIGS`` by the WGSL kernel's tile (square and the same by default).

Inside a workgroup: SG_M x SG_N subgroups of 32 lanes, each owning WM x WN accumulator
fragments of 16x16 of the BM x BN tile (128 x 256 instead of 128 x 128 where the grid stays
large: ``WIDE``). K advances in chunks of BK. Each thread fetches its share of A (BM x BK) and
B (BK x BN) chunks DEPTH chunks ahead into registers as uvec4 (8 halves); each step stores the
next chunk into the other half of a double buffer in workgroup memory, fetches another and
multiplies the current one out of workgroup memory: one barrier per chunk. Operands are
staged in their stored layout (rows along the dimension that is not contiguous), each row
padded by 16 bytes against bank conflicts, and loaded as fragments row- or column-major to
match. An operand whose contiguous dimension is not a multiple of 8, or that does not start
on 16 bytes, is fetched element by element and packed. Edges (M, N not multiples of the
tile; K not of the chunk) load zeros and skip stores.

The fragment operations are in ``coopmat_ops``, the operand fetches in ``coopmat_loads``.
"""
from __future__ import annotations

import functools
import os

import numpy as np

from .common import Bindings
from .coop_library import glsl_library
from .coopmat_loads import _Operand, _batch_offsets, _fetch_store, _ind, _raw_peak_lines, _scale_from_peak
from .coopmat_ops import COL, FRAG, ROW, SUBGROUP, CoopOps, EmulatedOps
from .expr import OutputStore
from .matmul import k_step, rounded_operands, split_k

# the names of the cooperative-matrix modules, as ``coopmat.<name>``
__all__ = ["COL", "CONFIGS", "FRAG", "RAW_CHUNKS", "ROW", "SUBGROUP", "WIDE", "CoopOps", "EmulatedOps", "config_key",
           "configs", "render", "select", "wide_configs"]


# per tile T of the WGSL kernel (chosen by ``matmul.plan_tiles``): the BM x BN output tile of a
# workgroup, its SG_M x SG_N subgroups, the K chunk BK and DEPTH, the chunks fetched into
# registers ahead of the one being multiplied. On the H200 (bench/coopmat.py, 4096^3) a K chunk
# of 16 beat 32 on the 128 tile: 204 against 178 TFLOP/s (B plain), 190 against 162 (B
# transposed); two chunks ahead instead of one: 223 and 194 (three: 209 and 188)
CONFIGS = {128: (128, 128, 2, 4, 16, 2), 64: (64, 64, 2, 2, 32, 1), 32: (32, 32, 2, 2, 32, 1)}
# a wider output tile for T where the launch still has WIDE_MIN_GROUPS workgroups with it:
# 128 x 256, each subgroup 64 x 64, four chunks ahead, stored before the multiply (see
# ``_part_function``): 241-246 / 214-216 TFLOP/s at 4096^3 on the H200 against 223 / 193 for
# the 128 tile (two ahead: 241-246 / 205-208; 256 x 128: 230 / 216-219; 16 subgroups of 32 x
# 64: 245 / 204). Half the workgroups of the 128 tile, so only for grids that fill a GPU
WIDE = {128: (128, 256, 2, 4, 16, 4)}
WIDE_MIN_GROUPS = 256
WIDE_MIN_CHUNKS = 32
# operands rounded to f16 in the loads (``matmul_ast.round_f16_functions``): a K split of at most RAW_CHUNKS
# chunks is fetched whole into registers in f32 and its peak taken there (the rounded products
# of SmolLM2's backward at 128 tokens 10.5 -> 8.1 us against a pre-pass); a longer split reads
# its peak in a pre-pass, SCALE_UNROLL chunks a step
RAW_CHUNKS = 4
SCALE_UNROLL = 8


def _forced_configs() -> dict:
    """The tile configurations ``MEGANEURA_COOPMAT_CONFIG`` sets (``T:BMxBNxSG_MxSG_NxBK[xDEPTH],...``,
    e.g. ``128:128x256x2x4x16``), checked: the benchmark's sweep."""
    return dict(_parse_configs(os.environ.get("MEGANEURA_COOPMAT_CONFIG", "").strip()))


@functools.lru_cache(maxsize=8)
def _parse_configs(raw) -> tuple:
    """``_forced_configs`` of one value of the switch, as (T, configuration) pairs (parsed
    once: the runtime asks for every matmul of every plan)."""
    out = {}
    for item in filter(None, (s.strip() for s in raw.split(","))):
        try:
            t, rest = item.split(":")
            bm, bn, sm, sn, bk, *depth = (int(x) for x in rest.lower().split("x"))
            t, depth = int(t), (depth or [1])
            if len(depth) != 1:
                raise ValueError
            depth = depth[0]
        except ValueError:
            raise ValueError(f"MEGANEURA_COOPMAT_CONFIG: {item!r} is not T:BMxBNxSG_MxSG_NxBK "
                             "(e.g. 128:128x128x2x4x32, or 128:128x128x2x4x16x2 with DEPTH)") from None
        if t not in CONFIGS or min(bm, bn, sm, sn, bk) <= 0 or bm % (FRAG * sm) or bn % (FRAG * sn) or bk % FRAG \
                or not 1 <= depth <= 4:
            raise ValueError(f"MEGANEURA_COOPMAT_CONFIG: {item!r}: T must be one of {sorted(CONFIGS)}, BM and BN "
                             f"split into 16-wide fragments by SG_M and SG_N, BK a multiple of 16, DEPTH 1-4")
        out[t] = (bm, bn, sm, sn, bk, depth)
    return tuple(sorted(out.items()))


def configs() -> dict:
    """The tile configurations: ``CONFIGS`` with those ``MEGANEURA_COOPMAT_CONFIG`` sets replacing some."""
    return {**CONFIGS, **_forced_configs()}


def wide_configs() -> dict:
    """``WIDE`` less the tiles ``MEGANEURA_COOPMAT_CONFIG`` sets (a sweep times one configuration)."""
    forced = _forced_configs()
    return {t: c for t, c in WIDE.items() if t not in forced}


def config_key() -> tuple:
    """What of the configuration a rendered kernel depends on (the runtime's variant keys)."""
    return tuple(sorted(configs().items())), tuple(sorted(wide_configs().items())), RAW_CHUNKS, SCALE_UNROLL


def select(kernel, workgroup_storage=None, emulate=False) -> str:
    """Why ``kernel`` cannot run on cooperative matrices ('' when it can; its workgroup memory
    is checked by ``render``, which picks the tile by it): it must be a tiled
    matmul (not a GEMV) whose A and B are f16 views (or computed in its loads: an implicit-GEMM
    convolution's columns), without a norm prologue or a paired product, and merged parts must
    share their tile, count of row tiles (the grid puts them side by side along x), split
    and batch size."""
    if kernel.archetype != "matmul":
        return f"archetype {kernel.archetype!r}"
    parts = kernel.spec.get("parts", [kernel])
    for p in parts:
        s = p.spec
        if "ta" not in s:
            return "no kernel IR (a plan read from the plan cache)"
        if s.get("gemv"):
            return "a GEMV"
        for what in ("prologue", "pair"):
            if s.get(what):
                return f"a {what}"
        if any(not gs.get("im2col") for gs in s.get("gathers", {}).values()):
            # (none do: a pointwise operand computed in the loads is f32, and of the
            # gathers only im2col is computed in a consumer's loads, by ``_im2col_fetch``)
            return "an operand computed by a function in its loads"
        a, b = p.reads[:2]
        rounded = rounded_operands(s)
        if any(x.dtype.name != ("f32" if r else "f16") for x, r in zip((a, b), rounded)):
            return f"operands {a.dtype.name} x {b.dtype.name} (f16 x f16 needed, or f32 rounded to f16 in the loads)"
        if s.get("tile") not in CONFIGS:
            return f"tile {s.get('tile')}"
    shape = {(p.spec["tile"], p.spec.get("split", 1), -(-p.shape[-2] // configs()[p.spec["tile"]][0]),
              int(np.prod(p.spec.get("batch", p.shape[:-2]), dtype=np.int64))) for p in parts}
    if len(shape) > 1:
        return "merged parts of different tiles, row tiles, splits or batch sizes"
    return ""


def _scale_lines(op: _Operand, ops, BK, NT, nch, off):
    """GLSL computing ``op.scale`` (and its inverse, ``op.scale`` + ``_inv``): the power of two
    that takes the largest magnitude of the workgroup's share of ``op`` (its rows or columns
    of the tile over the split's K range) to [2^13, 2^14), so that converting to f16 rounds
    as ``matmul_ast.round_f16_functions`` does (elements below 2^-24 of that peak go to f16's subnormals and
    zero). The same walk over the chunks as the fetches, in f32; a workgroup-wide max
    through ``Pk`` (``workgroup_max``). All zeros give zeros; a share holding an infinity or
    NaN makes the workgroup's whole tile meaningless (the step is lost either way, as with a
    scaled cast's peak)."""
    CQ = op.tile(BK)[1] // 8
    total, per, row0, col0, row_ext, col_ext, ld, last = op.walk(BK, NT)
    b = f"b{op.binding}"
    reads = []
    if op.vec:      # whole groups of 8 in or out (as the fetch)
        reads.append(f"if (gr < {row_ext} && gc < {col_ext}) {{")
        reads += [f"    vec4 m = max(abs({b}[min(e / 4u, {last // 4}u)]), abs({b}[min(e / 4u + 1u, {last // 4}u)]));",
                  "    pk = max(pk, max(max(m.x, m.y), max(m.z, m.w)));", "}"]
    for i in range(0 if op.vec else 8):
        conds = [f"gr < {row_ext}", f"gc + {i}u < {col_ext}"]
        reads.append(f"if ({' && '.join(conds)}) pk = max(pk, abs({b}[min(e + {i}u, {last}u)]));")
    inner = [f"uint r = v / {CQ}u, q = v % {CQ}u;", f"uint gr = {row0} + r, gc = {col0} + q * 8u;",
             f"uint e = {off} + gr * {ld}u + gc;"] + reads
    if total % NT:
        inner = [f"if (v < {total}u) {{"] + ["    " + x for x in inner] + ["}"]
    # SCALE_UNROLL chunks a step, unrolled, so that their loads are in flight together (one
    # latency instead of one per chunk)
    U = min(nch, SCALE_UNROLL)
    chunk = [f"uint k0 = kbeg + c * {BK}u;", f"[[unroll]] for (uint l = 0u; l < {per}u; ++l) {{",
             f"    uint v = t + l * {NT}u;"] + ["    " + x for x in inner] + ["}"]
    if nch % U:
        chunk = [f"if (c < {nch}u) {{"] + ["    " + x for x in chunk] + ["}"]
    lines = ["{", "    float pk = 0.0;", f"    for (uint c0 = 0u; c0 < {nch}u; c0 += {U}u) {{",
             f"        [[unroll]] for (uint u = 0u; u < {U}u; ++u) {{", "            uint c = c0 + u;"]
    lines += ["            " + x for x in chunk] + ["        }", "    }"]
    return lines + _scale_from_peak(op, ops, NT)


class _Part:
    """One matmul of the launch: its operands, bindings and store."""

    def __init__(self, kernel, bind, j, BM, BN):
        self.kernel, self.j = kernel, j
        a, b = kernel.reads[:2]
        s = kernel.spec
        # im2col columns computed in the loads (``_im2col_fetch``; bound first, as the WGSL
        # kernel's function binds its input)
        loads, convs = {}, {}
        for op, gs in s.get("gathers", {}).items():
            reads = kernel.reads[gs["first"]:gs["first"] + gs["n"]]
            xb = bind.index(reads[0].buf, reads[0].dtype)
            bind.scalar.add(xb)
            loads[op], convs[op] = gs["offset"], (gs["im2col"], xb, reads[0])
        index = lambda op, v: None if op in loads else bind.index(v.buf, v.dtype)  # noqa: E731
        self.ta, self.tb = bool(s["ta"]), bool(s["tb"])
        self.M, self.N = kernel.shape[-2:]
        self.K = a.shape[-2] if self.ta else a.shape[-1]
        self.S = s.get("split", 1)
        self.batch = tuple(s.get("batch", kernel.shape[:-2]))
        self.nb = int(np.prod(self.batch, dtype=np.int64))
        self.KC = split_k(self.K, self.S, s.get("tk") or k_step(s.get("tile") or 128))
        # bindings in the WGSL kernel's order: A, B, then the store's (output, epilogue)
        self.A = _Operand(a, index(0, a), not self.ta, self.M, BM, self.K, "m0", self.M % BM != 0, False, False,
                          loads.get(0, 0), convs.get(0, ()))
        self.B = _Operand(b, index(1, b), self.tb, self.N, BN, self.K, "n0", self.N % BN != 0, False, False,
                          loads.get(1, 0), convs.get(1, ()))
        for operand, rounded, name in zip((self.A, self.B), rounded_operands(s), ("sca", "scb")):
            if rounded:
                operand.scale = name
        self.store = OutputStore(kernel, bind, name=f"store_out{j}")
        self.store_bindings = {self.store.ob} | {bind.index(v.buf, v.dtype) for v in kernel.epi_reads}
        out = kernel.out
        # a plain f32 output written in whole fragments goes straight from the fragments
        self.direct = (kernel.epilogue is None and "store_map" not in s and not s.get("stores") and out.dtype.name == "f32"
                       and out.is_contiguous() and out.offset % 4 == 0 and self.M % FRAG == 0 and self.N % FRAG == 0)

    def groups(self):
        return -(-self.N // self.B.own_tile), -(-self.M // self.A.own_tile), self.nb * self.S


def render(kernel, workgroup_storage=49152, emulate=False, bufs=()):
    """(GLSL text, bound logical buffers in binding order, workgroup counts) of ``kernel`` on
    cooperative matrices; raises ValueError when it cannot (see ``select``) or when its
    workgroup memory exceeds ``workgroup_storage`` bytes. ``emulate``: the same kernel with
    the fragment operations as plain loops (``EmulatedOps``), for devices without them.
    ``bufs``: the WGSL kernel's bound buffers, kept at their positions (it binds a buffer
    that parts read in different layouts once per layout; this kernel binds it once)."""
    why = select(kernel)
    if why:
        raise ValueError(f"kernel {kernel.name!r} cannot run on cooperative matrices: {why}")
    ops = EmulatedOps() if emulate else CoopOps()
    parts_ir = kernel.spec.get("parts", [kernel])
    tile = parts_ir[0].spec["tile"]
    narrow, wide = configs()[tile], wide_configs().get(tile)
    for config in ([wide] if wide else []) + [narrow]:
        BM, BN, SG_M, SG_N, BK, DEPTH = config
        bind = Bindings(bufs)
        parts = [_Part(p, bind, j, BM, BN) for j, p in enumerate(parts_ir)]
        if config is narrow or (_wide_pays(parts, BK, narrow[1])
                                and _workgroup_bytes(parts, BK, SG_M * SG_N) <= workgroup_storage):
            break
    # uvec4 bindings where every operand use allows it and no store reads the buffer
    uses: dict = {}
    for p in parts:
        for op in (p.A, p.B):
            if op.binding is not None:
                uses.setdefault(op.binding, []).append(op)
    stored = set().union(*(p.store_bindings for p in parts))
    for k, used in uses.items():
        vec = k not in stored and all(op.vectorizable() for op in used)
        for op in used:
            op.vec = vec
        if vec:      # f16 as 8 halves, or f32 (rounded in the loads) as 4 floats
            bind.types[k] = "vec4<f32>" if used[0].scale else "vec4<u32>"
    if len({p.groups()[1:] for p in parts}) > 1:
        raise ValueError(f"kernel {kernel.name!r}: merged parts of different row tiles on a {BM}-row tile")
    for p in parts:        # K is guarded where a split is not whole chunks, or the last split is short
        p.A.chk_k = p.B.chk_k = p.K % p.KC != 0 or p.KC % BK != 0
    size_a = max(p.A.size(BK) for p in parts)
    size_b = max(p.B.size(BK) for p in parts)
    staged = not all(p.direct for p in parts)
    nsg = SG_M * SG_N
    nbytes = _workgroup_bytes(parts, BK, nsg)
    if nbytes > workgroup_storage:
        raise ValueError(f"kernel {kernel.name!r}: {nbytes} B of workgroup memory on cooperative matrices "
                         f"(the device allows {workgroup_storage})")
    lib = glsl_library(bind, [it for p in parts for it in p.store.module_items()])
    geo = dict(BM=BM, BN=BN, BK=BK, SG_M=SG_M, SG_N=SG_N, DEPTH=DEPTH, WM=BM // (FRAG * SG_M), WN=BN // (FRAG * SG_N),
               NT=SUBGROUP * nsg, size_a=size_a, size_b=size_b)
    fns, branches, x0 = [], [], 0
    for p in parts:
        fns.append(_part_function(p, ops, **geo))
        gx = p.groups()[0]
        branches.append(f"    if (wid.x < {x0 + gx}u) {{ mm{p.j}(uvec3(wid.x - {x0}u, wid.y, wid.z)); return; }}")
        x0 += gx
    ext = []     # (the library's 16-bit types are enabled by the header)
    shared = [f"shared uvec4 As[{2 * size_a}];", f"shared uvec4 Bs[{2 * size_b}];"]
    if staged:
        shared.append(f"shared float Cs[{FRAG * FRAG * nsg}];")
    if any(op.scale for p in parts for op in (p.A, p.B)):      # operands rounded to f16: their peaks
        shared.append(f"shared float Pk[{geo['NT']}];")
        if not emulate:
            ext.append("#extension GL_KHR_shader_subgroup_arithmetic : require")
    src = "\n".join([ops.header] + ext + [f"layout(local_size_x = {geo['NT']}) in;", lib.rstrip()] + shared +
                    [ops.helpers] + fns + ["void main() {", "    uvec3 wid = gl_WorkGroupID;"] + branches + ["}"]) + "\n"
    if emulate:     # loops kept: unrolled, the emulated fragments take LLVM (lavapipe) minutes to compile
        src = src.replace("[[unroll]]", "[[dont_unroll]]")
    return src, bind.bufs, _grid(parts)


def _grid(parts) -> tuple:
    """Workgroup counts of a launch: the parts side by side along x (same y and z)."""
    return sum(p.groups()[0] for p in parts), *parts[0].groups()[1:]


def _wide_pays(parts, BK, narrow_bn) -> bool:
    """Whether the wide tile (``WIDE``) suits the launch ``parts`` (built for it): the grid keeps
    WIDE_MIN_GROUPS workgroups, no part pads N further than the narrow tile would, and each
    workgroup runs WIDE_MIN_CHUNKS K chunks or more (its deeper prefetch is paid once per tile:
    SmolLM2's LM-head backward, N 576 and K 128, took 167 us wide against 146 narrow)."""
    return int(np.prod(_grid(parts))) >= WIDE_MIN_GROUPS and all(
        -(-p.N // p.B.own_tile) * p.B.own_tile <= -(-p.N // narrow_bn) * narrow_bn and p.KC >= WIDE_MIN_CHUNKS * BK
        for p in parts)


def _workgroup_bytes(parts, BK, nsg) -> int:
    """Workgroup memory of a launch: both halves of the A and B chunks, and the accumulator
    staging of an epilogue (none when every part stores straight from the fragments)."""
    staged = not all(p.direct for p in parts)
    return 16 * 2 * (max(p.A.size(BK) for p in parts) + max(p.B.size(BK) for p in parts)) + \
        (4 * FRAG * FRAG * nsg if staged else 0)


def _part_function(p: _Part, ops, BM, BN, BK, SG_M, SG_N, DEPTH, WM, WN, NT, size_a, size_b) -> str:
    """GLSL ``void mm{j}(uvec3 wid)``: one part's output tile of the workgroup ``wid``."""
    nch = -(-p.KC // BK)
    # operands rounded to f16 of a split of at most RAW_CHUNKS chunks are fetched whole into
    # registers in f32 (DEPTH chunks ahead, DEPTH = the split's chunks), their peak taken from
    # there and each chunk converted as it is stored; longer splits read theirs in a pre-pass
    raw = nch <= RAW_CHUNKS and any(op.scale for op in (p.A, p.B))
    for op in (p.A, p.B):
        op.raw = raw and bool(op.scale)
    if raw:
        DEPTH = max(DEPTH, nch)
    # register set r holds the chunks c with c % DEPTH == r (names, since a register array
    # indexed by a variable would live in memory)
    sets = [(_fetch_store(p.A, BK, NT, f"ra{r}", "aoff", "As"), _fetch_store(p.B, BK, NT, f"rb{r}", "boff", "Bs"))
            for r in range(DEPTH)]
    pa, pb = sets[0][0][2], sets[0][1][2]
    fetch = lambda r: sets[r][0][0] + sets[r][1][0]  # noqa: E731
    bl, aoff, boff = _batch_offsets(p.A.view, p.B.view, p.batch, f"wid.z / {p.S}u")
    sa, sb = p.A.stride(BK), p.B.stride(BK)
    # fragments (offsets in uvec4) inside a staged chunk: row-major where the staged rows are
    # the fragment's rows (A: m; B: k), column-major otherwise
    a_at = (f"(sy * {WM}u + i) * {FRAG * sa}u + kk * 2u" if p.A.rows_own else f"kk * {FRAG * sa}u + (sy * {WM}u + i) * 2u")
    b_at = (f"(sx * {WN}u + jn) * {FRAG * sb}u + kk * 2u" if p.B.rows_own else f"kk * {FRAG * sb}u + (sx * {WN}u + jn) * 2u")
    a_row, b_row = p.A.rows_own, not p.B.rows_own
    M, N = p.M, p.N
    scaled = [op for op in (p.A, p.B) if op.scale]
    unscale = [ops.scale("acc[i][jn]", f"{op.scale}_inv") for op in scaled]
    prepass, peaks = [], []
    for op, off, name in ((p.A, "aoff", "ra"), (p.B, "boff", "rb")):
        if op.raw:
            peaks += _raw_peak_lines(op, ops, BK, NT, min(DEPTH, nch), [f"{name}{r}" for r in range(DEPTH)])
        elif op.scale:
            prepass += _scale_lines(op, ops, BK, NT, nch, off)
    scale_decl = " ".join(f"float {op.scale} = 1.0, {op.scale}_inv = 1.0;" for op in scaled)
    if p.direct:
        out = p.kernel.out
        write = unscale + ([f"if (gm0 < {M}u && gn0 < {N}u)"] if M % BM or N % BN else []) + \
            ["    " + ops.store("acc[i][jn]", f"b{p.store.ob}", f"{out.offset}u + coff + gm0 * {N}u + gn0", N)]
    else:
        edge = " && ".join(c for c, on in ((f"gm < {M}u", M % BM != 0), (f"gn < {N}u", N % BN != 0)) if on)
        st = f"store_out{p.j}(coff + gm * {N}u + gn, Cs[cs + e]);"
        write = unscale + [ops.store("acc[i][jn]", "Cs", "cs", FRAG)] + ops.sync + [
            f"[[unroll]] for (uint q = 0u; q < {FRAG * FRAG // SUBGROUP}u; ++q) {{",
            f"    uint e = lane + q * {SUBGROUP}u;",
            f"    uint gm = gm0 + e / {FRAG}u, gn = gn0 + e % {FRAG}u;",
            f"    {'if (' + edge + ') ' if edge else ''}{st}", "}"] + ops.sync
    # per K step of 16 the fragments of the side with fewer (WM of A or WN of B) are held
    # while those of the other are loaded one at a time: fewer registers than holding WM
    load_a = ops.load("fa[i]", "As", "abuf + " + a_at, sa, a_row)
    load_b = ops.load("fb[jn]", "Bs", "bbuf + " + b_at, sb, b_row)
    mma = ops.mma("fa[i]", (sa, a_row), "fb[jn]", (sb, b_row), "acc[i][jn]")
    sides = {"A": ("fa", "i", WM, load_a), "B": ("fb", "jn", WN, load_b)}
    hold, other = ("B", "A") if WN < WM else ("A", "B")
    (hf, hv, hn, hload), (of, ov, on, oload) = sides[hold], sides[other]
    one = (f"{of}[{ov}]", f"{of}[0]")           # the other side's fragment, one at a time
    held = [ops.frag_decl(hold, f"{hf}[{hn}]"), f"[[unroll]] for (uint {hv} = 0u; {hv} < {hn}u; ++{hv})",
            "    " + hload, f"[[unroll]] for (uint {ov} = 0u; {ov} < {on}u; ++{ov}) {{",
            "    " + ops.frag_decl(other, f"{of}[1]"), "    " + oload.replace(*one),
            f"    [[unroll]] for (uint {hv} = 0u; {hv} < {hn}u; ++{hv})", "        " + mma.replace(*one), "}"]
    # chunk c: fetch chunk c + DEPTH into the register set chunk c left (stored at the step
    # before), multiply chunk c out of workgroup memory, store chunk c + 1 into the other half,
    # barrier; with three or more chunks ahead the store comes first (chunk c + 1 was fetched
    # two or more steps before). Unrolled by DEPTH, and by 2 when DEPTH > 1, so that each step
    # names its register sets (and its halves of workgroup memory) by constants. H200, 4096^3
    # TFLOP/s (B plain / B transposed), the 128 tile: DEPTH 1 202 / 188, unrolled by 2 191 / 174;
    # DEPTH 2 223 / 194 (210-222 / 184-193 storing first); DEPTH 3 209 / 188 (193 / 193 with the
    # halves indexed by c % 2). The 128 x 256 tile three ahead: 226 / 207, storing first 241 /
    # 201 (four ahead 241-245 / 214-216); storing between multiply and fetch: 179-185
    unroll = 1 if DEPTH == 1 else int(np.lcm(DEPTH, 2))
    half = (lambda r, size: f"(((c + {r}u) % 2u) * {size}u)") if unroll == 1 else \
        (lambda r, size: f"{(r % 2) * size}u")
    steps = []
    for r in range(unroll):
        fetch_next = [f"    if (c + {DEPTH}u < {nch}u) {{", f"        uint k0 = kbeg + (c + {DEPTH}u) * {BK}u;"]
        fetch_next += ["        " + x for x in fetch(r % DEPTH)] + ["    }"]
        multiply = [f"    uint abuf = {half(r, size_a)}, bbuf = {half(r, size_b)};",
                    f"    [[unroll]] for (uint kk = 0u; kk < {BK // FRAG}u; ++kk) {{"]
        multiply += ["        " + x for x in held] + ["    }"]
        store_next = [f"    if (c + 1u < {nch}u) {{", f"        uint base = {half(r + 1, size_a)};"]
        store_next += ["        " + x for x in sets[(r + 1) % DEPTH][0][1]] + [f"        base = {half(r + 1, size_b)};"]
        store_next += ["        " + x for x in sets[(r + 1) % DEPTH][1][1]] + ["    }"]
        body = store_next + fetch_next + multiply if DEPTH > 2 else fetch_next + multiply + store_next
        steps += [f"{{ uint c = c0 + {r}u;", f"if (c < {nch}u) {{"] + body + ["    barrier();", "}}"]
    ahead = []
    for r in range(1, DEPTH):
        ahead += [f"if ({r}u < {nch}u) {{", f"    uint k0 = kbeg + {r * BK}u;"] + ["    " + x for x in fetch(r)] + ["}"]
    # register types and lengths: f32 fetched raw takes two vec4s a group of 8 halves
    a_regs, b_regs = (("vec4", 2) if op.raw else ("uvec4", 1) for op in (p.A, p.B))
    if raw:     # every chunk fetched, then the peaks, then the first chunk stored
        prologue = fetch(0) + ahead + peaks + sets[0][0][1] + ["base = 0u;"] + sets[0][1][1]
    else:
        prologue = fetch(0) + sets[0][0][1] + ["base = 0u;"] + sets[0][1][1] + ahead
    regs = "\n    ".join(f"{a_regs[0]} ra{r}[{a_regs[1] * pa}];\n    {b_regs[0]} rb{r}[{b_regs[1] * pb}];"
                         for r in range(DEPTH))
    return f"""void mm{p.j}(uvec3 wid) {{
    uint t = gl_LocalInvocationIndex;
    {ops.ids}
    uint sy = sg / {SG_N}u, sx = sg % {SG_N}u;
    uint m0 = wid.y * {BM}u, n0 = wid.x * {BN}u;
    uint split = wid.z % {p.S}u;
    uint kbeg = split * {p.KC}u, kend = min(kbeg + {p.KC}u, {p.K}u);
{_ind(bl, 4)}
    uint aoff = {aoff};
    uint boff = {boff};
    uint coff = wid.z * {M * N}u;
    {scale_decl}
{_ind(prepass, 4)}
{_ind(ops.acc_decl(WM, WN), 4)}
    {regs}
    {{
        uint k0 = kbeg, base = 0u;
{_ind(prologue, 8)}
    }}
    barrier();
    // double-buffered chunks in workgroup memory, DEPTH chunks ahead in registers: one
    // barrier per chunk
    for (uint c0 = 0u; c0 < {nch}u; c0 += {unroll}u) {{
{_ind(steps, 8)}
    }}
    uint cs = sg * {FRAG * FRAG}u;
    [[unroll]] for (uint i = 0u; i < {WM}u; ++i) {{
        [[unroll]] for (uint jn = 0u; jn < {WN}u; ++jn) {{
            uint gm0 = m0 + (sy * {WM}u + i) * {FRAG}u, gn0 = n0 + (sx * {WN}u + jn) * {FRAG}u;
{_ind(write, 12)}
        }}
    }}
}}"""
