"""Sub-allocation of a few large memory blocks by offsets.

The backend allocates device memory in a few large blocks (``vkAllocateMemory`` is slow
and drivers cap the number of allocations), each bound to one ``VkBuffer`` covering it;
a tensor is a ``BufferRange``: a block, an offset and a size. ``OffsetAllocator`` hands out
aligned ranges of one block (first fit over a sorted free list, neighbours merged on free);
it is device-free so its bookkeeping is tested without a GPU.
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass


def align_up(x: int, a: int) -> int:
    return (x + a - 1) // a * a


class OffsetAllocator:
    """Aligned [offset, offset + size) ranges inside ``capacity`` bytes."""

    def __init__(self, capacity: int, alignment: int = 256):
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.capacity, self.alignment = int(capacity), int(alignment)
        self.free_list = [(0, self.capacity)]   # sorted, disjoint, merged (offset, size)
        self.used: dict = {}                    # offset -> size
        self.high_water = 0                     # bytes below it have been handed out before
        # the smallest size refused since the last free: a device with tens of blocks asks
        # each in turn, and a full block answers at once instead of walking its free list
        self.refused = float("inf")

    @property
    def bytes_used(self) -> int:
        return sum(self.used.values())

    @property
    def largest_free(self) -> int:
        return max((s for _, s in self.free_list), default=0)

    def alloc(self, size: int):
        """The offset of a new range of ``size`` bytes (rounded up to the alignment), or None
        when no free range is large enough."""
        size = align_up(max(int(size), 1), self.alignment)
        if size >= self.refused:
            return None
        for i, (off, avail) in enumerate(self.free_list):
            if avail >= size:
                if avail == size:
                    del self.free_list[i]
                else:
                    self.free_list[i] = (off + size, avail - size)
                self.used[off] = size
                self.high_water = max(self.high_water, off + size)
                return off
        self.refused = size
        return None

    def free(self, offset: int):
        size = self.used.pop(offset, None)
        if size is None:
            raise ValueError(f"offset {offset} is not an allocated range")
        self.refused = float("inf")
        i = bisect_left(self.free_list, (offset, 0))
        self.free_list.insert(i, (offset, size))
        # merge with the right, then the left neighbour
        if i + 1 < len(self.free_list) and offset + size == self.free_list[i + 1][0]:
            self.free_list[i] = (offset, size + self.free_list[i + 1][1])
            del self.free_list[i + 1]
        if i > 0 and self.free_list[i - 1][0] + self.free_list[i - 1][1] == offset:
            po, ps = self.free_list[i - 1]
            self.free_list[i - 1] = (po, ps + self.free_list[i][1])
            del self.free_list[i]


@dataclass(eq=False)
class BufferRange:
    """``size`` bytes at ``offset`` of ``block`` (a device memory block bound to one VkBuffer)."""
    block: object
    offset: int
    size: int

    def sub(self, offset: int, size: int) -> "BufferRange":
        """A range inside this one (offsets relative to this range)."""
        if offset < 0 or size < 0 or offset + size > self.size:
            raise ValueError(f"sub-range [{offset}, {offset + size}) outside a range of {self.size} bytes")
        return BufferRange(self.block, self.offset + offset, size)

    @property
    def host_visible(self) -> bool:
        return self.block.mapped is not None

    def __repr__(self):
        return f"BufferRange({self.block.label}, offset={self.offset}, size={self.size})"
