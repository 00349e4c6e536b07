"""The quantized archetype's GEMV (up to ``quantized.GEMV_MAX_ROWS`` rows of x: decoding).

Each output column is owned by L lanes (L = 256 / columns per workgroup) that stride over
its row's groups of 8 weights, so consecutive lanes read consecutive bytes of the blocks,
then sum through workgroup memory. Two fusions of ``passes/fuse_quantized.py`` shape it:

- ``spec["parts"]``: sibling GEMVs over the same x (the q, k and v projections) as one
  launch, each part owning a range of workgroups, with a weight (and block type) of its own;
- ``spec["pair"]``: a second weight over the same x in the same loop (SwiGLU's gate beside
  up), its product handed to the epilogue as ``acc2`` and never stored;
- ``spec["prologue"]``: x is a layer / RMS norm's input: the workgroup first takes each
  row's statistics, then normalises (and scales, shifts) x as it loads it.
"""
from __future__ import annotations


def render_gemv(kernel):
    from .kernel_ast import printed_made
    from .quantized_gemv_ast import gemv_kernel
    return printed_made(kernel, gemv_kernel(kernel), "its output store")
