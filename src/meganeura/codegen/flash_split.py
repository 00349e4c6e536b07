"""Flash attention forward split over keys (flash-decoding): how many splits, and the
kernel that combines the splits' partial outputs.

A sequence with few query tiles per head (Whisper-tiny's encoder: 6 heads x 24 tiles of
64 rows = 144 workgroups) leaves most of a large GPU idle. With S splits, S workgroups
share a query tile, each walking its share of the key tiles (``flash.py``, ``spec["split"]``)
and writing its output normalised by its own row sum, O_s, and its row log-sum-exp, lse_s
(-inf for a split that saw no unmasked key). The combine kernel then takes, per row,

    m = max_s lse_s,  w_s = exp(lse_s - m),  O = sum_s w_s O_s / sum_s w_s,  lse = m + log(sum_s w_s)

and a row no split saw an unmasked key of gives O = 0 and lse = +inf, as the unsplit
kernel does (the backward reads that LSE). The combine ends in ``store_out``, so the
output's epilogues (transposed stores, residual adds) fuse into it as into the unsplit
kernel.

``MEGANEURA_FLASH_SPLIT`` = S forces S splits (1: off), in the backward too
(``flash_grad.splits``, at most its walked tiles); unset, ``auto_splits`` chooses
(``AUTO_SPLIT``).
"""
from __future__ import annotations

import os


# Measured on an H200 (bench/attention.py --split 2,3,4,6,8, GPU timestamps, 64 query rows a
# workgroup): Whisper-tiny's encoder attention (144 query tiles) 255 us unsplit, 204 (S=2),
# 186 (3), 178 (4), 174 (6), 190 (8); SmolLM2's causal GQA prefill (288 tiles) 314, 271, 257,
# 254, 273, 281. The rule below picks 6 and 3.
AUTO_SPLIT = True
TARGET_GROUPS = 768      # workgroups to aim for: a few per SM on a 132-SM GPU
MAX_SPLIT = 6
MIN_TILES = 4            # key tiles per split at least: fewer and the combine outweighs the gain


def auto_splits(groups: int, key_tiles: int) -> int:
    """Splits for a forward of ``groups`` workgroups over ``key_tiles`` key tiles: enough
    to reach about TARGET_GROUPS workgroups, at most MAX_SPLIT, and at least MIN_TILES key
    tiles per split."""
    want = -(-TARGET_GROUPS // max(1, groups))
    return max(1, min(want, MAX_SPLIT, key_tiles // MIN_TILES))


def splits(groups: int, key_tiles: int) -> int:
    """S for a flash forward: MEGANEURA_FLASH_SPLIT if set, else the automatic rule
    (where AUTO_SPLIT is on; else 1)."""
    raw = os.environ.get("MEGANEURA_FLASH_SPLIT", "").strip()
    if raw:
        try:
            s = int(raw)
        except ValueError:
            s = 0
        if s < 1:
            raise ValueError(f"MEGANEURA_FLASH_SPLIT must be a positive integer (1: no split), got {raw!r}")
        return s
    return auto_splits(groups, key_tiles) if AUTO_SPLIT else 1


def render_combine(kernel):
    """The combine: one invocation per output element (row, column) reads the S partial
    LSEs of its row and the S partial values of its element; column 0 also writes the
    row's LSE when the kernel has that second output. Printed from its tree
    (``flash_split_ast``)."""
    from .flash_split_ast import combine_tree
    from .kernel_ast import printed_made
    return printed_made(kernel, combine_tree(kernel), "its output store")
