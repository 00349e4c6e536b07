"""WGSL code generation: one module per archetype, each with ``render(kernel)`` returning
(WGSL text, bound logical buffers in binding order, workgroup counts). Importing this
package registers the lowerings of the ops it runs (``ops.registry.register_lowering``)."""
from ..ops.registry import OPS, register_lowering
from . import attention, gather, layout, matmul, pointwise, quantized, reduce, rows, rowfuse

RENDER = {"pointwise": pointwise.render, "multi": pointwise.render_multi, "reduce": reduce.render, "matmul": matmul.render,
          "gather": gather.render, "rows": rows.render, "norm": rows.render_norm,
          "attention": attention.render, "rowfuse": rowfuse.render, "quantized": quantized.render}

LOWERINGS = {"reduce_sum": reduce.lower_reduce, "reduce_mean": reduce.lower_reduce, "reduce_max": reduce.lower_reduce,
             "matmul": matmul.lower_matmul, "concat": layout.lower_concat, "slice_grad": layout.lower_slice_grad,
             "softmax": rows.lower_softmax, "log_softmax": rows.lower_softmax, "safe_softmax": rows.lower_softmax,
             "layer_norm": rows.lower_norm, "rms_norm": rows.lower_norm, "norm_stat": rows.lower_norm_stat,
             "scaled_dot_product_attention": attention.lower_attention, "attention_lse": attention.lower_attention,
             "attention_grad": attention.lower_attention_grad, **gather.LOWER, **quantized.LOWER}
for _op, _lower in LOWERINGS.items():
    register_lowering(_op, _lower)


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
    return od.lower is not None or od.extra.get("pointwise", False) or od.extra.get("layout", False)
