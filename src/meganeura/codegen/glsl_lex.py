"""The lexical and type layer of the WGSL-subset translator (``glsl``): tokens of the subset,
WGSL types and their GLSL names, typed expression values with WGSL's literal typing and
conversions, and the operator and builtin tables. Standard library only, as ``glsl_target``
(identifier spelling) that it imports (the translation workers load them without the package)."""
from __future__ import annotations

import functools
import operator
import re
from dataclasses import dataclass, field

from .glsl_target import clear_caches as clear_names
from .glsl_target import glsl_name


class GlslTranslationError(ValueError):
    pass


# ----------------------------------------------------------------------------- types
@dataclass(frozen=True)
class Ty:
    """A WGSL type: ``kind`` scalar / vec / array / barray (``binding_array``: an array of
    storage buffers, a module binding only); ``elem`` the scalar name (or the array's element
    Ty); ``n`` the vector width or array length (None: runtime-sized)."""
    kind: str
    elem: object
    n: int | None = None
    # fields, not properties: the translator asks for them a few times per token
    scalar: str = field(init=False, repr=False, compare=False)
    abstract: bool = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "scalar", self.elem.scalar if self.kind in ("array", "barray") else self.elem)
        object.__setattr__(self, "abstract", self.kind == "scalar" and self.elem in ("aint", "afloat"))


@functools.lru_cache(maxsize=1024)
def make_ty(kind, elem, n=None) -> Ty:
    """The one ``Ty`` of these fields (types are built a few times per token)."""
    return Ty(kind, elem, n)


def S(name):
    return make_ty("scalar", name)


BOOL, U32, I32, F32, F16, AINT, AFLOAT = (S(n) for n in ("bool", "u32", "i32", "f32", "f16", "aint", "afloat"))
SCALARS = {"bool", "u32", "i32", "f32", "f16"}
GLSL_SCALAR = {"bool": "bool", "u32": "uint", "i32": "int", "f32": "float", "f16": "float16_t",
               "aint": "int", "afloat": "float"}
VEC_PREFIX = {"bool": "b", "u32": "u", "i32": "i", "f32": "", "f16": "f16"}


def glsl_type(t: Ty) -> str:
    if t.kind == "scalar":
        return GLSL_SCALAR[t.elem]
    if t.kind == "vec":
        return f"{VEC_PREFIX[t.elem]}vec{t.n}"
    raise GlslTranslationError(f"no GLSL value type for array {t}")


def concrete(t: Ty) -> Ty:
    """WGSL's concretisation of an abstract type (a ``let`` of a bare literal)."""
    return {"aint": I32, "afloat": F32}.get(t.elem, t) if t.abstract else t


def _is_float(t: Ty):
    return t.scalar in ("f32", "f16", "afloat")


# ---------------------------------------------------------------------------- tokens
# whitespace and comments match outside the group (findall gives ''), tokens inside it, and any
# other character as a token of its own that ``tokenize`` rejects: findall builds the list in
# C (a Python loop over match objects, one Tok each, took 60% of translating U-Net's 469
# training kernels)
_TOKEN = re.compile(r"""\s+|//[^\n]*|(
    [A-Za-z_]\w*
  | 0[xX][0-9a-fA-F]+[iu]?|(?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?[fhiu]?
  | ->|<<=|>>=|<<|>>|<=|>=|==|!=|&&|\|\||\+=|-=|\*=|/=|%=|&=|\|=|\^=|[-+*/%<>=!&|^~(){}\[\];:,.@]
  | .)""", re.VERBOSE | re.ASCII)
_KIND = dict.fromkeys("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ_", "id") | dict.fromkeys("0123456789", "num")
_OP_CHARS = set("-+*/%<>=!&|^~(){}[];:,.@")


class Tok:
    """A token: ``kind`` id / num / op / eof. Equal texts share one Tok (tokens are never
    changed), so a kernel's tokens cost a dict lookup each."""
    __slots__ = ("kind", "text")

    def __init__(self, kind, text):
        self.kind, self.text = kind, text


EOF_TOK, CLOSE_ANGLE = Tok("eof", ""), Tok("op", ">")
_SCAN_MARKS = frozenset(("{", "}", "fn", "var"))
_TEXT = operator.attrgetter("text")


def _kind(text: str) -> str:
    return "num" if text[0] == "." and len(text) > 1 else _KIND.get(text[0], "op")


def tokenize(src: str) -> list[Tok]:
    """``src``'s tokens, then EOF_TOK. No token spans lines, so each distinct line is
    tokenized once per process (``_line_tokens``): a plan's kernels repeat most of their lines
    (U-Net's 410 training kernels: 48813 lines, 7605 distinct; tokenizing 0.40 -> 0.1 s)."""
    toks = []
    for line in src.split("\n"):
        found = _line_tokens(line)
        if found is None:          # a character outside the language: the whole text says where
            return _tokenize_text(src)
        toks.extend(found)
    toks.append(EOF_TOK)
    return toks


@functools.lru_cache(maxsize=1 << 16)
def _line_tokens(line: str) -> tuple | None:
    """The tokens of one line (Toks shared by text, as they are never changed), or None where
    it holds a character no token takes."""
    toks = tuple(map(_tok, filter(None, _TOKEN.findall(line))))
    return None if any(_stray(t.text) for t in toks) else toks


def _stray(text: str) -> bool:
    """``text`` is a character no token takes (``_TOKEN``'s catch-all)."""
    return len(text) == 1 and _KIND.get(text) is None and text not in _OP_CHARS


@functools.lru_cache(maxsize=1 << 12)
def _tok(text: str) -> Tok:
    return Tok(_kind(text), text)


def _tokenize_text(src: str) -> list[Tok]:
    """``tokenize`` of the whole text at once: raises, naming the line of the first character
    outside the language."""
    found = _TOKEN.findall(src)
    seen = {t: Tok(_kind(t), t) for t in set(found) if t}
    toks = list(map(seen.__getitem__, filter(None, found)))      # (in C, as findall)
    bad = [t for t in seen if _stray(t)]
    if bad:
        k = next(i for i, t in enumerate(toks) if t.text in bad)
        raise GlslTranslationError(f"line {token_line(src, k)}: unexpected character {toks[k].text!r}")
    toks.append(EOF_TOK)
    return toks


def token_line(src: str, index: int) -> int:
    """The line of the ``index``-th token of ``src`` (error messages only)."""
    k = 0
    for m in _TOKEN.finditer(src):
        if m.group(1):
            if k == index:
                return src.count("\n", 0, m.start()) + 1
            k += 1
    return src.count("\n") + 1


# ------------------------------------------------------------------- expression values
@dataclass(slots=True)
class Val:
    text: str
    ty: Ty
    lit: str | None = None      # the literal's digits, while its type is still abstract


@functools.lru_cache(maxsize=4096)
def _literal(s: str) -> Val:
    """The value of literal ``s`` (shared: values are never changed)."""
    if s[:2].lower() == "0x":
        digits, suffix = (s[:-1], s[-1]) if s[-1] in "iu" else (s, "")
        return Val(digits + ("u" if suffix == "u" else ""), {"u": U32, "i": I32, "": AINT}[suffix], digits)
    if s[-1] in "fh":
        v = s[:-1]
        return Val(f"float16_t({v})" if s[-1] == "h" else _float_text(v), F16 if s[-1] == "h" else F32)
    if s[-1] in "iu":
        return Val(s[:-1] + ("u" if s[-1] == "u" else ""), U32 if s[-1] == "u" else I32)
    if any(c in s for c in ".eE"):
        return Val(_float_text(s), AFLOAT, s)
    return Val(s, AINT, s)


def _float_text(s):
    return s if any(c in s for c in ".eE") else s + ".0"


def convert(v: Val, to: Ty) -> Val:
    """``v`` as type ``to`` where WGSL converts implicitly (abstract literals only)."""
    if not v.ty.abstract or to.abstract:
        return v
    target = to.scalar
    digits = v.lit if v.lit is not None else v.text
    if target in ("f32", "f16"):
        text = _float_text(digits) if v.lit is not None else f"float({v.text})"
        text = f"float16_t({text})" if target == "f16" else text
    elif target == "u32":
        text = digits + "u" if v.lit is not None and not digits.startswith("-") else f"uint({v.text})"
    elif target == "i32":
        text = digits if v.lit is not None else f"int({v.text})"
    else:
        raise GlslTranslationError(f"cannot convert {v.text} to {target}")
    return Val(text, S(target))      # beside a vector, the converted literal stays a scalar


def unify(a: Val, b: Val) -> tuple[Val, Val]:
    """Abstract operands take the other operand's (scalar) type."""
    if a.ty.abstract and not b.ty.abstract:
        a = convert(a, S(b.ty.scalar))
    elif b.ty.abstract and not a.ty.abstract:
        b = convert(b, S(a.ty.scalar))
    elif a.ty.abstract and b.ty.abstract and a.ty != b.ty:
        a, b = convert(a, F32), convert(b, F32)
        a, b = Val(a.text, AFLOAT, a.text), Val(b.text, AFLOAT, b.text)
    return a, b


BINARY = [("||",), ("&&",), ("|",), ("^",), ("&",), ("==", "!="), ("<", ">", "<=", ">="), ("<<", ">>"),
          ("+", "-"), ("*", "/", "%")]
PRECEDENCE = {op: lvl for lvl, ops in enumerate(BINARY) for op in ops}
COMPARE = {"==", "!=", "<", ">", "<=", ">="}
VEC_COMPARE = {"==": "equal", "!=": "notEqual", "<": "lessThan", ">": "greaterThan", "<=": "lessThanEqual",
               ">=": "greaterThanEqual"}
TEMPLATED = {"vec2", "vec3", "vec4", "array", "bitcast", "ptr"}
SAME_TYPE_BUILTINS = {"min", "max", "clamp", "abs", "exp", "exp2", "log", "log2", "sqrt", "inverseSqrt", "pow",
                      "floor", "ceil", "trunc", "fract", "sign", "sin", "cos", "tan", "asin", "acos", "atan",
                      "sinh", "cosh", "tanh", "asinh", "acosh", "atanh", "fma", "mix", "step", "smoothstep",
                      "round", "atan2", "countOneBits", "reverseBits"}
RENAMED = {"round": "roundEven", "inverseSqrt": "inversesqrt", "atan2": "atan", "countOneBits": "bitCount", "reverseBits": "bitfieldReverse"}
# identifiers GLSL reserves are spelt as the kernel AST's printer spells them (one table)
_ident = glsl_name


def clear_caches():
    """Forget the translator's per-process memos of lines, literals and names (bounded; what a
    process that compiled many distinct kernels may want back, as ``clear_caches`` of the
    Vulkan runtime does)."""
    for memo in (_line_tokens, _tok, _literal):
        memo.cache_clear()
    clear_names()


@dataclass
class Fn:
    name: str
    params: list          # [(name, Ty)]
    ret: Ty | None
