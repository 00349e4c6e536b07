"""Flash attention backward: dQ, dK and dV from Q, K, V, dO, the forward's log-sum-exp
(LSE) and D = rowsum(dO * O), without materialising the Lq x Lk matrices.

The probabilities are recomputed tile by tile, P = exp(scale * Q K^T + mask - LSE), and
with dP = dO V^T and dS = P * (dP - D):

- ``dq``: a workgroup owns BX = 32 query rows of one (batch, head) and walks the key
  tiles: dQ = scale * dS K, accumulated in registers;
- ``dkv``: a workgroup owns BX = 32 keys of one (batch, kv head) and walks the query
  tiles of every query head of its group: dV = P^T dO and dK = scale * dS^T Q, so grouped
  heads are summed inside the kernel. It writes two outputs (dK through ``store_out``,
  where a fused epilogue runs; dV as ``kernel.outs[0]``).

Both are one template over "own" rows X (queries for dq, keys for dkv) and "walked" rows
Y of BY = 32 per tile. Threads: 8 x 16; thread (ty, tx) owns the 4 x 2 block of the
32 x 32 score tile at own rows 4ty..4ty+3 and walked rows tx + 16c, and the output columns
4tx..4tx+3 of every 64-column chunk of its four rows: a walked row's P or dS for those four
rows is one vec4 (PS holds each walked row's 32 values as 8 vec4s, the thread's swizzled to
ty ^ (y % 8)), so the accumulation reads 2 vec4s per 16 FMAs. (With 16 x 16 threads of 2 x
2 it read 3 values per 8, and Whisper-tiny's backward was bound by workgroup memory.)
Operands reach workgroup memory in
chunks of 64 columns as vec4s over 4 columns, column-group-major with a row stride of 33
vec4s, so the score loop reads 8 different banks per quarter warp and the accumulation
(over Y rows, lanes along columns) too. With D <= 64 the K (dq) or Q and dO (dkv) chunks
staged for the scores are reused by the accumulation; wider heads stage them again.

Masks as in the forward (a float mask added, an integer mask keeping non-zero positions,
``is_causal`` keeping j <= i, whose tiles entirely above the diagonal are skipped). Rows
and keys past the ends read zeros and their probabilities are zero; a fully masked row
has LSE +inf, so its probabilities and gradients are zeros.
"""
from __future__ import annotations

import numpy as np

from .common import LOOP_BOUND
from . import flash_split
from .flash import MAX_DIM, _chunks, _stage_trips, shapes_ok

BX = BY = 32         # own rows per workgroup, walked rows per tile
TX = 16              # lanes per row group
RO = 4               # own rows per thread: 4ty..4ty+3
TY = BX // RO        # row groups
TH = TY * TX         # threads (128)
PAD = 33             # vec4 stride between column groups of a staged chunk
CHUNK_VEC4 = 16 * PAD


def loop_trips(kind, lq, lk, d, dv, group) -> int:
    """Loop back-edges one invocation takes (LOOP_BOUND keeps software drivers exact)."""
    st = _stage_trips(BY * 64, TH)[0]
    per_tile = 1
    for _, w in _chunks(d):
        per_tile += 2 * st + w // 4
    for _, w in _chunks(dv):
        per_tile += 2 * st + w // 4
    acc = [d] if kind == "dq" else [d, dv]
    per_tile += sum(len(_chunks(n)) * (BY // 4 + (st if len(_chunks(n)) > 1 else 0)) for n in acc)
    tiles = -(-lk // BY) if kind == "dq" else group * -(-lq // BY)
    return tiles * per_tile


def supported(t) -> bool:
    """An ``attention_grad`` node this kernel takes: f32, head dims up to 256, one set of
    batch dims, within LOOP_BOUND (Whisper and SmolLM2 shapes are far inside)."""
    q, k, v, do = t.inputs[:4]
    if not shapes_ok(q, k, v, do.shape[:-2]) or max(q.shape[-1], v.shape[-1]) > MAX_DIM:
        return False
    lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    group = q.shape[-3] // k.shape[-3]
    return max(loop_trips(kind, lq, lk, d, dv, group) for kind in ("dq", "dkv")) <= LOOP_BOUND


def splits(kind, q_shape, k_shape) -> int:
    """S workgroups per own tile, each walking 1/S of the walked tiles into a partial
    gradient (``flash_split.splits``'s rule: about its TARGET_GROUPS workgroups, at least
    MIN_TILES tiles each; MEGANEURA_FLASH_SPLIT forces it). Whisper-tiny's encoder has
    6 heads x 47 tiles of 32 rows: 282 workgroups of 128 threads, two an SM of an H200."""
    *batch, hq, lq, _ = q_shape
    hkv, lk = k_shape[-3], k_shape[-2]
    nb = int(np.prod(batch, dtype=np.int64))
    if kind == "dq":
        groups, walked = nb * hq * -(-lq // BX), -(-lk // BY)
    else:
        groups, walked = nb * hkv * -(-lk // BX), (hq // hkv) * -(-lq // BY)
    return max(1, min(flash_split.splits(groups, walked), walked))


def render(kernel):
    """(WGSL, bound buffers, workgroups), printed from the kernel's tree (``flash_grad_ast``)."""
    from .flash_grad_ast import tree
    from .kernel_ast import printed_made
    return printed_made(kernel, tree(kernel), "its output store")
