"""The process group and this rank's place in it: joining the group torchrun describes
(``init``, ``shutdown``), the GPU a local rank takes (wgpu adapter or Vulkan device), the
count of all-reduce streams, blocking collectives that fail with a ``DistributedError``
naming what was being done, and each rank's share of a batch (``shard``, ``shard_indices``)."""
from __future__ import annotations

import atexit
import datetime
import os
import warnings

import numpy as np


DEFAULT_TIMEOUT_S = 300.0     # a collective that waits longer than this fails (a rank died or hangs)

DEFAULT_STREAMS = 4           # concurrent all-reduce streams (Gloo process groups)
MAX_STREAMS = 64
STREAMS_ENV = "MEGANEURA_DP_STREAMS"


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
    from ..runtime import device as devmod
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
    from ..runtime.vulkan import device as vkdev
    return _by_local_rank(local_rank, "MEGANEURA_VK_DEVICE", vkdev.list_physical_devices(), vkdev.choose_physical,
                          lambda d: (vkdev.device_rank(d), d["type"] == "cpu"))


def _resolve_for_rank(backend: str, local_rank: int) -> str:
    """``resolve(backend)`` for a rank: deciding between the runtimes opens the process-wide
    Vulkan device, so it must open this rank's (device 0 for every rank made rank 1 fail on
    a 2-GPU machine)."""
    from ..runtime.backends import resolve
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
    from ..runtime.vulkan import device as vkdev
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
