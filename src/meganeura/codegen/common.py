"""Pieces every WGSL archetype shares: bindings, literals, index maths, launch sizes."""
from __future__ import annotations

import math
import re

import numpy as np

# the WGSL type of each element type (the graph's dtypes name no language)
WGSL_TYPES = {"f32": "f32", "f16": "f16", "u32": "u32", "i32": "i32"}


def wgsl_type(dtype) -> str:
    """``dtype``'s WGSL scalar type (a ``graph.DType``)."""
    return WGSL_TYPES[dtype.name]

WG = 256                     # threads per workgroup for 1-D kernels
MAX_GROUPS = 65535           # per dispatch dimension
# loop iterations per invocation that a kernel's main loop stays within: llvmpipe gives each
# invocation 65535 loop back-edges in total (all loops, nested or not, count) and then leaves
# every loop early, silently; the rest of the budget is for the small loops around it
LOOP_BOUND = 1 << 15


def literal(value, dtype) -> str:
    """A WGSL literal of ``dtype`` (infinities and NaN as bit patterns)."""
    if dtype.name == "f32":
        v = float(value)
        if math.isnan(v):
            return "bitcast<f32>(0x7fc00000u)"
        if math.isinf(v):
            return "bitcast<f32>(0x7f800000u)" if v > 0 else "bitcast<f32>(0xff800000u)"
        return repr(float(np.float32(v)))
    if dtype.name == "f16":
        return f"{float(value)!r}h"
    if dtype.name == "i32":
        return f"{int(value)}i"
    return f"{int(value)}u"


class Bindings:
    """Distinct logical buffers a kernel touches, numbered in order of first use."""

    def __init__(self, order=()):
        """``order``: buffers bound at fixed positions (another kernel's bindings, which a
        variant must keep); each position is claimed by the first use of its buffer, and a
        position never claimed (a buffer the other kernel binds twice) is declared as
        words, unused (a Vulkan kernel's bindings run 0..N-1)."""
        self.bufs, self.types, self.written = list(order), [None] * len(order), set()
        self.scalar = set()          # bindings read element by element elsewhere: never vec4
        self.helpers_done = set()    # WGSL helper functions already in the module
        self.enable_f16 = False      # a function of the module computes in f16 without an f16 binding

    def array(self, bufs: tuple, ty: str, write=False) -> int:
        """A binding of the array of buffers ``bufs`` (the parts of a merged launch that share
        one body, each reading its own buffer through it), elements of WGSL type ``ty``; in the
        returned binding list it stands for its buffers, in order (``flat``)."""
        self.bufs.append(tuple(bufs))
        self.types.append(ty)
        if write:
            self.written.add(id(self.bufs[-1]))
        return len(self.bufs) - 1

    def flat(self) -> list:
        """The buffers bound, one per descriptor: an array binding's buffers in its place."""
        return [x for b in self.bufs for x in (b if isinstance(b, tuple) else (b,))]

    def index(self, buf, dtype, write=False) -> int:
        return self.slot(buf, wgsl_type(dtype), write)

    def slot(self, buf, ty: str, write=False) -> int:
        """``index`` by the WGSL name of the element type."""
        if write:
            self.written.add(id(buf))
        free = None
        for k, b in enumerate(self.bufs):
            if b is buf and self.types[k] == ty:
                return k
            if b is buf and self.types[k] is None and free is None:
                free = k
        if free is not None:
            self.types[free] = ty
            return free
        self.bufs.append(buf)
        self.types.append(ty)
        return len(self.bufs) - 1

    def decls(self) -> str:
        """Buffers the kernel only reads are declared ``read``: wgpu then needs no barrier
        between two dispatches that both only read them."""
        enable = ["enable f16;"] if self.enable_f16 or any("f16" in (t or "") for t in self.types) else []
        def of(b, ty):
            return f"binding_array<array<{ty}>, {len(b)}>" if isinstance(b, tuple) else f"array<{ty or 'u32'}>"
        return "\n".join(enable + [
            f"@group(0) @binding({k}) var<storage, {'read_write' if id(b) in self.written else 'read'}> "
            f"b{k}: {of(b, ty)};" for k, (b, ty) in enumerate(zip(self.bufs, self.types))])


def grid(n_groups: int) -> tuple[int, int, int]:
    """Workgroup counts for ``n_groups`` groups, folded into 2-D past the per-dimension cap."""
    n_groups = max(1, int(n_groups))
    if n_groups <= MAX_GROUPS:
        return (n_groups, 1, 1)
    y = -(-n_groups // MAX_GROUPS)
    return (-(-n_groups // y), y, 1)


GROUP_INDEX = "wid.x + wid.y * nwg.x"   # linear workgroup index under ``grid``
NOWHERE = 0xFFFFFFFF        # a merged launch's ``locate``: the part id past the last range (spare groups)

ENTRY = ("@compute @workgroup_size({wg})\n"
         "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32, "
         "@builtin(num_workgroups) nwg: vec3<u32>) {{\n")


def coords(var: str, shape, prefix="c") -> list[str]:
    """WGSL lines splitting flat index ``var`` into coordinates ``c0..`` of ``shape``."""
    if not shape:
        return []
    lines, r = [f"    var {prefix}r = {var};"], len(shape)
    for d in range(r - 1, 0, -1):
        lines.append(f"    let {prefix}{d} = {prefix}r % {shape[d]}u; {prefix}r = {prefix}r / {shape[d]}u;")
    lines.append(f"    let {prefix}0 = {prefix}r;")
    return lines


def coalesce(shape, strides_list):
    """(shape, [strides]) with size-1 dims dropped and neighbouring dims merged wherever
    every stride vector of ``strides_list`` walks them as one (the outer stride is the inner
    stride times the inner size, broadcast zeros included): a kernel indexing contiguous
    views of a 4-D tensor splits its flat index once, not into four coordinates."""
    kept = [d for d, n in enumerate(shape) if n != 1]
    out_shape, out_strides = [], [[] for _ in strides_list]
    for d in kept:
        if out_shape and all(st[-1] == s[d] * shape[d] for st, s in zip(out_strides, strides_list)):
            out_shape[-1] *= shape[d]
            for st, s in zip(out_strides, strides_list):
                st[-1] = s[d]
        else:
            out_shape.append(shape[d])
            for st, s in zip(out_strides, strides_list):
                st.append(s[d])
    return tuple(out_shape), [tuple(st) for st in out_strides]


def offset_expr(offset, strides, prefix="c", dims=None) -> str:
    """``offset + sum(c_d * stride_d)`` over dims with non-zero stride."""
    dims = range(len(strides)) if dims is None else dims
    terms = [str(offset) + "u"] if offset else []
    terms += [f"{prefix}{d}" if strides[i] == 1 else f"{prefix}{d} * {strides[i]}u"
              for i, d in zip(range(len(strides)), dims) if strides[i] != 0]
    return " + ".join(terms) if terms else "0u"


def broadcast_view_strides(view, out_shape):
    """Strides that read ``view`` (right-aligned, size-1 dims broadcast) at ``out_shape`` coords."""
    lead = len(out_shape) - len(view.shape)
    st = [0] * lead
    for n, m, s in zip(view.shape, out_shape[lead:], view.strides):
        st.append(0 if n == 1 and m != 1 else s)
    return st


def contiguous_batch_strides(shape, batch, mat_size):
    """Per batch-dim element strides of a dense operand with batch dims ``shape``, read at
    the broadcast ``batch`` coordinates (0 where the operand is broadcast)."""
    lead = len(batch) - len(shape)
    st, acc = [0] * len(batch), mat_size
    for d in range(len(batch) - 1, lead - 1, -1):
        n = shape[d - lead]
        st[d] = 0 if n == 1 else acc
        acc *= n
    return st


BUFFER_USE = re.compile(r"\bb(\d+)\[")      # a binding indexed, as every renderer writes it


def batch_offset_terms(a, b, batch):
    """How a batched product's batch index splits into coordinates ``z{d}``: the dims
    (d, size), innermost first, and each operand's element offset terms (its view's offset,
    then ``z{d} * stride``; broadcast batch dims contribute nothing). The WGSL and GLSL
    renderers print the lines in their own syntax."""
    sa = contiguous_batch_strides(a.shape[:-2], batch, a.shape[-2] * a.shape[-1])
    sb = contiguous_batch_strides(b.shape[:-2], batch, b.shape[-2] * b.shape[-1])
    dims, aoff, boff = [], [f"{a.offset}u"], [f"{b.offset}u"]
    for d in range(len(batch) - 1, -1, -1):
        dims.append((d, batch[d]))
        if sa[d]:
            aoff.append(f"z{d} * {sa[d]}u")
        if sb[d]:
            boff.append(f"z{d} * {sb[d]}u")
    return dims, aoff, boff


def bind_roles(b: Bindings, members, text: str, index: str) -> str:
    """``text``, a body rendered on a Bindings of its own (``members[0]``; the other members
    are the Bindings of bodies of the same text for other parts), with its bindings bound on
    ``b``: a binding every member gives the same buffer stays one binding, the others become
    an array of the members' buffers indexed by ``index`` (the part's position among them)."""
    first, uses = members[0], []
    for r, ty in enumerate(first.types):
        bufs = [m.bufs[r] for m in members]
        written = id(first.bufs[r]) in first.written
        if all(x is bufs[0] for x in bufs):
            uses.append(f"b{b.slot(bufs[0], ty, written)}[")
        else:
            uses.append(f"b{b.array(bufs, ty, written)}[{index}][")
    return BUFFER_USE.sub(lambda m: uses[int(m.group(1))], text)


def form_key(pb: Bindings, text) -> tuple:
    """What decides that two parts rendered on Bindings of their own (``pb``) share a body:
    the text, the element types of its bindings and which it writes."""
    return (text, tuple(pb.types), tuple(id(x) in pb.written for x in pb.bufs), pb.enable_f16)
