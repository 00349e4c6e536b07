"""The matmul archetype's few-row kernels (GEMV, up to ``matmul_tiles.GEMV_MAX_ROWS`` rows
of A: one-token decoding), with a norm of A's rows computed in the loads where fusion put
one there (``spec["prologue"]``)."""
from __future__ import annotations


def render_gemv(kernel):
    """Few-row products (one-token decoding): the weight is streamed once, coalesced.
    Built on the typed kernel AST (``gemv_ast``); an output store the tree does not build
    (``kernel_ast_matmul.store_supported``) is an error.

    B transposed ([N, K], the linear layout): 32 lanes share one output column and stride
    over K, then combine through workgroup memory (8 columns per workgroup). B plain
    ([K, N]): one thread per output column walks K. Sibling GEMVs that share A (q, k and v
    projections) run as one launch (``spec["parts"]``): each owns a range of workgroups."""
    from .gemv_ast import gemv_kernel
    from .kernel_ast import printed_made
    return printed_made(kernel, gemv_kernel(kernel), "its output store")
