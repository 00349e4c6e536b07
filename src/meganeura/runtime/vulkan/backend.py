"""The ``vulkan`` backend of the executor: compiled plans run on a ``VulkanDevice``.

The executor (``runtime.executor``) is written against a small device interface: buffers,
uploads and readbacks, pipelines from kernel text, bind groups, and a recorder that runs a
prepared dispatch list with copies after it. ``VulkanRuntime`` and ``VulkanRecorder``
implement that interface over this package, so every plan the compiler makes runs here
unchanged:

- kernel text is rendered to GLSL (``codegen.glsl``) and compiled to SPIR-V by glslang;
  binding access comes from the SPIR-V (``readonly`` -> read). The SPIR-V and what is read
  from it are kept on disk under a key of the kernel text (``cache.CompiledKernel``), so a
  later process creates its pipelines without translating or compiling anything, in
  batches of ``vkCreateComputePipelines`` on several threads;
- in accelerated precision, tiled matmuls with f16 operands (``codegen.coopmat``) and flash
  attention (``codegen.flash_coop``, ``codegen.flash_grad_coop``) run on cooperative matrices
  where the device has them: ``kernel_variant`` swaps the kernel when the executor builds a plan;
- a step is a ``Program``: one command buffer recorded once per (plan, copies), its
  dispatches grouped into dependency levels with one barrier between levels;
- buffers are ranges of a few large memory blocks (``VulkanDevice.alloc``).
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import OrderedDict

import numpy as np

from ..backends import env_flag
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


# While pipelines are made, threads return from glslang and driver calls (which release the
# GIL) a dozen times a kernel, each time waiting for the GIL from a thread that translates
# kernels or plans memory in Python; that thread gives it up only every switch interval
# (5 ms by default), so sixteen threads queue behind it. A shorter interval while they run:
# H200, U-Net's training plans from empty caches on 16 threads: glslang's seconds summed over
# threads 31.1 -> 16.4 (0.2 ms; 1 ms: 21.5), compile 6.8 -> 5.6 s.
GIL_SWITCH_S = 2e-4
# threads that create pipelines of kernels read compiled from disk; the driver's cache serves
# them one at a time (H200: U-Net's 448 training kernels in 0.10 s on one thread or sixteen,
# which spent 1.0 s of CPU doing it)
CACHED_PIPELINE_THREADS = 2
_switch_lock = threading.Lock()
_switch_users = [0, None]       # callers inside, the interval to restore


@contextlib.contextmanager
def _prompt_gil_handoff():
    """Hand the GIL over every ``GIL_SWITCH_S`` seconds inside (process-wide; nested and
    concurrent users restore the interval once the last leaves)."""
    import sys
    with _switch_lock:
        if _switch_users[0] == 0:
            _switch_users[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(GIL_SWITCH_S, _switch_users[1]))
        _switch_users[0] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users[0] -= 1
            if _switch_users[0] == 0:
                sys.setswitchinterval(_switch_users[1])


class _InlineJobs:
    """``ThreadPoolExecutor``'s ``submit`` run on the calling thread (one kernel, or one
    compile thread: no pool to start)."""

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def submit(self, fn, *args):
        from concurrent.futures import Future
        f = Future()
        try:
            f.set_result(fn(*args))
        except BaseException as e:
            f.set_exception(e)
        return f


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


COOPMAT_MODES = ("auto", "off", "emulate")


def coopmat_mode() -> str:
    """``MEGANEURA_COOPMAT``: ``auto`` (default: cooperative-matrix matmuls and flash attention
    in accelerated precision where the device has them), ``off``, or ``emulate`` (the same
    kernels with the fragment operations as plain loops, on any device: for testing; slow)."""
    raw = os.environ.get("MEGANEURA_COOPMAT", "").strip().lower() or "auto"
    raw = {"0": "off", "false": "off", "no": "off", "1": "auto", "on": "auto", "yes": "auto"}.get(raw, raw)
    if raw not in COOPMAT_MODES:
        raise ValueError(f"MEGANEURA_COOPMAT={raw!r}: must be one of {COOPMAT_MODES} (or unset)")
    return raw


# archetypes with kernels on cooperative matrices: tiled matmuls (``codegen.coopmat``) and
# flash attention (``codegen.flash_coop``, its backward ``codegen.flash_grad_coop``)
VARIANT_ARCHETYPES = ("matmul", "attention")


def _tensor_core_renderer(kernel):
    """The module that renders ``kernel`` on cooperative matrices (its ``select`` says whether
    it can)."""
    from ...codegen import coopmat, flash_coop, flash_grad_coop
    if kernel.archetype == "matmul":
        return coopmat
    return flash_grad_coop if kernel.spec.get("grad") else flash_coop


def _has_ir(kernel) -> bool:
    """Whether ``kernel`` has its IR (a plan read from the plan cache keeps only its name,
    archetype and outputs: no reads)."""
    return bool(kernel.spec.get("parts", [kernel])[0].reads)


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
        # [[unroll]] hints for hardware drivers only (codegen.glsl: a software rasterizer's
        # compile time explodes on unrolled kernels)
        from ...codegen.glsl import unroll_switch
        forced = unroll_switch()
        self.unroll_loops = (not self.is_software) if forced is None else forced
        self.features = {k for k, on in f.items() if on}
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
                      "glsl_seconds": 0.0, "steps": 0, "pipelines_evicted": 0,
                      "pipeline_wall_seconds": 0.0, "coopmat_kernels": 0,
                      "kernel_cache_hits": 0}
        self.coopmat_reason = coopmat_unavailable(self.vk)
        self._variants: dict = {}         # (kernel text, emulate, configs) -> (GLSL, groups) or None
        self._early: dict = {}            # kernel text -> future of a kernel started early (``start_kernel``)
        self._early_pool = None           # (pid, the threads that make them)

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
    def kernel_variant(self, kernel, text, label, bufs, groups, precision="strict"):
        """Another kernel for one dispatch of a plan, as (text, label, bufs, groups), or None
        to run ``text`` as rendered. In accelerated precision, tiled matmuls with f16
        operands and flash attention run on cooperative matrices where the device has them
        (``MEGANEURA_COOPMAT`` switches that, see ``coopmat_mode``); strict precision never.

        A variant binds the WGSL kernel's buffers in the same order, so it is a function of the
        WGSL text: cached by it in memory, and on disk for plans read from the plan cache,
        which have no kernel IR to render from."""
        emulate = self._variant_mode(precision)
        if emulate is None:
            return None
        from ...codegen.coopmat import config_key
        return self._variant(kernel, text, label, bufs, emulate, config_key())

    def _variant_mode(self, precision):
        """None where every kernel runs as rendered (strict precision, ``MEGANEURA_COOPMAT``
        off, or auto on a device without cooperative matrices), else whether the variants are
        emulated."""
        mode = coopmat_mode()
        if precision != "accelerated" or mode == "off" or (mode == "auto" and self.coopmat_reason):
            return None
        return mode == "emulate"

    def _variant(self, kernel, text, label, bufs, emulate, config):
        """``kernel_variant`` with the mode and the configuration key (``coopmat.config_key``)
        decided by the caller, once for a whole plan."""
        if kernel.archetype not in VARIANT_ARCHETYPES:
            return None
        key = (text, emulate, config)
        with self._lock:
            found = self._variants.get(key, False)
        if found is False:
            found = self._render_variant(kernel, text, bufs, emulate)
            if found is not None or _has_ir(kernel):
                with self._lock:       # (a kernel without IR may find its variant later)
                    self._variants[key] = found
        if found is None:
            return None
        glsl, vgroups = found
        self.stats["coopmat_kernels"] += 1
        return glsl, label, bufs, vgroups

    def kernel_variants(self, kernels, shaders, precision="strict"):
        """``kernel_variant`` over a plan's dispatches (``shaders``: their (text, label, bufs,
        groups)) at once: the executor's hook. The variants of a plan's matmuls are also
        stored together, keyed by all their WGSL texts, so that a plan read from the plan
        cache (no kernel IR) finds them in one file instead of one file each."""
        emulate = self._variant_mode(precision)
        texts = sorted({sh[0] for k, sh in zip(kernels, shaders) if k.archetype in VARIANT_ARCHETYPES})
        if emulate is None or not texts:
            return shaders
        from ...codegen.coopmat import config_key
        from .cache import disk_cache_enabled, load_json, store_json
        config = config_key()
        path = self._variant_path(texts, emulate, what="set") if disk_cache_enabled() else None
        with self._lock:
            missing = [t for t in texts if (t, emulate, config) not in self._variants]
        stored = None
        if missing and path is not None:
            try:
                stored = (load_json(path) or {})["variants"]
            except (KeyError, TypeError):
                stored = None
            if stored is not None and len(stored) == len(texts):
                with self._lock:
                    for t, v in zip(texts, stored):
                        self._variants.setdefault((t, emulate, config), None if v is None else (v[0], tuple(v[1])))
        out = [self._variant(k, text, label, bufs, emulate, config) or (text, label, bufs, groups)
               for k, (text, label, bufs, groups) in zip(kernels, shaders)]
        if missing and stored is None and path is not None:
            with self._lock:
                found = [self._variants.get((t, emulate, config), False) for t in texts]
            if False not in found:          # every variant known (a plan with IR): store the set
                from ...plan_cache import prune
                from .cache import SET_MAX_BYTES
                if store_json(path, {"variants": [None if v is None else [v[0], list(v[1])] for v in found]}):
                    # variants and sets past the kernel sets' budget: oldest first
                    prune(path.parent, SET_MAX_BYTES, ("*.json",))
        return out

    def _variant_path(self, texts, emulate, what="variant"):
        """The file of the variant of one WGSL text (``what`` "variant"), or of a plan's set of
        them (``texts`` a sorted list, ``what`` "set")."""
        from ...codegen import coopmat
        from ...plan_cache import package_digest
        from .cache import cache_dir, sha256_of
        texts = [texts] if isinstance(texts, str) else texts
        h = sha256_of([what, repr((emulate, coopmat.config_key(), self.limits["max-compute-workgroup-storage-size"])),
                        package_digest(), *texts])
        return cache_dir() / "coopmat" / f"{h.hexdigest()}{'' if what == 'variant' else '.' + what}.json"

    def _render_variant(self, kernel, text, bufs, emulate):
        """(GLSL, groups) of ``kernel`` on cooperative matrices, or None."""
        from .cache import disk_cache_enabled, load_json, store_json
        disk = disk_cache_enabled()
        if not _has_ir(kernel):
            if not disk:
                return None
            try:        # a kernel without IR: the variant stored when its plan was compiled
                saved = load_json(self._variant_path(text, emulate))
                return saved["glsl"], tuple(saved["groups"])
            except (KeyError, TypeError):
                return None
        renderer = _tensor_core_renderer(kernel)
        storage = self.limits["max-compute-workgroup-storage-size"]
        if renderer.select(kernel, storage, emulate):
            return None
        try:
            glsl, vbufs, groups = renderer.render(kernel, storage, emulate, **(
                {"bufs": bufs} if kernel.archetype == "matmul" else {}))
        except ValueError:          # more workgroup memory than the device has: the WGSL kernel
            return None
        # the variant binds the WGSL kernel's buffers in the same order (checked here, so that
        # a variant found by the WGSL text alone is right for any plan)
        if len(vbufs) != len(bufs) or any(x is not y for x, y in zip(vbufs, bufs)):
            return None
        if disk:
            store_json(self._variant_path(text, emulate), {"glsl": glsl, "groups": groups})
        return glsl, tuple(groups)

    def pipeline(self, text: str, entry="main", access=None, label="", immediate_size=0):
        """A kernel from the renderers' text (translated to GLSL, compiled to SPIR-V), or
        from GLSL (text starting ``#version``: ``kernel_variant``'s), cached by text."""
        return self.pipelines([(text, label)], threads=1, access=access)[0]

    def _target(self) -> str:
        return "vulkan1.3" if self.vk.api >= (1, 3) else "vulkan1.2"

    def _key_context(self) -> dict:
        """What besides the text decides compiled kernels: the target, glslang, the package."""
        from ...plan_cache import package_digest
        from .glslang import glslang_version_tag
        return dict(target=self._target(), glslang=glslang_version_tag(), package=package_digest())

    def _kernel_key(self, text) -> str:
        """The key of ``text``'s compiled kernel (``cache.kernel_key``): the GLSL translation
        switches count for renderers' text only (GLSL is compiled as it is)."""
        from .cache import kernel_key
        return kernel_key(text, unroll=self.unroll_loops and not text.startswith("#version"), **self._key_context())

    def prepare_compile(self):
        """A plan is being compiled (not read from the plan cache): glslang's first compile of
        the process, which runs alone, starts now beside the compiler passes instead of
        holding up the first of the new kernels (``glslang.start_warm_up``); the translation
        workers (``translators``) start too."""
        from . import translators
        from .glslang import start_warm_up
        start_warm_up(_prompt_gil_handoff)
        translators.start()         # the translation workers, if any, boot beside the passes

    def _kernel_set_key(self, texts) -> str:
        """The key of the compiled kernels of ``texts`` (``cache.kernel_set_key``)."""
        from .cache import kernel_set_key
        return kernel_set_key(texts, unroll=self.unroll_loops, **self._key_context())

    def _compile(self, glsl, label, key, disk):
        """The ``CompiledKernel`` of a kernel's GLSL: compiled to SPIR-V (glslang's own cache
        is keyed by the GLSL) and reflected; stored under ``key`` when ``disk``."""
        from .cache import CompiledKernel, store_kernel
        from .glslang import compile_glsl
        from .spirv import reflect
        spirv = compile_glsl(glsl, name=label, target=self._target(), disk_cache=disk)
        # cooperative-matrix kernels map subgroups of 32 to fragments
        ck = CompiledKernel(spirv, reflect(spirv), "GL_KHR_cooperative_matrix" in glsl)
        if disk:
            store_kernel(key, ck)
        return ck

    def _pin(self, ck) -> int | None:
        """The subgroup size a kernel requires (cooperative matrices: 32 where the device's
        subgroups may be another size), or None."""
        sub = self.vk.subgroup
        return 32 if ck.subgroup32 and (sub["min_size"], sub["max_size"]) != (32, 32) else None

    def pipelines(self, shaders, threads=None, access=None):
        """Kernels for many ``(text, label)`` at once, in order (identical text once).

        A kernel text whose SPIR-V an earlier process stored (``cache.CompiledKernel``, keyed
        by the text) is read back with its reflection: no GLSL translation, no glslang, no
        SPIR-V parsing. Where those of every text were stored together (a ``cache`` kernel
        set, written once a request of at least ``cache.SET_MIN_KERNELS`` kernels is made)
        one file is read. Those pipelines are created in ``CACHED_PIPELINE_THREADS`` batches
        (one ``vkCreateComputePipelines`` each) on as many threads, each batch as soon as it
        is read. The others stream: each is translated to GLSL (by the translation workers,
        ``translators``, for a large request, else on this thread), longest text first, and
        handed as soon as it is to the pool of ``threads`` threads
        (``backends.compile_threads``) that compile it with glslang and create its pipeline,
        so the driver compiles while the rest are translated and the longest compiles do not
        come last. A failure raises once every job has ended and leaves no pipeline behind."""
        from ..backends import lookup_cached, store_cached
        from .cache import SET_MIN_KERNELS, disk_cache_enabled, load_kernel_set, store_kernel_set
        t0 = time.perf_counter()
        with self._lock:
            found, missing = lookup_cached(self._pipelines, shaders, self.stats)
        if missing:
            entries = [(text, label or "kernel") for text, label in missing.items()]
            disk = disk_cache_enabled()
            set_key = self._kernel_set_key(missing) if disk and len(entries) >= SET_MIN_KERNELS else None
            stored = load_kernel_set(set_key, len(entries)) if set_key else None
            had_set = stored is not None
            early = self._take_early(missing) if access is None else {}
            rest = [e for e in entries if e[0] not in early]
            if stored is not None and early:
                stored = [ck for (text, _), ck in zip(entries, stored) if text not in early]
            try:
                made, compiled, from_disk, glsl_s, cpu_s = self._make_kernels(rest, threads, access, disk, stored)
            except BaseException:
                for _, kernel, _, _, _ in early.values():
                    kernel.destroy()
                raise
            for text, (ck, kernel, from_disk_, glsl_, cpu_) in early.items():
                made.append((text, kernel))
                compiled[text] = ck
                from_disk, glsl_s, cpu_s = from_disk + from_disk_, glsl_s + glsl_, cpu_s + cpu_
            if set_key and not had_set:
                store_kernel_set(set_key, [compiled[text] for text, _ in entries])
            with self._lock:
                self.stats["kernel_cache_hits"] += from_disk
                self.stats["glsl_seconds"] += glsl_s
                self.stats["compile_seconds"] += cpu_s
                self.stats["pipelines_compiled"] += len(made)
                # evicted kernels stay alive while a plan holds them (the driver's pipeline
                # cache makes a later rebuild cheap)
                store_cached(self._pipelines, made, self.pipeline_cache_size, self.stats, found)
        self.stats["pipeline_wall_seconds"] += time.perf_counter() - t0
        return [found[text] for text, _ in shaders]

    def start_kernel(self, kernel, text, precision="strict"):
        """Start making the pipeline of ``text`` (``kernel``'s rendered text) now, on threads of
        its own: the executor calls this for each new text while ``compile_plan`` renders the
        rest of the plan and plans its memory, so the driver is compiling the large kernels by
        the time ``pipelines`` asks for them (it takes them from here). A kernel this runtime
        may run its own way (a cooperative-matrix variant) is left for ``pipelines``; a failure
        too: ``pipelines`` makes that kernel again and raises there."""
        if self._variant_mode(precision) is not None and kernel.archetype in VARIANT_ARCHETYPES:
            return
        with self._lock:
            if self._early_pool is not None and self._early_pool[0] != os.getpid():
                self._early_pool, self._early = None, {}       # a forked child: the threads stayed behind
            if text in self._pipelines or text in self._early:
                return
            if self._early_pool is None:
                from concurrent.futures import ThreadPoolExecutor
                from ..backends import compile_threads
                self._early_pool = (os.getpid(), ThreadPoolExecutor(compile_threads(), thread_name_prefix="vk-early"))
            self._early[text] = self._early_pool[1].submit(self._make_early, text, kernel.name or "kernel")

    def _make_early(self, text, label):
        """(CompiledKernel, pipeline, read from disk, seconds translating, CPU seconds) of one
        kernel started early: read from the disk cache, else translated (by the translation
        workers where they run), compiled and created."""
        from . import translators
        from .cache import disk_cache_enabled, load_kernel
        disk = disk_cache_enabled()
        key = self._kernel_key(text)
        ck = load_kernel(key) if disk else None
        from_disk, glsl_s, compile_s = ck is not None, 0.0, 0.0
        if ck is None:
            glsl = text if text.startswith("#version") else None
            workers = translators.pool_for(translators.MIN_KERNELS) if glsl is None else None
            if workers is not None:
                try:
                    glsl, glsl_s = workers.submit(text, label, self.unroll_loops).result()
                except translators.WorkerLost:
                    glsl = None
            if glsl is None:
                glsl, glsl_s = self._glsl_here(text, label)
            t = time.perf_counter()
            ck = self._compile(glsl, label, key, disk)
            compile_s = time.perf_counter() - t
        made = self.vk.kernels([self._kernel_spec(label, ck)], threads=1)[0]
        return ck, made, int(from_disk), glsl_s, glsl_s + compile_s + made.create_seconds

    def _take_early(self, texts) -> dict:
        """{text: ``_make_early``'s result} of the kernels of ``texts`` started early, once each
        has ended; those that failed are left out (``pipelines`` makes them again)."""
        with self._lock:
            futures = {t: self._early.pop(t) for t in texts if t in self._early}
        done = {}
        for text, future in futures.items():
            try:
                done[text] = future.result()
            except BaseException:       # noqa: BLE001 (made again by the caller, which raises)
                pass
        return done

    def _kernel_spec(self, label, ck, access=None) -> dict:
        """What ``VulkanDevice.kernels`` makes a pipeline of, for a compiled kernel."""
        return dict(spirv=ck.spirv, name=label, access=access, info=ck.info, required_subgroup_size=self._pin(ck))

    def _glsl_here(self, text, label):
        """(GLSL, seconds) of WGSL ``text`` translated on this thread."""
        from ...codegen.glsl import to_glsl
        t = time.perf_counter()
        return to_glsl(text, label, unroll=self.unroll_loops), time.perf_counter() - t

    def _make_kernels(self, entries, threads, access, disk, stored=None):
        """([(text, Kernel)], {text: CompiledKernel}, how many were read compiled from disk,
        seconds translating to GLSL, CPU seconds in all) for ``entries`` [(text, label)];
        ``stored``: their compiled kernels, in order, where a kernel set had them."""
        from concurrent.futures import ThreadPoolExecutor
        from ..backends import compile_threads
        from .cache import load_kernel

        failed = threading.Event()      # a job raised: translate and hand out no more

        def flags_failure(make):
            def run(*args):
                try:
                    return make(*args)
                except BaseException:
                    failed.set()
                    raise
            return run

        @flags_failure
        def create(batch):
            return self.vk.kernels([self._kernel_spec(label, ck, access) for _, label, ck in batch], threads=1,
                                   batch=len(batch)), 0.0

        @flags_failure
        def compile_and_create(text, glsl, label, key):
            t = time.perf_counter()
            ck = compiled[text] = self._compile(glsl, label, key, disk)
            t = time.perf_counter() - t
            return self.vk.kernels([self._kernel_spec(label, ck, access)], threads=1), t

        n = compile_threads(threads)
        # kernels read compiled: a few large batches (the driver serves cached pipelines one
        # at a time however many threads ask, and more threads only spin while the thread
        # that plans memory meanwhile wants a core)
        per = max(1, -(-len(entries) // min(n, CACHED_PIPELINE_THREADS)))
        workers = min(n, len(entries))
        jobs, texts, error, glsl_s, compiled = [], [], None, 0.0, {}
        with contextlib.ExitStack() as inside:
            pool = inside.enter_context(ThreadPoolExecutor(workers) if workers > 1 else _InlineJobs())
            try:
                # kernels on disk: read here (in Python, which threads would only contend
                # for), created in batches by the pool as each batch fills
                misses, batch = [], []
                for i, (text, label) in enumerate(entries):
                    ck = stored[i] if stored is not None else None
                    if ck is None:
                        key = self._kernel_key(text)
                        ck = load_kernel(key) if disk and stored is None else None
                    if ck is None:
                        misses.append((text, label, key))
                    else:
                        compiled[text] = ck
                        batch.append((text, label, ck))
                    if batch and (len(batch) == per or i == len(entries) - 1):
                        jobs.append(pool.submit(create, batch))
                        texts.append([t for t, _, _ in batch])
                        batch = []
                from_disk = len(entries) - len(misses)
                # the others: the driver's compile time grows with the kernel, the longest start
                # first; while they compile, the GIL changes hands promptly (until every job ends)
                if workers > 1 and misses:
                    inside.enter_context(_prompt_gil_handoff())
                for text, label, key, glsl, seconds in self._translated(misses, failed):
                    glsl_s += seconds
                    jobs.append(pool.submit(compile_and_create, text, glsl, label, key))
                    texts.append([text])
            except BaseException as e:      # a translation failed: let the submitted jobs end
                error = e
            results = []
            for future in jobs:
                try:
                    results.append(future.result())
                except BaseException as e:
                    error = error or e
                    results.append(([], 0.0))
        if error is not None:
            for kernels, _ in results:
                for k in kernels:
                    k.destroy()
            raise error
        made = [(text, k) for ts, (kernels, _) in zip(texts, results) for text, k in zip(ts, kernels)]
        cpu_s = glsl_s + sum(t for _, t in results) + sum(k.create_seconds for _, k in made)
        return made, compiled, from_disk, glsl_s, cpu_s

    def _translated(self, misses, failed):
        """(text, label, key, GLSL, seconds translating) of ``misses`` [(text, label, key)], in
        the order they are ready, the longest texts (the longest compiles) first: by the
        translation workers (``translators``) for a large request, else here. Stops once
        ``failed`` is set; a kernel a lost worker held is translated here."""
        from concurrent.futures import as_completed

        from . import translators

        todo = []
        for text, label, key in sorted(misses, key=lambda m: -len(m[0])):
            if text.startswith("#version"):         # GLSL already (``kernel_variant``'s)
                yield text, label, key, text, 0.0
            else:
                todo.append((text, label, key))
        workers = translators.pool_for(len(todo))
        if workers is None:
            for text, label, key in todo:
                if failed.is_set():
                    return
                yield (text, label, key) + self._glsl_here(text, label)
            return
        asked = {workers.submit(text, label, self.unroll_loops): (text, label, key) for text, label, key in todo}
        try:
            for fut in as_completed(asked):
                if failed.is_set():
                    return
                text, label, key = asked[fut]
                try:
                    glsl, seconds = fut.result()
                except translators.WorkerLost:
                    glsl, seconds = self._glsl_here(text, label)
                yield text, label, key, glsl, seconds
        finally:            # stopped early (a failure): what is not sent yet is not translated
            for fut in asked:
                fut.cancel()

    def clear_caches(self):
        """Drop the cached kernels (plans that are alive keep their own)."""
        with self._lock:
            self._pipelines.clear()

    def cache_info(self) -> dict:
        with self._lock:
            return {"pipelines": len(self._pipelines), "staging_buffers": 0, "staging_bytes": 0}

    def bind_group(self, pipeline, buffers, label=""):
        if len(buffers) != len(pipeline.access):
            raise ValueError(f"kernel {pipeline.name!r}: {len(buffers)} buffers for {len(pipeline.access)} bindings")
        return list(buffers)

    def compile_summary(self) -> str:
        st = self.stats
        return (f"{st['pipelines_compiled']} pipelines compiled in {st['compile_seconds']:.3f} s "
                f"(GLSL rendering {st['glsl_seconds']:.3f} s), {st['pipeline_cache_hits']} cache hits, "
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
