"""How the tiled cooperative-matrix kernel (``coopmat``) fetches its operands: per operand
(``_Operand``) the GLSL lines that fetch a chunk into registers (uvec4 of 8 halves, element
by element where not aligned, or computed as im2col columns) and store it to workgroup
memory, f32 operands rounded to f16 by a scale from their peak, and batch offsets."""
from __future__ import annotations

from dataclasses import dataclass

from .common import batch_offset_terms


@dataclass
class _Operand:
    """One operand as staged: ``rows_own`` when its staged rows run along its own dimension
    (M for A, N for B; K is then contiguous), else along K."""
    view: object
    binding: int
    rows_own: bool
    own: int          # M or N
    own_tile: int     # BM or BN
    K: int
    own0: str         # the tile's first row (m0) or column (n0)
    chk_own: bool
    chk_k: bool
    vec: bool = False
    load_offset: int = 0  # an operand computed in the loads: its view's offset in the gather's output
    conv: tuple = ()  # an im2col computed in the loads: (geometry, input binding, input view)
    scale: str = ""   # an f32 operand rounded to f16 (``matmul_ast.round_f16_functions``): the GLSL name of its scale
    raw: bool = False  # (scaled) fetched as f32 (two vec4 a group of 8), converted as it is stored

    def tile(self, BK):
        """(rows, columns) of the staged chunk."""
        return (self.own_tile, BK) if self.rows_own else (BK, self.own_tile)

    def stride(self, BK):
        """uvec4 per staged row, padded."""
        return self.tile(BK)[1] // 8 + 1

    def size(self, BK):
        return self.tile(BK)[0] * self.stride(BK)

    def walk(self, BK, NT):
        """How ``NT`` threads walk a staged chunk, in groups of 8 along its rows: (groups in a
        chunk, groups a thread, the GLSL of the first row and column, of the rows' and
        columns' ends, the stored row length, the view's last element)."""
        R, C = self.tile(BK)
        total = R * (C // 8)
        row0, col0 = (self.own0, "k0") if self.rows_own else ("k0", self.own0)
        row_ext, col_ext = (f"{self.own}u", "kend") if self.rows_own else ("kend", f"{self.own}u")
        ld = self.K if self.rows_own else self.own
        return total, -(-total // NT), row0, col0, row_ext, col_ext, ld, self.view.offset + self.view.size - 1

    def vectorizable(self):
        return not self.conv and (self.K if self.rows_own else self.own) % 8 == 0 and self.view.offset % 8 == 0


def _ind(lines, n):
    return "\n".join(" " * n + ln for ln in lines)


def _fetch_store(op: _Operand, BK, NT, reg, off, shared):
    """GLSL fetching this thread's share of the chunk at ``k0`` into ``reg[]`` and storing it
    into ``shared`` at ``base``; and the register array's length."""
    CQ, SX = op.tile(BK)[1] // 8, op.stride(BK)
    total, per, row0, col0, row_ext, col_ext, ld, last = op.walk(BK, NT)
    guard = total % NT != 0
    chk_row, chk_col = (op.chk_own, op.chk_k) if op.rows_own else (op.chk_k, op.chk_own)
    b = f"b{op.binding}"
    idx = [f"uint v = t + l * {NT}u;", f"uint r = v / {CQ}u, q = v % {CQ}u;",
           f"uint gr = {row0} + r, gc = {col0} + q * 8u;"]
    # whole groups of 8 in or out along the contiguous dimension (a vec4 binding)
    vec_conds = [c for c, on in ((f"gr < {row_ext}", chk_row), (f"gc < {col_ext}", chk_col)) if on]
    if op.conv:
        body = _im2col_fetch(op, reg, off, ld, [(f"gr < {row_ext}", chk_row)], (col_ext, chk_col))
    elif op.vec and op.scale:      # two vec4s of f32, scaled and packed (or kept: ``raw``)
        body = [f"uint a4 = ({off} + gr * {ld}u + gc) / 4u;"]
        for name, shift in (("lo", ""), ("hi", " + 1u")):
            load = f"{b}[min(a4{shift}, {last // 4}u)]" if vec_conds else f"{b}[a4{shift}]"
            load = f"({' && '.join(vec_conds)}) ? {load} : vec4(0.0)" if vec_conds else load
            body.append(f"vec4 {name} = {load};" if op.raw else f"vec4 {name} = ({load}) * {op.scale};")
        body.append(f"{reg}[2u * l] = lo; {reg}[2u * l + 1u] = hi;" if op.raw else
                    f"{reg}[l] = {_pack_f16('lo', 'hi')};")
    elif op.vec:
        at = f"({off} + gr * {ld}u + gc) / 8u"
        if vec_conds:
            load = f"({' && '.join(vec_conds)}) ? {b}[min({at}, {last // 8}u)] : uvec4(0u)"
        else:
            load = f"{b}[{at}]"
        body = [f"{reg}[l] = {load};"]
    else:
        body = [f"uint e = {off} + gr * {ld}u + gc;", f"{'float' if op.raw else 'float16_t'} h[8];"]
        for i in range(8):
            conds = [c for c, on in ((f"gr < {row_ext}", chk_row), (f"gc + {i}u < {col_ext}", chk_col)) if on]
            value = f"{b}[min(e + {i}u, {last}u)]" if conds else f"{b}[e + {i}u]"
            if op.scale and not op.raw:
                value = f"float16_t({value} * {op.scale})"
            zero = "0.0" if op.raw else "float16_t(0.0)"
            body.append(f"h[{i}] = ({' && '.join(conds)}) ? {value} : {zero};" if conds else f"h[{i}] = {value};")
        if op.raw:
            body.append(f"{reg}[2u * l] = vec4(h[0], h[1], h[2], h[3]); {reg}[2u * l + 1u] = vec4(h[4], h[5], h[6], h[7]);")
        else:
            body.append(f"{reg}[l] = uvec4(" + ", ".join(f"packFloat2x16(f16vec2(h[{2 * i}], h[{2 * i + 1}]))"
                                                         for i in range(4)) + ");")
    wrap = (lambda ls: [f"if (v < {total}u) {{"] + ["    " + x for x in ls] + ["}"]) if guard else (lambda ls: ls)
    head = [f"[[unroll]] for (uint l = 0u; l < {per}u; ++l) {{"]
    fetch = head + ["    " + x for x in idx[:1] + wrap(idx[1:] + body)] + ["}"]
    value = _pack_f16(f"{reg}[2u * l] * {op.scale}", f"{reg}[2u * l + 1u] * {op.scale}") if op.raw else f"{reg}[l]"
    store = head + ["    " + x for x in idx[:1] + wrap([idx[1], f"{shared}[base + r * {SX}u + q] = {value};"])] + ["}"]
    return fetch, store, per


def _scale_from_peak(op: _Operand, ops, NT) -> list:
    """The end of ``_scale_lines``' block: this thread's peak ``pk`` taken over the workgroup,
    and the power of two from it."""
    lines = ["    " + x for x in ops.workgroup_max("pk", NT)]
    return lines + ["    int ex;", "    frexp(pk, ex);", "    ex = clamp(ex, -100, 113);",
                    f"    {op.scale} = ldexp(1.0, 14 - ex);", f"    {op.scale}_inv = ldexp(1.0, ex - 14);", "}"]


def _pack_f16(lo, hi) -> str:
    """GLSL packing two vec4s (8 floats) into a uvec4 of halves."""
    return (f"uvec4(packFloat2x16(f16vec2(({lo}).xy)), packFloat2x16(f16vec2(({lo}).zw)), "
            f"packFloat2x16(f16vec2(({hi}).xy)), packFloat2x16(f16vec2(({hi}).zw)))")


def _raw_peak_lines(op: _Operand, ops, BK, NT, sets, regs) -> list:
    """GLSL setting ``op.scale`` (as ``_scale_lines``) from the raw f32 chunks already in this
    thread's registers ``regs`` (one array per register set): the whole split fetched ahead,
    so nothing is read twice."""
    total, per = op.walk(BK, NT)[:2]
    lines = ["{", "    vec4 m = vec4(0.0);"]
    for reg in regs[:sets]:
        lines.append(f"    [[unroll]] for (uint l = 0u; l < {per}u; ++l)")
        cond = f"if (t + l * {NT}u < {total}u) " if total % NT else ""
        lines.append(f"        {cond}m = max(m, max(abs({reg}[2u * l]), abs({reg}[2u * l + 1u])));")
    return lines + ["    float pk = max(max(m.x, m.y), max(m.z, m.w));"] + _scale_from_peak(op, ops, NT)


def _im2col_fetch(op: _Operand, reg, off, ld, row_conds, col_check):
    """GLSL packing the 8 elements of the virtual im2col matrix at flat index ``e`` on:
    consecutive columns (output positions) of one row (a channel and kernel offset), so the
    row's coordinates are computed once and the position advances without a division (a
    function of the flat index divides per element, which left the tensor cores idle).
    ``gr`` indexes the operand's rows along the matrix's rows in both layouts (A of a
    convolution's weight gradient reads it transposed). The matrix is (N, C*kh*kw, L), or
    with ``fold_batch`` (C*kh*kw, N*L), where the positions run on into the next image."""
    geo, xb, x = op.conv
    n, c, h, w = geo["nchw"]
    kh, kw = geo["kernel"]
    (sh, sw), (dh, dw), (top, left), wo = geo["stride"], geo["dilation"], geo["pad"], geo["wo"]
    fold = geo.get("fold_batch", False)
    cols = op.view.shape[-1]          # L, or N * L folded
    L = cols // n if fold else cols
    rows = op.view.size // cols       # rows of the matrix over its batch
    ck = c * kh * kw
    last = x.offset + x.size - 1
    col_ext, chk_col = col_check
    lines = [f"uint fi = {off} + gr * {ld}u + gc - {op.load_offset}u;",
             f"uint row = min(fi / {cols}u, {rows - 1}u), col = fi % {cols}u;"]
    if fold:
        lines += [f"uint ch = row, xbase = {x.offset}u + (col / {L}u * {c}u + ch / {kh * kw}u) * {h * w}u;",
                  f"col = col % {L}u;"]
    else:
        lines.append(f"uint ch = row % {ck}u, xbase = {x.offset}u + (row / {ck}u * {c}u + ch / {kh * kw}u) * {h * w}u;")
    plain = not fold and (kh, kw, sh, sw, top, left) == (1, 1, 1, 1, 0, 0)
    if plain:                         # a 1x1 convolution: the row of x itself
        lines.append("xbase += col;")
    else:
        lines += [f"uint kr = ch % {kh * kw}u;",
                  f"int y0 = int(kr / {kw}u) * {dh} - {top}, x0 = int(kr % {kw}u) * {dw} - {left};",
                  f"uint oy = col / {wo}u, ox = col % {wo}u;"]
    step = f"ox += 1u; if (ox == {wo}u) {{ ox = 0u; oy += 1u;" + \
        (f" if (oy == {L // wo}u) {{ oy = 0u; xbase += {c * h * w}u; }}" if fold else "") + " }"
    lines.append("float16_t h[8];")
    fill = f"float16_t({float(geo['fill'])!r})"
    for i in range(8):
        conds = [cnd for cnd, on in row_conds if on] + ([f"gc + {i}u < {col_ext}"] if chk_col else [])
        if plain:
            value = f"float16_t(b{xb}[min(xbase + {i}u, {last}u)])"
        else:
            value = f"(y >= 0 && y < {h} && xx >= 0 && xx < {w}) ? float16_t(b{xb}[min(xbase + uint(y * {w} + xx), {last}u)]) : {fill}"
            lines.append(f"{{ int y = int(oy) * {sh} + y0, xx = int(ox) * {sw} + x0;")
        lines.append(f"h[{i}] = ({' && '.join(conds)}) ? {value} : float16_t(0.0);" if conds else f"h[{i}] = {value};")
        if not plain:
            lines[-1] = "  " + lines[-1]
            lines.append(f"  {step} }}" if i < 7 else "}")
    lines.append(f"{reg}[l] = uvec4(" + ", ".join(f"packFloat2x16(f16vec2(h[{2 * i}], h[{2 * i + 1}]))"
                                                for i in range(4)) + ");")
    return lines


def _batch_offsets(a, b, batch, index):
    """GLSL lines splitting the batch ``index`` into coordinates, and each operand's element
    offset (``common.batch_offset_terms``, as the WGSL kernels' ``kernel_ast_matmul.batch_offsets``)."""
    dims, aoff, boff = batch_offset_terms(a, b, batch)
    lines = [f"uint br = {index};"] + [f"uint z{d} = br % {n}u; br = br / {n}u;" for d, n in dims]
    return lines, " + ".join(aoff), " + ".join(boff)
