"""The printers of the typed kernel AST (``kernel_ast``): ``WgslPrinter`` writes the WGSL the
hand-written templates wrote (the same bytes, pinned by the tests' golden digests), ``GlslPrinter`` the GLSL 4.50 that the WGSL-to-GLSL
translator (``glsl.to_glsl``) writes for that WGSL: every binary operator parenthesised,
literals spelled in the type WGSL gives them, ``select`` as ``?:``, float ``%`` as a
truncated remainder, barriers as ``barrier()``, declarations typed and zero-initialised,
workgroup arrays ``shared`` and hoisted, prototypes before the functions, loops of a few
constant trips ``[[unroll]]`` under the unroll switch."""
from __future__ import annotations

import re

from ..graph import DTYPES
from .common import literal
from .glsl_target import IEEE_PRESERVE as GLSL_IEEE
from .glsl_target import glsl_name
from .kernel_ast import (COMPARE, GLSL_F16, GLSL_NAMES, GLSL_TYPE, PRECEDENCE, UNARY, Assign, AssignIndex,
                         AssignOp, Barrier, Bin, Bitcast, Blank, Block, Break, Call, CallIf, Construct, Continue,
                         Convert, ExprStmt, Field, For, Function, Group, If, Index, Let, Line, Lit, Load, Name, Neg,
                         Not, Private, Return, ReturnIf, Select, Shared, Store, Var, is_float, is_vec, scalar_of)

# the node classes of ``kernel_ast`` (others print themselves: ``wgsl`` / ``glsl`` methods)
_OURS = frozenset((Name, Lit, Bin, Call, Neg, Not, Group, Field, Index, Load, Convert, Select, Bitcast, Construct,
                   Let, Var, Assign, AssignIndex, AssignOp, Store, ExprStmt, If, For, Block, Break, Continue, Return,
                   Barrier, ReturnIf, CallIf, Line, Blank))
VEC_PREFIX = {"bool": "b", "u32": "u", "i32": "i", "f32": "", "f16": "f16"}
VEC_COMPARE = {"==": "equal", "!=": "notEqual", "<": "lessThan", ">": "greaterThan", "<=": "lessThanEqual",
               ">=": "greaterThanEqual"}
BITCAST = {("f32", "u32"): "floatBitsToUint", ("f32", "i32"): "floatBitsToInt", ("u32", "f32"): "uintBitsToFloat",
           ("i32", "f32"): "intBitsToFloat", ("u32", "i32"): "int", ("i32", "u32"): "uint"}
BARRIER_WGSL = {"workgroup": "workgroupBarrier();", "storage": "storageBarrier();", "subgroup": "subgroupBarrier();"}
BARRIER_GLSL = {"workgroup": "memoryBarrierShared(); barrier();", "storage": "memoryBarrierBuffer(); barrier();",
                "subgroup": "subgroupMemoryBarrierShared(); subgroupBarrier();"}
# builtins whose operands all take one type (the first concrete one); others: a module's functions
BUILTINS = frozenset("""min max clamp abs exp exp2 log log2 sqrt inverseSqrt pow floor ceil trunc fract sign sin cos
tan asin acos atan sinh cosh tanh asinh acosh atanh fma mix step smoothstep round atan2 countOneBits reverseBits
dot saturate""".split())
BUILTIN_IDS = {"workgroup_id": "gl_WorkGroupID", "local_invocation_index": "gl_LocalInvocationIndex",
               "local_invocation_id": "gl_LocalInvocationID", "global_invocation_id": "gl_GlobalInvocationID",
               "num_workgroups": "gl_NumWorkGroups"}
_SHORT_LOOP = re.compile(r"^\(*\w+ < (\d+)u?\)*$")     # a loop of at most 32 constant trips
PAD = "    "


def glsl_type(ty: str) -> str:
    if ty in GLSL_TYPE:
        return GLSL_TYPE[ty]
    if is_vec(ty):
        return f"{VEC_PREFIX[scalar_of(ty)]}vec{ty[3]}"
    raise TypeError(f"no GLSL value type for {ty!r}")


def array_type(ty: str):
    """(element type, length) of ``array<T, n>``, else None."""
    if not ty.startswith("array<"):
        return None
    el, n = ty[6:-1].rsplit(",", 1)
    return el.strip(), int(n.strip().rstrip("u"))


def wgsl_literal(e: Lit) -> str:
    if e.text:
        return e.text
    ty = e.ty
    if ty == "u32":
        return f"{int(e.value)}u"
    if ty == "bool":
        return "true" if e.value else "false"
    return literal(e.value, DTYPES[ty])


def _float_text(s: str) -> str:
    return s if any(c in s for c in ".eE") else s + ".0"


def abstract(e) -> bool:
    """A literal WGSL types by where it stands (no suffix)."""
    if not isinstance(e, Lit):
        return False
    s = wgsl_literal(e).lstrip("-")
    return s not in ("true", "false") and not s.startswith("bitcast") and s[-1] not in "fhiu"


def glsl_literal(text: str) -> str:
    """The GLSL of a WGSL literal of a concrete type (a suffix, a bit pattern, a bool; an
    abstract one takes the type of where it stands: ``GlslPrinter.convert``)."""
    if text in ("true", "false"):
        return text
    if text.startswith("bitcast<f32>("):       # an infinity or NaN: its bit pattern
        return "uintBitsToFloat(" + text[len("bitcast<f32>("):]
    neg, s = text.startswith("-"), text.lstrip("-")
    if s[-1] in "fh" and s[:2].lower() != "0x":
        t = _float_text(s[:-1])
        t = f"float16_t({t})" if s[-1] == "h" else t
    else:           # ...i, ...u (decimal or hexadecimal)
        t = s[:-1] + ("u" if s[-1] == "u" else "")
    return f"(-{t})" if neg else t


BITWISE = frozenset({"&", "|", "^"})
LOGICAL = frozenset({"&&", "||"})


def needs_group(child, op: str, right: bool) -> bool:
    """Whether WGSL prints ``child``, an operand of binary ``op``, in parentheses: where
    precedence asks for them, and where WGSL's grammar does (shifts take unary operands,
    bitwise and logical operators chain only with themselves, comparisons do not chain)."""
    if type(child) is not Bin:
        return False
    c = child.op
    if op in ("<<", ">>"):
        return True
    if op in BITWISE:
        return c != op or right
    if op in LOGICAL:
        return c in BITWISE or (c in LOGICAL and (c != op or right))
    if op in COMPARE:
        return PRECEDENCE[c] <= PRECEDENCE[op]
    return PRECEDENCE[c] < PRECEDENCE[op] or (right and PRECEDENCE[c] == PRECEDENCE[op])


def _foreign(node, method, *args):
    fn = getattr(node, method, None)
    if fn is None:
        raise TypeError(f"not a node of the kernel AST: {node!r}")
    return fn(*args)


class WgslPrinter:
    """The WGSL printer (no state: the text of a node of ours is kept on it, ``_wgsl``, as
    nodes never change and a kernel's renderer prints its parts more than once)."""

    # ------------------------------------------------------------------ expressions
    def expr(self, e, parent=0) -> str:
        k = type(e)
        if k is Name:
            return e.id
        form = _WGSL_EXPR.get(k)
        if form is None:
            return _foreign(e, "wgsl", self)
        text = e._wgsl
        if text is None:
            text = e._wgsl = form(self, e)
        return f"({text})" if k is Bin and parent and PRECEDENCE[e.op] < parent else text

    # one method a node class (``_WGSL_EXPR``); an operand that is a name is printed inline
    def _bin(self, e) -> str:
        a, b, op = e.a, e.b, e.op
        ta = a.id if type(a) is Name else self.expr(a)
        tb = b.id if type(b) is Name else self.expr(b)
        if type(a) is Bin and needs_group(a, op, False):
            ta = f"({ta})"
        if type(b) is Bin and needs_group(b, op, True):
            tb = f"({tb})"
        return f"{ta} {op} {tb}"

    def _load(self, e) -> str:
        member = "" if e.member is None else f"[{self.expr(e.member)}]"
        i = e.index
        return f"b{e.binding}{member}[{i.id if type(i) is Name else self.expr(i)}]"

    def _call(self, e) -> str:
        return f"{e.fn}({', '.join([a.id if type(a) is Name else self.expr(a) for a in e.args])})"

    def _construct(self, e) -> str:
        return f"{e.ty}({', '.join([a.id if type(a) is Name else self.expr(a) for a in e.args])})"

    @staticmethod
    def target(t) -> str:
        return t if isinstance(t, str) else WgslPrinter().expr(t)

    # ------------------------------------------------------------------ statements
    def stmt(self, s) -> str:
        """``s`` on one line (a block statement: its inline form)."""
        k = type(s)
        if k not in _OURS:
            text = _foreign(s, "wgsl", self)
            return text if isinstance(text, str) else " ".join(text)
        text = s._wgsl
        if text is None:
            text = s._wgsl = self._stmt(s, k)
        return text

    def _stmt(self, s, k) -> str:
        if k is Line:
            return " ".join(self.stmt(x) for x in s.stmts)
        if k is Let:
            return f"let {s.name}{': ' + s.ty if s.ty else ''} = {self.expr(s.e)};"
        if k is Var:
            return f"var {s.name}{': ' + s.ty if s.ty else ''}{'' if s.e is None else ' = ' + self.expr(s.e)};"
        if k is Assign:
            return f"{self.target(s.name)} = {self.expr(s.e)};"
        if k is AssignIndex:
            return f"{self.target(s.base)}[{self.expr(s.index)}] = {self.expr(s.e)};"
        if k is AssignOp:
            return f"{self.target(s.name)} {s.op}= {self.expr(s.e)};"
        if k is Store:
            member = "" if s.member is None else f"[{self.expr(s.member)}]"
            return f"b{s.binding}{member}[{self.expr(s.index)}] = {self.expr(s.value)};"
        if k is ExprStmt:
            return f"{self.expr(s.e)};"
        if k is Return:
            return "return;" if s.value is None else f"return {self.expr(s.value)};"
        if k is Break:
            return "break;"
        if k is Continue:
            return "continue;"
        if k is Barrier:
            return BARRIER_WGSL[s.kind]
        if k is ReturnIf:
            return f"if ({self.expr(s.cond)}) {{ return; }}"
        if k is CallIf:
            return f"if ({self.expr(s.cond)}) {{ {s.fn}({', '.join(self.expr(a) for a in s.args)}); return; }}"
        if k is If:
            text = f"if ({self.expr(s.cond)}) {{ {self.inline(s.then)} }}"
            if isinstance(s.orelse, If):
                return text + " else " + self.stmt(s.orelse)
            return text + (f" else {{ {self.inline(s.orelse)} }}" if s.orelse else "")
        if k is For:
            return f"{self.for_head(s)} {{ {self.inline(s.body)} }}"
        if k is Block:
            return f"{{ {self.inline(s.body)} }}"
        if k is Blank:
            return ""
        raise TypeError(f"not a statement: {s!r}")

    def inline(self, body) -> str:
        return " ".join(self.stmt(x) for x in body)

    def for_head(self, s: For) -> str:
        init = "" if s.init is None else self.stmt(s.init)[:-1]
        update = "" if s.update is None else self.stmt(s.update)[:-1]
        return f"for ({init}; {'' if s.cond is None else self.expr(s.cond)}; {update})"

    def lines(self, s, depth=1) -> list[str]:
        """``s`` as lines indented ``depth`` levels."""
        pad, k = PAD * depth, type(s)
        if k is Blank:
            return [""]
        if k is If and not s.inline:
            out = [f"{pad}if ({self.expr(s.cond)}) {{"] + self.block(s.then, depth + 1)
            orelse = s.orelse
            while isinstance(orelse, If):
                out += [f"{pad}}} else if ({self.expr(orelse.cond)}) {{"] + self.block(orelse.then, depth + 1)
                orelse = orelse.orelse
            if orelse:
                out += [f"{pad}}} else {{"] + self.block(orelse, depth + 1)
            return out + [f"{pad}}}"]
        if k is For and not s.inline:
            return [f"{pad}{self.for_head(s)} {{"] + self.block(s.body, depth + 1) + [f"{pad}}}"]
        if k is Block:
            return [f"{pad}{{"] + self.block(s.body, depth + (not s.flat)) + [f"{pad}}}"]
        if k.__module__ != Let.__module__ and hasattr(s, "wgsl"):
            text = s.wgsl(self)
            return [pad + ln if ln else "" for ln in (text.split("\n") if isinstance(text, str) else text)]
        return [pad + self.stmt(s)]

    def block(self, body, depth) -> list[str]:
        return [ln for s in body for ln in self.lines(s, depth)]

    # ------------------------------------------------------------------ module
    def function(self, f: Function) -> str:
        params = ", ".join(f"{p.id}: {p.ty}" for p in f.params)
        ret = f" -> {f.ret}" if f.ret else ""
        if f.inline:        # (an empty one: "{}")
            body = self.inline(f.body)
            return f"fn {f.name}({params}){ret} {{ {body} }}" if body else f"fn {f.name}({params}){ret} {{}}"
        return "\n".join([f"fn {f.name}({params}){ret} {{"] + self.block(f.body, 1) + ["}"])

    def item(self, it) -> str:
        if isinstance(it, Function):
            return self.function(it)
        if isinstance(it, Shared):
            return f"var<workgroup> {it.name}: array<{it.ty}, {it.count}>;"
        if isinstance(it, Private):
            return f"var<private> {it.name}: {it.ty};"
        if isinstance(it, Blank):
            return ""
        return _foreign(it, "wgsl", self)

    def kernel(self, k) -> str:
        enable = ["enable f16;"] if k.uses_f16() else []

        def of(b):
            ty = b.ty or "u32"
            return f"binding_array<array<{ty}>, {b.count}>" if b.count is not None else f"array<{ty}>"
        decls = "\n".join(enable + [f"@group(0) @binding({j}) var<storage, {'read_write' if b.write else 'read'}> "
                                    f"b{j}: {of(b)};" for j, b in enumerate(k.buffers)])
        wg = ", ".join(map(str, k.workgroup)) if isinstance(k.workgroup, tuple) else k.workgroup
        params = ", ".join(f"@builtin({which}) {n.id}: {n.ty}" for which, n in k.builtins)
        entry = [f"@compute @workgroup_size({wg})", f"fn main({params}) {{"]
        return "\n".join([decls] + [self.item(it) for it in k.items()] + entry + self.block(k.body, 1) + ["}"]) + "\n"


_WGSL_EXPR = {
    Lit: lambda p, e: wgsl_literal(e),
    Bin: WgslPrinter._bin,
    Group: lambda p, e: f"({p.expr(e.e)})",
    Field: lambda p, e: f"{p.expr(e.e, UNARY + 1)}.{e.name}",
    Index: lambda p, e: f"{p.expr(e.base, UNARY + 1)}[{p.expr(e.index)}]",
    Load: WgslPrinter._load,
    Convert: lambda p, e: f"{e.ty}({p.expr(e.e)})",
    Neg: lambda p, e: f"-{p.expr(e.e, UNARY)}",
    Not: lambda p, e: f"!{p.expr(e.e, UNARY)}",
    Call: WgslPrinter._call,
    Select: lambda p, e: f"select({p.expr(e.f)}, {p.expr(e.t)}, {p.expr(e.cond)})",
    Bitcast: lambda p, e: f"bitcast<{e.ty}>({p.expr(e.e)})",
    Construct: WgslPrinter._construct,
}


class GlslPrinter:
    def __init__(self, unroll=False, preserve_ieee=True):
        self.unroll, self.preserve_ieee = unroll, preserve_ieee
        self.unrolled, self.tmp, self.ret = False, 0, None
        self.f16 = False        # the WGSL names the type f16 (the translator then enables it)

    def names(self, ty):
        """``ty`` is a type the WGSL text writes."""
        if ty and "f16" in ty:
            self.f16 = True
        return ty

    # ------------------------------------------------------------------ expressions
    # WGSL's abstract literals take the type of where they stand; the translator kept an
    # abstract value (a literal, or an operation on abstract values alone) as its text and its
    # digits (a literal's, through parentheses and minus signs) until it met a type:
    # ``abstract_value`` is that pair and its kind, ``convert`` the value met
    def abstract_value(self, e):
        """(text, digits or None, "afloat" / "aint") of an abstract value, else None (kept on
        the node, ``_abstract``: operands ask for it at every level)."""
        k = type(e)
        if k is Name or k not in _OURS:
            return None
        v = e._abstract
        if v == ():
            v = e._abstract = self._abstract_value(e, k)
        return v

    def _abstract_value(self, e, k):
        if k is Lit:
            if not abstract(e):
                return None
            t = wgsl_literal(e)
            s = t.lstrip("-")
            kind = "afloat" if any(c in s for c in ".eE") and not s.startswith("0x") else "aint"
            text = _float_text(s) if kind == "afloat" else s
            return (f"(-{text})", t, kind) if t.startswith("-") else (text, t, kind)
        if k in (Neg, Group):
            v = self.abstract_value(e.e)
            if v is None:
                return None
            if k is Group:
                return f"({v[0]})", v[1], v[2]
            return f"(-{v[0]})", None if v[1] is None else "-" + v[1], v[2]
        if k is Bin and e.op not in COMPARE and e.op not in LOGICAL and e.op not in ("<<", ">>"):
            a, b = self.abstract_value(e.a), self.abstract_value(e.b)
            if a is None or b is None:
                return None
            at = f"({a[0]})" if needs_group(e.a, e.op, False) else a[0]
            bt = f"({b[0]})" if needs_group(e.b, e.op, True) else b[0]
            return f"({at} {e.op} {bt})", None, "afloat" if "afloat" in (a[2], b[2]) else "aint"
        return None

    @staticmethod
    def convert(v, ty) -> str:
        text, digits, _ = v
        target = scalar_of(ty)
        if target in ("f32", "f16"):
            t = _float_text(digits) if digits is not None else f"float({text})"
            return f"float16_t({t})" if target == "f16" else t
        if target == "u32":
            return digits + "u" if digits is not None and not digits.startswith("-") else f"uint({text})"
        if target == "i32":
            return digits if digits is not None else f"int({text})"
        return text

    def value(self, e, ty, parent=0) -> str:
        """``e`` standing where WGSL converts an abstract value to ``ty``."""
        v = self.abstract_value(e)
        return self.convert(v, ty) if v is not None else self.expr(e, parent)

    def unified(self, a, b) -> tuple[str, str]:
        """Two operands of one type: an abstract one takes the other's (both abstract: as they are)."""
        va, vb = self.abstract_value(a), self.abstract_value(b)
        if va is not None and vb is None:
            return self.convert(va, b.ty), self.expr(b)
        if vb is not None and va is None:
            return self.expr(a), self.convert(vb, a.ty)
        return self.expr(a), self.expr(b)

    def expr(self, e, parent=0) -> str:
        """``parent``: the precedence the WGSL printer prints ``e`` under; where it adds
        parentheses the translator read a pair of them (one more pair here)."""
        k = type(e)
        if k in (Lit, Neg, Group, Bin) and (v := self.abstract_value(e)) is not None:
            if k is Lit and not v[0].startswith("("):
                return v[0]
            return f"({v[0]})" if k is Bin and PRECEDENCE[e.op] < parent else v[0]
        if k is Name:
            return glsl_name(e.id)
        if k is Lit:
            return glsl_literal(wgsl_literal(e))
        if k is Bin:
            text = self.binary(e)
            return f"({text})" if PRECEDENCE[e.op] < parent else text
        if k is Group:
            return f"({self.expr(e.e)})"
        if k is Field:
            return f"{self.expr(e.e, UNARY + 1)}.{e.name}"
        if k is Index:
            return f"{self.expr(e.base, UNARY + 1)}[{self.value(e.index, 'u32')}]"
        if k is Load:
            member = "" if e.member is None else f"[{self.value(e.member, 'u32')}].d"
            return f"b{e.binding}{member}[{self.value(e.index, 'u32')}]"
        if k is Convert:
            self.names(e.ty)
            if (v := self.abstract_value(e.e)) is not None and not is_vec(e.ty):
                return self.convert(v, e.ty)
            if is_vec(e.ty):
                return f"{glsl_type(e.ty)}({self.value(e.e, scalar_of(e.ty))})"
            return f"{glsl_type(e.ty)}({self.expr(e.e)})"
        if k is Neg:
            return f"(-{self.expr(e.e, UNARY)})"
        if k is Not:
            return f"(!{self.expr(e.e, UNARY)})"
        if k is Call:
            return self.call(e)
        if k is Select:
            cond, (f, t) = self.expr(e.cond), self.unified(e.f, e.t)
            return f"mix({f}, {t}, {cond})" if is_vec(e.cond.ty) else f"({cond} ? {t} : {f})"
        if k is Bitcast:
            self.names(e.ty)
            src, dst = scalar_of(e.e.ty), scalar_of(e.ty)
            x = self.value(e.e, "u32") if src not in ("f32", "f16") else self.expr(e.e)
            if src == dst:
                return x
            fn = BITCAST[(src, dst)]
            return f"{glsl_type(e.ty) if is_vec(e.ty) and fn in ('int', 'uint') else fn}({x})"
        if k is Construct:
            self.names(e.ty)
            arr = array_type(e.ty)
            el = arr[0] if arr else scalar_of(e.ty)
            args = ", ".join(self.value(a, el) for a in e.args)
            return f"{glsl_type(el)}[{arr[1]}]({args})" if arr else f"{glsl_type(e.ty)}({args})"
        return _foreign(e, "glsl", self)

    def binary(self, e: Bin) -> str:
        op, ty = e.op, e.ty
        if op in ("<<", ">>"):
            a, b = self.value(e.a, "i32"), self.value(e.b, "u32")
        elif op in LOGICAL:
            a, b = self.expr(e.a), self.expr(e.b)
        else:
            a, b = self.unified(e.a, e.b)
        a = f"({a})" if needs_group(e.a, op, False) else a
        b = f"({b})" if needs_group(e.b, op, True) else b
        if op in COMPARE and is_vec(e.a.ty if is_vec(e.a.ty) else e.b.ty):
            return f"{VEC_COMPARE[op]}({a}, {b})"
        if op == "%" and is_float(ty):      # WGSL's float remainder truncates (C fmod); GLSL's mod floors
            return f"({a} - {b} * trunc({a} / {b}))"
        if op == "%" and scalar_of(ty) == "i32":   # the dividend's sign, as WGSL's
            return f"({a} - {b} * ({a} / {b}))"
        return f"({a} {op} {b})"

    def call(self, e: Call) -> str:
        if e.fn == "saturate":
            x = self.expr(e.args[0])
            s = scalar_of(e.args[0].ty)
            return f"clamp({x}, {self.convert(('0.0', '0.0', 'afloat'), s)}, {self.convert(('1.0', '1.0', 'afloat'), s)})"
        if e.fn in BUILTINS:
            # every operand takes the type of the first concrete one (a vector's first)
            vals = [self.abstract_value(a) for a in e.args]
            ref = next((a for a, v in zip(e.args, vals) if v is None and is_vec(a.ty)), None) or \
                next((a for a, v in zip(e.args, vals) if v is None), None)
            ty = ref.ty if ref is not None else "f32" if any(v[2] == "afloat" for v in vals) else "i32"
            args = [self.value(a, scalar_of(ty)) for a in e.args]
            ref = ref or e.args[0]
            if is_vec(ref.ty) and e.fn == "fma":     # GLSL's fma takes vectors for every operand
                args = [x if is_vec(a.ty) else f"{glsl_type(ref.ty)}({x})" for x, a in zip(args, e.args)]
            return f"{GLSL_NAMES.get(e.fn, e.fn)}({', '.join(args)})"
        return f"{glsl_name(e.fn)}({', '.join(self.value(a, a.ty) for a in e.args)})"

    def target(self, t) -> str:
        return glsl_name(t) if isinstance(t, str) else self.expr(t)

    @staticmethod
    def target_ty(t):
        return None if isinstance(t, str) else t.ty

    # ------------------------------------------------------------------ statements
    def decl(self, s, pad) -> list[str]:
        self.names(s.ty)
        v = None if s.ty or s.e is None else self.abstract_value(s.e)
        ty = s.ty or ({"afloat": "f32", "aint": "i32"}[v[2]] if v is not None else s.e.ty)
        name = glsl_name(s.name)
        arr = array_type(ty)
        if arr:
            el, n = glsl_type(arr[0]), arr[1]
            if s.e is not None:
                return [f"{pad}{el} {name}[{n}] = {self.expr(s.e)};"]
            self.tmp += 1
            z = f"z{self.tmp}_"
            return [f"{pad}{el} {name}[{n}];", f"{pad}for (int {z} = 0; {z} < {n}; {z}++) {{ {name}[{z}] = {el}(0); }}"]
        value = self.value(s.e, ty) if s.e is not None else f"{glsl_type(ty)}(0)"
        return [f"{pad}{glsl_type(ty)} {name} = {value};"]

    def simple(self, s) -> str:
        """An assignment without its ``;``."""
        if isinstance(s, AssignIndex):
            s = Assign(Index(s.base if not isinstance(s.base, str) else Name(s.base, "?"), s.index, s.e.ty), s.e)
        target = self.target(s.name)
        ty = self.target_ty(s.name) or s.e.ty
        if isinstance(s, AssignOp):
            if s.op == "%" and is_float(ty):
                return f"{target} = {self.binary(Bin('%', s.name if not isinstance(s.name, str) else Name(s.name, ty), s.e))}"
            return f"{target} {s.op}= {self.value(s.e, ty)}"
        return f"{target} = {self.value(s.e, ty)}"

    def lines(self, s, depth=1) -> list[str]:
        pad, k = PAD * depth, type(s)
        if k is Line:
            return [ln for x in s.stmts for ln in self.lines(x, depth)]
        if k in (Let, Var):
            return self.decl(s, pad)
        if k in (Assign, AssignIndex, AssignOp):
            return [pad + self.simple(s) + ";"]
        if k is Store:
            member = "" if s.member is None else f"[{self.value(s.member, 'u32')}].d"
            return [f"{pad}b{s.binding}{member}[{self.value(s.index, 'u32')}] = {self.value(s.value, s.value.ty)};"]
        if k is ExprStmt:
            return [f"{pad}{self.expr(s.e)};"]
        if k is Return:
            return [f"{pad}return;" if s.value is None else f"{pad}return {self.value(s.value, self.ret or s.value.ty)};"]
        if k in (Break, Continue):
            return [f"{pad}{'break' if k is Break else 'continue'};"]
        if k is Barrier:
            return [pad + BARRIER_GLSL[s.kind]]
        if k is ReturnIf:
            return [f"{pad}if ({self.expr(s.cond)}) {{", f"{pad}    return;", f"{pad}}}"]
        if k is CallIf:
            return [f"{pad}if ({self.expr(s.cond)}) {{",
                    f"{pad}    {glsl_name(s.fn)}({', '.join(self.expr(a) for a in s.args)});", f"{pad}    return;",
                    f"{pad}}}"]
        if k is If:
            out = [f"{pad}if ({self.expr(s.cond)}) {{"] + self.block(s.then, depth + 1)
            orelse = s.orelse
            while isinstance(orelse, If):
                out += [f"{pad}}} else if ({self.expr(orelse.cond)}) {{"] + self.block(orelse.then, depth + 1)
                orelse = orelse.orelse
            if orelse:
                out += [f"{pad}}} else {{"] + self.block(orelse, depth + 1)
            return out + [f"{pad}}}"]
        if k is For:
            init = "" if s.init is None else (self.decl(s.init, "")[0] if isinstance(s.init, (Let, Var))
                                              else self.simple(s.init) + ";")[:-1]
            cond = "" if s.cond is None else self.expr(s.cond)
            update = "" if s.update is None else self.simple(s.update)
            out = []
            if self.unroll and (m := _SHORT_LOOP.match(cond.strip())) is not None and int(m.group(1)) <= 32:
                self.unrolled = True
                out.append(f"{pad}[[unroll]]")
            return out + [f"{pad}for ({init}; {cond}; {update}) {{"] + self.block(s.body, depth + 1) + [f"{pad}}}"]
        if k is Block:
            return [f"{pad}{{"] + self.block(s.body, depth + 1) + [f"{pad}}}"]
        if k is Blank:
            return []
        text = _foreign(s, "glsl", self)
        return [pad + ln if ln else "" for ln in (text.split("\n") if isinstance(text, str) else text)]

    def block(self, body, depth) -> list[str]:
        return [ln for s in body for ln in self.lines(s, depth)]

    # ------------------------------------------------------------------ module
    def signature(self, f: Function) -> str:
        for t in (f.ret, *(p.ty for p in f.params)):
            self.names(t)
        ret = glsl_type(f.ret) if f.ret else "void"
        return f"{ret} {glsl_name(f.name)}({', '.join(f'{glsl_type(p.ty)} {glsl_name(p.id)}' for p in f.params)})"

    def function(self, f: Function) -> str:
        self.ret = f.ret
        return "\n".join([self.signature(f) + " {"] + self.block(f.body, 1) + ["}"])

    def kernel(self, k) -> str:
        decls, fns = [], []
        for j, b in enumerate(k.buffers):
            ro = "" if b.write else "readonly "
            el = glsl_type(b.ty or "u32")
            decls.append(f"layout(std430, set = 0, binding = {j}) {ro}buffer B{j}_ {{ {el} b{j}[]; }};" if b.count is None
                         else f"layout(std430, set = 0, binding = {j}) {ro}buffer B{j}_ {{ {el} d[]; }} b{j}[{b.count}];")
        for it in k.items():
            if isinstance(it, (Shared, Private)):
                self.names(it.ty)
            if isinstance(it, Shared):
                decls.append(f"shared {glsl_type(it.ty)} {glsl_name(it.name)}[{it.count}];")
            elif isinstance(it, Private):
                decls.append(f"{glsl_type(it.ty)} {glsl_name(it.name)};")
            elif isinstance(it, Function):
                fns.append(it)
            elif not isinstance(it, Blank):
                decls += _foreign(it, "glsl", self)
        bodies = [self.function(f) for f in fns]
        self.ret = None
        main = ["void main() {"] + [f"    {glsl_type(n.ty)} {glsl_name(n.id)} = {BUILTIN_IDS[which]};"
                                    for which, n in k.builtins] + self.block(k.body, 1) + ["}"]
        size = (list(k.workgroup) if isinstance(k.workgroup, tuple) else [k.workgroup]) + [1, 1]
        head = ["#version 450"] + (GLSL_F16 if k.uses_f16() or self.f16 else []) + \
            (["#extension GL_EXT_control_flow_attributes : require"] if self.unrolled else []) + \
            (GLSL_IEEE if self.preserve_ieee else []) + \
            [f"layout(local_size_x = {size[0]}, local_size_y = {size[1]}, local_size_z = {size[2]}) in;"]
        protos = [self.signature(f) + ";" for f in fns]
        return "\n".join(head + decls + protos + bodies + ["\n".join(main)]) + "\n"
