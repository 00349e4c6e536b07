"""Fusion passes over the kernel IR (lists of ``schedule.Kernel`` in launch order).

Each pass is a function ``(kernels, max_bindings) -> kernels`` registered in
``FUSION_PASSES`` by name; ``MEGANEURA_NO_FUSE=name,...`` (or ``all``) switches passes off
for debugging. Passes only move work between kernels: every buffer keeps its meaning, so
the memory planner and the runtime need no knowledge of them.

- ``epilogue``: a pointwise kernel that is the only reader of another kernel's output
  becomes that kernel's epilogue (matmul + bias/activation/residual, reductions + scale,
  softmax/norm + mul, ...), so the intermediate is never stored.
- ``prologue``: a pointwise kernel read only by a reduction is evaluated in its loads; a
  norm read only by GEMVs is computed inside them.
- ``rows``: reductions read only by a pointwise kernel that broadcasts them back over the
  reduced axes run with it as one row kernel.
- ``normstats``: a norm statistic the backward reads is stored by the forward norm kernel
  over the same rows.
- ``stores``: a copy of a kernel's whole output into a slice of another buffer (a
  concat) becomes a second store of that kernel.
- ``outputs``: a pointwise kernel computes the pointwise kernels that write its operands
  and stores their values too (AdamW's moments with its parameter update).
- ``hoist``: kernels that read only inputs and parameters move to the front, so that
  ``horizontal`` can merge the same work of every layer.
- ``quantized``: GEMVs on quantized weights take the norm they read, pair (gate and up)
  and merge (q, k, v) as matmul GEMVs do (``fuse_quantized.py``).
- ``horizontal``: independent pointwise kernels close together run as one launch.
"""
from __future__ import annotations

from .fuse_epilogue import fuse_epilogues
from .fuse_index import EPILOGUE_ARCHETYPES, _Uses, _in_place
from .fuse_merge import MAX_TILED_PARTS, merge_horizontal
from .fuse_prologue import fuse_norm_producer, fuse_pointwise_operands, fuse_prologues, fuse_rows
from .fuse_quantized import fuse_quantized
from .fuse_stores import _view_through, fuse_copy_stores, fuse_norm_stats, fuse_producer_outputs, hoist_independent

# names the passes' modules define, as ``fuse.<name>`` (tests and docstrings use them)
__all__ = ["EPILOGUE_ARCHETYPES", "FUSION_PASSES", "MAX_TILED_PARTS", "_Uses", "_in_place", "_view_through",
           "fuse_copy_stores", "fuse_epilogues", "fuse_norm_producer", "fuse_norm_stats", "fuse_pointwise_operands",
           "fuse_producer_outputs", "fuse_prologues", "fuse_rows", "hoist_independent", "merge_horizontal",
           "run_fusion"]


FUSION_PASSES = {"epilogue": fuse_epilogues, "prologue": fuse_prologues, "rows": fuse_rows,
                 "normstats": fuse_norm_stats, "stores": fuse_copy_stores, "outputs": fuse_producer_outputs,
                 "hoist": hoist_independent, "quantized": fuse_quantized, "horizontal": merge_horizontal}


def run_fusion(kernels, disabled=frozenset(), max_bindings=8):
    held = uses = None      # while in-place passes run: the kernels with their holes, and one index
    for name, fn in FUSION_PASSES.items():
        if name in disabled:
            continue
        in_place = getattr(fn, "in_place", None)
        if in_place is not None:
            if held is None:
                held = list(kernels)
                uses = _Uses(held)
            in_place(held, uses, max_bindings)
            continue
        if held is not None:
            kernels, held = [k for k in held if k is not None], None
        kernels = fn(kernels, max_bindings)
    return kernels if held is None else [k for k in held if k is not None]
