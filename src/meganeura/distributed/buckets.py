"""Gradient buckets: the gradients of one all-reduce, laid out in one host-visible staging
range (or host array), filled as the kernels that write them finish."""
from __future__ import annotations

import numpy as np

from .transports import _mapped_view


DEFAULT_BUCKET_MB = 25.0      # gradient bytes per all-reduce (as torch's DistributedDataParallel)


# ------------------------------------------------------------------------------ the session
class _Bucket:
    """Gradients all-reduced together: their device locations, one staging buffer, the
    host tensor (torch) that the collective reduces in place, and the dispatch after which
    all of them are final.

    ``mapped``: the tensor is the staging buffer's own mapped memory (the Vulkan runtime's
    staging ranges stay mapped), so the copies into it from the device are the whole
    readback and the update copies the sums from it inside its own command buffer
    (``upload_copies``); otherwise a separate host array (wgpu: a MAP_READ buffer is mapped
    only between reads and cannot be a copy's source)."""

    def __init__(self, dev, torch, entries, extra=0, mapped=False):
        self.names = [n for n, _, _ in entries]
        self.locs = [loc for _, loc, _ in entries]
        self.ready_after = max((last for _, _, last in entries), default=-1)
        self.offsets, off = [], 0
        for _, (_, _, nb, _, _), _ in entries:
            self.offsets.append(off)
            off += nb // 4
        self.n = off
        self.size = self.n + extra          # values all-reduced: the gradients and, in the last, the loss
        self.staging = dev.create_buffer(4 * max(self.size, 1), "staging", label="grad_bucket")
        view = _mapped_view(self.staging, 4 * self.size) if mapped else None
        self.mapped = view is not None
        if self.mapped:
            self.host_np = view.view(np.float32)
            self.host_np[:] = 0.0
        else:
            self.host_np = np.zeros(self.size, np.float32)
        self.host = torch.from_numpy(self.host_np) if torch is not None else None   # the same memory
        self.copies = [(buf, off_b, self.staging, 4 * o, nb)
                       for (buf, off_b, nb, _, _), o in zip(self.locs, self.offsets)]
        self.upload_copies = []        # mapped: staging -> the update's gradient inputs
        self.pieces = [(0, self.size, None)]    # (start, stop, group): one all-reduce each
        self.piece_tensors = [self.host] if self.host is not None else []
        self.works = []

    def set_pieces(self, pieces):
        """All-reduce ``[(start, stop, group)]`` (views of the one tensor) instead of the whole."""
        self.pieces = list(pieces)
        self.piece_tensors = [self.host[a:z] for a, z, _ in self.pieces] if self.host is not None else []

    def start_allreduce(self, tdist, shm=None, index=None):
        """Issue this bucket's asynchronous all-reduces, one per piece on its stream's group
        (through ``shm``, a ``_ShmAllReduce``, where the ranks share a host)."""
        if shm is not None:
            self.works = [shm.start(index, self.host_np, a, z, g) for a, z, g in self.pieces]
            return
        self.works = [tdist.all_reduce(t, group=g, async_op=True)
                      for t, (_, _, g) in zip(self.piece_tensors, self.pieces)]

    def release(self):
        """Drop the views of the staging memory (before it is unmapped) and free it."""
        self.host = self.host_np = None
        self.piece_tensors, self.works = [], []
        self.upload_copies = []
        self.staging.destroy()


def _chunks(names, nbytes, limit):
    """Consecutive groups of ``names`` of at most ``limit`` bytes (a larger one alone)."""
    groups, cur, size = [], [], 0
    for n in names:
        b = nbytes(n)
        if cur and size + b > limit:
            groups.append(cur)
            cur, size = [], 0
        cur.append(n)
        size += b
    if cur:
        groups.append(cur)
    return groups
