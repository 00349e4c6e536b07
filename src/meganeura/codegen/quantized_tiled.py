"""The quantized archetype's tiled product (more than ``quantized.GEMV_MAX_ROWS`` rows of
x: prompt processing).

A 64 x 64 output tile per workgroup of 256 threads, each thread holding a 4 x 4 block of
it (4 rows, 4 columns as a vec4). K advances 32 columns a step: each thread dequantizes
one group of 8 weights (``qgroup``) of one of the tile's 64 weight rows into workgroup
memory, and loads 2 vec4s of the 64 x 32 tile of x, both stored [k][64] as vec4s; then
each step of k is two vec4 reads and four vec4 FMAs a thread. 16 KiB of workgroup memory
(WebGPU's default limit).
"""
from __future__ import annotations


T = 64          # rows and columns of the output tile


def render_tiled(kernel):
    s = kernel.spec
    M, N = s["m"], s["n"]
    if -(-M // T) > 65535 or -(-N // T) > 65535:
        raise NotImplementedError(f"quantized_matmul: ({M}, {N}) outputs is past one launch's 65535 x 65535 tiles")
    from .kernel_ast import printed_made
    from .quantized_tiled_ast import tiled_kernel
    return printed_made(kernel, tiled_kernel(kernel), "its output store")
