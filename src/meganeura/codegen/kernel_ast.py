"""A small typed kernel AST, printed as WGSL (wgpu) or as GLSL 4.50 (glslang, the direct
Vulkan backend): the way off "render WGSL, parse it, print GLSL" (``codegen/glsl.py``).

A renderer that builds its kernel here gets both languages from one tree; the Vulkan
finishing stage (``compilation.vulkan``) prints such kernels as GLSL directly instead of
translating their WGSL. Families move here one at a time (``pointwise_ast.ast_kernel`` says
which kernels have moved); the others keep their WGSL templates and the translator.

The tree is what the printers must decide between the languages, no more:

- expressions carry their WGSL type name (``u32``, ``i32``, ``f32``, ``f16``): GLSL
  declarations need it, WGSL's ``let`` does not;
- ``Group`` is a pair of parentheses the kernel writes; otherwise WGSL prints binary
  operators by precedence and GLSL parenthesises every one;
- literals, conversions and storage declarations are spelled per language.

While the translator still exists, the GLSL printer writes exactly what it writes for the
same WGSL (``tests/test_kernel_ast.py`` checks it kernel by kernel), so the SPIR-V of a
moved kernel is the same as before.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .common import ENTRY, literal

GLSL_NAMES = {"round": "roundEven", "inverseSqrt": "inversesqrt"}
GLSL_TYPE = {"u32": "uint", "i32": "int", "f32": "float", "f16": "float16_t", "bool": "bool"}
# WGSL binding precedence of the binary operators the kernels use (higher binds tighter)
PRECEDENCE = {"*": 3, "/": 3, "%": 3, "+": 2, "-": 2, "<": 1, ">": 1, "<=": 1, ">=": 1, "==": 1, "!=": 1}
# the header lines of every kernel of the Vulkan backend (IEEE signed zeros, infinities and NaN
# kept by the driver: the translator's ``glsl.IEEE_PRESERVE``, which goes with it)
GLSL_F16 = ["#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require",
            "#extension GL_EXT_shader_16bit_storage : require"]
GLSL_IEEE = ["#extension GL_EXT_spirv_intrinsics : require",
             'spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4466], 4461, 32);']


# ----------------------------------------------------------------------------- expressions
@dataclass(frozen=True)
class Name:
    id: str
    ty: str


@dataclass(frozen=True)
class Lit:
    value: object
    dtype: object       # a graph dtype (``graph.f32``...)
    text: str = ""      # as a template wrote it (a float literal of an op record's WGSL)

    @property
    def ty(self):
        return self.dtype.name


@dataclass(frozen=True)
class Bin:
    op: str
    a: object
    b: object

    @property
    def ty(self):
        return "bool" if PRECEDENCE[self.op] == 1 else self.a.ty


@dataclass(frozen=True)
class Call:
    """A builtin function of the same meaning in both languages (``GLSL_NAMES`` where GLSL
    spells it otherwise)."""
    fn: str
    args: tuple
    ty: str


@dataclass(frozen=True)
class Neg:
    e: object

    @property
    def ty(self):
        return self.e.ty


@dataclass(frozen=True)
class Group:
    e: object

    @property
    def ty(self):
        return self.e.ty


@dataclass(frozen=True)
class Field:
    """A component of a builtin vector (``wid.x``)."""
    e: Name
    name: str
    ty: str = "u32"


@dataclass(frozen=True)
class Load:
    binding: int
    index: object
    ty: str


@dataclass(frozen=True)
class Convert:
    ty: str
    e: object


# ------------------------------------------------------------------------------ statements
@dataclass(frozen=True)
class Let:
    name: str
    e: object


@dataclass(frozen=True)
class Var:
    name: str
    e: object


@dataclass(frozen=True)
class Assign:
    name: str
    e: object


@dataclass(frozen=True)
class Store:
    binding: int
    index: object
    value: object


@dataclass(frozen=True)
class ReturnIf:
    cond: object


@dataclass(frozen=True)
class CallIf:
    """``if (cond) { fn(args); return; }``: a merged launch handing its workgroup to a part."""
    cond: object
    fn: str
    args: tuple


@dataclass(frozen=True)
class Line:
    """Statements the WGSL text writes on one line (GLSL: one a line)."""
    stmts: tuple


@dataclass(frozen=True)
class Buffer:
    ty: str             # element type
    write: bool


@dataclass(frozen=True)
class Function:
    """A function without a result (a part of a merged launch), ``params`` names."""
    name: str
    params: tuple
    body: tuple


@dataclass(frozen=True)
class ComputeKernel:
    """One compute entry point over storage buffers ``b0..``, with the builtins ``wid``
    (workgroup id), ``lid`` (local invocation index) and ``nwg`` (workgroup counts), after
    ``functions``."""
    buffers: tuple
    workgroup: int
    body: tuple
    functions: tuple = ()


WID, LID, NWG = Name("wid", "vec3<u32>"), Name("lid", "u32"), Name("nwg", "vec3<u32>")


def add(*terms):
    """``terms`` summed left to right (one term: itself)."""
    e = terms[0]
    for t in terms[1:]:
        e = Bin("+", e, t)
    return e


def u32(n: int) -> Lit:
    from ..graph import u32 as U32
    return Lit(int(n), U32)


# -------------------------------------------------------------------------------- printers
class WgslPrinter:
    def expr(self, e, parent=0) -> str:
        if isinstance(e, Name):
            return e.id
        if isinstance(e, Lit):
            return e.text or literal(e.value, e.dtype)
        if isinstance(e, Group):
            return f"({self.expr(e.e)})"
        if isinstance(e, Field):
            return f"{self.expr(e.e)}.{e.name}"
        if isinstance(e, Load):
            return f"b{e.binding}[{self.expr(e.index)}]"
        if isinstance(e, Convert):
            return f"{e.ty}({self.expr(e.e)})"
        if isinstance(e, Neg):
            return f"-{self.expr(e.e, 4)}"
        if isinstance(e, Call):
            return f"{e.fn}({', '.join(self.expr(a) for a in e.args)})"
        p = PRECEDENCE[e.op]
        # left-associative: the right operand binds tighter to print without parentheses
        text = f"{self.expr(e.a, p)} {e.op} {self.expr(e.b, p + 1)}"
        return f"({text})" if p < parent else text

    def stmt(self, s) -> str:
        if isinstance(s, Line):
            return " ".join(self.stmt(x) for x in s.stmts)
        if isinstance(s, Let):
            return f"let {s.name} = {self.expr(s.e)};"
        if isinstance(s, Var):
            return f"var {s.name} = {self.expr(s.e)};"
        if isinstance(s, Assign):
            return f"{s.name} = {self.expr(s.e)};"
        if isinstance(s, Store):
            return f"b{s.binding}[{self.expr(s.index)}] = {self.expr(s.value)};"
        if isinstance(s, ReturnIf):
            return f"if ({self.expr(s.cond)}) {{ return; }}"
        if isinstance(s, CallIf):
            return f"if ({self.expr(s.cond)}) {{ {s.fn}({', '.join(self.expr(a) for a in s.args)}); return; }}"
        raise TypeError(f"not a statement: {s!r}")

    def function(self, f: Function) -> str:
        params = ", ".join(f"{p.id}: {p.ty}" for p in f.params)
        return f"fn {f.name}({params}) {{\n" + "\n".join("    " + self.stmt(s) for s in f.body) + "\n}"

    def kernel(self, k: ComputeKernel) -> str:
        enable = ["enable f16;"] if any(b.ty == "f16" for b in k.buffers) else []
        decls = enable + [f"@group(0) @binding({j}) var<storage, {'read_write' if b.write else 'read'}> "
                          f"b{j}: array<{b.ty}>;" for j, b in enumerate(k.buffers)]
        fns = "".join("\n" + self.function(f) for f in k.functions)
        return ("\n".join(decls) + ("\n" + fns if fns else "") + "\n\n" + ENTRY.format(wg=k.workgroup)
                + "\n".join("    " + self.stmt(s) for s in k.body) + "\n}\n")


class GlslPrinter:
    def expr(self, e) -> str:
        if isinstance(e, Name):
            return e.id
        if isinstance(e, Lit):
            return self.literal(e)
        if isinstance(e, Group):
            return f"({self.expr(e.e)})"
        if isinstance(e, Field):
            return f"{self.expr(e.e)}.{e.name}"
        if isinstance(e, Load):
            return f"b{e.binding}[{self.expr(e.index)}]"
        if isinstance(e, Convert):
            return f"{GLSL_TYPE[e.ty]}({self.expr(e.e)})"
        if isinstance(e, Neg):
            return f"(-{self.expr(e.e)})"
        if isinstance(e, Call):
            return f"{GLSL_NAMES.get(e.fn, e.fn)}({', '.join(self.expr(a) for a in e.args)})"
        return f"({self.expr(e.a)} {e.op} {self.expr(e.b)})"

    @staticmethod
    def literal(e: Lit) -> str:
        if e.text:
            return e.text
        name = e.dtype.name
        if name == "f32":
            v = float(e.value)
            if math.isnan(v) or math.isinf(v):     # the bit patterns WGSL's literal has
                return "uintBitsToFloat(" + literal(v, e.dtype)[len("bitcast<f32>("):]
            return literal(v, e.dtype)
        if name == "f16":
            return f"float16_t({float(e.value)!r})"
        if name == "i32":
            return f"({int(e.value)})" if int(e.value) < 0 else str(int(e.value))
        return literal(e.value, e.dtype)

    def stmts(self, s) -> list[str]:
        if isinstance(s, Line):
            return [x for t in s.stmts for x in self.stmts(t)]
        if isinstance(s, (Let, Var)):
            return [f"{GLSL_TYPE[s.e.ty]} {s.name} = {self.expr(s.e)};"]
        if isinstance(s, Assign):
            return [f"{s.name} = {self.expr(s.e)};"]
        if isinstance(s, Store):
            return [f"b{s.binding}[{self.expr(s.index)}] = {self.expr(s.value)};"]
        if isinstance(s, ReturnIf):
            return [f"if ({self.expr(s.cond)}) {{", "    return;", "}"]
        if isinstance(s, CallIf):
            return [f"if ({self.expr(s.cond)}) {{", f"    {s.fn}({', '.join(self.expr(a) for a in s.args)});",
                    "    return;", "}"]
        raise TypeError(f"not a statement: {s!r}")

    def signature(self, f: Function) -> str:
        return f"void {f.name}({', '.join(f'{GLSL_TYPE[p.ty]} {p.id}' for p in f.params)})"

    def kernel(self, k: ComputeKernel) -> str:
        head = ["#version 450"] + (GLSL_F16 if any(b.ty == "f16" for b in k.buffers) else []) + GLSL_IEEE
        head.append(f"layout(local_size_x = {k.workgroup}, local_size_y = 1, local_size_z = 1) in;")
        head += [f"layout(std430, set = 0, binding = {j}) {'' if b.write else 'readonly '}buffer B{j}_ "
                 f"{{ {GLSL_TYPE[b.ty]} b{j}[]; }};" for j, b in enumerate(k.buffers)]
        head += [self.signature(f) + ";" for f in k.functions]        # prototypes first, as WGSL needs none
        for f in k.functions:
            head += [self.signature(f) + " {"] + ["    " + ln for s in f.body for ln in self.stmts(s)] + ["}"]
        body = ["uvec3 wid = gl_WorkGroupID;", "uint lid = gl_LocalInvocationIndex;", "uvec3 nwg = gl_NumWorkGroups;"]
        body += [line for s in k.body for line in self.stmts(s)]
        return "\n".join(head + ["void main() {"] + ["    " + ln for ln in body] + ["}"]) + "\n"


def print_wgsl(k: ComputeKernel) -> str:
    return WgslPrinter().kernel(k)


def print_glsl(k: ComputeKernel) -> str:
    return GlslPrinter().kernel(k)
