"""Dependency levels: which dispatches of a step may run together between two barriers.

Each dispatch (or copy) touches byte ranges of memory blocks, each access a read or a write.
Dispatch ``i`` depends on an earlier dispatch ``j`` when their ranges overlap on one block and
at least one of the two writes (read-after-write, write-after-read, write-after-write);
two reads never conflict. Levels are assigned as soon as possible:

    level(i) = 1 + max(level(j) for the earlier j that i depends on), or 0 if none

so every dependency crosses at least one level boundary, and the step is recorded level by
level with one global memory barrier between consecutive levels and none inside a level.
Dispatches that do not depend on each other keep their relative order inside a level.

Per block, an interval map remembers for every byte range the highest level that read it
and the highest level that wrote it, so one access costs a bisection plus the segments it
overlaps (not a scan of all earlier dispatches). Device-free: pure Python over tuples.
"""
from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass


@dataclass(frozen=True)
class Access:
    """``size`` bytes at ``offset`` of memory block ``block`` (any hashable), read or written."""
    block: object
    offset: int
    size: int
    write: bool

    @property
    def end(self):
        return self.offset + self.size


class _Segments:
    """Disjoint [start, end) segments of one block with (max read level, max write level)."""

    def __init__(self):
        self.starts: list = []   # sorted segment starts
        self.segs: list = []     # [start, end, read_level, write_level] (-1: never)

    def _overlapping(self, s, e):
        i = max(bisect_right(self.starts, s) - 1, 0)
        while i < len(self.segs) and self.segs[i][0] < e:
            if self.segs[i][1] > s:
                yield self.segs[i]
            i += 1

    def after(self, s, e, write):
        """The lowest level an access of [s, e) may take."""
        lvl = -1
        for seg in self._overlapping(s, e):
            lvl = max(lvl, seg[3], seg[2] if write else -1)
        return lvl + 1

    def _split(self, x):
        i = bisect_right(self.starts, x) - 1
        if i >= 0:
            seg = self.segs[i]
            if seg[0] < x < seg[1]:
                right = [x, seg[1], seg[2], seg[3]]
                seg[1] = x
                self.segs.insert(i + 1, right)
                self.starts.insert(i + 1, x)

    def mark(self, s, e, write, level):
        self._split(s)
        self._split(e)
        # fill the gaps of [s, e) not covered by a segment
        covered = s
        gaps = []
        for seg in list(self._overlapping(s, e)):
            if seg[0] > covered:
                gaps.append((covered, seg[0]))
            covered = max(covered, seg[1])
        if covered < e:
            gaps.append((covered, e))
        for gs, ge in gaps:
            i = bisect_right(self.starts, gs)
            self.starts.insert(i, gs)
            self.segs.insert(i, [gs, ge, -1, -1])
        k = 3 if write else 2
        for seg in self._overlapping(s, e):
            seg[k] = max(seg[k], level)


def assign_levels(accesses) -> list:
    """``accesses``: per dispatch, an iterable of ``Access`` (or (block, offset, size, write)
    tuples). Returns the level of each dispatch (ints from 0)."""
    blocks: dict = {}
    levels = []
    for acc in accesses:
        acc = [a if isinstance(a, Access) else Access(*a) for a in acc]
        acc = [a for a in acc if a.size > 0]
        lvl = 0
        for a in acc:
            segs = blocks.get(a.block)
            if segs is not None:
                lvl = max(lvl, segs.after(a.offset, a.end, a.write))
        for a in acc:
            blocks.setdefault(a.block, _Segments()).mark(a.offset, a.end, a.write, lvl)
        levels.append(lvl)
    return levels


def group_levels(accesses) -> list:
    """Dispatch indices grouped by level, in level order; inside a level, in input order."""
    levels = assign_levels(accesses)
    groups = [[] for _ in range(max(levels, default=-1) + 1)]
    for i, lvl in enumerate(levels):
        groups[lvl].append(i)
    return groups


def serial_levels(n) -> list:
    """One dispatch per level: what a backend without dependency tracking records."""
    return [[i] for i in range(n)]
