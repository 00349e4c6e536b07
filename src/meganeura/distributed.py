"""Data-parallel training: one process per GPU, gradients averaged by torch.distributed.

Launch one process per GPU with PyTorch's launcher; each process builds the same graph and
trains on its own share of every batch::

    torchrun --nproc_per_node 2 train.py          # one machine, two GPUs
    torchrun --nnodes 2 --node_rank 0 --master_addr HOST --nproc_per_node 2 train.py

    import meganeura as mg
    from meganeura import distributed as dist
    ctx = dist.init()                              # joins the group; picks this process's GPU
    s = dist.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-3), accumulate=4)
    for xb, yb in batches:
        s.step(dist.shard({"x": xb, "labels": yb}))
    s.save("model.safetensors")                    # rank 0 writes it; every rank can load it

A step runs forward and backward on the device, copies the gradients to host-visible
staging memory in buckets as soon as the kernels that write them have run (the step is
submitted in segments that end where a bucket is final), all-reduces each bucket with an
asynchronous Gloo collective while later buckets are still being computed or copied (split
over several concurrent streams, each a Gloo process group of its own: ``init(streams=)``), and
runs the optimizer update (the session's "update" phase) on the sums scaled to the mean.
On the Vulkan runtime Gloo reduces the mapped staging memory itself and the update copies
the sums from it in its own command buffer; on wgpu the buckets go through host arrays
(``DataParallel.grad_path``). Gloo runs on CPU tensors, between processes and machines;
see docs/distributed.md for why it was chosen. Ranks on one host can sum the buckets in shared
memory instead (``compile(transport="auto")``: faster where cores are few).

torch is an optional extra (``pip install 'meganeura[distributed]'``); this module imports
it only when used, and ``import meganeura`` never does.
"""
from __future__ import annotations

import atexit
import datetime
import hashlib
import os
import time
import warnings
import zlib

import numpy as np

from .api import GRAD_FEED, GRAD_SCALE, Session
from .graph import Graph, Tensor
from .optim import SCALAR_PREFIX

DEFAULT_TIMEOUT_S = 300.0     # a collective that waits longer than this fails (a rank died or hangs)
DEFAULT_BUCKET_MB = 25.0      # gradient bytes per all-reduce (as torch's DistributedDataParallel)
DEFAULT_STREAMS = 4           # concurrent all-reduce streams (Gloo process groups)
MAX_STREAMS = 64
STREAMS_ENV = "MEGANEURA_DP_STREAMS"
MIN_PIECE_BYTES = 2 ** 20     # a bucket is split over the streams into pieces no smaller than this
TIMING_KEYS = ("compute", "readback", "allreduce", "upload", "update", "total")
TRANSPORTS = ("auto", "shm", "gloo")
# Gloo by default: the maintained library, and on a 32-core host with two H200s its four
# streams all-reduce SmolLM2's 513 MiB in 73 ms against 113 ms through shared memory
# (bench/results/h200x2/); "auto" (shared memory on one host) wins only where cores are few
DEFAULT_TRANSPORT = "gloo"
TRANSPORT_ENV = "MEGANEURA_DP_TRANSPORT"
SHM_DIR = "/dev/shm"


class DistributedError(RuntimeError):
    """A collective failed or timed out (another rank exited or hangs), or the ranks
    disagree on the program they train."""


def _torch_dist():
    try:
        import torch
        import torch.distributed as tdist
    except ImportError as e:
        raise ImportError("mg.distributed needs torch.distributed: pip install 'meganeura[distributed]'") from e
    if not tdist.is_available() or not tdist.is_gloo_available():
        raise ImportError("this torch build has no torch.distributed with the Gloo backend")
    return torch, tdist


# ----------------------------------------------------------------------------- process group
class Context:
    """This process's place in the group: rank, world_size, local_rank (its index on its
    machine), the GPU runtime (``vulkan`` or ``wgpu``) and the device it uses, and the
    collective timeout in seconds."""

    def __init__(self, rank, world_size, local_rank, adapter, timeout_s, runtime=None, streams=1):
        self.rank, self.world_size, self.local_rank = rank, world_size, local_rank
        self.adapter, self.timeout_s, self.runtime = adapter, timeout_s, runtime
        self.streams = streams
        self.groups = []        # Gloo process groups of the all-reduce streams (created by stream_groups)

    def stream_groups(self, n):
        """The process groups of ``n`` all-reduce streams: [None] (the default group) for one
        stream or a world of one, else the first ``n`` of the groups made for streams,
        creating the missing ones (a collective: every rank must ask for the same counts in
        the same order, as ``init`` and ``compile`` do)."""
        n = check_streams(n)
        if n == 1 or self.world_size == 1:
            return [None]
        _, tdist = _torch_dist()
        while len(self.groups) < n:
            what = f"creating all-reduce stream {len(self.groups) + 1} of {n}"
            self.groups.append(_collective(self, what, lambda: tdist.new_group(
                backend="gloo", timeout=datetime.timedelta(seconds=self.timeout_s))))
        return self.groups[:n]

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def __repr__(self):
        return (f"Context(rank={self.rank}, world_size={self.world_size}, local_rank={self.local_rank}, "
                f"runtime={self.runtime!r}, adapter={self.adapter!r})")


_context: Context | None = None


def check_streams(streams):
    """``streams`` as an int in 1..MAX_STREAMS, or a ValueError that says what is allowed."""
    if isinstance(streams, (bool, float)) or not isinstance(streams, (int, np.integer)) \
            or not 1 <= streams <= MAX_STREAMS:
        raise ValueError(f"streams must be an integer from 1 to {MAX_STREAMS} (the number of concurrent "
                         f"all-reduce streams), got {streams!r}")
    return int(streams)


def _streams_setting(streams=None) -> int:
    """``streams``, else ``$MEGANEURA_DP_STREAMS``, else DEFAULT_STREAMS; validated."""
    if streams is not None:
        return check_streams(streams)
    v = os.environ.get(STREAMS_ENV, "").strip()
    if not v:
        return DEFAULT_STREAMS
    try:
        return check_streams(int(v))
    except ValueError:
        raise ValueError(f"${STREAMS_ENV}={v!r}: the number of concurrent all-reduce streams must be an "
                         f"integer from 1 to {MAX_STREAMS}") from None


def _env_int(name, default=None):
    v = os.environ.get(name)
    if v is None or v.strip() == "":
        if default is None:
            raise DistributedError(f"${name} is not set: launch with torchrun (it sets RANK, WORLD_SIZE, "
                                   f"LOCAL_RANK, MASTER_ADDR and MASTER_PORT)")
        return default
    if not v.strip().isdigit():
        raise DistributedError(f"${name}={v!r} is not a non-negative integer")
    return int(v)


def select_adapter(local_rank: int, runtime: str | None = None) -> str:
    """Make this process use the GPU of its local rank, before ``runtime`` (``vulkan`` or
    ``wgpu``; default: what ``backend="gpu"`` resolves to) opens a device.

    The candidates are the devices of the kind the runtime would pick by itself (hardware
    before software; on wgpu, Vulkan before other backends), in the order the runtime lists
    them; local rank r takes the r-th (wrapping round, with a warning, when there are
    fewer). With one device (lavapipe) every rank uses it. The runtime's own selector set
    by the user wins (``$MEGANEURA_VK_DEVICE`` on Vulkan, ``$MEGANEURA_ADAPTER`` on wgpu):
    one for all ranks, or a comma-separated list indexed by local rank. Returns the
    device's name."""
    if (runtime or _resolve_for_rank("gpu", local_rank)) == "vulkan":
        return _select_vulkan_device(local_rank)
    from .runtime import device as devmod
    adapters = devmod.enumerate_adapters()

    def kind(a):
        return (devmod.adapter_summary(a)["backend"] != "Vulkan", devmod.is_software_adapter(a))
    chosen = _by_local_rank(local_rank, "MEGANEURA_ADAPTER", adapters, devmod.choose_adapter, kind)
    current = devmod._device
    if current is not None and current.adapter is not chosen:
        raise DistributedError(f"local rank {local_rank} should use {devmod.adapter_summary(chosen)['name']!r}, "
                               f"but this process already opened {current.name!r}: call "
                               f"mg.distributed.init() before anything uses the GPU")
    if current is None:
        with devmod._device_lock:         # what get_device() will return from now on
            devmod._device = devmod.Device(chosen)
    return f"[{adapters.index(chosen)}] {devmod.adapter_summary(chosen)['name']}"


def _vulkan_choice(local_rank: int) -> dict:
    """The Vulkan physical device (as ``list_physical_devices`` describes it) of a local rank."""
    from .runtime.vulkan import device as vkdev
    return _by_local_rank(local_rank, "MEGANEURA_VK_DEVICE", vkdev.list_physical_devices(), vkdev.choose_physical,
                          lambda d: (vkdev.device_rank(d), d["type"] == "cpu"))


def _resolve_for_rank(backend: str, local_rank: int) -> str:
    """``resolve(backend)`` for a rank: deciding between the runtimes opens the process-wide
    Vulkan device, so it must open this rank's (device 0 for every rank made rank 1 fail on
    a 2-GPU machine)."""
    from .runtime.backends import resolve
    try:
        selector = str(_vulkan_choice(local_rank)["index"])
    except DistributedError:
        raise
    except Exception:           # no Vulkan loader or device: resolve says why, or picks wgpu
        selector = None
    return resolve(backend, vulkan_selector=selector)


def _select_vulkan_device(local_rank: int) -> str:
    """``select_adapter`` on the direct Vulkan backend: the process-wide VulkanDevice is
    created on the chosen physical device (no wgpu device is opened)."""
    from .runtime.vulkan import device as vkdev
    chosen = _vulkan_choice(local_rank)
    dev = vkdev.get_vulkan_device(str(chosen["index"]))
    if dev.index != chosen["index"]:
        raise DistributedError(f"local rank {local_rank} should use Vulkan device [{chosen['index']}] "
                               f"{chosen['name']!r}, but this process already opened [{dev.index}] {dev.name!r}: "
                               f"call mg.distributed.init() before anything uses the GPU")
    return f"[{chosen['index']}] {chosen['name']}"


def _by_local_rank(local_rank, var, items, choose, kind):
    """The device of ``items`` for ``local_rank``: by ``$var`` (one selector, or one per local
    rank, comma-separated; ``choose(items, selector)`` resolves it), else the local_rank-th
    of those of the lowest ``kind`` (a tuple whose last item says software; ``choose(items)``
    raises its own error when there are none)."""
    sel = os.environ.get(var, "").strip()
    if "," in sel:
        choices = [c.strip() for c in sel.split(",")]
        if local_rank >= len(choices):
            raise DistributedError(f"{var}={sel!r} names {len(choices)} devices, "
                                   f"but this process has local rank {local_rank}")
        return choose(items, choices[local_rank])
    if sel:
        return choose(items, sel)
    best = min(kind(a) for a in items) if items else None
    candidates = [a for a in items if kind(a) == best]
    if not candidates:
        return choose(items)
    if local_rank >= len(candidates) and not best[-1]:
        warnings.warn(f"local rank {local_rank}: only {len(candidates)} GPU(s) on this machine; "
                      f"ranks share GPU {local_rank % len(candidates)}")
    return candidates[local_rank % len(candidates)]


def init(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str = "gpu", streams: int | None = None) -> Context:
    """Join the process group that torchrun describes ($RANK, $WORLD_SIZE, $LOCAL_RANK,
    $MASTER_ADDR, $MASTER_PORT) on the Gloo backend and pick this process's GPU by local
    rank. Without $WORLD_SIZE the process trains alone (world size 1, no communication).
    ``timeout_s``: how long a collective may wait for the other ranks before failing.
    ``backend``: ``gpu`` (the direct Vulkan backend where it runs, else wgpu; as
    ``mg.compile``'s, ``$MEGANEURA_BACKEND`` chooses), ``vulkan`` or ``wgpu``.
    ``streams``: how many all-reduces run at once (each stream is a Gloo process group of
    its own, with its own connections and threads; the gradient buckets are split over
    them); default ``$MEGANEURA_DP_STREAMS``, else DEFAULT_STREAMS (4). The groups are
    created here, on every rank in the same order."""
    global _context
    if _context is not None:
        if streams is not None and check_streams(streams) != _context.streams:
            raise ValueError(f"init(streams={streams}): this process already joined with streams="
                             f"{_context.streams}; pass streams= to compile() for another count")
        return _context
    if timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
    streams = _streams_setting(streams)
    world = _env_int("WORLD_SIZE", 1)
    rank = _env_int("RANK", 0 if world == 1 else None)
    local = _env_int("LOCAL_RANK", rank if world == 1 else None)
    if not 0 <= rank < world:
        raise DistributedError(f"$RANK={rank} is outside 0..{world - 1} ($WORLD_SIZE={world})")
    runtime = _resolve_for_rank(backend, local)
    adapter = select_adapter(local, runtime)
    if world > 1:
        _, tdist = _torch_dist()
        if not tdist.is_initialized():
            try:
                tdist.init_process_group("gloo", rank=rank, world_size=world,
                                         timeout=datetime.timedelta(seconds=timeout_s))
            except Exception as e:
                raise DistributedError(f"rank {rank} of {world}: could not join the process group at "
                                       f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')} "
                                       f"within {timeout_s:g} s: {e}") from e
        # leave the group before the interpreter tears down (Gloo's threads abort otherwise)
        atexit.register(shutdown)
        every = [None] * world          # the stream groups are made in step: the counts must agree
        _collective(Context(rank, world, local, adapter, float(timeout_s)), "comparing the stream counts",
                    lambda: tdist.all_gather_object(every, streams))
        if len(set(every)) > 1:
            raise DistributedError("ranks disagree on the number of all-reduce streams (init(streams=...) or "
                                   f"${STREAMS_ENV}): " + ", ".join(f"rank {r}: {v}" for r, v in enumerate(every)))
    ctx = Context(rank, world, local, adapter, float(timeout_s), runtime, streams)
    ctx.stream_groups(streams)
    _context = ctx
    return _context


def shutdown():
    """Leave the process group (the end of a training script)."""
    global _context
    if _context is not None and _context.world_size > 1:
        _, tdist = _torch_dist()
        if tdist.is_initialized():
            tdist.destroy_process_group()
    _context = None


def _ctx(ctx=None) -> Context:
    return ctx or _context or init()


def _collective(ctx, what, fn):
    """Run a blocking collective, turning a failure (a peer died: the connection closed;
    or the timeout passed) into a DistributedError that says what was being done."""
    try:
        return fn()
    except DistributedError:
        raise
    except Exception as e:
        raise DistributedError(f"rank {ctx.rank} of {ctx.world_size}: {what} failed: another rank exited or "
                               f"did not answer within {ctx.timeout_s:g} s ({type(e).__name__}: {e})") from e


def barrier(ctx=None):
    """Wait for every rank (no-op alone)."""
    ctx = _ctx(ctx)
    if ctx.world_size > 1:
        _, tdist = _torch_dist()
        _collective(ctx, "a barrier", lambda: tdist.barrier())


# ------------------------------------------------------------------------------ data sharding
def shard(batch, ctx=None):
    """This rank's share of a global batch: each array (or each value of a dict of arrays)
    split into world_size equal parts along axis 0, part ``rank``. The global batch must
    divide evenly, so that the mean of the ranks' losses is the loss of the whole batch."""
    ctx = _ctx(ctx)
    if isinstance(batch, dict):
        return {k: shard(v, ctx) for k, v in batch.items()}
    arr = np.asarray(batch)
    if arr.ndim == 0 or arr.shape[0] % ctx.world_size:
        raise ValueError(f"shard: a batch of shape {arr.shape} does not split into {ctx.world_size} equal "
                         f"parts along axis 0")
    n = arr.shape[0] // ctx.world_size
    return arr[ctx.rank * n:(ctx.rank + 1) * n]


def shard_indices(n: int, epoch: int = 0, seed: int = 0, shuffle: bool = True, ctx=None) -> np.ndarray:
    """Indices of this rank's examples for one epoch (as torch's DistributedSampler with
    drop_last): the same permutation of range(n) on every rank (seeded by seed and epoch),
    cut to a multiple of world_size, then every world_size-th index from ``rank``."""
    ctx = _ctx(ctx)
    order = np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)
    usable = n - n % ctx.world_size
    return order[:usable][ctx.rank::ctx.world_size]


# ---------------------------------------------------------------------------- plan signature
def _canon(v):
    """A stable text for an attribute value (arrays by shape, dtype and checksum)."""
    if isinstance(v, np.ndarray):
        return f"array{v.shape}{v.dtype}:{zlib.crc32(np.ascontiguousarray(v).tobytes()):08x}"
    if isinstance(v, Tensor):
        return f"tensor#{v.id}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_canon(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_canon(v[k])}" for k in sorted(v, key=str)) + "}"
    if v is None or isinstance(v, (bool, int, float, str, np.generic)):
        return repr(v)
    return type(v).__name__


def plan_signature(session: Session) -> str:
    """A device-independent hash of what ``session`` trains: every node of its program
    (op, shape, dtype, name of parameters, inputs and states, attributes, inputs), its
    accumulation and its optimizer's settings. Equal on ranks that train the same model."""
    from .reference import needed_nodes
    prog = session.program
    targets = [t for _, v in prog.updates.items() for t in v.values()] + prog.fetches + list(prog.grads.values())
    h = hashlib.sha256()
    index = {}
    for t in needed_nodes(targets):
        index[t.id] = len(index)
        named = t.op in ("input", "parameter", "state")
        attrs = {k: v for k, v in t.attrs.items() if k != "init"}
        h.update(f"{t.op}|{t.shape}|{t.dtype.name}|{t.name if named else ''}|{_canon(attrs)}|"
                 f"{[index[i.id] for i in t.inputs]};".encode())
    opt = session.optimizer
    settings = {k: v for k, v in vars(opt).items() if isinstance(v, (int, float, bool, str, type(None)))}
    h.update(f"accumulate={session.accumulate}|{type(opt).__name__}|{_canon(settings)}".encode())
    return h.hexdigest()


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
    from .runtime.backends import get_runtime_device
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


class DataParallel:
    """A training session replicated on every rank; see ``mg.distributed.compile``.

    ``step(feeds)`` takes this rank's share of the batch and returns this rank's loss;
    ``mean_loss`` is the mean over ranks (and micro-steps) of the last update's losses.
    ``runtime`` names the GPU runtime it runs on (``vulkan`` or ``wgpu``).
    ``grad_path`` says how gradients reach the collective and come back: ``mapped`` (Gloo
    reduces the mapped staging memory the device copied them into, and the update copies
    the sums from there: no host copy) or ``host`` (copied into a host array, reduced there
    and uploaded as the update's inputs).
    ``timings`` holds the host seconds of the last update by stage (``TIMING_KEYS``:
    compute = waiting for the GPU, readback = copying gradients out of mapped memory into
    host arrays (the host path), allreduce = waiting for collectives, upload (the host
    path), update, total); ``timing_totals`` sums
    them over every update and ``reset_timings`` clears them."""

    def __init__(self, graph: Graph, loss: Tensor, optimizer, accumulate=1, precision="strict", seed=0,
                 bucket_mb=DEFAULT_BUCKET_MB, ctx=None, backend=None, mapped=None, streams=None, transport=None):
        if streams is not None:
            check_streams(streams)
        transport = _transport_setting(transport)
        self.ctx = ctx = ctx or _context or init(backend=backend or "gpu")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.streams = ctx.streams if streams is None else int(streams)
        if loss is None or optimizer is None:
            raise ValueError("mg.distributed.compile: give loss= and optimizer= (data-parallel training)")
        self.runtime = _session_runtime(ctx, backend)
        if mapped and not _runtime_maps_staging(self.runtime):
            raise ValueError(f"mg.distributed.compile: mapped=True, but the {self.runtime} runtime keeps no "
                             f"staging memory mapped (wgpu maps a buffer only to read it): use mapped=None")
        self.session = Session(graph, None, loss, optimizer, self.runtime, precision, seed, accumulate,
                               separate_update=True)
        self.accumulate = self.session.accumulate
        self.torch, self.tdist = _torch_dist() if ctx.world_size > 1 else (_torch_or_none(), None)
        self.check_same_program()
        self.groups = ctx.stream_groups(self.streams)
        self.broadcast_values()
        ex = self.session.executor
        self.phase = "micro" if self.accumulate > 1 else "grads"
        plan = ex.plan(self.phase)
        ex.plan("update")
        self._build_buckets(plan, bucket_mb, mapped)
        self.shm = open_shm_allreduce(ctx, self.tdist, [b.size for b in self.buckets], transport)
        self.transport = "shm" if self.shm is not None else "gloo"
        self.mean_loss = None
        self._loss_sum = 0.0
        self.reset_timings()

    # ---------------------------------------------------------------- start-up checks
    def check_same_program(self):
        """Raise DistributedError on every rank unless all ranks compiled the same program."""
        ctx = self.ctx
        if ctx.world_size == 1:
            return
        params = [(n, self.session.graph.parameters[n].shape) for n in self.session.parameter_names]
        mine = (plan_signature(self.session), len(params), sum(int(np.prod(s)) for _, s in params), params,
                self.streams)
        every = [None] * ctx.world_size
        _collective(ctx, "comparing the program hash", lambda: self.tdist.all_gather_object(every, mine))
        if len({e[4] for e in every}) > 1:
            raise DistributedError("ranks disagree on the number of all-reduce streams (compile(streams=...)): "
                                   + ", ".join(f"rank {r}: {e[4]}" for r, e in enumerate(every)))
        if all(e[0] == every[0][0] for e in every):
            return
        lines = [f"rank {r}: {e[1]} parameters ({e[2]} values), hash {e[0][:12]}" for r, e in enumerate(every)]
        diff = ""
        for r, e in enumerate(every):
            first = next(((a, b) for a, b in zip(every[0][3], e[3]) if a != b), None)
            if first is not None:
                diff = f"; first differing parameter: rank 0 {first[0][0]!r} {first[0][1]}, " \
                       f"rank {r} {first[1][0]!r} {first[1][1]}"
                break
        raise DistributedError("ranks disagree on the graph they train (every rank must build the same "
                               "model, loss, optimizer and accumulate): " + "; ".join(lines) + diff)

    def broadcast_values(self):
        """Give every rank rank 0's parameters and optimizer state (in buckets)."""
        ctx = self.ctx
        if ctx.world_size == 1:
            return
        torch = self.torch
        state = self.session.state_dict(include_optimizer=True)
        names = sorted(state)
        out = {}
        for group in _chunks(names, lambda n: state[n].nbytes, DEFAULT_BUCKET_MB * 2 ** 20):
            by_dtype = {}
            for n in group:
                by_dtype.setdefault(state[n].dtype, []).append(n)
            for dt, ns in by_dtype.items():
                flat = np.concatenate([state[n].reshape(-1) for n in ns]) if ctx.rank == 0 else \
                    np.empty(sum(state[n].size for n in ns), dt)
                t = torch.from_numpy(flat)
                _collective(ctx, "broadcasting the initial weights from rank 0",
                            lambda: self.tdist.broadcast(t, src=0))
                off = 0
                for n in ns:
                    out[n] = flat[off:off + state[n].size].reshape(state[n].shape).copy()
                    off += state[n].size
        if ctx.rank != 0:
            self.session.assign(out)

    def _build_buckets(self, plan, bucket_mb, mapped=None):
        """Group the gradients (or, when accumulating, the accumulated sums) into buckets
        in the order the step finishes them; rank 0's grouping is used by all. ``mapped``:
        None all-reduces in the staging memory where the runtime maps it for good (Vulkan),
        True insists, False copies through host arrays (the path wgpu takes)."""
        ex, torch = self.session.executor, self.torch
        if self.accumulate > 1:
            locs = {n: plan.update_locs[f"{n}.grad_accum"] for n in self.session.program.grads}
        else:
            locs = dict(plan.grad_locs)
        for n, loc in locs.items():
            if loc[3] != np.float32:
                raise NotImplementedError(f"mg.distributed: gradient of {n!r} is {loc[3]}, only float32 is "
                                          f"all-reduced")
        last = {}
        for i, bufs in enumerate(plan.writes):
            for b in bufs:
                last[id(b)] = i
        ready = {n: last.get(id(loc[0]), -1) for n, loc in locs.items()}
        order = sorted(locs, key=lambda n: (ready[n], n))
        groups = _chunks(order, lambda n: locs[n][2], bucket_mb * 2 ** 20)
        if self.ctx.world_size > 1:
            box = [groups]
            _collective(self.ctx, "sharing the bucket layout", lambda: self.tdist.broadcast_object_list(box, src=0))
            groups = box[0]
        self.buckets = [_Bucket(ex.dev, torch, [(n, locs[n], ready[n]) for n in g],
                                extra=1 if k == len(groups) - 1 else 0, mapped=mapped is not False)
                        for k, g in enumerate(groups)]
        self.grad_path = "mapped" if self.buckets and all(b.mapped for b in self.buckets) else "host"
        if len(self.groups) > 1:
            split = split_pieces([b.size for b in self.buckets], len(self.groups))
            for b, pieces in zip(self.buckets, split):
                b.set_pieces([(a, z, self.groups[i]) for a, z, i in pieces])
        for b in self.buckets:
            if b.mapped:
                # the update's gradient inputs are filled from the staging memory inside the
                # update's own command buffer (recorded once: the ranges never change)
                b.upload_copies = [(b.staging, 4 * o, ex.named_buffer(GRAD_FEED + n, nb), 0, nb)
                                   for n, o, (_, _, nb, _, _) in zip(b.names, b.offsets, b.locs)]
        self.update_copies = [c for b in self.buckets for c in b.upload_copies]
        # the step is submitted in segments, each ending where a bucket's gradients are final
        # and followed by that bucket's copies (buckets final at the same point share one);
        # the outputs' copies follow the last. No segment is copies alone: on lavapipe such a
        # submit blocks until the work before it is done.
        n = len(plan.dispatches)
        subs, early, early_k = [], [], []       # [start, end, copies, bucket indices]
        for k, b in enumerate(self.buckets):
            cut = max(b.ready_after + 1, subs[-1][1] if subs else 0)
            if subs and subs[-1][1] == cut:
                subs[-1][2].extend(b.copies)
                subs[-1][3].append(k)
            elif cut > 0:
                subs.append([subs[-1][1] if subs else 0, cut, early + list(b.copies), early_k + [k]])
                early, early_k = [], []
            else:                      # final before any dispatch: rides with the first segment
                early.extend(b.copies)
                early_k.append(k)
        end = subs[-1][1] if subs else 0
        if end < n or not subs:
            subs.append([end, n, early + list(plan.copies_after), early_k])
        else:
            subs[-1][2].extend(early + list(plan.copies_after))
            subs[-1][3].extend(early_k)
        self.bucket_submission = {k: i for i, sub in enumerate(subs) for k in sub[3]}
        self.submissions = [(ex.recorder.prepare(plan.dispatches[a:b], plan.names[a:b]), copies)
                            for a, b, copies, _ in subs]

    # ---------------------------------------------------------------------------- stepping
    def reset_timings(self):
        self.timings = dict.fromkeys(TIMING_KEYS, 0.0)      # the last finished update's
        self._current = dict.fromkeys(TIMING_KEYS, 0.0)     # the update under way
        self.timing_totals = dict.fromkeys(TIMING_KEYS, 0.0)
        self.updates_timed = 0

    @property
    def steps_done(self) -> int:
        return self.session.steps_done

    def step(self, feeds: dict) -> float:
        """One micro-step on this rank's share of the batch; every ``accumulate``-th call
        all-reduces the gradients and updates. Returns this rank's loss."""
        s = self.session
        with s._lock:
            if s.closed:
                raise RuntimeError("step: this session is closed")
            feeds = s._feeds(feeds)
            t0 = time.perf_counter()
            if s.micro_done == 0:
                self._current = dict.fromkeys(TIMING_KEYS, 0.0)
            if s.micro_done + 1 < self.accumulate:
                loss = float(s.executor.execute(feeds, "micro")[-1])
                s.micro_done += 1
                self._loss_sum += loss
                self._current["compute"] += time.perf_counter() - t0
                self._current["total"] += time.perf_counter() - t0
                return loss
            loss = self._reduce_step(feeds)
            self._update()
            s.micro_done = 0
            s.steps_done += 1
            self._current["total"] += time.perf_counter() - t0
            self.timings = self._current
            for k in TIMING_KEYS:
                self.timing_totals[k] += self.timings[k]
            self.updates_timed += 1
            return loss

    def _reduce_step(self, feeds) -> float:
        """The last micro-step: its segments are submitted ahead of the host; each bucket is
        all-reduced asynchronously once its segment has run, while later segments run: in
        place in its mapped staging memory (``grad_path`` "mapped"), or copied out of it into
        a host array first, and the sums then uploaded as the update's inputs ("host")."""
        ex, dev, tm = self.session.executor, self.session.executor.dev, self._current
        rec = ex.recorder
        plan = ex.plan(self.phase)
        subs, done = self.submissions, []
        # wgpu on a software driver runs a submit only once the one before it has finished,
        # so there one segment is queued ahead of the host; elsewhere they go all at once
        ahead = 1 if dev.is_software and self.runtime == "wgpu" else len(subs)

        def submit_until(i):
            while len(done) <= min(i, len(subs) - 1):
                done.append(rec.submit(*subs[len(done)]))

        try:
            t = time.perf_counter()
            # as GpuExecutor.execute: values never set go up first (alone and with
            # accumulate=1, this is the first thing that runs)
            ex.send_initial_values()
            ex.refresh_copies(plan)
            ex.upload(feeds)
            ex.overwriting(plan)
            submit_until(ahead - 1)
            tm["compute"] += time.perf_counter() - t
            loss = None
            for k, b in enumerate(self.buckets):
                t = time.perf_counter()
                j = self.bucket_submission[k]
                submit_until(j + ahead)
                if b.mapped:          # its segment alone; the collective reduces the staging memory
                    rec.wait(done[j])
                    t1 = time.perf_counter()
                else:
                    with rec.mapped_after(done[j], b.staging, 4 * max(b.n, 1)) as raw:
                        t1 = time.perf_counter()
                        b.host_np[:b.n] = raw.view(np.float32)[:b.n]
                t2 = time.perf_counter()
                tm["compute"] += t1 - t
                tm["readback"] += t2 - t1
                if k == len(self.buckets) - 1:     # the loss rides with the last bucket
                    submit_until(len(subs) - 1)
                    st, (_, _, nb, dt, _) = plan.staging[-1], plan.fetch_locs[-1]
                    with rec.mapped_after(done[-1], st, nb) as raw:
                        loss = float(raw.view(dt)[0])
                    self._loss_sum += loss
                    b.host_np[b.n] = self._loss_sum
                    tm["compute"] += time.perf_counter() - t2
                if self.tdist is not None:      # on its streams, while later segments run
                    _collective(self.ctx, f"starting the all-reduce of gradient bucket {k + 1}/"
                                f"{len(self.buckets)}", lambda: b.start_allreduce(self.tdist, self.shm, k))
        finally:
            for d in done:          # a submission left unwaited could not be submitted again
                rec.wait(d)
        plan.check_indices(dev)
        ex.last_plan = ex.last_fetch_plan = plan
        for k, b in enumerate(self.buckets):
            t = time.perf_counter()
            for w in b.works:
                _collective(self.ctx, f"the all-reduce of gradient bucket {k + 1}/{len(self.buckets)} at update "
                            f"{self.session.steps_done + 1}", w.wait)
            b.works = []
            t1 = time.perf_counter()
            # inputs of the update phase: mapped buckets are copied from their staging memory
            # inside the update's command buffer (self.update_copies); otherwise uploaded (on
            # the Vulkan backend with staged memory the small ones are copied inside it too)
            if not b.mapped:
                ex.upload({GRAD_FEED + name: b.host_np[o:o + nb // 4]
                           for name, o, (_, _, nb, _, _) in zip(b.names, b.offsets, b.locs)})
            tm["allreduce"] += t1 - t
            tm["upload"] += time.perf_counter() - t1
        last = self.buckets[-1]
        self.mean_loss = float(last.host_np[last.n]) / (self.accumulate * self.ctx.world_size)
        self._loss_sum = 0.0
        return loss

    def _update(self):
        s = self.session
        t = time.perf_counter()
        scal = s.optimizer.scalars(s.steps_done + 1)
        scal[SCALAR_PREFIX + GRAD_SCALE] = 1.0 / (self.accumulate * self.ctx.world_size)
        feeds = {k: np.asarray(v, np.float32) for k, v in scal.items() if k in s.graph.inputs}
        s.executor.execute(feeds, "update", copies_before=self.update_copies)
        s.executor.dev.sync()
        self._current["update"] += time.perf_counter() - t

    # ------------------------------------------------------------------ checkpoints, state
    def save(self, path, include_optimizer=True):
        """Rank 0 writes the checkpoint (atomically: see meganeura.checkpoint); every rank
        waits until it is written, so any rank may load it next. Returns the path."""
        if self.session.micro_done:
            raise RuntimeError(f"save: {self.session.micro_done} of {self.accumulate} micro-steps are "
                               f"accumulated; save after an update")
        if self.ctx.rank == 0:
            self.session.save(path, include_optimizer)
        barrier(self.ctx)
        return os.fspath(path)

    def load(self, path, strict=True):
        """Every rank loads the same checkpoint (parameters, optimizer state and step)."""
        return self.session.load(path, strict)

    def state_dict(self, include_optimizer=False):
        return self.session.state_dict(include_optimizer)

    def close(self):
        for step, _ in getattr(self, "submissions", ()):
            close = getattr(step, "close", None)      # the Vulkan backend's recorded command buffers
            if close is not None:
                close()
        if getattr(self, "shm", None) is not None:
            self.shm.close()
            self.shm = None
        self.session.close()
        for b in getattr(self, "buckets", ()):
            if b.host_np is not None:
                b.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _torch_or_none():
    """torch alone (a world of one process still keeps gradients in torch tensors when
    torch is installed, so the code path is the same); None without it."""
    try:
        import torch
        return torch
    except ImportError:
        return None


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


def _session_runtime(ctx, backend) -> str:
    """The runtime a session runs on: ``backend`` resolved, else the one ``init`` chose the
    device for; they must agree (the other runtime would open its own default device)."""
    from .runtime.backends import resolve
    runtime = resolve(backend) if backend is not None else (ctx.runtime or resolve("gpu"))
    if ctx.runtime is not None and runtime != ctx.runtime:
        raise ValueError(f"mg.distributed.compile: backend {backend!r} runs on {runtime}, but init() chose this "
                         f"rank's device on {ctx.runtime}: pass the same backend to init()")
    return runtime


def compile(graph: Graph, loss: Tensor, optimizer, accumulate=1, precision="strict", seed=0,
            bucket_mb=DEFAULT_BUCKET_MB, ctx=None, backend=None, mapped=None, streams=None,
            transport=None) -> DataParallel:
    """A data-parallel training session on this rank's GPU (``init`` is called if it was
    not). Every rank must build the same graph: their program hashes are compared first
    (DistributedError otherwise). Rank 0's initial values are broadcast to all.
    accumulate: all-reduce and update once per ``accumulate`` calls of ``step``.
    bucket_mb: gradient megabytes per all-reduce. backend: None runs on the runtime that
    ``init`` chose (``init(backend=...)``: the direct Vulkan backend by default, wgpu where
    it does not run or when asked). mapped: None all-reduces the gradients in the staging
    memory the device copies them into and updates from there, where the runtime keeps it
    mapped (Vulkan), else through host copies (wgpu); False always copies (for comparison);
    True refuses a runtime that cannot. streams: concurrent all-reduce streams (None: what
    ``init`` set up, by default 4; another count uses the first of the context's stream
    groups, creating more where needed, on every rank alike). transport: how the buckets are
    all-reduced (``$MEGANEURA_DP_TRANSPORT``): "gloo" (default); "auto": through shared memory
    where every rank runs on this host and /dev/shm has room, else Gloo; "shm" insists."""
    return DataParallel(graph, loss, optimizer, accumulate, precision, seed, bucket_mb, ctx, backend, mapped,
                        streams, transport)
