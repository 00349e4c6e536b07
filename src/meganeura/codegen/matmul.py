"""The matmul archetype: C[b] = op(A[b]) @ op(B[b]) with batch broadcasting.

A TM x TN output tile per workgroup of WY x WX threads (the block, ``BLOCKS``), each thread
holding (TM / WY) x (TN / WX) outputs as vec4 rows in 4 x 4 groups; K in steps of 8 or 16
through double-buffered workgroup memory laid out as vec4, so each step of K reads one
vector per 4 rows or columns a thread owns. Shapes are baked in, so bounds checks are
emitted only for dimensions that are not tile multiples. Operands are dense (strided views
are copied first).

The lowering and tile planning are in ``matmul_tiles``, the GEMV kernels in ``gemv``, the
kernels' trees in ``matmul_ast``; this module re-exports the planning names.
"""
from __future__ import annotations

import numpy as np

from .gemv import render_gemv
from .matmul_tiles import (BLOCKS, DEEP_BLOCK, DEEP_MIN_K, DEEP_MIN_OUTPUTS, GEMV_MAX_ROWS, GEMV_TARGET_GROUPS, K_STEPS,
                           MAX_SPLIT, SHALLOW_K, SHALLOW_MIN_GROUPS, TARGET_GROUPS, accelerate, block_of, gemv_columns,
                           gemv_split, k_step, lower_matmul, parse_block, plan_tiles, rounded_operands, split_k)

# the names of the matmul modules, as ``matmul.<name>``
__all__ = ["BLOCKS", "DEEP_BLOCK", "DEEP_MIN_K", "DEEP_MIN_OUTPUTS", "GEMV_MAX_ROWS", "GEMV_TARGET_GROUPS", "K_STEPS",
           "MAX_SPLIT", "PEELED_ROWS", "SHALLOW_K", "SHALLOW_MIN_GROUPS", "TARGET_GROUPS", "accelerate", "block_of",
           "gemv_columns", "gemv_split", "k_step", "lower_matmul", "parse_block", "peeled", "plan_tiles", "render",
           "render_gemv", "rounded_operands", "split_k"]


# Products with A read along K from a buffer (not transposed, not gathered) on the blocks of
# at least PEELED_ROWS rows (128 threads, 16 x 8 or 8 x 8 outputs each) take two changes:
# - A is staged transposed ([k][m]) by four scalar stores per vec4 read along K; one vec4 of
#   padding per staged row of A puts the two rows a warp writes at once on different banks;
# - the K loop's first fetch and last product are peeled off, so its body has no branches.
# H200, GPU TFLOP/s: 1024^3 30.1 -> 33.7, 4096^3 43.6 -> 44.1, Whisper-tiny's 1500 x 384 x 1536
# (B transposed) 22.5 -> 27.3. Elsewhere they lost (GPU us a dispatch): the 64 tile of 256
# threads, SmolVLA's matmuls 14.3 -> 21.5; A transposed, ResNet-50's input gradients 36 -> 58
# and weight gradients with their bias sums 20 -> 30; im2col gathers, ResNet-50's
# convolutions 49 -> 52 and Whisper-tiny's 61 -> 80.
PEELED_ROWS = 128


def peeled(TM, ta, gathers) -> bool:
    return TM >= PEELED_ROWS and not ta and not gathers


def a_padding(peel) -> int:
    """vec4s of padding per staged row of A: one in the peeled form."""
    return 1 if peel else 0


def _launch_form(parts) -> tuple:
    """(each part's block, peeled): one workgroup memory layout and loop form for a launch,
    peeled when every part is."""
    blocks = [_block(p) for p in parts]
    return blocks, all(peeled(blk[0], p.spec["ta"], p.spec.get("gathers")) for blk, p in zip(blocks, parts))


def render(kernel, array_limit=0):
    """Tiled matmul; sibling matmuls that share A (``spec["parts"]``, q/k/v or gate/up
    projections) run as one launch, each owning a range of x workgroups. ``array_limit``:
    the runtime binds arrays of buffers, at most this many buffers a kernel, and alike parts
    share one body (``matmul_ast.render_shared_tree``) where that stays within the limit.
    Built on the typed kernel AST (``matmul_ast``); a part it does not build
    (``matmul_ast.supported``) is an error."""
    if kernel.spec.get("gemv"):
        return render_gemv(kernel)
    from .kernel_ast import printed, printed_made
    from .matmul_ast import render_shared_tree, render_tree
    parts = kernel.spec.get("parts", [kernel])
    if array_limit and len(parts) > 1:
        made = render_shared_tree(kernel, _launch_form)     # None: no two parts alike (or not built)
        if made is not None and len(made[1]) <= array_limit:
            return printed(made[0]), made[1], made[2]
    return printed_made(kernel, render_tree(kernel, _launch_form), "a part's output store or computed operand")


def _block(kernel) -> tuple:
    """(TM, TN, WY, WX) of one tiled matmul: as lowering chose it, else as ``plan_tiles`` would."""
    if "tile" in kernel.spec:
        return block_of(kernel.spec)
    a = kernel.reads[0]
    M, N = kernel.shape[-2:]
    K = a.shape[-2] if kernel.spec["ta"] else a.shape[-1]
    nb = int(np.prod(kernel.spec.get("batch", kernel.shape[:-2]), dtype=np.int64))
    return plan_tiles(M, N, K, nb)[1]
