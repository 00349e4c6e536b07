"""The matmul archetype's lowering and tile planning (no kernel text): a matmul node becomes
a GEMV or a tiled kernel (with K split where the grid is small, its partial sums added by
a pointwise kernel), its tile and split chosen for the shape (``plan_tiles``); accelerated
precision's f16 operands (``accelerate``); what fusion and the renderers read of a spec
(``block_of``, ``k_step``, ``rounded_operands``)."""
from __future__ import annotations

import os

import numpy as np

from ..schedule import Kernel, View, contiguous_strides
from .common import LOOP_BOUND
from .pointwise import sum_kernel


def lower_matmul(t, ins, out, materialize, temp):
    if t.size == 0:
        return []          # nothing to write (a zero-size batch or output dim)
    if (t.inputs[0].shape[-2] if t.attrs["ta"] else t.inputs[0].shape[-1]) == 0:
        from .layout import fill
        return [fill(out, 0, "matmul.empty_k")]     # an empty sum: zeros
    a, b = (materialize(v, x) for v, x in zip(ins, t.inputs))
    m, n = t.shape[-2:]
    k = t.inputs[0].shape[-2] if t.attrs["ta"] else t.inputs[0].shape[-1]
    spec = {"ta": t.attrs["ta"], "tb": t.attrs["tb"], "batch": tuple(t.shape[:-2])}
    if t.attrs.get("f16_round"):        # (flags as ``accelerate`` emitted them)
        spec["f16_round"] = t.attrs["f16_round"]
    nb = int(np.prod(t.shape[:-2], dtype=np.int64))
    if m <= GEMV_MAX_ROWS and -(-n // 8) <= 65535 and "f16_round" not in spec:
        split = gemv_split(k, spec["tb"])
        if split == 1:
            return [Kernel("gemv", "matmul", {**spec, "gemv": True}, out, [a, b])]
        return _split_k(t, out, temp, Kernel("gemv", "matmul", {**spec, "gemv": True, "split": split},
                                             temp((nb, split, m, n), out.dtype), [a, b]), split)
    # f16 operands (accelerated precision) keep square tiles: the cooperative-matrix kernels
    # that replace them choose their own tile by it and share the K splits
    f32 = all(v.dtype.name == "f32" for v in t.inputs) and "f16_round" not in spec
    tile, block, split = plan_tiles(m, n, k, nb, BLOCKS if f32 else ())
    spec.update(tile=tile, split=split, tk=k_step(tile), block=block)
    if split == 1:
        return [Kernel("matmul", "matmul", {**spec, "split": 1}, out, [a, b])]
    part = temp((nb, split, m, n), out.dtype)
    return _split_k(t, out, temp, Kernel("matmul", "matmul", spec, part, [a, b]), split)


def _split_k(t, out, temp, mm, split):
    """Split-K: ``mm`` writes the partial products side by side, then their sum runs as a
    pointwise kernel (one strided view per split), which fusion treats like any other:
    epilogues, merging."""
    part = mm.out
    m, n = t.shape[-2:]
    batch = tuple(t.shape[:-2])
    bst = tuple(s * split for s in contiguous_strides(batch + (m, n))[:len(batch)])
    leaves = [View(part.buf, t.shape, bst + (n, 1), part.offset + s * m * n, out.dtype) for s in range(split)]
    return [mm, sum_kernel("matmul.splitk_sum", leaves, out)]


def accelerate(a, b, ta, tb, f16_round=None):
    """A matmul in accelerated precision: f16 operands (cast where they are not), f32
    accumulation and output. ``f16_round``: (a, b) flags of operands kept f32 and rounded to
    f16 precision by the kernel as it loads them, scaled into f16's range (a gradient: see
    ``matmul_ast.round_f16_functions``), instead of cast."""
    from ..ops import cast, emit
    if not f16_round or not any(f16_round):
        return emit("matmul", [cast(a, "f16"), cast(b, "f16")], ta=ta, tb=tb, out_dtype="f32")
    ops = [x if r else cast(x, "f16") for x, r in zip((a, b), f16_round)]
    return emit("matmul", ops, ta=ta, tb=tb, out_dtype="f32", f16_round=tuple(bool(r) for r in f16_round))


# K elements per double-buffered step (one barrier each), by tile. Workgroup memory: 2
# stages x 2 operands x TK x T floats (16 KiB for 64 x 16). The 64 tile, with 16 per step
# and more K splits (plan_tiles), took SmolVLA's expert 2.25 -> 1.78 ms and ResNet-50's
# batch-1 inference 2.34 -> 1.65 ms on an H200.
K_STEPS = {32: 8, 64: 16, 128: 8}


def block_of(spec) -> tuple:
    """(TM, TN, WY, WX) of a tiled matmul: its TM x TN output tile and its WY x WX threads
    (rows by columns), each thread holding (TM / WY) x (TN / WX) outputs in 4 x 4 groups.
    ``spec["block"]`` when set (``plan_tiles`` chose it), else square from ``spec["tile"]``:
    16 x 16 threads (8 x 8 for the 32 tile)."""
    if spec.get("block"):
        return tuple(spec["block"])
    t = spec["tile"]
    w = 8 if t == 32 else 16
    return (t, t, w, w)


def parse_block(text) -> tuple:
    """``TMxTN/WYxWX`` -> (TM, TN, WY, WX), checked: every thread holds whole 4 x 4 groups."""
    try:
        tile, threads = text.split("/")
        TM, TN = (int(v) for v in tile.split("x"))
        WY, WX = (int(v) for v in threads.split("x"))
    except ValueError:
        raise ValueError(f"matmul block {text!r}: expected TMxTN/WYxWX, e.g. 128x64/16x16") from None
    if TM % (4 * WY) or TN % (4 * WX) or WY * WX > 1024 or min(TM, TN, WY, WX) <= 0:
        raise ValueError(f"matmul block {text!r}: TM must be a multiple of 4 x WY and TN of 4 x WX, "
                         f"with at most 1024 threads")
    return TM, TN, WY, WX


def k_step(tile) -> int:
    """K per step of ``tile``: MEGANEURA_MATMUL_TK (8, 16 or 32) or the tile's default."""
    forced = os.environ.get("MEGANEURA_MATMUL_TK")
    if not forced:
        return K_STEPS[tile]
    tk = int(forced)
    if tk not in (8, 16, 32) or tk * tile > 4096:
        raise ValueError(f"MEGANEURA_MATMUL_TK={tk}: expected 8, 16 or 32 (at most 4096 / tile {tile})")
    return tk


def _env_count(name, default) -> int:
    """A positive integer from the environment (a sweep's switch), else ``default``."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        value = int(raw, 10)
    except ValueError:
        value = 0
    if value < 1 or not raw.isascii():
        raise ValueError(f"{name}={raw!r}: expected a positive integer (unset: {default})")
    return value


# enough workgroups to occupy a large GPU (an H200 has 132 SMs); MEGANEURA_MATMUL_GROUPS
# overrides it for sweeps (the 128-wide tile needs half as many of its own)
TARGET_GROUPS = _env_count("MEGANEURA_MATMUL_GROUPS", 256)
# K splits at most (MEGANEURA_MATMUL_MAX_SPLIT for sweeps). 32 instead of 8 gives the few
# output tiles of batch-1 convolutions more workgroups; H200, ms of a call: U-Net inference
# 1.87 -> 1.63, ResNet-50 batch-1 1.40 -> 1.20 (its im2col matmuls 23 -> 20 us), ResNet-50
# forward+loss+backward 10.2 -> 9.9, SmolVLA 1.49 -> 1.45. Extra workgroups (a target of 512
# instead of 256) lost on ResNet-50's batch-8 inference 2.99 -> 3.21.
MAX_SPLIT = _env_count("MEGANEURA_MATMUL_MAX_SPLIT", 32)


# A product at most SHALLOW_K deep on a grid of SHALLOW_MIN_GROUPS workgroups or more is not
# split: its sum of partials costs a launch and a pass over the output that the few K steps a
# split saves do not win back. H200, ms (splitting as before -> whole from 192 workgroups ->
# from 12): SmolLM2's train step (weight gradients over 128 tokens) 11.14 -> 10.71 -> 10.26;
# U-Net train step 4.80 -> 4.79 -> 4.74 (all shallow products whole: 4.88), inference 1.54 either way
SHALLOW_K = 128
SHALLOW_MIN_GROUPS = 12


# f32 blocks (TM, TN, WY, WX) of 128 threads with 16 x 8 or 8 x 8 outputs each, the largest
# that still yields this many workgroups before K splits; smaller products take the square
# 64 tile of 256 threads (4 x 4 outputs each) with K splits. H200, TFLOP/s of GPU time
# against the 128 x 128 tile of 256 threads (8 x 8 outputs each): 4096^3 39.7 -> 43.5,
# 2048^3 38.2 -> 41.8; 128 x 64: Whisper's 1500 x 384 x 1536 20.3 -> 23.8, 1024^3 26.5 -> 28.1
BLOCKS = (((128, 128, 8, 16), 256), ((128, 64, 16, 8), 128))
# Deep products too small for those blocks (at least DEEP_MIN_K deep, DEEP_MIN_OUTPUTS
# outputs) still take the 128 x 64 block, with K splits making up the workgroups, not the
# 64 tile of 256 threads with 4 x 4 outputs each. H200, GPU us: Whisper-tiny's fc2 (1500 x
# 1536 x 384) 95 -> 78 with 4 splits, its second convolution (384 x 1152 x 1500) 100 -> 79;
# 64 x 64 tiles of 128 threads took them to 89 and 98. (128-thread 64 x 64 tiles as the
# fallback of every smaller product were slower: SmolVLA, the U-Net, SmolLM2.)
DEEP_BLOCK = (128, 64, 16, 8)
DEEP_MIN_K = 1024
DEEP_MIN_OUTPUTS = 1 << 18


def plan_tiles(M, N, K, nb, blocks=BLOCKS):
    """(tile, block, K splits): the first of ``blocks`` with enough workgroups, else 64-wide
    tiles (256 threads each; 32-wide tiles of 64 threads were slower on every measured
    shape) with K split so that more workgroups share the work. ``tile`` (the block's rows)
    is what the cooperative-matrix kernels choose their own tile by."""
    groups = lambda tm, tn: -(-M // tm) * -(-N // tn) * nb  # noqa: E731
    forced_block = os.environ.get("MEGANEURA_MATMUL_BLOCK")     # TMxTN/WYxWX, for sweeps
    forced_tile = os.environ.get("MEGANEURA_MATMUL_TILE")
    fitting = [blk for blk, least in blocks if groups(*blk[:2]) >= least]
    if forced_block:
        block = parse_block(forced_block)
    elif forced_tile:
        block = block_of({"tile": int(forced_tile)})
    elif fitting:
        block = fitting[0]
    elif not blocks and groups(128, 128) >= TARGET_GROUPS // 2:
        block = block_of({"tile": 128})      # f16 operands: the square 128 tile
    elif blocks and K >= DEEP_MIN_K and M * N * nb >= DEEP_MIN_OUTPUTS:
        block = DEEP_BLOCK
    else:
        block = block_of({"tile": 64})
    tile = block[0]
    # up to MAX_SPLIT K splits of at least 64 each, toward TARGET_GROUPS workgroups. Splits of at
    # least 128 cut the U-Net's launches 247 -> 219 but cost it 5-10% (H200)
    split = int(os.environ.get("MEGANEURA_MATMUL_SPLIT", "0"))
    if not split:
        n = groups(*block[:2])
        whole = K <= SHALLOW_K and n >= SHALLOW_MIN_GROUPS
        split = 1 if whole else max(1, min(-(-TARGET_GROUPS // n), K // 64, MAX_SPLIT))
    tk = k_step(tile)
    split = max(split, -(-K // (tk * (LOOP_BOUND - 1))))   # each split loops K / split / tk + 1 times
    return tile, block, -(-K // split_k(K, split, tk))   # no empty splits


def split_k(K, split, tk):
    """K per split: a whole number of K steps of ``tk``."""
    return -(-(-(-K // split)) // tk) * tk


def rounded_operands(spec) -> tuple:
    """(a, b): which operands of a matmul's ``spec`` are rounded to f16 in its loads."""
    return spec.get("f16_round") or (False, False)


GEMV_MAX_ROWS = 4
GEMV_TARGET_GROUPS = 256    # enough workgroups to occupy a large GPU


def gemv_split(K, tb) -> int:
    """K splits of a GEMV whose lanes would otherwise loop past ``LOOP_BOUND``: B
    transposed, at least 32 lanes stride over K; B plain, one thread walks all of K. Only
    K decides it, so sibling GEMVs (one merged launch) split alike."""
    return -(-K // (LOOP_BOUND * (32 if tb else 1)))


def gemv_columns(N) -> int:
    """Output columns per 256-thread workgroup of the B-transposed GEMV: 8 (32 lanes over K
    each) for wide outputs, fewer, with more lanes each, for narrow ones so that the GPU
    still gets enough workgroups."""
    for c in (8, 4, 2):
        if -(-N // c) >= GEMV_TARGET_GROUPS:
            return c
    return 2
