"""Precision policy: which matmuls, convolutions and attention gradients accelerated
precision gives f16 operands (forward casts, persistent f16 copies of weights, backward
operands rounded in the product's loads or scaled and cast), with the measurements behind
each threshold. ``accelerated_rewrite`` is the rewrite ``passes.lower`` applies."""
from __future__ import annotations

from .. import codegen

F16_COPY = "@f16"      # name suffix of a parameter's persistent f16 copy (never a user name: no '@' in module paths)


def f16_copy_name(name: str) -> str:
    return name + F16_COPY


def _accelerated(t, forward) -> bool:
    """``t`` is a forward f32 matmul that accelerated precision gives f16 operands."""
    return t.op == "matmul" and t.id in forward and t.dtype.name == "f32" and not t.attrs.get("out_dtype")


CONV_OPS = ("conv2d", "conv2d_input_grad", "conv2d_weight_grad")


def _accelerated_conv(t, forward) -> bool:
    """``t`` is a forward f32 convolution: its matmul takes f16 operands (the columns rounded
    in the implicit GEMM's loads)."""
    return t.op == "conv2d" and t.id in forward and t.dtype.name == "f32"


def _conv_macs(t) -> int:
    """Multiply-adds of a convolution op's matmul (forward, input or weight gradient)."""
    if t.op == "conv2d_weight_grad":
        ct = t.inputs[1]
        return t.size * ct.shape[0] * ct.shape[2] * ct.shape[3]
    ct, w = t.inputs[0], t.inputs[1]
    return (t if t.op == "conv2d" else ct).size * w.shape[1] * w.shape[2] * w.shape[3]


def _layout_chain(x):
    """(the tensor that layout ops (reshape, permute, ...) make ``x`` a view of, those ops from
    it to ``x``, outermost first)."""
    from ..schedule import VIEW_OPS
    chain = []
    while x.op in VIEW_OPS:
        chain.append(x)
        x = x.inputs[0]
    return x, chain


def _viewed_parameter(x):
    """(parameter, layout ops from it to ``x``, outermost first) when ``x`` is an f32
    parameter or a layout view of one, else (None, [])."""
    x, chain = _layout_chain(x)
    if x.op == "parameter" and x.dtype.name == "f32":
        return x, chain
    return None, []


def f16_weights(forward_targets) -> frozenset:
    """Names of the parameters that accelerated forward matmuls read as operands (directly
    or through layout views). Each gets a persistent f16 copy on the device, written when
    the weight is set or updated instead of cast by every call."""
    from ..reference import needed_nodes
    nodes = needed_nodes(forward_targets)
    forward = {t.id for t in nodes}
    names = set()
    for t in nodes:
        if _accelerated(t, forward) or _accelerated_conv(t, forward):
            names.update(p.name for p in (_viewed_parameter(x)[0] for x in t.inputs) if p is not None)
    return frozenset(names)


# A gradient operand of an accelerated backward matmul is scaled so that its largest
# magnitude is this before it is rounded to f16: gradients are often far below f16's
# smallest normal (6e-5; a token-mean loss over 512 tokens gives logit gradients near 1e-8),
# and 2^14 leaves room below f16's largest (65504) while keeping small elements normal.
GRAD_SCALE_TARGET = 2.0 ** 14
# A backward matmul takes f16 operands from this many multiply-adds on: scaling a gradient
# costs a max reduction and a cast (three launches, shared by the matmuls reading it), which
# smaller products do not win back. H200: SmolLM2 (128 tokens) with every backward matmul
# in f16 launched 1401 -> 1855 kernels per forward+backward and gained only 11.2 -> 10.0 ms;
# after the outputs fusion (2^20 here) 1259 -> 1734 launches lost, 8.85 -> 9.49 ms, although
# its matmuls' GPU time fell 5.32 -> 3.91 ms.
BACKWARD_F16_MIN_MACS = 2 ** 28
# A backward matmul or convolution takes its gradient operands in f32 and rounds them
# to f16 precision in its loads (``codegen.matmul_ast.round_f16_functions``: the tensor-core kernel scales
# its share of each into f16's range by a power of two), so it needs no launch of its own to
# scale them: from this many multiply-adds on it runs on f16 operands.
BACKWARD_MATMUL_F16_MIN_MACS = 2 ** 20
# ... up to this depth (K): deeper, the scaled cast. The tensor-core kernel
# keeps a K split of up to coopmat.RAW_CHUNKS chunks in registers to take the rounded
# operand's peak, and reads a longer one twice (a pre-pass), which a deep product pays more
# than the two launches of the cast.
BACKWARD_ROUND_MAX_K = 4096
# ... and a convolution's product up to this depth: its weight gradient's K (an image's
# positions, or the batch's) is split few ways, and a long split reads the rounded operand
# twice (a pre-pass for its peak). H200, accelerated train steps at 4096 / 1024 / 512:
# ResNet-50 7.09 / 7.16 / 7.44 ms, U-Net 4.04 / 3.99 / 4.07, Whisper 4.49 / 4.46 / 4.44
# (its 1500-deep weight gradient took 124.7 us rounded, 59.4 cast; the cast's launches
# about 92 more); with the scaled cast for every convolution 7.48-7.55 / 4.27-4.29 / 4.43-4.48.
BACKWARD_CONV_ROUND_MAX_K = 1024


def precision_constants() -> tuple:
    """The module constants that decide accelerated precision's rewrite: part of the plan
    cache's key (a test or benchmark that changes one never reads another's plan)."""
    return (GRAD_SCALE_TARGET, BACKWARD_F16_MIN_MACS, BACKWARD_MATMUL_F16_MIN_MACS, BACKWARD_ROUND_MAX_K,
            BACKWARD_CONV_ROUND_MAX_K)


def _backward_f16(t, forward) -> str | None:
    """How accelerated precision gives backward f32 matmul or convolution ``t`` (one the
    autodiff added) f16 operands: "round" (its gradient operands read in f32 and rounded in
    its product's loads, ``_rounds_in_loads``: from BACKWARD_MATMUL_F16_MIN_MACS on), "scale"
    (scaled and cast before it: from BACKWARD_F16_MIN_MACS on), or None where it stays f32
    (too small, or not such a product). Matmuls that only a state update or the optimizer
    reads stay f32."""
    if t.op not in ("matmul",) + CONV_OPS or t.id in forward or t.id not in t.graph.backward_ids \
            or t.dtype.name != "f32" or t.attrs.get("out_dtype"):
        return None
    rounds = _rounds_in_loads(t, forward)
    macs = t.size * _depth(t) if t.op == "matmul" else _conv_macs(t)
    if macs < (BACKWARD_MATMUL_F16_MIN_MACS if rounds else BACKWARD_F16_MIN_MACS):
        return None
    return "round" if rounds else "scale"


def _depth(t) -> int:
    """K of matmul ``t``."""
    a = t.inputs[0]
    return a.shape[-2] if t.attrs["ta"] else a.shape[-1]


# the operand of a convolution gradient that is the cotangent (the other is a forward value)
_COTANGENT = {"conv2d_input_grad": 0, "conv2d_weight_grad": 1}


def _rounds_in_loads(t, forward) -> bool:
    """Backward matmul or convolution ``t`` reads its gradient operands in f32, rounded to f16
    by its product's loads (``f16_round``), rather than scaled and cast before it: up to
    BACKWARD_ROUND_MAX_K deep (a convolution's product: BACKWARD_CONV_ROUND_MAX_K), and for a
    convolution only where its one gradient operand is the cotangent, which reaches the
    product through views alone (the other operand, the weight or the im2col of the input,
    is a forward value)."""
    if t.op == "matmul":
        return _depth(t) <= BACKWARD_ROUND_MAX_K
    from ..ops.conv import gradient_product_depth
    at = _COTANGENT.get(t.op)
    return at is not None and gradient_product_depth(t) <= BACKWARD_CONV_ROUND_MAX_K and \
        [x.id in forward for x in t.inputs] == [i != at for i in range(len(t.inputs))]


def _accelerated_attention_grad(t) -> bool:
    """``t`` is an attention gradient that the flash backward takes, with head dims the
    tensor-core kernels take (``codegen.flash_grad_coop``): its dO gets scaled. Elsewhere
    (short rows: decomposed, f32) scaling would only add launches."""
    if t.op != "attention_grad" or t.id not in t.graph.backward_ids or t.dtype.name != "f32":
        return False
    from ..codegen import attention, flash_coop
    q, v = t.inputs[0], t.inputs[2]
    return attention.grad_supported(t) and max(q.shape[-1], v.shape[-1]) <= flash_coop.MAX_DIM


def accelerated_rewrite(forward_targets, f16_weights=frozenset()):
    """Accelerated precision: matmuls read f16 operands and accumulate in f32, and so do
    the matmuls of convolutions (decomposed here around them: the im2col columns are cast,
    which the implicit GEMM does in its loads). Forward matmuls (those the fetched outputs
    and loss depend on) cast theirs; a parameter named in
    ``f16_weights`` is read from its persistent f16 copy (a state of the lowered graph,
    ``f16_copy_name``) rather than cast on every call. Backward matmuls cast forward values
    alike and read gradient operands in f32, rounded to f16 precision as the kernel loads
    them (``f16_round``: the tensor-core kernel scales each workgroup's share into f16's
    range by a power of two and unscales its product); so do backward convolutions, whose
    cotangent reaches the product through views (``_rounds_in_loads``). Deeper products
    scale each gradient operand by GRAD_SCALE_TARGET over its
    largest magnitude before the cast (one max reduction per gradient, shared by the
    matmuls that read it), dividing the product by the scales after. A gradient holding an
    inf or NaN makes the product NaN where it reaches (a convolution's whole product; strict
    poisons only the rows and columns that touch it): either way the step is lost.

    An attention gradient that the flash backward takes reads dO, and D = rowsum(dO * O),
    divided by dO's largest magnitude, and its gradient is multiplied back: the flash backward on
    tensor cores (``codegen.flash_grad_coop``) rounds dO and dS to f16, which would flush a
    small loss's cotangents to zero."""
    from ..ops import cast, emit
    from ..ops.elementwise import maximum
    from ..ops.registry import OPS
    from ..ops.reduce import amax
    from ..reference import needed_nodes
    forward = {t.id for t in needed_nodes(forward_targets)}
    scaled = {}       # original gradient tensor id -> (its scaled f16 copy, its peak magnitude)
    unit = {}         # dO's id -> (dO / its peak, the peak); D's id -> D / dO's peak

    def operand(x, new):
        p, chain = _viewed_parameter(x)
        if p is None or p.name not in f16_weights:
            return new
        g, name = new.graph, f16_copy_name(p.name)
        v = g.states.get(name) or g.state(name, p.shape, "f16")
        for view in reversed(chain):
            v = emit(view.op, [v], **view.attrs)
        return v

    def gradient_operand(x, new):
        # the peak is read by the cast and by the product's epilogue as it is (a scalar
        # computed from it, scale or inverse, would be a launch of its own between them);
        # scaling by the power of two GRAD_SCALE_TARGET is exact, and comes after the division
        # so that no finite gradient overflows on the way
        if x.id not in scaled:
            peak = maximum(amax(emit("abs", [new])), 1e-30)     # all zeros: any finite scale
            scaled[x.id] = (cast(new / peak * GRAD_SCALE_TARGET, "f16"), peak)
        return scaled[x.id]

    def attention_grad(t, ins):
        do, delta = t.inputs[3], t.inputs[5]
        if do.id not in unit:
            peak = maximum(amax(emit("abs", [ins[3]])), 1e-30)     # all zeros: any finite scale
            unit[do.id] = (ins[3] / peak, peak)
        do_unit, peak = unit[do.id]
        if delta.id not in unit:
            unit[delta.id] = ins[5] / peak
        return emit(t.op, ins[:3] + [do_unit, ins[4], unit[delta.id]] + ins[6:], **t.attrs) * peak

    def product(a, b, ta=False, tb=False):
        return codegen.matmul.accelerate(a, b, ta, tb)

    def apply(t, ops):
        """``t`` over ``ops`` with its matmul on f16 operands: a matmul, or a convolution
        decomposed around one (its im2col, col2im and batch sum stay f32)."""
        if t.op == "matmul":
            return product(*ops, t.attrs["ta"], t.attrs["tb"])
        return OPS[t.op].extra["decompose"](*ops, **t.attrs, product=product)

    def rw(t, ins):
        if _accelerated(t, forward) or _accelerated_conv(t, forward):
            return apply(t, [operand(x, n) for x, n in zip(t.inputs, ins)])
        if _accelerated_attention_grad(t):
            return attention_grad(t, ins)
        path = _backward_f16(t, forward)
        if path == "round":
            # gradient operands stay f32, rounded to f16 by the product's loads
            rounded = tuple(x.id not in forward for x in t.inputs)
            ops = [n if r else operand(x, n) for x, n, r in zip(t.inputs, ins, rounded)]
            if t.op == "matmul":
                return codegen.matmul.accelerate(*ops, t.attrs["ta"], t.attrs["tb"], f16_round=rounded)
            # the cotangent by the tensor it views: layout ops fold (a reshape of a reshape
            # is one), so the product's operand may view it through another chain
            grads = {_layout_chain(n)[0].id for n, r in zip(ops, rounded) if r}

            def rounding_product(a, b, ta=False, tb=False):
                flags = tuple(_layout_chain(v)[0].id in grads for v in (a, b))
                if flags.count(True) != 1:      # an unscaled cast would flush small gradients
                    raise RuntimeError(f"{t.op}: the product's operands {a.op} and {b.op} do not view the "
                                       "cotangent once")
                return codegen.matmul.accelerate(a, b, ta, tb, f16_round=flags)
            return OPS[t.op].extra["decompose"](*ops, **t.attrs, product=rounding_product)
        if path == "scale":
            ops, unscale = [], []
            for x, n in zip(t.inputs, ins):
                if x.id in forward:
                    ops.append(operand(x, n))
                else:
                    v, peak = gradient_operand(x, n)
                    ops.append(v)
                    unscale.append(peak)
            y = apply(t, ops)
            for peak in unscale:     # one factor at a time: their product could underflow
                y = y * (1.0 / GRAD_SCALE_TARGET) * peak
            return y
        return None
    return rw


def refresh_f16_copies(targets, updates, f16_weights) -> dict:
    """The f16 copy of every updated parameter that has one, computed from its new value:
    appended to ``targets`` (a list of the lowered graph) with its copy's name added to
    ``updates``, so an optimizer step writes the master weight and its copy in one pass."""
    from ..ops import cast
    updates = dict(updates or {})
    for i, name in list(updates.items()):
        if name in f16_weights:
            updates[len(targets)] = f16_copy_name(name)
            targets.append(cast(targets[i], "f16"))
    return updates
