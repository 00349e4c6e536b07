"""The quantized archetype's byte readers and block decoders (``half_functions``,
``weight_functions``) and its dequantize / embedding kernel, built on the typed kernel AST
(``kernel_ast``): their WGSL is printed from the tree, and the Vulkan backend's GLSL too.
The GEMV and tiled products are in ``quantized_gemv_ast`` and ``quantized_tiled_ast``."""
from __future__ import annotations

from .kernel_ast import (Bitcast, Call, Construct, Convert, ExprStmt, Field, Function, If, Let, Load, Name, Return,
                         ReturnIf, Select)
from .kernel_ast import LID
from .kernel_ast_matmul import (ENTRY_1D, GROUP, F, I, U, add, assign, b_, blank, broken, g, inline, line, module,
                                private, store_function, store_supported, terms, v4, Minus, Wrapped)

# the module's helpers, in the order the module declares them
U32, F32, VEC4 = "u32", "f32", "vec4<f32>"
PAD = " " * len("    return vec4<f32>(")      # the further lines of a decoder's vector


def _p(name, ty=U32):
    return Name(name, ty)


def _byte_of(w, shift):
    """``(w >> shift) & 255u``, ``shift`` a name or a constant."""
    return b_("&", g(b_(">>", w, shift)), U(255))


def half_functions() -> list:
    """The f16 and bit decoders every quantized module declares once: the module items
    (functions, then the private ``qlo``/``qhi`` that ``qgroup`` sets)."""
    h, w, s_, j, sl, sh = (_p(n) for n in ("h", "w", "s", "j", "sl", "sh"))
    e, m, s = _p("e"), _p("m"), _p("s")
    qhalf = Function("qhalf", (h,), (
        Let("e", b_("&", g(b_(">>", h, U(10))), U(31))),
        Let("m", b_("&", h, U(1023))),
        Let("s", b_("<<", g(b_("&", h, U(32768))), U(16))),
        inline(If(b_("==", e, U(0)), (Return(b_("*", b_("*", Select(F("1.0"), Minus(F("1.0")), b_("!=", s, U(0))),
                                                     Convert(F32, m)), F("5.9604644775390625e-08"))),))),
        inline(If(b_("==", e, U(31)), (Return(Bitcast(F32, b_("|", b_("|", s, U(2139095040)), g(b_("<<", m, U(13)))))),))),
        Return(Bitcast(F32, b_("|", b_("|", s, g(b_("<<", g(b_("+", e, U(112))), U(23)))), g(b_("<<", m, U(13)))))),
    ), F32)

    def s8(shift, last=False):
        byte = g(b_(">>", w, U(24))) if last else g(_byte_of(w, U(shift)))
        return Convert(F32, b_("-", Convert("i32", b_("^", byte, U(128))), I(128)))
    qs8 = Function("qs8", (w,), (Return(Wrapped(VEC4, (s8(0), s8(8), s8(16), s8(24, True)), (2, 2), PAD)),), VEC4)

    def bit(x, k):
        return Convert(F32, b_("&", x, U(1)) if k == 0 else b_("&", g(b_(">>", x, U(k))), U(1)))
    qb4 = Function("qb4", (h,), (Return(Construct(VEC4, tuple(bit(h, k) for k in range(4)))),), VEC4)

    def at(base, k):          # ``(base)``, ``(8u + base)`` ...
        return base if k == 0 else g(b_("+", U(8 * k), base))

    def q6c(k):
        lo = b_("&", g(b_(">>", w, at(sl, k))), U(15))
        hi = b_("<<", g(b_("&", g(b_(">>", h, at(sh, k))), U(3))), U(4))
        return Convert(F32, b_("|", g(lo), g(hi)))
    q6 = Function("q6", (w, sl, h, sh), (Return(Wrapped(VEC4, tuple(q6c(k) for k in range(4)), (1, 1, 1, 1), PAD)),), VEC4)

    def field(shift, mask):
        return lambda k: Convert(F32, b_("&", g(b_(">>", w, at(shift, k))), U(mask)))
    qbit = Function("qbit", (w, j), (Return(Wrapped(VEC4, tuple(map(field(j, 1), range(4))), (3, 1), PAD)),), VEC4)
    q2 = Function("q2", (w, s_), (Return(Wrapped(VEC4, tuple(map(field(s_, 3), range(4))), (3, 1), PAD)),), VEC4)
    qn4 = Function("qn4", (w, s_), (Return(Wrapped(VEC4, tuple(map(field(s_, 15), range(4))), (3, 1), PAD)),), VEC4)
    return [qhalf, qs8, qb4, q6, qbit, q2, qn4, private("qlo", VEC4), private("qhi", VEC4)]


def _call(name, *args, ty=U32):
    return Call(name, tuple(args), ty)


def weight_functions(qtype, k, wb, nwords, sfx="") -> list:
    """``qword{sfx}``, ``qbyte{sfx}``, ``qscale{sfx}`` and
    ``qgroup{sfx}(n, g)`` of one weight (binding ``wb`` of ``nwords`` words, rows of ``k``)."""
    from ..ops.quantized import QTYPES, row_bytes
    rb = row_bytes(qtype, k)
    p, i, s = _p("p"), _p("i"), _p("s")
    word = lambda at: Load(wb, at, U32)        # noqa: E731
    qword, qbyte, qscale, qgroup = (f"{x}{sfx}" for x in ("qword", "qbyte", "qscale", "qgroup"))
    fns = [
        Function(qword, (p,), (
            Let("i", b_(">>", p, U(2))),
            Let("s", b_("*", g(b_("&", p, U(3))), U(8))),
            inline(If(b_("==", s, U(0)), (Return(word(i)),))),
            Return(b_("|", g(b_(">>", word(i), s)),
                       g(b_("<<", word(Call("min", (add(i, U(1)), U(nwords - 1)), U32)), g(b_("-", U(32), s)))))),
        ), U32),
        Function(qbyte, (p,), (Return(b_("&", g(b_(">>", word(b_(">>", p, U(2))),
                                                               g(b_("*", g(b_("&", p, U(3))), U(8))))), U(255))),), U32),
        Function(qscale, (p,), (Return(_call("qhalf", b_("&", g(b_(">>", word(b_(">>", p, U(2))),
                                                                            g(b_("*", g(b_("&", p, U(2))), U(8))))),
                                                                  U(65535)), ty=F32)),), F32),
    ]
    bs, nb = QTYPES[qtype]
    n, gi, base = _p("n"), _p("g"), _p("base")
    body = [Let("base", add(b_("*", n, U(rb)), b_("*", g(b_("/", gi, U(bs // 8))), U(nb))))]
    qw = lambda at: _call(qword, at)                    # noqa: E731
    qb = lambda at: _call(qbyte, at)                    # noqa: E731
    qs = lambda at: _call(qscale, at, ty=F32)           # noqa: E731
    vf = lambda text: v4(F(text))                       # noqa: E731  vec4<f32>(4.0)
    fn4 = lambda name, *a: _call(name, *a, ty=VEC4)    # noqa: E731
    if qtype == "Q8_0":
        d, pp = Name("d", F32), _p("p")
        body += [Let("d", qs(base)),
                 Let("p", add(base, U(2), b_("*", g(b_("%", gi, U(4))), U(8)))),
                 assign("qlo", b_("*", d, fn4("qs8", qw(pp)))),
                 assign("qhi", b_("*", d, fn4("qs8", qw(add(pp, U(4))))))]
    elif qtype in ("Q4_0", "Q4_1", "Q5_0", "Q5_1"):
        five, ofs = qtype[1] == "5", 2 if qtype[3] == "0" else 4
        d, pp, hh = Name("d", F32), _p("p"), _p("h")

        def q(off, shift):
            e = fn4("qn4", qw(pp if off is None else add(pp, U(off))), s)
            if five:
                e = b_("+", e, b_("*", F("16.0"), fn4("qb4", hh if shift is None else b_(">>", hh, U(shift)))))
            return g(e)
        qs_ = [q(None, None), q(4, 4)]
        if ofs == 2:
            off = "8.0" if qtype == "Q4_0" else "16.0"
            vals = [b_("*", d, g(b_("-", x, vf(off)))) for x in qs_]
        else:
            vals = [b_("+", b_("*", d, x), v4(qs(add(base, U(2))))) for x in qs_]
        body += [Let("d", qs(base)),
                 Let("h", b_("&", g(b_(">>", qw(add(base, U(ofs))), g(b_("*", g(b_("%", gi, U(4))), U(8))))), U(255)))
                 if five else blank(),
                 Let("p", add(base, U(ofs + 4 * five), b_("*", g(b_("%", gi, U(2))), U(8)))),
                 Let("s", b_("*", g(b_("%", g(b_("/", gi, U(2))), U(2))), U(4))),
                 assign("qlo", vals[0]), assign("qhi", vals[1])]
    elif qtype == "Q6_K":
        e, r, ds, pl, ph, sl, sh = (_p(x) for x in ("e", "r", "ds", "pl", "ph", "sl", "sh"))
        ds = Name("ds", F32)
        byte = qb(add(base, U(192), b_("/", e, U(16))))
        body += [Let("e", b_("*", g(b_("%", gi, U(32))), U(8))),
                 Let("r", b_("%", e, U(128))),
                 Let("ds", b_("*", qs(add(base, U(208))),
                              Convert(F32, b_("-", Convert("i32", b_("^", byte, U(128))), I(128))))),
                 Let("pl", add(base, b_("*", g(b_("/", e, U(128))), U(64)), b_("%", r, U(64)))),
                 Let("ph", add(base, U(128), b_("*", g(b_("/", e, U(128))), U(32)), b_("%", r, U(32)))),
                 Let("sl", b_("*", g(b_("/", r, U(64))), U(4))),
                 Let("sh", b_("*", g(b_("/", r, U(32))), U(2)))]
        for name, a in (("qlo", 0), ("qhi", 4)):
            at = (lambda x: x) if a == 0 else (lambda x: add(x, U(4)))
            six = fn4("q6", qw(at(pl)), sl, qw(at(ph)), sh)
            body.append(assign(name, b_("*", ds, g(b_("-", six, vf("32.0"))))))
    elif qtype == "Q2_K":
        e, sc, pp, s2 = _p("e"), _p("sc"), _p("p"), _p("s")
        dw, dl, ml = _p("dw"), Name("dl", F32), Name("ml", F32)
        body += [Let("e", b_("*", g(b_("%", gi, U(32))), U(8))),
                 Let("dw", word(b_(">>", g(add(base, U(80))), U(2)))),
                 Let("sc", qb(add(base, b_("/", e, U(16))))),
                 Let("dl", b_("*", _call("qhalf", b_("&", dw, U(65535)), ty=F32), Convert(F32, b_("&", sc, U(15))))),
                 Let("ml", b_("*", _call("qhalf", b_(">>", dw, U(16)), ty=F32), Convert(F32, b_(">>", sc, U(4))))),
                 Let("p", b_(">>", g(add(base, U(16), b_("*", g(b_("/", e, U(128))), U(32)), b_("%", e, U(32)))), U(2))),
                 Let("s", b_("*", g(b_("/", g(b_("%", e, U(128))), U(32))), U(2))),
                 assign("qlo", b_("-", b_("*", dl, fn4("q2", word(pp), s2)), v4(ml))),
                 assign("qhi", b_("-", b_("*", dl, fn4("q2", word(add(pp, U(1))), s2)), v4(ml)))]
    elif qtype == "Q3_K":
        e, si, sc, pp, u = _p("e"), _p("si"), _p("sc"), _p("p"), _p("u")
        ds = Name("ds", F32)
        lo = b_("&", g(b_(">>", qb(add(base, U(96), b_("%", si, U(8)))), g(b_("*", g(b_("/", si, U(8))), U(4))))), U(15))
        hi = b_("<<", g(b_("&", g(b_(">>", qb(add(base, U(104), b_("%", si, U(4)))),
                                      g(b_("*", g(b_("/", si, U(4))), U(2))))), U(3))), U(4))
        body += [Let("e", b_("*", g(b_("%", gi, U(32))), U(8))),
                 Let("si", b_("/", e, U(16))),
                 Let("sc", broken(b_("|", g(lo), g(hi)))),
                 Let("ds", b_("*", qs(add(base, U(108))), Convert(F32, b_("-", Convert("i32", sc), I(32))))),
                 Let("p", add(base, U(32), b_("*", g(b_("/", e, U(128))), U(32)), b_("%", e, U(32)))),
                 Let("s", b_("*", g(b_("/", g(b_("%", e, U(128))), U(32))), U(2))),
                 Let("u", b_("/", e, U(32)))]
        for name, a in (("qlo", None), ("qhi", 4)):
            pa = pp if a is None else add(pp, U(4))
            hb = add(base, b_("%", e, U(32))) if a is None else add(base, b_("%", e, U(32)), U(4))
            val = b_("-", b_("+", fn4("q2", qw(pa), s), b_("*", F("4.0"), fn4("qbit", qw(hb), u))), vf("4.0"))
            body.append(assign(name, b_("*", ds, g(val))))
    else:   # Q4_K, Q5_K
        five = qtype == "Q5_K"
        j, dw, hi, lo, sc, mn, pp, ph, s2 = (_p(x) for x in ("j", "dw", "hi", "lo", "sc", "mn", "p", "ph", "s"))
        d, dmin, ds, dm = (Name(x, F32) for x in ("d", "dmin", "ds", "dm"))
        body += [Let("j", b_("%", g(b_("/", gi, U(4))), U(8))),
                 Let("dw", word(b_(">>", base, U(2)))),
                 Let("d", _call("qhalf", b_("&", dw, U(65535)), ty=F32)),
                 Let("dmin", _call("qhalf", b_(">>", dw, U(16)), ty=F32)),
                 Let("hi", qb(add(base, U(8), j))),
                 Let("lo", qb(add(base, U(4), j))),
                 Let("sc", Select(b_("|", g(b_("&", hi, U(15))), g(b_("<<", g(b_(">>", qb(add(base, j)), U(6))), U(4)))),
                                  b_("&", lo, U(63)), b_("<", j, U(4)))),
                 Let("mn", Select(b_("|", g(b_(">>", hi, U(4))), g(b_("<<", g(b_(">>", lo, U(6))), U(4)))),
                                  b_("&", hi, U(63)), b_("<", j, U(4)))),
                 Let("ds", b_("*", d, Convert(F32, sc))),
                 Let("dm", b_("*", dmin, Convert(F32, mn))),
                 Let("p", b_(">>", g(add(base, U(48 if five else 16), b_("*", g(b_("/", j, U(2))), U(32)),
                                         b_("*", g(b_("%", gi, U(4))), U(8)))), U(2))),
                 Let("ph", b_(">>", g(add(base, U(16), b_("*", g(b_("%", gi, U(4))), U(8)))), U(2))),
                 Let("s", b_("*", g(b_("%", j, U(2))), U(4)))]
        for name, a in (("qlo", None), ("qhi", 1)):
            at = (lambda x: x) if a is None else (lambda x: add(x, U(1)))
            q = fn4("qn4", word(at(pp)), s2)
            if five:
                q = b_("+", q, b_("*", F("16.0"), fn4("qbit", word(at(ph)), j)))
            body.append(assign(name, b_("-", b_("*", ds, g(q)), v4(dm))))
    fns.append(Function(qgroup, (n, gi), tuple(body)))
    return fns


def x_loads(b, xv, K):
    """``xvec(row, col)``: the vec4 of x (view ``xv``, rows of K) at (row, col .. col + 3), col
    a multiple of 4: one vec4 load where the view starts on a vec4, else 4 scalar loads."""
    vec = xv.offset % 4 == 0
    xb = b.slot(xv.buf, "vec4<f32>") if vec else b.index(xv.buf, xv.dtype)

    def xvec(row, col):
        if vec:
            return Load(xb, add(U(xv.offset // 4), b_("*", row, U(K // 4)), b_("/", g(col), U(4))), VEC4)
        at = add(U(xv.offset), b_("*", row, U(K)), *terms(col))
        return v4(*(Load(xb, add(at, U(i)), F32) for i in range(4)))
    return xvec


def store_calls(name, f, lo, hi):
    """``store_out(f, qlo.x); ... store_out(f + 7u, qhi.w);`` on two lines."""
    def call(k, v, c):
        return ExprStmt(Call(name, (f if k == 0 else add(f, U(k)), Field(v, c, F32)), "void"))
    return [line(*(call(4 * h + j, v, c) for j, c in enumerate("xyzw"))) for h, v in enumerate((lo, hi))]


def dequant_kernel(kernel):
    """(tree, bound buffers, workgroups) of the ``dequant`` / ``embed`` kernels of
    ``quantized.render``, or None where the output store is not on the tree."""
    from .common import Bindings, grid
    s = kernel.spec
    qtype, N, K = s["qtype"], s["n"], s["k"]
    if not store_supported(kernel):
        return None
    b = Bindings()
    store = store_function(kernel, b)
    wv = kernel.reads[-1]
    wb = b.index(wv.buf, wv.dtype)
    if wv.offset:
        raise NotImplementedError("quantized kernels read their weight from the start of its buffer")
    items = store + half_functions() + weight_functions(qtype, K, wb, wv.size)
    G = K // 8
    rows = N if s["mode"] == "dequant" else kernel.reads[0].size
    total = rows * G
    t, n, gi, ident = _p("t"), _p("n"), _p("g"), Name("id", "i32")
    qlo, qhi = Name("qlo", VEC4), Name("qhi", VEC4)
    body = [Let("t", add(b_("*", GROUP, U(256)), LID)),
            ReturnIf(b_(">=", t, U(total))),
            Let("n", b_("/", t, U(G))),
            Let("g", b_("%", t, U(G)))]
    pick = ExprStmt(Call("qgroup", (n, gi), "void"))
    if s["mode"] == "embed":
        iv = kernel.reads[0]
        ib = b.index(iv.buf, iv.dtype)
        raw = Load(ib, add(U(iv.offset), n), iv.dtype.name)
        body += [Let("id", raw if iv.dtype.name == "i32" else Convert("i32", raw)),
                 assign("qlo", v4(F("0.0"))), assign("qhi", v4(F("0.0"))),
                 inline(If(b_("&&", b_(">=", ident, I(0)), b_("<", ident, I(N))),
                           (ExprStmt(Call("qgroup", (Convert(U32, ident), gi), "void")),)))]
    else:
        body.append(pick)
    f = _p("f")
    body += [Let("f", add(b_("*", n, U(K)), b_("*", gi, U(8))))] + store_calls("store_out", f, qlo, hi=qhi)
    tree = module(b, items, 256, body, ENTRY_1D)
    return tree, b.bufs, grid(-(-total // 256))
