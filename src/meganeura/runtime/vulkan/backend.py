"""The ``vulkan`` backend of the executor: compiled plans run on a ``VulkanDevice``.

The executor (``runtime.executor``) is written against a small device interface: buffers,
uploads and readbacks, pipelines from kernel text, bind groups, and a recorder that runs a
prepared dispatch list with copies after it. ``VulkanRuntime`` and ``VulkanRecorder``
implement that interface over this package, so every plan the compiler makes runs here
unchanged:

- the device describes itself as a compile ``Target`` (``target``); the compile stage
  finishes every kernel for it (``compilation.vulkan``: cooperative-matrix variants, GLSL,
  SPIR-V and its reflection), and this runtime only creates pipelines of that SPIR-V, in
  batches of ``vkCreateComputePipelines`` on several threads, as the kernels stream in
  (``pipelines_from``) or all at once (``pipelines``); binding access comes from the
  reflection (``readonly`` -> read);
- a step is a ``Program``: one command buffer recorded once per (plan, copies), its
  dispatches grouped into dependency levels with one barrier between levels;
- buffers are ranges of a few large memory blocks (``VulkanDevice.alloc``).
"""
from __future__ import annotations

import contextlib
import gc
import threading
import time
import weakref
from collections import OrderedDict

import numpy as np

from ...compilation.target import COOPMAT_MODES, coopmat_mode  # noqa: F401 (the switch, read by callers too)
from ..backends import env_flag, return_freed_memory
from .device import VulkanDevice, get_vulkan_device
from .memory import BufferRange
from .program import Copy, Dispatch, Program


DEFERRED_UPLOAD_BYTES = 8 << 20   # larger uploads (weights) go at once and keep no staging copy


class OwnedRange(BufferRange):
    """A device range the runtime allocated; ``destroy`` gives it back."""

    def __init__(self, rng: BufferRange, dev: VulkanDevice, label=""):
        super().__init__(rng.block, rng.offset, rng.size)
        self._dev, self.label, self.freed = dev, label, False
        self.staging = None          # host range of deferred uploads into this one

    def destroy(self):
        if not self.freed:
            self.freed = True
            self._dev.free(self)
            if self.staging is not None:
                self.staging.destroy()

    def __del__(self):
        # plan buffers (slots, constants, targets) are dropped with their plan, as wgpu's are
        if not self.freed and self._dev.handle is not None:
            try:
                self.destroy()
            except Exception:       # interpreter shutdown: the device goes anyway
                pass


# threads that create pipelines of kernels read compiled from disk; the driver's cache serves
# them one at a time (H200: U-Net's 448 training kernels in 0.10 s on one thread or sixteen,
# which spent 1.0 s of CPU doing it)
CACHED_PIPELINE_THREADS = 2


class PreparedProgram:
    """A plan's dispatch list: (kernel, ranges, groups) and names; the Programs recorded
    from it, one per set of copies after it (outputs fetched or not) and timing mode."""

    def __init__(self, dispatches, names, lock=None):
        self.lock = lock or threading.RLock()    # the runtime's queue lock (closing waits on the queue)
        self.dispatches = [(k, list(bufs), _groups(g)) for k, bufs, g, *_ in dispatches]
        self.names = list(names) if names is not None else [k.name for k, _, _ in self.dispatches]
        if len(self.names) != len(self.dispatches):
            raise ValueError(f"{len(self.names)} names for {len(self.dispatches)} dispatches")
        self.programs = {}
        self.last = None
        # a plan dropped without its session being closed takes its Programs with it
        self._release = weakref.finalize(self, _close_programs, self.programs, self.lock)

    def __len__(self):
        return len(self.dispatches)

    def sync_stats(self) -> dict:
        """Levels and barriers of the last Program recorded from this step (``Program.stats``);
        empty before the first run."""
        return self.programs[self.last][0].stats if self.programs else {}

    def close(self):
        """Destroy the Programs recorded from this step (their command buffers, fences and
        descriptor pools)."""
        _close_programs(self.programs, self.lock)
        self.last = None


def _close_programs(programs, lock):
    with lock:
        for prog, _ in programs.values():
            prog.close()
        programs.clear()


def _groups(g):
    return (int(g), 1, 1) if isinstance(g, (int, np.integer)) else tuple(int(x) for x in (tuple(g) + (1, 1))[:3])


def _copy(c) -> Copy:
    """A (src, dst, n) or (src, src_offset, dst, dst_offset, n) copy of the executor as a Copy
    (the executor rounds sizes up to 4 bytes; ranges here are exact, so sizes are clamped)."""
    if len(c) == 3:
        src, dst, n = c
        so = do = 0
    else:
        src, so, dst, do, n = c
    n = min(int(n), src.size - int(so), dst.size - int(do))
    return Copy(src.sub(int(so), n), dst.sub(int(do), n), n)


class VulkanRecorder:
    """Runs prepared steps as Programs (the ``StepRecorder`` interface)."""

    def __init__(self, runtime: "VulkanRuntime"):
        self.runtime = runtime
        self.last_timestamps_ns = None

    def prepare(self, dispatches, names=None) -> PreparedProgram:
        return PreparedProgram(dispatches, names, self.runtime.queue_lock)

    @staticmethod
    def release(step: PreparedProgram):
        """Destroy the Programs recorded from ``step`` (a session closing)."""
        step.close()

    def _program(self, step, before, after, timestamps) -> Program:
        """The Program of ``step`` with these copies (recorded on first use, then kept)."""
        rt = self.runtime
        key = (tuple(_key(c) for c in before), tuple(_key(c) for c in after), bool(timestamps))
        entry = step.programs.get(key)
        if entry is None:
            ops = [_copy(c) for c in before]
            ops += [Dispatch(k, bufs, g, name=n) for (k, bufs, g), n in zip(step.dispatches, step.names)]
            ops += [_copy(c) for c in after]
            prog = Program(rt.vk, ops, levels=rt.use_levels, timestamps="ops" if timestamps else False, name="step")
            # the ranges the key names by id() stay alive as long as the Program
            entry = step.programs[key] = (prog, (list(before), list(after)))
        step.last = key
        return entry[0]

    def run(self, step, copies_before=(), copies_after=(), timestamps=False, wait=False):
        """Submit ``step`` with its copies and wait (the Vulkan queue is used synchronously:
        the caller reads results right after). ``timestamps``: returns an (n, 2) array of
        [start, end] ns per dispatch. A raw dispatch list (anomaly mode: one dispatch at a
        time) runs as a Program that is closed after it."""
        rt = self.runtime
        if timestamps and not rt.has_timestamps:
            raise RuntimeError(f"{rt.name}: the device has no timestamp queries")
        temporary = not isinstance(step, PreparedProgram)
        step = self.prepare(step) if temporary else step
        with rt.queue_lock:
            # inputs waiting in staging memory go first, in the same submit
            pending = rt.take_pending()
            try:
                before = pending + list(copies_before)
                prog = self._program(step, before, copies_after, timestamps)
                prog.run(wait=True)
                ns = None
                if timestamps:
                    ts = prog.timestamps_ns()
                    first = len(before)
                    ns = self.last_timestamps_ns = np.asarray(ts[first:first + len(step.dispatches)], dtype=np.int64)
            except BaseException:
                rt.restore_pending(pending)      # nothing was copied: the next step copies them
                raise
            finally:
                if temporary:
                    step.close()
        rt.stats["steps"] += 1
        return ns

    def run_repeated(self, step: PreparedProgram, reps: int):
        """``step`` ``reps`` times back to back in one submit, then wait: a benchmark's view
        of queued launches, as a CUDA stream runs them (each repetition after the one it
        depends on, by the same levels as one step). No inputs are copied in."""
        rt = self.runtime
        key = ("repeated", int(reps))
        with rt.queue_lock:
            entry = step.programs.get(key)
            if entry is None:
                ops = [Dispatch(k, bufs, g, name=n) for (k, bufs, g), n in zip(step.dispatches, step.names)]
                entry = step.programs[key] = (Program(rt.vk, ops * int(reps), levels=rt.use_levels,
                                                      name=f"step x{reps}"), ([], []))
            entry[0].run(wait=True)
        rt.stats["steps"] += int(reps)

    # ------------------------------------------------ submissions waited for one by one
    def submit(self, step: PreparedProgram, copies_after=()) -> "Submission":
        """Submit ``step`` (the deferred inputs first, as in ``run``) and the copies after it
        without waiting; returns a ``Submission`` to wait for it alone (its Program's fence),
        while later submissions run. Wait before submitting the same step again."""
        rt = self.runtime
        with rt.queue_lock:
            pending = rt.take_pending()
            try:
                prog = self._program(step, pending, copies_after, False)
                prog.run(wait=False)
            except BaseException:
                rt.restore_pending(pending)
                raise
        rt.stats["steps"] += 1
        return Submission(prog)

    @staticmethod
    def wait(sub: "Submission"):
        sub.wait()

    @contextlib.contextmanager
    def mapped_after(self, sub: "Submission", staging, nbytes):
        """The first ``nbytes`` of host-visible ``staging`` as a uint8 array, once ``sub``
        (which fills it) has run: a view of the mapped memory, valid inside the block."""
        sub.wait()
        if staging.block.mapped is None:
            raise ValueError(f"mapped_after: {getattr(staging, 'label', staging)!r} is not host-visible")
        yield staging.block.mapped[staging.offset:staging.offset + int(nbytes)]


class Submission:
    """A Program submitted without waiting; ``wait`` returns once it has run (the first call
    waits on and resets its fence, later calls return at once)."""

    def __init__(self, program: Program):
        self.program, self.done = program, False

    def wait(self):
        if not self.done:
            self.program.wait()
            self.done = True


def _key(c):
    return tuple(id(x) if isinstance(x, BufferRange) else int(x) for x in c)


def coopmat_unavailable(vk) -> str:
    """Why ``vk`` cannot run the cooperative-matrix matmuls ('' when it can)."""
    if not vk.features.get("cooperativeMatrix"):
        return f"no cooperative matrices ({vk.cooperative_matrix_reason})"
    if not vk.has_coop_shape(16, 16, 16, "f16", "f16", "f32"):
        return "no 16x16x16 f16 x f16 -> f32 subgroup shape"
    if not (vk.features.get("shaderFloat16") and vk.features.get("storageBuffer16BitAccess")):
        return "no f16 arithmetic or 16-bit storage"
    sub = vk.subgroup
    if sub["size"] != 32 and not (vk.features.get("subgroupSizeControl") and sub["min_size"] <= 32 <= sub["max_size"]):
        return f"subgroups of 32 needed, the device has {sub['size']}"
    return ""


class VulkanRuntime:
    """The executor's device interface over a ``VulkanDevice`` (see the module docstring).

    checked: None reads ``MEGANEURA_CHECKED`` (index checks report bad indices, as on wgpu);
    levels: False records a barrier after every dispatch (for comparison)."""

    def __init__(self, vk: VulkanDevice | None = None, checked=None, levels=True):
        self.vk = vk or get_vulkan_device()
        self.checked = env_flag("MEGANEURA_CHECKED") if checked is None else bool(checked)
        self.use_levels = levels
        self.backend = "vulkan"
        # a plan's pipelines may be created on another thread while it allocates memory:
        # Vulkan lets both run at once on one device, and cffi releases the GIL in them
        self.concurrent_pipelines = True
        f = self.vk.features
        self.has_f16 = bool(f.get("shaderFloat16") and f.get("storageBuffer16BitAccess"))
        self.has_timestamps = self.vk.timestamp_bits > 0
        self.is_software = self.vk.is_software
        # [[unroll]] hints for hardware drivers only (a software rasterizer's compile time
        # explodes on unrolled kernels); MEGANEURA_GLSL_UNROLL forces them on or off
        from ...codegen.glsl_target import unroll_switch
        forced = unroll_switch()
        self.unroll_loops = (not self.is_software) if forced is None else forced
        self.features = {k for k, on in f.items() if on}
        self.ieee_preserve = self.vk.float_controls["signed_zero_inf_nan_f32"]
        lim = self.vk.limits
        # the limits the compiler and the executor read, under wgpu's names
        self.limits = {
            "max-storage-buffers-per-shader-stage": min(int(lim["maxPerStageDescriptorStorageBuffers"]), 1 << 16),
            "max-compute-workgroup-storage-size": int(lim["maxComputeSharedMemorySize"]),
            "max-storage-buffer-binding-size": int(lim["maxStorageBufferRange"]),
            "max-buffer-size": int(lim["maxStorageBufferRange"]),
            "max-compute-workgroups-per-dimension": int(min(lim["maxComputeWorkGroupCount"])),
            "max-compute-invocations-per-workgroup": int(lim["maxComputeWorkGroupInvocations"]),
            # arrays of buffers indexed per workgroup: the parts of a merged launch share bodies
            # (MEGANEURA_BINDING_ARRAYS=0: one body per part, as on wgpu)
            "binding-arrays": bool(f.get("shaderStorageBufferArrayDynamicIndexing"))
                              and env_flag("MEGANEURA_BINDING_ARRAYS", default=True),
        }
        drv = self.vk.driver
        self.adapter_info = {"name": self.vk.name, "backend": "Vulkan (direct)", "type": self.vk.device_type,
                             "description": f"{drv.get('name', '')} {drv.get('info', '')}".strip()}
        from ..backends import PIPELINE_CACHE_SIZE
        self._pending: dict = {}        # id(buffer) -> deferred input copy (see upload_input)
        self._pending_lock = threading.RLock()
        self._pipelines: OrderedDict = OrderedDict()    # text -> Kernel, least recently used first
        self.pipeline_cache_size = PIPELINE_CACHE_SIZE
        self._lock = threading.RLock()
        self.queue_lock = threading.RLock()    # the queue, and the deferred inputs (taken first)
        self.stats = {"pipelines_compiled": 0, "pipeline_cache_hits": 0, "compile_seconds": 0.0,
                      "steps": 0, "pipelines_evicted": 0,
                      "pipeline_wall_seconds": 0.0, "coopmat_kernels": 0,
                      "kernel_cache_hits": 0}
        self.coopmat_reason = coopmat_unavailable(self.vk)

    @property
    def name(self) -> str:
        return self.vk.name

    @property
    def trusted(self) -> bool:
        """As wgpu's: no checks beyond the kernels' own (checked mode adds the index reports)."""
        return not self.checked

    def __repr__(self):
        return f"VulkanRuntime({self.name!r}, {'software/CPU' if self.is_software else 'hardware'})"

    # ----------------------------------------------------------------- buffers
    def create_buffer(self, nbytes, usage_kind="storage", label=""):
        # sizes rounded up to 4 bytes as wgpu's are: copies move whole words
        # zeros, as wgpu's new buffers: the executor leaves values that start at zero
        # (optimizer moments, accumulators) to them, and a range may be one that a closed
        # session freed
        rng = self.vk.alloc(max((int(nbytes) + 3) & ~3, 4), host=usage_kind == "staging", label=label,
                            zeroed=usage_kind != "staging", input=usage_kind == "input")
        return OwnedRange(rng, self.vk, label)

    def upload(self, buffer, array, offset=0):
        """Write ``array`` into ``buffer`` now (after any deferred input copies, so the order
        of writes holds)."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if raw.size + int(offset) > buffer.size:
            raise ValueError(f"upload of {raw.size} B at offset {offset} into a buffer of {buffer.size} B "
                             f"({getattr(buffer, 'label', '')!r})")
        with self.queue_lock:
            self.flush_locked()
            if raw.size:
                self.vk.upload(buffer.sub(int(offset), buffer.size - int(offset)) if offset else buffer, raw)

    def upload_input(self, buffer, array):
        """A call's input: on mapped memory (lavapipe, integrated GPUs) a memcpy; elsewhere,
        when small, copied into a staging range kept for that buffer, and from there into
        device memory at the start of the next step's command buffer (no submit of its own).
        A readback, a copy or an ordinary upload first runs the pending copies (``flush``)."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if buffer.host_visible or raw.size == 0 or raw.size > DEFERRED_UPLOAD_BYTES \
                or not isinstance(buffer, OwnedRange) or raw.size > buffer.size:
            self.upload(buffer, array)
            return
        with self.queue_lock, self._pending_lock:
            stage = buffer.staging
            if stage is None or stage.size < raw.size:
                if stage is not None:
                    self.flush_locked()
                    stage.destroy()
                stage = buffer.staging = OwnedRange(self.vk.alloc(raw.size, host=True), self.vk, "upload")
            stage.block.mapped[stage.offset:stage.offset + raw.size] = raw
            self._pending[id(buffer)] = (stage, 0, buffer, 0, raw.size)

    def take_pending(self) -> list:
        """The deferred uploads as copies (source, offset, destination, offset, bytes), cleared."""
        with self._pending_lock:
            out = [c for c in self._pending.values() if not c[2].freed]     # a freed buffer needs none
            self._pending.clear()
        return out

    def restore_pending(self, copies):
        """Put back deferred uploads a failed step did not run (unless a newer one replaced them)."""
        with self._pending_lock:
            for c in copies:
                self._pending.setdefault(id(c[2]), c)

    def flush(self):
        """Run the deferred uploads now (before a readback or a copy that reads them)."""
        with self.queue_lock:
            self.flush_locked()

    def flush_locked(self):
        pending = self.take_pending()
        try:       # one submit for all of them (the gradient uploads of a data-parallel update: hundreds)
            self.vk.copy_many([(src.sub(so, n), dst.sub(do, n), n) for src, so, dst, do, n in pending])
        except BaseException:
            self.restore_pending(pending)
            raise

    def readback(self, buffer, nbytes, dtype=np.float32, shape=None, offset=0):
        dtype = np.dtype(dtype)
        n = min(int(nbytes), buffer.size - int(offset))
        with self.queue_lock:
            self.flush_locked()
            raw = self.vk.download(buffer.sub(int(offset), n), np.uint8)
        count = int(np.prod(shape)) if shape is not None else n // dtype.itemsize
        out = raw[:count * dtype.itemsize].view(dtype)
        return out.reshape(shape) if shape is not None else out

    def read_staging(self, staging, nbytes, dtype=np.float32, shape=None):
        return self.readback(staging, nbytes, dtype, shape)

    def sync(self):
        """Every submission waits for itself (``VulkanRecorder.run``): nothing is in flight."""

    # ---------------------------------------------------------------- pipelines
    def target(self):
        """This device as a compile ``Target`` (``MEGANEURA_COOPMAT`` read now)."""
        from ...compilation.target import Target
        vk = self.vk
        return Target("vulkan", limits=dict(self.limits), features=frozenset(self.features),
                      subgroup={k: int(vk.subgroup[k]) for k in ("size", "min_size", "max_size")},
                      coop_shapes=tuple(dict(sh) for sh in vk.cooperative_matrix_shapes), vulkan=tuple(vk.api),
                      software=self.is_software, adapter=dict(self.adapter_info), coopmat_reason=self.coopmat_reason,
                      unroll=self.unroll_loops, coopmat=coopmat_mode(), has_f16=self.has_f16,
                      ieee_preserve=self.ieee_preserve)

    def pipelines(self, kernels, threads=None, access=None):
        """Pipelines of ``kernels`` (``FinalKernel``s: SPIR-V and its reflection), in order, each
        key once, kept for later plans. Kernels read compiled from disk (which the driver's
        pipeline cache likely holds too) are created in ``CACHED_PIPELINE_THREADS`` batches of
        one ``vkCreateComputePipelines`` each; the others one a thread on ``threads`` threads
        (``backends.compile_threads``). A failure raises and leaves no pipeline behind."""
        from ..backends import lookup_cached, store_cached
        t0 = time.perf_counter()
        self.stats["coopmat_kernels"] += sum(1 for k in kernels if k.coopmat)
        with self._lock:
            found, missing = lookup_cached(self._pipelines, [(k.key, k) for k in kernels], self.stats)
        if missing:
            made = self._create(list(missing.values()), threads, access)
            with self._lock:
                self.stats["pipelines_compiled"] += len(made)
                # evicted kernels stay alive while a plan holds them
                store_cached(self._pipelines, made, self.pipeline_cache_size, self.stats, found)
        self.stats["pipeline_wall_seconds"] += time.perf_counter() - t0
        return [found[k.key] for k in kernels]

    def _spec(self, k, access=None) -> dict:
        """What ``VulkanDevice.kernels`` makes a pipeline of, for a finished kernel."""
        if k.spirv is None:
            raise ValueError(f"kernel {k.label!r}: no SPIR-V (an executable compiled for another target than Vulkan)")
        return dict(spirv=k.spirv, name=k.label, access=access, info=k.info, required_subgroup_size=k.subgroup_size)

    def _create(self, kernels, threads=None, access=None) -> list:
        """[(key, Kernel)] of ``kernels`` (see ``pipelines``)."""
        from concurrent.futures import ThreadPoolExecutor
        from ..backends import compile_threads
        n = compile_threads(threads)
        cached = [k for k in kernels if k.from_disk]
        per = max(1, -(-len(cached) // min(n, CACHED_PIPELINE_THREADS)))
        batches = [cached[i:i + per] for i in range(0, len(cached), per)]
        batches += [[k] for k in sorted((k for k in kernels if not k.from_disk), key=lambda k: -len(k.spirv or b""))]

        def create(batch):
            return self.vk.kernels([self._spec(k, access) for k in batch], threads=1, batch=len(batch))
        workers = min(n, len(batches))
        results, error = [], None
        if workers > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="vk-pipelines") as pool:
                futures = [pool.submit(create, b) for b in batches]
                for f in futures:
                    try:
                        results.append(f.result())
                    except BaseException as e:
                        error = error or e
                        results.append([])
        else:
            for b in batches:
                try:
                    results.append(create(b))
                except BaseException as e:
                    error = e
                    break
        if error is not None:
            for made in results:
                for k in made:
                    k.destroy()
            raise error
        with self._lock:
            self.stats["compile_seconds"] += sum(k.create_seconds for made in results for k in made)
            self.stats["kernel_cache_hits"] += len(cached)
        return [(fk.key, k) for b, made in zip(batches, results) for fk, k in zip(b, made)]

    def pipelines_from(self, stream):
        """Start creating the pipelines of the kernels ``stream`` hands out as they come (each
        batch the compile stage has finished meanwhile), on threads; returns a Future that
        ends once the stream is closed and they are made. A kernel that fails here is left
        out: ``pipelines`` makes it again and raises there."""
        from concurrent.futures import ThreadPoolExecutor
        from ..backends import compile_threads, store_cached

        def make(batch):
            try:
                made = self._create(batch, threads=1)
            except Exception:       # noqa: BLE001 (made again by ``pipelines``, which raises)
                return
            with self._lock:
                self.stats["pipelines_compiled"] += len(made)
                store_cached(self._pipelines, made, self.pipeline_cache_size, self.stats, {})

        def drain():
            with ThreadPoolExecutor(compile_threads(), thread_name_prefix="vk-stream") as pool:
                for batch in stream.batches():
                    with self._lock:
                        new = [k for k in batch if k.key not in self._pipelines]
                    from_disk = [k for k in new if k.from_disk]
                    if from_disk:
                        pool.submit(make, from_disk)
                    for k in new:
                        if not k.from_disk:
                            pool.submit(make, [k])
        runner = ThreadPoolExecutor(1, thread_name_prefix="vk-stream-drain")
        future = runner.submit(drain)
        runner.shutdown(wait=False)
        return future

    def clear_caches(self):
        """Drop the cached kernels (their pipelines are destroyed once no live plan holds
        them), and everything compiling kept in this process: the SPIR-V, the finished kernels
        (GLSL, SPIR-V and reflection), the cooperative-matrix variants and the GLSL
        GLSL memos (``compilation.vulkan.clear_memory``); then the freed C heap goes back to the system. The disk caches stay."""
        with self._lock:
            self._pipelines.clear()
        from ...compilation.glslang import clear_memory_cache
        from ...compilation.vulkan import clear_memory
        clear_memory_cache()
        clear_memory()
        gc.collect()            # pipelines in reference cycles are destroyed now, not later
        return_freed_memory()

    def cache_info(self) -> dict:
        with self._lock:
            return {"pipelines": len(self._pipelines), "staging_buffers": 0, "staging_bytes": 0}

    def bind_group(self, pipeline, buffers, label=""):
        if len(buffers) != len(pipeline.access):
            raise ValueError(f"kernel {pipeline.name!r}: {len(buffers)} buffers for {len(pipeline.access)} bindings")
        return list(buffers)

    def compile_summary(self) -> str:
        st = self.stats
        return (f"{st['pipelines_compiled']} pipelines created in {st['compile_seconds']:.3f} s, "
                f"{st['pipeline_cache_hits']} cache hits, "
                f"{st['kernel_cache_hits']} kernels read compiled from disk, "
                f"{st['coopmat_kernels']} dispatches on cooperative matrices")

    def timestamp_period(self) -> float:
        return float(self.vk.limits["timestampPeriod"])


_runtime = None
_runtime_lock = threading.Lock()


def get_vulkan_runtime() -> VulkanRuntime:
    """The process-wide Vulkan runtime (over the process-wide ``VulkanDevice``)."""
    global _runtime
    with _runtime_lock:
        if _runtime is None:
            _runtime = VulkanRuntime()
        return _runtime
