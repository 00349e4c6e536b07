"""WGSL code generation: one module per archetype, each with ``render(kernel)`` returning
(WGSL text, bound logical buffers in binding order, workgroup counts). Importing this
package attaches the lowerings to the op registry records."""
from ..ops.registry import OPS
from . import attention, gather, layout, matmul, pointwise, quantized, reduce, rows, rowfuse

RENDER = {"pointwise": pointwise.render, "multi": pointwise.render_multi, "reduce": reduce.render, "matmul": matmul.render,
          "gather": gather.render, "rows": rows.render, "norm": rows.render_norm,
          "attention": attention.render, "rowfuse": rowfuse.render, "quantized": quantized.render}

for _op in ("reduce_sum", "reduce_mean", "reduce_max"):
    OPS[_op].lower = reduce.lower_reduce
OPS["matmul"].lower = matmul.lower_matmul
OPS["concat"].lower = layout.lower_concat
OPS["slice_grad"].lower = layout.lower_slice_grad
OPS["softmax"].lower = OPS["log_softmax"].lower = OPS["safe_softmax"].lower = rows.lower_softmax
OPS["layer_norm"].lower = OPS["rms_norm"].lower = rows.lower_norm
OPS["norm_stat"].lower = rows.lower_norm_stat
for _op, _lower in (*gather.LOWER.items(), *quantized.LOWER.items()):
    OPS[_op].lower = _lower


def render(kernel, errors=None, array_limit=0, tiled_arrays=False):
    """``errors``: checked mode's error buffer for kernels with index checks (gather);
    ``array_limit``: the runtime binds arrays of buffers, at most this many buffers a kernel
    (``CompileOptions.binding_arrays``; 0: it does not); ``tiled_arrays``: merged tiled
    matmuls may share bodies too (not where a runtime renders them again its own way, binding
    their buffers in the same order: the cooperative-matrix variants of accelerated precision)."""
    if errors is not None:
        return gather.render(kernel, errors)
    if array_limit and kernel.archetype == "multi":
        return pointwise.render_multi(kernel, array_limit)
    if array_limit and tiled_arrays and kernel.archetype == "matmul":
        return matmul.render(kernel, array_limit)
    return RENDER[kernel.archetype](kernel)


# ops with a kernel for some shapes only: the predicate says which nodes
KERNEL_WHEN = {"scaled_dot_product_attention": attention.supported,
               "attention_lse": attention.lse_supported, "attention_grad": attention.grad_supported}
OPS["scaled_dot_product_attention"].lower = OPS["attention_lse"].lower = attention.lower_attention
OPS["attention_grad"].lower = attention.lower_attention_grad


def routing_constants() -> tuple:
    """The module constants that decide which kernels a graph gets (attention routing,
    matmul tiles): part of the plan cache's key, so that a benchmark or test that changes
    one (the decomposed attention baseline) never reads a plan compiled under another."""
    from . import flash, flash_split
    return (attention.MAX_ROW_WORK, attention.ACCELERATED_MAX_ROW_WORK, flash.LOOP_BOUND, matmul.TARGET_GROUPS, matmul.MAX_SPLIT, matmul.BLOCKS,
            matmul.DEEP_BLOCK, matmul.DEEP_MIN_K, matmul.DEEP_MIN_OUTPUTS, sorted(matmul.K_STEPS.items()),
            matmul.PEELED_ROWS, matmul.GEMV_MAX_ROWS, flash_split.AUTO_SPLIT, flash_split.TARGET_GROUPS,
            flash_split.MAX_SPLIT)


def has_kernel(t) -> bool:
    """Nodes (or ops, by name) the GPU runs directly; everything else is decomposed first."""
    op = t if isinstance(t, str) else t.op
    od = OPS[op]
    if op in KERNEL_WHEN:
        return not isinstance(t, str) and KERNEL_WHEN[op](t)
    return od.lower is not None or "wgsl" in od.extra or od.extra.get("layout", False)
