"""The GLSL renderer: every archetype's kernel text in GLSL 4.50 for glslang (the direct
Vulkan backend), from the same kernel IR as the WGSL renderers.

The archetype renderers write their kernels in a small, regular subset of WGSL (module
bindings, workgroup arrays, functions, ``let``/``var``, ``if``/``for``, scalar and vec4
maths). This module parses that subset, types every expression, and prints GLSL, so one
renderer per archetype serves both languages and a new archetype gets GLSL for free. What
the printer must decide:

- workgroup (``shared``) arrays are not zero-initialised as WGSL's are: the renderers write
  them before reading (the tests run every kernel on both runtimes);
- declarations carry types in GLSL: every ``let``/``var`` gets the type of its value, and
  WGSL's abstract literals take the type of the operand they meet (``x + 1`` on a u32 is
  ``x + 1u``; ``2.0`` beside an f16 is an f16 literal);
- WGSL zero-initialises variables, GLSL does not: local declarations without a value are
  initialised explicitly;
- functions may be used before their definition in WGSL: prototypes come first, module
  variables are hoisted above every function;
- spellings: ``select`` is ``?:``, ``bitcast`` names the conversion, ``round`` is
  ``roundEven``, float ``%`` is a truncated remainder, ``workgroupBarrier`` is ``barrier``.

Anything outside the subset raises ``GlslTranslationError`` naming the construct and the
line, so a renderer that starts emitting something new fails loudly in the tests that
render every archetype in both languages.

The subset's tokens, types, typed values and GLSL spelling tables are in ``glsl_lex``
(standard library only, as this module: the translation workers load the two as a package
of their own, ``compilation.translators``).
"""
from __future__ import annotations

import itertools
import re
from dataclasses import dataclass

from .glsl_lex import (_SCAN_MARKS, _TEXT, AFLOAT, AINT, BOOL, CLOSE_ANGLE, COMPARE, F32, I32, PRECEDENCE, RENAMED, S,
                       SAME_TYPE_BUILTINS, SCALARS, TEMPLATED, U32, VEC_COMPARE, Fn, GlslTranslationError, Tok, Ty, Val,
                       _ident, _is_float, _literal, _tokenize_text, clear_caches, concrete, convert, glsl_type, make_ty,
                       token_line, tokenize, unify)
from .glsl_target import IEEE_PRESERVE, unroll_switch

__all__ = ["GlslLibrary", "GlslTranslationError", "IEEE_PRESERVE", "_tokenize_text", "clear_caches", "to_glsl",
           "to_glsl_library",
           "tokenize", "unroll_switch"]


# IEEE_PRESERVE (the float-controls header) and unroll_switch (MEGANEURA_GLSL_UNROLL) are the
# kernel AST printer's too: ``glsl_target``


_SHORT_LOOP = re.compile(r"^\(*\w+ < (\d+)u?\)*$")


def _short_loop(cond: str) -> bool:
    m = _SHORT_LOOP.match(cond.strip())
    return m is not None and int(m.group(1)) <= 32


class _Translator:
    def __init__(self, src: str, name: str, unroll: bool = False, preserve_ieee: bool = True):
        self.unroll, self.preserve_ieee = unroll, preserve_ieee
        self.src, self.toks, self.splits = src, tokenize(src), []
        self.i = 0
        self.name = name
        self.globals: dict[str, Ty] = {}
        self.fns: dict[str, Fn] = {}
        self.scopes: list[dict[str, Ty]] = []
        self.uses_f16 = False
        self.unrolled = False
        self.tmp = 0

    # --------------------------------------------------------------- token helpers
    @property
    def tok(self) -> Tok:
        return self.toks[self.i]

    def peek(self, k=1) -> Tok:
        return self.toks[min(self.i + k, len(self.toks) - 1)]

    def fail(self, what):
        t = self.tok
        # a split ">>" added one token before each later one
        index = self.i - sum(1 for k in self.splits if k < self.i)
        raise GlslTranslationError(f"{self.name}: line {token_line(self.src, index)}: {what} (at {t.text!r})")

    def eat(self, text=None, kind=None) -> Tok:
        t = self.toks[self.i]
        if (text is not None and t.text != text) or (kind is not None and t.kind != kind):
            self.fail(f"expected {text or kind}")
        self.i += 1
        return t

    def accept(self, text) -> bool:
        if self.toks[self.i].text == text and text:      # the eof token's text is ""
            self.i += 1
            return True
        return False

    # ----------------------------------------------------------------------- types
    def parse_type(self) -> Ty:
        name = self.eat(kind="id").text
        if name in SCALARS:
            if name == "f16":
                self.uses_f16 = True
            return S(name)
        if name in ("vec2", "vec3", "vec4"):
            self.eat("<")
            el = self.parse_type()
            self.eat_close_angle()
            return make_ty("vec", el.elem, int(name[-1]))
        if name == "binding_array":     # binding_array<array<T>, N>
            self.eat("<")
            el = self.parse_type()
            self.eat(",")
            n = int(self.eat(kind="num").text.rstrip("iu"))
            self.eat_close_angle()
            if el.kind != "array" or el.n is not None:
                self.fail(f"binding_array of {el} (runtime-sized arrays only)")
            return make_ty("barray", el, n)
        if name == "array":
            self.eat("<")
            el = self.parse_type()
            n = None
            if self.accept(","):
                n = int(self.eat(kind="num").text.rstrip("iu"))
            self.eat_close_angle()
            return make_ty("array", el, n)
        self.fail(f"type {name!r} outside the subset")

    def eat_close_angle(self):
        if self.tok.text == ">>":     # array<vec4<f32>> closes two templates at once
            self.toks[self.i:self.i + 1] = [CLOSE_ANGLE, CLOSE_ANGLE]
            # splits recorded further on (during the signature scan) moved with the insertion
            self.splits = [k + 1 if k > self.i else k for k in self.splits] + [self.i]
        self.eat(">")

    # ----------------------------------------------------------------- scopes
    def lookup(self, name) -> Ty:
        for sc in reversed(self.scopes):
            if name in sc:
                return sc[name]
        if name in self.globals:
            return self.globals[name]
        self.fail(f"unknown identifier {name!r}")

    def declare(self, name, ty):
        self.scopes[-1][name] = ty

    # ------------------------------------------------------------------ expressions
    def expr(self, level=0) -> Val:
        """Precedence climbing over ``BINARY`` (lowest first): operators of ``level`` and up."""
        left = self.unary()
        while True:
            t = self.toks[self.i]
            prec = PRECEDENCE.get(t.text) if t.kind == "op" else None
            if prec is None or prec < level:
                return left
            self.i += 1
            left = self.binary(t.text, left, self.expr(prec + 1))

    def binary(self, op, a: Val, b: Val) -> Val:
        if op in ("&&", "||"):
            return Val(f"({a.text} {op} {b.text})", BOOL)
        if op in ("<<", ">>"):
            a = convert(a, I32) if a.ty.abstract else a
            b = convert(b, U32) if b.ty.abstract else b
            return Val(f"({a.text} {op} {b.text})", a.ty)
        if a.ty.abstract and b.ty.abstract:
            # constant folding of abstract operands stays abstract (WGSL semantics): keep text
            ty = AFLOAT if AFLOAT in (a.ty, b.ty) else AINT
            text = f"({a.text} {op} {b.text})"
            # no digits to suffix: a later conversion wraps the whole expression
            return Val(text, ty) if op not in COMPARE else Val(text, BOOL)
        a, b = unify(a, b)
        if op in COMPARE and a.ty.kind == "vec":
            # WGSL compares vectors componentwise; GLSL's == on vectors is one bool
            return Val(f"{VEC_COMPARE[op]}({a.text}, {b.text})", make_ty("vec", "bool", a.ty.n))
        if op in COMPARE:
            return Val(f"({a.text} {op} {b.text})", BOOL)
        ty = a.ty if a.ty.kind == "vec" else b.ty
        if op == "%" and _is_float(ty):
            # WGSL's float remainder truncates (C fmod); GLSL's mod floors
            return Val(f"({a.text} - {b.text} * trunc({a.text} / {b.text}))", ty)
        if op == "%" and ty.scalar == "i32":
            # WGSL's signed remainder takes the dividend's sign; GLSL's % leaves negatives to the driver
            return Val(f"({a.text} - {b.text} * ({a.text} / {b.text}))", ty)
        return Val(f"({a.text} {op} {b.text})", ty)

    def unary(self) -> Val:
        if self.toks[self.i].text in ("-", "!", "~"):
            op = self.eat().text
            v = self.unary()
            if op == "-" and v.lit is not None:
                return Val(f"(-{v.text})", v.ty, "-" + v.lit)
            return Val(f"({op}{v.text})", BOOL if op == "!" else v.ty)
        v = self.primary()
        return self.postfix(v) if self.toks[self.i].text in ("[", ".") else v

    def postfix(self, v: Val) -> Val:
        while True:
            nxt = self.toks[self.i].text
            if nxt == "[":
                self.i += 1
                idx = self.expr()
                self.eat("]")
                if v.ty.kind == "barray":      # one buffer of the array: its block's member
                    v = Val(f"{v.text}[{convert(idx, U32).text if idx.ty.abstract else idx.text}].d", v.ty.elem)
                    continue
                if v.ty.kind == "array":
                    ty = v.ty.elem
                elif v.ty.kind == "vec":
                    ty = S(v.ty.elem)
                else:
                    self.fail(f"indexing a {v.ty}")
                v = Val(f"{v.text}[{convert(idx, U32).text if idx.ty.abstract else idx.text}]", ty)
            elif nxt == ".":
                self.i += 1
                sw = self.eat(kind="id").text
                if v.ty.kind != "vec" or not set(sw) <= set("xyzwrgba"):
                    self.fail(f"member .{sw} of {v.ty}")
                v = Val(f"{v.text}.{sw}", S(v.ty.elem) if len(sw) == 1 else make_ty("vec", v.ty.elem, len(sw)))
            else:
                return v

    def args(self) -> list[Val]:
        self.eat("(")
        out = []
        while not self.accept(")"):
            out.append(self.expr())
            if not self.accept(","):
                self.eat(")")
                break
        return out

    def primary(self) -> Val:
        t = self.toks[self.i]
        if t.kind == "num":
            self.i += 1
            return _literal(t.text)
        if t.text == "(":
            self.i += 1
            v = self.expr()
            self.eat(")")
            return Val(f"({v.text})", v.ty, v.lit)
        if t.kind != "id":
            self.fail("expression expected")
        name = t.text
        if name in ("true", "false"):
            self.i += 1
            return Val(name, BOOL)
        if name in TEMPLATED or name in SCALARS:
            return self.construct()
        if self.toks[self.i + 1].text == "(":       # an id is never the last token (eof is)
            self.i += 1
            return self.call(name, self.args())
        self.i += 1
        return Val(_ident(name), self.lookup(name))

    def construct(self) -> Val:
        """Type constructors and conversions: ``f32(x)``, ``vec4<f32>(..)``, ``bitcast<T>(x)``."""
        if self.tok.text == "bitcast":
            self.i += 1
            self.eat("<")
            to = self.parse_type()
            self.eat_close_angle()
            (x,) = self.args()
            x = convert(x, U32 if x.ty.elem == "aint" else x.ty)
            return Val(self.bitcast(x, to), to)
        ty = self.parse_type()
        args = self.args()
        if ty.kind == "scalar":
            (x,) = args                        # (parse_type noted an f16)
            if x.ty.abstract:
                return convert(x, ty)
            return Val(f"{glsl_type(ty)}({x.text})", ty)
        if ty.kind == "vec":
            args = [convert(a, S(ty.elem)) for a in args]
            return Val(f"{glsl_type(ty)}({', '.join(a.text for a in args)})", ty)
        if ty.n is None or len(args) != ty.n:
            self.fail(f"an array constructor of {len(args)} values for {ty}")
        el = glsl_type(ty.elem)
        args = [convert(a, ty.elem) for a in args]
        return Val(f"{el}[{ty.n}]({', '.join(a.text for a in args)})", ty)

    def bitcast(self, x: Val, to: Ty) -> str:
        src, dst = x.ty.scalar, to.scalar
        if src == dst:
            return x.text
        fn = {("f32", "u32"): "floatBitsToUint", ("f32", "i32"): "floatBitsToInt",
              ("u32", "f32"): "uintBitsToFloat", ("i32", "f32"): "intBitsToFloat",
              ("u32", "i32"): "int", ("i32", "u32"): "uint"}.get((src, dst))
        if fn is None:
            self.fail(f"bitcast from {src} to {dst}")
        if to.kind == "vec" and fn in ("int", "uint"):
            fn = glsl_type(to)
        return f"{fn}({x.text})"

    def call(self, name, args: list[Val]) -> Val:
        if name == "select":
            f, t, c = args
            f, t = unify(f, t)
            if c.ty.kind == "vec":
                return Val(f"mix({f.text}, {t.text}, {c.text})", t.ty)
            return Val(f"({c.text} ? {t.text} : {f.text})", t.ty if not t.ty.abstract else concrete(t.ty))
        if name in ("workgroupBarrier", "storageBarrier"):
            return Val("memoryBarrierShared(); barrier()" if name == "workgroupBarrier" else
                       "memoryBarrierBuffer(); barrier()", make_ty("void", None))
        if name == "dot":
            a, b = args
            return Val(f"dot({a.text}, {b.text})", S(a.ty.elem))
        if name == "saturate":
            (x,) = args
            lo, hi = (convert(Val(v, AFLOAT, v), S(x.ty.scalar)) for v in ("0.0", "1.0"))
            return Val(f"clamp({x.text}, {lo.text}, {hi.text})", x.ty)
        if name in SAME_TYPE_BUILTINS:
            # every operand takes the type of the first concrete one (min(x, 0.0) on f16 ...)
            ref = next((a for a in args if not a.ty.abstract and a.ty.kind == "vec"), None) or \
                next((a for a in args if not a.ty.abstract), None)
            if ref is not None:
                args = [convert(a, S(ref.ty.scalar)) for a in args]
                ty = ref.ty
            else:
                args = [convert(a, F32) if any(x.ty == AFLOAT for x in args) else convert(a, I32) for a in args]
                ty = args[0].ty
            if ty.kind == "vec":     # GLSL's fma/mix/clamp take vectors for every operand
                args = [a if a.ty.kind == "vec" or name not in ("fma",) else
                        Val(f"{glsl_type(ty)}({a.text})", ty) for a in args]
            return Val(f"{RENAMED.get(name, name)}({', '.join(a.text for a in args)})", ty)
        fn = self.fns.get(name)
        if fn is None:
            self.fail(f"unknown function {name!r}")
        if len(args) != len(fn.params):
            self.fail(f"{name} takes {len(fn.params)} arguments, given {len(args)}")
        args = [convert(a, pt) for a, (_, pt) in zip(args, fn.params)]
        return Val(f"{_ident(name)}({', '.join(a.text for a in args)})", fn.ret or make_ty("void", None))

    # -------------------------------------------------------------------- statements
    def block(self, out: list, depth: int):
        self.eat("{")
        self.scopes.append({})
        while not self.accept("}"):
            self.statement(out, depth)
        self.scopes.pop()

    def decl(self, depth) -> list[str]:
        """``let``/``var`` declaration (the keyword already read) as GLSL lines."""
        name = self.eat(kind="id").text
        ty = self.parse_type() if self.accept(":") else None
        init = self.expr() if self.accept("=") else None
        pad = "    " * depth
        if ty is None:
            ty = concrete(init.ty)
        if init is not None:
            init = convert(init, ty)
        self.declare(name, ty)
        gname = _ident(name)
        if ty.kind == "array":
            el = ty.elem
            if init is not None:
                return [f"{pad}{glsl_type(el)} {_ident(name)}[{ty.n}] = {init.text};"]
            self.tmp += 1
            return [f"{pad}{glsl_type(el)} {gname}[{ty.n}];",
                    f"{pad}for (int z{self.tmp}_ = 0; z{self.tmp}_ < {ty.n}; z{self.tmp}_++) "
                    f"{{ {gname}[z{self.tmp}_] = {glsl_type(el)}(0); }}"]
        value = init.text if init is not None else f"{glsl_type(ty)}(0)"
        return [f"{pad}{glsl_type(ty)} {gname} = {value};"]

    def simple(self, depth) -> str:
        """An assignment or a call (no trailing ``;``)."""
        start = self.i
        target = self.expr()
        if self.tok.text in ("=", "+=", "-=", "*=", "/=", "%=", "&=", "|=", "^=", "<<=", ">>="):
            op = self.eat().text
            value = self.expr()
            if op == "%=" and _is_float(target.ty):
                return f"{target.text} = {self.binary('%', target, value).text}"
            value = convert(value, S(target.ty.scalar)) if target.ty.kind != "array" else value
            return f"{target.text} {op} {value.text}"
        if self.toks[start].kind == "id" and self.toks[start + 1].text == "(":
            return target.text
        self.i = start
        self.fail("statement expected")

    def statement(self, out: list, depth: int):
        pad = "    " * depth
        t = self.tok
        if t.text in ("let", "var") and t.kind == "id":
            self.i += 1
            out += self.decl(depth)
            self.eat(";")
        elif t.text == "if":
            self.i += 1
            self.eat("(")
            cond = self.expr()
            self.eat(")")
            out.append(f"{pad}if ({cond.text}) {{")
            self.block(out, depth + 1)
            while self.tok.text == "else":
                self.i += 1
                if self.accept("if"):
                    self.eat("(")
                    cond = self.expr()
                    self.eat(")")
                    out.append(f"{pad}}} else if ({cond.text}) {{")
                else:
                    out.append(f"{pad}}} else {{")
                self.block(out, depth + 1)
            out.append(f"{pad}}}")
        elif t.text == "for":
            self.i += 1
            self.eat("(")
            self.scopes.append({})
            init = ""
            if self.accept("var") or self.accept("let"):
                init = self.decl(0)
                if len(init) != 1:
                    self.fail("an array in a for loop's initialiser")
                init = init[0].rstrip(";")
            elif self.tok.text != ";":
                init = self.simple(0)
            self.eat(";")
            cond = self.expr().text if self.tok.text != ";" else ""
            self.eat(";")
            step = self.simple(0) if self.tok.text != ")" else ""
            self.eat(")")
            if self.unroll and _short_loop(cond):
                self.unrolled = True
                out.append(f"{pad}[[unroll]]")
            out.append(f"{pad}for ({init}; {cond}; {step}) {{")
            self.block(out, depth + 1)
            self.scopes.pop()
            out.append(f"{pad}}}")
        elif t.text == "return":
            self.i += 1
            if self.accept(";"):
                out.append(f"{pad}return;")
            else:
                v = self.expr()
                self.eat(";")
                out.append(f"{pad}return {convert(v, self.ret).text};")
        elif t.text in ("break", "continue"):
            self.i += 1
            self.eat(";")
            out.append(f"{pad}{t.text};")
        elif t.text == "{":
            out.append(f"{pad}{{")
            self.block(out, depth + 1)
            out.append(f"{pad}}}")
        elif t.text == ";":
            self.i += 1
        else:
            s = self.simple(depth)
            self.eat(";")
            out.append(f"{pad}{s};")

    # ----------------------------------------------------------------------- module
    def attributes(self) -> dict:
        attrs = {}
        while self.accept("@"):
            name = self.eat(kind="id").text
            vals = []
            if self.accept("("):
                while not self.accept(")"):
                    tt = self.eat()
                    if tt.text != ",":
                        vals.append(tt.text)
            attrs[name] = vals
        return attrs

    def translate(self) -> str:
        decls, protos, bodies = [], [], []
        local_size = None
        # first pass: signatures of every function, so calls can be typed before definitions
        self._scan_signatures()
        while self.tok.kind != "eof":
            attrs = self.attributes()
            t = self.tok
            if t.text == "enable":
                self.i += 1
                ext = self.eat(kind="id").text
                if ext != "f16":
                    self.fail(f"enable {ext}")
                self.uses_f16 = True
                self.eat(";")
            elif t.text == "var":
                self.i += 1
                space, access = None, None
                if self.accept("<"):
                    space = self.eat(kind="id").text
                    if self.accept(","):
                        access = self.eat(kind="id").text
                    self.eat(">")
                name = self.eat(kind="id").text
                self.eat(":")
                ty = self.parse_type()
                self.eat(";")
                self.globals[name] = ty
                if space == "storage":
                    b = int(attrs["binding"][0])
                    g = int(attrs.get("group", ["0"])[0])
                    ro = "readonly " if access in (None, "read") else ""
                    if ty.kind == "barray":
                        decls.append(f"layout(std430, set = {g}, binding = {b}) {ro}buffer B{b}_ {{ "
                                     f"{glsl_type(ty.elem.elem)} d[]; }} {_ident(name)}[{ty.n}];")
                    else:
                        decls.append(f"layout(std430, set = {g}, binding = {b}) {ro}buffer B{b}_ {{ "
                                     f"{glsl_type(ty.elem)} {_ident(name)}[]; }};")
                elif space == "workgroup":
                    decls.append(f"shared {glsl_type(ty.elem)} {_ident(name)}[{ty.n}];")
                elif space == "private" and ty.kind in ("scalar", "vec"):    # set before it is read
                    decls.append(f"{glsl_type(ty)} {_ident(name)};")
                else:
                    self.fail(f"module variable in address space {space!r}")
            elif t.text == "fn":
                if "compute" in attrs:
                    size = [int(x.rstrip("u")) for x in attrs["workgroup_size"]] + [1, 1]
                    local_size = size[:3]
                    bodies.append(self.entry())
                else:
                    proto, body = self.function()
                    protos.append(proto + ";")
                    bodies.append(body)
            else:
                self.fail("module item expected")
        if local_size is None:
            raise GlslTranslationError(f"{self.name}: no @compute entry point")
        head = ["#version 450",
                "#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require" if self.uses_f16 else "",
                "#extension GL_EXT_shader_16bit_storage : require" if self.uses_f16 else "",
                "#extension GL_EXT_control_flow_attributes : require" if self.unrolled else "",
                *(IEEE_PRESERVE if self.preserve_ieee else []),
                f"layout(local_size_x = {local_size[0]}, local_size_y = {local_size[1]}, "
                f"local_size_z = {local_size[2]}) in;"]
        return "\n".join([h for h in head if h] + decls + protos + bodies) + "\n"

    def _scan_signatures(self):
        """Signatures of every function and types of module variables, so that uses can be
        typed before the definitions. Only braces, ``fn`` and ``var`` matter here, so only
        they are visited (walking every token took a fifth of the translation)."""
        save, depth, toks, n0 = self.i, 0, self.toks, len(self.splits)
        marks = list(itertools.compress(itertools.count(), map(_SCAN_MARKS.__contains__, map(_TEXT, toks))))
        for i in marks:
            i += len(self.splits) - n0      # a ">>" split while parsing moved the later tokens
            if i < self.i:                  # inside a signature parsed below
                continue
            t = toks[i]
            if t.text == "{":
                depth += 1
            elif t.text == "}":
                depth -= 1
            elif depth == 0 and t.text == "fn" and toks[i + 1].kind == "id":
                self.i = i + 1
                name = self.eat(kind="id").text
                params = self.params() if name != "main" else []
                ret = self.parse_type() if self.accept("->") else None
                self.fns[name] = Fn(name, params, ret)
            elif depth == 0 and t.text == "var":
                self.i = i + 1
                if self.accept("<"):
                    while not self.accept(">"):
                        self.i += 1
                name = self.eat(kind="id").text
                self.eat(":")
                self.globals[name] = self.parse_type()
        self.i = save

    def params(self) -> list:
        self.eat("(")
        out = []
        while not self.accept(")"):
            self.attributes()
            pname = self.eat(kind="id").text
            self.eat(":")
            out.append((pname, self.parse_type()))
            if not self.accept(","):
                self.eat(")")
                break
        return out

    def function(self) -> tuple[str, str]:
        self.eat("fn")
        fn = self.fns[self.eat(kind="id").text]
        self.params()
        if self.accept("->"):
            self.parse_type()
        self.ret = fn.ret
        sig = f"{glsl_type(fn.ret) if fn.ret else 'void'} {_ident(fn.name)}(" + \
            ", ".join(f"{glsl_type(t)} {_ident(p)}" for p, t in fn.params) + ")"
        self.scopes.append(dict(fn.params))
        out = [sig + " {"]
        self.block(out, 1)
        self.scopes.pop()
        out.append("}")
        return sig, "\n".join(out)

    BUILTINS = {"workgroup_id": ("gl_WorkGroupID", make_ty("vec", "u32", 3)),
                "local_invocation_index": ("gl_LocalInvocationIndex", U32),
                "local_invocation_id": ("gl_LocalInvocationID", make_ty("vec", "u32", 3)),
                "global_invocation_id": ("gl_GlobalInvocationID", make_ty("vec", "u32", 3)),
                "num_workgroups": ("gl_NumWorkGroups", make_ty("vec", "u32", 3))}

    def entry(self) -> str:
        self.eat("fn")
        self.eat("main")
        self.eat("(")
        lines, scope = [], {}
        while not self.accept(")"):
            attrs = self.attributes()
            pname = self.eat(kind="id").text
            self.eat(":")
            ty = self.parse_type()
            which = attrs.get("builtin", [None])[0]
            if which not in self.BUILTINS:
                self.fail(f"entry parameter {pname!r}: builtin {which!r} outside the subset")
            glname, gty = self.BUILTINS[which]
            lines.append(f"    {glsl_type(ty)} {_ident(pname)} = {glname};")
            scope[pname] = ty
            self.accept(",")
        self.ret = None
        self.scopes.append(scope)
        out = ["void main() {"] + lines
        self.block(out, 1)
        self.scopes.pop()
        out.append("}")
        return "\n".join(out)


def to_glsl(wgsl: str, name: str = "kernel", unroll: bool | None = None, preserve_ieee: bool = True) -> str:
    """GLSL 4.50 (Vulkan semantics) for a kernel rendered in our WGSL subset. ``unroll``:
    mark loops of at most 32 constant trips ``[[unroll]]`` (None: MEGANEURA_GLSL_UNROLL, else no).
    ``preserve_ieee``: ask the driver to keep Inf, NaN and signed zeros (``IEEE_PRESERVE``;
    a runtime passes False for a device whose shaderSignedZeroInfNanPreserveFloat32 is off)."""
    if unroll is None:
        unroll = bool(unroll_switch())
    return _Translator(wgsl, name, unroll, preserve_ieee).translate()


@dataclass
class GlslLibrary:
    """A WGSL module without an entry point, in GLSL: for kernels whose ``main`` is written
    in GLSL directly (the cooperative-matrix matmul) but whose bindings and epilogue store
    come from the WGSL renderers. ``extensions``: the ``#extension`` lines it needs;
    ``code``: buffer declarations, workgroup arrays, prototypes and functions."""
    extensions: list
    code: str


def to_glsl_library(wgsl: str, name: str = "kernel") -> GlslLibrary:
    """Translate the declarations and functions of ``wgsl`` (no ``@compute`` function)."""
    # the kernel that includes the library writes its own header (and execution modes)
    text = _Translator(wgsl + "\n@compute @workgroup_size(1)\nfn main() {\n}\n", name, preserve_ieee=False).translate()
    lines = text.splitlines()
    if lines[-2:] != ["void main() {", "}"]:
        raise GlslTranslationError(f"{name}: the module has an entry point of its own")
    lines = lines[:-2]
    ext = [ln for ln in lines if ln.startswith("#extension")]
    code = [ln for ln in lines if not ln.startswith(("#version", "#extension", "layout(local_size"))]
    return GlslLibrary(ext, "\n".join(code) + "\n")
