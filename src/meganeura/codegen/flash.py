"""Flash attention forward: scaled dot-product attention for sequences too long for the
one-row kernel (``attention.py``), without materialising the Lq x Lk scores.

A workgroup owns BQ query rows of one (batch, head) and walks the keys in tiles of
``BK`` = 64: each tile's scores S = Q K^T live in registers, an online softmax keeps each
row's running max and sum, and O += P V accumulates in registers; O is divided by the row
sum once, at the end, and stored through ``store_out`` (fused epilogues work).

Threads: ``TY = BQ / 4`` row groups x ``TX`` = 16 lanes. A thread owns 4 consecutive
query rows and, per key tile, the 4 keys ``tx + 16c`` (a 4x4 block of S: 8 vec4 loads
from workgroup memory per 64 FMAs) and the 4 value columns ``4tx..4tx+3`` of every
64-column chunk of the output (one vec4 of P and one of V per 16 FMAs). A row's 16 lanes
share its max through workgroup memory; row sums stay per lane and combine once, at the end.

Workgroup memory (f32): Q (BQ x D, staged once), one 64x64 area that holds a chunk of K
(64 keys x 64 dims; D > 64 runs several chunks) and then a chunk of V (64 keys x 64
columns), and P (64 keys x BQ rows, also the lanes' max/sum exchange). Bank conflicts: K
rows are XOR-swizzled by key so 8 consecutive keys read one dim from 8 different banks;
P's rows (vec4 over 4 query rows) are swizzled by key the same way for the P writes.

Masks: a float mask is added to the scaled scores, an integer mask keeps non-zero
positions, ``is_causal`` keeps j <= i and skips the key tiles entirely above the
diagonal; grouped heads read kv head h // G; a fully masked row gives zeros. q, k, v and
the mask are read through their strided views (head splits and transposes cost nothing).

With a second output (``kernel.outs``, the ``attention_lse`` node scheduled with the
output's) the kernel also stores each row's log-sum-exp, max + log(sum), for the backward
pass (``flash_grad.py``).

Split over keys (``spec["split"]`` = S > 1, flash-decoding): S workgroups share a query
tile, split s walking key tiles [s * nt / S, (s + 1) * nt / S) of the nt that tile needs;
``out`` is then (S, *batch, Hq, Lq, Dv) of partial outputs, each normalised by its own row
sum, and the second output (S, *batch, Hq, Lq) their log-sum-exps (-inf where a split saw
no unmasked key). ``flash_split.py`` combines them.
"""
from __future__ import annotations

import contextvars
import os

from .common import LOOP_BOUND

BK = 64              # keys per tile
TX = 16              # lanes per row group (4 keys each: 64)
CH = 64              # columns of a K (dims) or V chunk in workgroup memory
MAX_DIM = 256


DEFAULT_SMEM = 32768     # bytes: lavapipe, Apple GPUs and most desktop GPUs offer it

# The adapter's workgroup memory for the compile under way (the compiler sets it around
# scheduling): lowering fixes the split over keys (its buffers' sizes depend on it) by the
# query rows per workgroup the kernel will render with, before the tiles are sized.
ADAPTER_SMEM = contextvars.ContextVar("flash_adapter_smem", default=0)


def smem_floats(budget=None) -> int:
    """Workgroup memory the tiles may use, in f32s: MEGANEURA_FLASH_SMEM, else ``budget``
    (the adapter's limit, which the compile stage records in the kernel's spec), else 32
    KiB. Larger tiles pay: Whisper-tiny inference 4.17 -> 3.77 ms with an H200's 48 KiB."""
    return int(os.environ.get("MEGANEURA_FLASH_SMEM", budget or DEFAULT_SMEM)) // 4


def _pad4(n):
    return -(-n // 4) * 4


def rows_per_group(d, budget=None) -> int | None:
    """BQ, query rows per workgroup: the largest that fits Q, the K/V chunk and P."""
    for bq in (64, 32, 16, 8):
        if bq * _pad4(d) + BK * CH + BK * bq <= smem_floats(budget):
            return bq
    return None


def _chunks(n):
    """(start, width) of the 64-wide chunks of ``n`` (padded to 4) columns."""
    n = _pad4(n)
    return [(c, min(CH, n - c)) for c in range(0, n, CH)]


def _stage_trips(total, threads):
    """(loop trips, copies per trip) to stage ``total`` elements with ``threads``."""
    per = -(-total // threads)
    unroll = min(per, 8)
    return -(-per // unroll), unroll


def loop_trips(lk, d, dv) -> int:
    """Loop back-edges one invocation takes (software drivers stop after 65535 in all)."""
    bq = rows_per_group(d)
    th = 4 * bq
    per_tile = 1
    for _, w in _chunks(d):
        per_tile += _stage_trips(BK * w, th)[0] + w // 4
    for _, w in _chunks(dv):
        per_tile += _stage_trips(BK * w, th)[0] + BK // 4
    return -(-lk // BK) * per_tile + _stage_trips(bq * _pad4(d), th)[0]


def supported(t) -> bool:
    """Shapes this kernel takes: f32, head dims up to 256, same batch dims for q, k and v,
    and at most LOOP_BOUND loop back-edges per invocation (Lk up to about 40k at D = 64);
    others decompose."""
    q, k, v = t.inputs[:3]
    return shapes_ok(q, k, v, t.shape[:-2]) and rows_per_group(q.shape[-1]) is not None \
        and loop_trips(k.shape[-2], q.shape[-1], v.shape[-1]) <= LOOP_BOUND


def shapes_ok(q, k, v, lead) -> bool:
    """q, k and v are f32 with head dims up to 256 and one set of batch dims, which the
    output's leading dims ``lead`` (*batch, Hq) are too."""
    if q.ndim < 3 or q.dtype.name != "f32" or k.dtype is not q.dtype or v.dtype is not q.dtype:
        return False
    lq, lk, d, dv = q.shape[-2], k.shape[-2], q.shape[-1], v.shape[-1]
    if not (0 < lq and 0 < lk and 0 < d <= MAX_DIM and 0 < dv <= MAX_DIM):
        return False
    if not (q.shape[:-3] == k.shape[:-3] == v.shape[:-3] and k.shape[-3] == v.shape[-3]
            and q.shape[-3] % k.shape[-3] == 0 and tuple(lead) == tuple(q.shape[:-2])):
        return False
    return True


def render(kernel):
    """(WGSL, bound buffers, workgroups), printed from the kernel's tree (``flash_ast``)."""
    from .flash_ast import tree
    from .kernel_ast import printed_made
    return printed_made(kernel, tree(kernel), "its output store")
