"""How gradient buckets are summed across ranks: Gloo collectives on CPU tensors, or, for
ranks on one host, shared memory (``_ShmAllReduce``); which transport a session takes, and
the split of a bucket into pieces over the concurrent streams."""
from __future__ import annotations

import os
import zlib

import numpy as np

from .ranks import DistributedError, _collective


MIN_PIECE_BYTES = 2 ** 20     # a bucket is split over the streams into pieces no smaller than this

TRANSPORTS = ("auto", "shm", "gloo")
# Gloo by default: the maintained library, and on a 32-core host with two H200s its four
# streams all-reduce SmolLM2's 513 MiB in 73 ms against 113 ms through shared memory
# (bench/results/h200x2/); "auto" (shared memory on one host) wins only where cores are few
DEFAULT_TRANSPORT = "gloo"
TRANSPORT_ENV = "MEGANEURA_DP_TRANSPORT"
SHM_DIR = "/dev/shm"


class _ShmAllReduce:
    """All-reduces between the ranks of one host through shared memory instead of Gloo's
    loopback sockets (about 2 GB/s between two processes; memory copies are several times
    faster). Each bucket has W + 1 float32 rows in one shared segment: for a piece [a, z),
    every rank copies its values into its own row, then (barrier) sums its 1/W of the
    piece over the rows in rank order into the last row, then (barrier) copies the sum
    back. Two ranks add a + b as Gloo does: the sums are bitwise Gloo's. The pieces of a
    stream run in order on that stream's thread, the barriers on its process group, so
    several pieces are reduced at once, as with Gloo's streams."""

    def __init__(self, ctx, tdist, sizes, name):
        from multiprocessing import shared_memory
        self.W, self.rank, self.tdist = ctx.world_size, ctx.rank, tdist
        self.owner = ctx.rank == 0
        total = 4 * (self.W + 1) * max(1, sum(sizes))
        self.shm = shared_memory.SharedMemory(name=name, create=self.owner, size=total if self.owner else 0)
        if not self.owner:      # the creating rank unlinks it; the others only map it
            _untrack_shm(self.shm)
        self.rows, off = [], 0
        for n in sizes:
            self.rows.append(np.ndarray((self.W + 1, n), np.float32, buffer=self.shm.buf, offset=off))
            off += 4 * (self.W + 1) * n
        # one thread per stream (made on first use): a stream's pieces, and so its barriers,
        # in the same order on every rank
        self.threads = {}

    def start(self, k, host, a, z, group):
        from concurrent.futures import ThreadPoolExecutor
        t = self.threads.get(id(group))
        if t is None:
            t = self.threads[id(group)] = ThreadPoolExecutor(1, thread_name_prefix="mg-allreduce")
        return _Future(t.submit(self._reduce, self.rows[k], host, a, z, group))

    def _reduce(self, rows, host, a, z, group):
        W, r = self.W, self.rank
        np.copyto(rows[r, a:z], host[a:z])
        self.tdist.barrier(group=group)
        c0, c1 = a + r * (z - a) // W, a + (r + 1) * (z - a) // W
        out = rows[W, c0:c1]
        np.add(rows[0, c0:c1], rows[1, c0:c1], out=out)
        for j in range(2, W):
            np.add(out, rows[j, c0:c1], out=out)
        self.tdist.barrier(group=group)
        np.copyto(host[a:z], rows[W, a:z])

    def close(self):
        for t in self.threads.values():
            t.shutdown(wait=True)
        self.rows = []
        self.shm.close()
        if self.owner:
            try:
                self.shm.unlink()
            except FileNotFoundError:
                pass


class _Future:
    """A ``concurrent.futures.Future`` as a collective's work (``wait``)."""

    def __init__(self, fut):
        self.fut = fut

    def wait(self):
        self.fut.result()


def _untrack_shm(shm):
    """Keep Python's resource tracker from unlinking (and warning about) a segment this
    process only attached to."""
    try:
        from multiprocessing import resource_tracker
        resource_tracker.unregister(shm._name, "shared_memory")
    except Exception:      # noqa: BLE001 (a tracker detail; the segment works either way)
        pass


def _transport_setting(transport=None) -> str:
    t = transport if transport is not None else (os.environ.get(TRANSPORT_ENV, "").strip().lower() or DEFAULT_TRANSPORT)
    if t not in TRANSPORTS:
        src = "transport" if transport is not None else f"${TRANSPORT_ENV}"
        raise ValueError(f"{src}={t!r}: the gradient all-reduce goes through one of {', '.join(TRANSPORTS)}")
    return t


def _shm_room(nbytes) -> bool:
    """Whether the shared-memory folder can hold ``nbytes`` more (a segment larger than its
    tmpfs would fail only when touched, with SIGBUS)."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize >= 1.1 * nbytes + (64 << 20)


def open_shm_allreduce(ctx, tdist, sizes, want="auto"):
    """The shared-memory all-reduce of buckets of ``sizes`` float32 values where every rank
    runs on this host and the shared-memory folder has room for them (``want`` "auto" or
    "shm"), else None (Gloo); the same on every rank. "shm" refuses to fall back. Rank 0
    makes the segment, the others attach to it."""
    if ctx.world_size == 1 or want == "gloo":
        return None
    import socket
    nbytes = 4 * (ctx.world_size + 1) * max(1, sum(sizes))
    mine = (socket.gethostname(), _shm_room(nbytes) if ctx.rank == 0 else None)
    every = [None] * ctx.world_size
    _collective(ctx, "comparing hosts", lambda: tdist.all_gather_object(every, mine))
    hosts = len({h for h, _ in every})
    if hosts > 1 or not every[0][1]:
        if want == "shm":
            why = "the ranks run on several hosts" if hosts > 1 else \
                f"{SHM_DIR} has no room for {nbytes / 2 ** 20:.0f} MiB"
            raise DistributedError(f"transport='shm': {why}; use 'auto' or 'gloo'")
        return None
    box = [f"mg{os.getpid()}_{zlib.crc32(os.urandom(8)):08x}" if ctx.rank == 0 else None]
    _collective(ctx, "sharing the shared-memory name", lambda: tdist.broadcast_object_list(box, src=0))
    red = _ShmAllReduce(ctx, tdist, sizes, box[0]) if ctx.rank == 0 else None
    _collective(ctx, "creating the shared memory", tdist.barrier)
    red = red or _ShmAllReduce(ctx, tdist, sizes, box[0])
    _collective(ctx, "attaching the shared memory", tdist.barrier)
    return red


def split_pieces(sizes, streams, min_piece=None, align=16):
    """How buckets of ``sizes`` float32 values are all-reduced over ``streams`` concurrent
    streams: ``[[(start, stop, stream)] per bucket]``. A bucket is cut into up to ``streams``
    equal pieces (boundaries on multiples of ``align`` values), none under ``min_piece``
    values, so every stream works on the bucket that is final first and a large bucket
    (SmolLM2's 108 MiB embedding) does not hold one stream alone; the pieces go to the
    streams round-robin, counting on across buckets (small buckets spread too). The same
    on every rank (it depends on sizes and streams alone). ``min_piece``: default
    MIN_PIECE_BYTES / 4."""
    min_piece = MIN_PIECE_BYTES // 4 if min_piece is None else min_piece
    out, turn = [], 0
    for m in sizes:
        k = max(1, min(streams, m // max(min_piece, 1)))
        step = -(-m // k)
        step = -(-step // align) * align
        cuts = list(range(0, m, step)) + [m] if m else [0, 0]
        pieces = []
        for a, z in zip(cuts, cuts[1:]):
            pieces.append((a, z, turn % streams))
            turn += 1
        out.append(pieces)
    return out


def _runtime_maps_staging(runtime) -> bool:
    """Whether ``runtime``'s staging buffers stay mapped (``_mapped_view`` gives a view)."""
    from ..runtime.backends import get_runtime_device
    probe = get_runtime_device(runtime).create_buffer(4, "staging", label="probe")
    try:
        return _mapped_view(probe, 4) is not None
    finally:
        probe.destroy()


def _mapped_view(buf, nbytes):
    """The first ``nbytes`` of ``buf``'s host mapping as a writable uint8 array, or None
    when the runtime gives none that stays valid (wgpu maps a buffer only between reads).
    On the Vulkan runtime staging ranges are host-visible and mapped for their lifetime."""
    block = getattr(buf, "block", None)
    mapped = getattr(block, "mapped", None)
    if mapped is None or not mapped.flags.writeable or int(nbytes) > buf.size:
        return None
    return mapped[buf.offset:buf.offset + int(nbytes)]
