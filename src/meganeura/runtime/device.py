"""Process-wide wgpu device: adapter choice, buffers, pipelines, readback.

Everything the compiled plan needs from the GPU goes through one `Device`:
storage buffers, uploads, readbacks through pooled staging buffers, and
compute pipelines built from WGSL (trusted shader modules by default, so the
generated kernels run without wgpu's per-access bounds checks).

Thread safety: submits go through one lock per device queue; a readback takes a staging
buffer out of the pool for its own use (a mapped buffer must never be the target of
another thread's copy), and the pipeline cache and pool are guarded by a lock. Both
caches are bounded (`PIPELINE_CACHE_SIZE`, `STAGING_POOL_BYTES`) and `clear_caches`
empties them.
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import OrderedDict

import numpy as np
import wgpu
from wgpu.backends.wgpu_native import _api as _wapi
from wgpu.backends.wgpu_native._ffi import ffi, lib

from .backends import PIPELINE_CACHE_SIZE, env_flag, return_freed_memory

# Features requested when the adapter offers them. `timestamp-query-inside-encoders`
# comes with `-inside-passes`; `shader-float32-atomic` lets scatter-add kernels use
# atomics on f32.
WANTED_FEATURES = (
    "shader-f16",
    "subgroup",
    "subgroup-barrier",
    "timestamp-query",
    "timestamp-query-inside-encoders",
    "timestamp-query-inside-passes",
    "immediates",
    "pipeline-cache",
    "shader-float32-atomic",
)

# Limits requested at the adapter's maximum.
WANTED_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-compute-workgroups-per-dimension",
    "max-storage-buffers-per-shader-stage",
    "max-bind-groups",
    "max-bindings-per-bind-group",
    "max-immediate-size",
)

_SOFTWARE_NAMES = ("llvmpipe", "lavapipe", "swiftshader", "softpipe", "warp")
_TYPE_RANK = {"DiscreteGPU": 0, "IntegratedGPU": 1, "VirtualGPU": 2, "Unknown": 3, "CPU": 4}

_USAGE = {
    "storage": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST,
    "input": wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST,
    "staging": wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST,
    "upload": wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC,
    "query": wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC,
}

_BINDING_RES = (
    # @group(g) @binding(b) var<storage, access> ...  and the reverse attribute order
    re.compile(
        r"@group\s*\(\s*(?P<g>\d+)\s*\)\s*@binding\s*\(\s*(?P<b>\d+)\s*\)\s*"
        r"var\s*<\s*(?P<space>\w+)\s*(?:,\s*(?P<acc>\w+)\s*)?>"
    ),
    re.compile(
        r"@binding\s*\(\s*(?P<b>\d+)\s*\)\s*@group\s*\(\s*(?P<g>\d+)\s*\)\s*"
        r"var\s*<\s*(?P<space>\w+)\s*(?:,\s*(?P<acc>\w+)\s*)?>"
    ),
)


# Bytes of idle staging buffers kept for reuse by readbacks; the rest are destroyed.
STAGING_POOL_BYTES = 64 << 20


def _round4(n):
    return max(4, (int(n) + 3) & ~3)


def adapter_summary(adapter):
    info = adapter.info
    return {
        "name": info.get("device", "") or info.get("description", ""),
        "vendor": info.get("vendor", ""),
        "description": info.get("description", ""),
        "backend": info.get("backend_type", ""),
        "type": info.get("adapter_type", ""),
    }


def is_software_adapter(adapter) -> bool:
    s = adapter_summary(adapter)
    if s["type"] == "CPU":
        return True
    text = " ".join(str(v) for v in s.values()).lower()
    return any(n in text for n in _SOFTWARE_NAMES)


_adapters_cache = None


def enumerate_adapters():
    """All adapters wgpu sees (enumerated once per process)."""
    global _adapters_cache
    if _adapters_cache is None:
        _adapters_cache = list(wgpu.gpu.enumerate_adapters_sync())
    return _adapters_cache


def choose_adapter(adapters=None, selector=None):
    """Pick an adapter: `selector` (or $MEGANEURA_ADAPTER) is an index or a name
    substring; otherwise prefer Vulkan, then hardware over software."""
    adapters = enumerate_adapters() if adapters is None else list(adapters)
    if not adapters:
        raise RuntimeError(
            "no wgpu adapter found; on a machine without a GPU install Mesa's lavapipe "
            "(apt-get install mesa-vulkan-drivers)"
        )
    if selector is None:
        selector = os.environ.get("MEGANEURA_ADAPTER") or None
    if selector is not None:
        sel = str(selector).strip()
        if sel.isdigit():
            i = int(sel)
            if not 0 <= i < len(adapters):
                raise RuntimeError(f"MEGANEURA_ADAPTER={sel}: only {len(adapters)} adapters")
            return adapters[i]
        low = sel.lower()
        for a in adapters:
            if low in " ".join(str(v) for v in adapter_summary(a).values()).lower():
                return a
        names = [adapter_summary(a)["name"] + " / " + adapter_summary(a)["backend"] for a in adapters]
        raise RuntimeError(f"MEGANEURA_ADAPTER={sel!r} matches none of {names}")

    def rank(a):
        s = adapter_summary(a)
        return (
            0 if s["backend"] == "Vulkan" else 1,
            1 if is_software_adapter(a) else 0,
            _TYPE_RANK.get(s["type"], 3),
        )

    return min(adapters, key=rank)


def parse_bindings(wgsl: str):
    """Access flags ('read' / 'rw') of the group-0 storage bindings, in binding order."""
    found = {}
    for rx in _BINDING_RES:
        for m in rx.finditer(wgsl):
            g, b = int(m.group("g")), int(m.group("b"))
            if g != 0:
                raise ValueError(f"binding {b} is in group {g}; the runtime binds group 0 only")
            if m.group("space") != "storage":
                raise ValueError(
                    f"binding {b} is var<{m.group('space')}>; only storage buffers are supported"
                )
            found[b] = "read" if m.group("acc") == "read" else "rw"
    n = len(found)
    if sorted(found) != list(range(n)):
        raise ValueError(f"bindings must be 0..N-1, found {sorted(found)}")
    return [found[i] for i in range(n)]


class Pipeline:
    """A compute pipeline with its explicit group-0 layout.

    `raw` is the wgpu-py GPUComputePipeline, `handle` its wgpu-native pointer."""

    __slots__ = ("raw", "handle", "bind_group_layout", "access", "entry", "label",
                 "immediate_size", "compile_seconds", "trusted")

    def __init__(self, raw, bgl, access, entry, label, immediate_size, compile_seconds, trusted):
        self.raw = raw
        self.handle = raw._internal
        self.bind_group_layout = bgl
        self.access = tuple(access)
        self.entry = entry
        self.label = label
        self.immediate_size = immediate_size
        self.compile_seconds = compile_seconds
        self.trusted = trusted

    @property
    def num_bindings(self):
        return len(self.access)

    def __repr__(self):
        return (f"Pipeline({self.label or self.entry!r}, bindings={self.num_bindings}, "
                f"trusted={self.trusted}, {self.compile_seconds * 1e3:.1f} ms)")


class Device:
    """One wgpu device with the runtime's helpers.

    checked: None reads $MEGANEURA_CHECKED; True compiles shader modules with
    wgpu's runtime bounds checks (the ordinary create_shader_module); False
    creates them trusted (no checks), the default.
    adapter: a wgpu adapter, or an index / name substring (as $MEGANEURA_ADAPTER)."""

    def __init__(self, adapter=None, checked=None):
        if adapter is None or isinstance(adapter, (int, str)):
            adapter = choose_adapter(selector=adapter)
        self.adapter = adapter
        self.backend = "wgpu"
        self.concurrent_pipelines = False     # pipelines made before memory, not beside it
        self.checked = env_flag("MEGANEURA_CHECKED") if checked is None else bool(checked)
        a_feats = set(self.adapter.features)
        want = [f for f in WANTED_FEATURES if f in a_feats]
        a_lims = self.adapter.limits
        limits = {k: a_lims[k] for k in WANTED_LIMITS if k in a_lims}
        self.raw = self.adapter.request_device_sync(required_features=want, required_limits=limits)
        self.queue = self.raw.queue
        self.handle = self.raw._internal

        self.adapter_info = dict(adapter_summary(self.adapter))
        self.adapter_info.update({k: v for k, v in self.adapter.info.items()})
        self.features = set(self.raw.features)
        self.limits = dict(self.raw.limits)
        self.is_software = is_software_adapter(self.adapter)
        self.has_f16 = "shader-f16" in self.features
        self.has_subgroups = "subgroup" in self.features
        self.has_timestamps = "timestamp-query" in self.features
        self.has_timestamps_in_passes = "timestamp-query-inside-passes" in self.features

        # Trusted modules need wgpuDeviceCreateShaderModuleTrusted in this wgpu-native.
        self.trusted_unavailable_reason = None
        if not hasattr(lib, "wgpuDeviceCreateShaderModuleTrusted"):
            self.trusted_unavailable_reason = (
                "wgpuDeviceCreateShaderModuleTrusted is not in this wgpu-native build")
        # wgpu-native 29's C API has no pipeline-cache object calls, so the feature
        # cannot be used from here even when the adapter offers it.
        self.pipeline_cache_reason = (
            "adapter lacks pipeline-cache" if "pipeline-cache" not in self.features
            else "wgpu-native exposes no wgpuDeviceCreatePipelineCache")
        self.disk_pipeline_cache = False

        self._pipelines = OrderedDict()     # key -> Pipeline, least recently used first
        self._staging = {}                  # size -> idle staging buffers
        self._staging_idle_bytes = 0
        self.pipeline_cache_size = PIPELINE_CACHE_SIZE
        self.staging_pool_bytes = STAGING_POOL_BYTES
        self._lock = threading.RLock()      # caches and stats
        self.queue_lock = threading.Lock()  # submits and writes to the queue
        self._sync_lock = threading.Lock()
        self.stats = {
            "pipelines_compiled": 0,
            "pipeline_cache_hits": 0,
            "compile_seconds": 0.0,           # summed over pipelines (threads overlap)
            "pipeline_wall_seconds": 0.0,     # waited for by Device.pipelines
            "shader_seconds": 0.0,
            "staging_buffers_created": 0,
            "pipelines_evicted": 0,
            "readbacks": 0,
            "bind_groups_created": 0,
        }
        self._sync_src = self.create_buffer(4)
        self._sync_dst = self.raw.create_buffer(size=4, usage=_USAGE["staging"])

    # ----------------------------------------------------------------- info
    @property
    def trusted(self) -> bool:
        return not self.checked and self.trusted_unavailable_reason is None

    @property
    def name(self) -> str:
        return self.adapter_info["name"]

    def __repr__(self):
        kind = "software/CPU" if self.is_software else "hardware"
        mode = "trusted" if self.trusted else "checked"
        return f"Device({self.name!r}, {self.adapter_info['backend']}, {kind}, {mode})"

    def compile_summary(self) -> str:
        st = self.stats
        return (f"{st['pipelines_compiled']} pipelines compiled in {st['compile_seconds']:.3f} s "
                f"(shader modules {st['shader_seconds']:.3f} s), "
                f"{st['pipeline_cache_hits']} cache hits, "
                f"{'trusted' if self.trusted else 'checked'} modules")

    # -------------------------------------------------------------- buffers
    def create_buffer(self, nbytes, usage_kind="storage", label=""):
        """A buffer of at least `nbytes` (rounded up to a multiple of 4, min 4).

        usage_kind: 'storage' (STORAGE|COPY_SRC|COPY_DST; 'input', a call's input, the same
        here), 'staging' (MAP_READ|COPY_DST),
        'upload' (MAP_WRITE|COPY_SRC), 'query' (QUERY_RESOLVE|COPY_SRC)."""
        size = _round4(nbytes)
        if size > self.limits["max-buffer-size"]:
            raise MemoryError(
                f"buffer of {size} bytes exceeds max-buffer-size {self.limits['max-buffer-size']}")
        try:
            usage = _USAGE[usage_kind]
        except KeyError:
            raise ValueError(f"usage_kind must be one of {sorted(_USAGE)}, got {usage_kind!r}")
        return self.raw.create_buffer(label=label, size=size, usage=usage)

    def upload(self, buffer, array, offset=0):
        """Write `array`'s bytes into `buffer` at byte `offset` (queued, ordered before
        later submits)."""
        data = np.ascontiguousarray(array)
        raw = data.view(np.uint8).reshape(-1) if data.nbytes else np.zeros(0, np.uint8)
        if raw.nbytes % 4:
            # write_buffer needs a multiple of 4 bytes
            raw = np.concatenate([raw, np.zeros(4 - raw.nbytes % 4, np.uint8)])
        if raw.nbytes:
            with self.queue_lock:
                self.queue.write_buffer(buffer, int(offset), raw)

    # a call's inputs: wgpu already stages writes and runs them before the next submit
    upload_input = upload

    def submit(self, command_buffers):
        """Submit to the queue (serialised across threads)."""
        with self.queue_lock:
            self.queue.submit(command_buffers)

    def staging(self, nbytes):
        """A MAP_READ staging buffer of this (rounded) size for the caller alone: taken
        from the pool when one is idle; hand it back with `release_staging`."""
        size = _round4(nbytes)
        with self._lock:
            free = self._staging.get(size)
            if free:
                self._staging_idle_bytes -= size
                return free.pop()
            self.stats["staging_buffers_created"] += 1
        return self.raw.create_buffer(label=f"staging{size}", size=size, usage=_USAGE["staging"])

    def release_staging(self, buf):
        """Return a staging buffer to the pool (destroyed if the pool is full)."""
        with self._lock:
            if self._staging_idle_bytes + buf.size <= self.staging_pool_bytes:
                self._staging.setdefault(buf.size, []).append(buf)
                self._staging_idle_bytes += buf.size
                return
        buf.destroy()

    def clear_caches(self):
        """Drop the cached pipelines, destroy the idle staging buffers (plans that are
        alive keep their own pipelines and buffers) and forget the packed kernel trees; the
        freed C heap goes back to the system."""
        from .. import plan_cache
        plan_cache.clear_packed()
        with self._lock:
            self._pipelines.clear()
            idle = [b for bufs in self._staging.values() for b in bufs]
            self._staging.clear()
            self._staging_idle_bytes = 0
        for b in idle:
            b.destroy()
        return_freed_memory()

    def cache_info(self) -> dict:
        with self._lock:
            return {"pipelines": len(self._pipelines),
                    "staging_buffers": sum(len(b) for b in self._staging.values()),
                    "staging_bytes": self._staging_idle_bytes}

    def read_staging(self, staging, nbytes, dtype=np.float32, shape=None):
        """Map a staging buffer that a submitted copy has filled; returns a NumPy copy."""
        size = _round4(nbytes)
        staging.map_sync(wgpu.MapMode.READ, 0, size)
        try:
            mem = staging.read_mapped(0, size, copy=False)
            out = np.frombuffer(mem, dtype=np.uint8, count=int(nbytes)).copy()
        finally:
            staging.unmap()
        out = out.view(dtype)
        return out.reshape(shape) if shape is not None else out

    def readback(self, buffer, nbytes, dtype=np.float32, shape=None, offset=0):
        """Copy `nbytes` of `buffer` (from byte `offset`) to the host, through a pooled
        staging buffer that no other readback uses meanwhile."""
        size = _round4(nbytes)
        st = self.staging(size)
        try:
            enc = self.raw.create_command_encoder()
            enc.copy_buffer_to_buffer(buffer, int(offset), st, 0, size)
            self.submit([enc.finish()])
            with self._lock:
                self.stats["readbacks"] += 1
            return self.read_staging(st, nbytes, dtype, shape)
        finally:
            self.release_staging(st)

    def sync(self):
        """Wait for all submitted work: a copy into a small buffer is queued after it,
        and mapping that buffer completes only when the queue has reached it."""
        with self._sync_lock:
            enc = self.raw.create_command_encoder()
            enc.copy_buffer_to_buffer(self._sync_src, 0, self._sync_dst, 0, 4)
            self.submit([enc.finish()])
            self._sync_dst.map_sync(wgpu.MapMode.READ, 0, 4)
            self._sync_dst.unmap()

    # ------------------------------------------------------------ pipelines
    def shader_module(self, wgsl, label="", trusted=None):
        """A shader module; trusted (no runtime checks) unless the device is checked."""
        trusted = self.trusted if trusted is None else (trusted and self.trusted_unavailable_reason is None)
        if not trusted:
            return self.raw.create_shader_module(label=label, code=wgsl)
        # Same descriptor wgpu-py builds for WGSL, sent to the trusted entry point.
        src = _wapi.new_struct_p("WGPUShaderSourceWGSL *", code=_wapi.to_c_string_view(wgsl))
        src[0].chain.next = ffi.NULL
        src[0].chain.sType = lib.WGPUSType_ShaderSourceWGSL
        desc = _wapi.new_struct_p(
            "WGPUShaderModuleDescriptor *",
            nextInChain=ffi.cast("WGPUChainedStruct *", src),
            label=_wapi.to_c_string_view(label),
        )
        handle = _wapi.libf.wgpuDeviceCreateShaderModuleTrusted(self.handle, desc, 0)
        if handle == ffi.NULL:
            raise RuntimeError("trusted shader module creation failed")
        return _wapi.GPUShaderModule(label, handle, self.raw)

    def pipeline(self, wgsl: str, entry="main", access=None, label="", immediate_size=0):
        """Compute pipeline for `wgsl` with an explicit layout of group-0 storage buffers.

        access: list of 'read'/'rw' per binding 0..N-1, or an int N (all 'rw'), or None
        to parse the WGSL. Identical (wgsl, entry, access, immediate_size) compile once."""
        if access is None:
            access = parse_bindings(wgsl)
        elif isinstance(access, int):
            access = ["rw"] * access
        access = tuple("read" if a in ("read", "r", "ro") else "rw" for a in access)
        key = (wgsl, entry, access, int(immediate_size))
        with self._lock:
            p = self._pipelines.get(key)
            if p is not None:
                self._pipelines.move_to_end(key)
                self.stats["pipeline_cache_hits"] += 1
                return p
            p = self._compile(wgsl, entry, access, label, int(immediate_size))
            self._pipelines[key] = p
            while len(self._pipelines) > max(self.pipeline_cache_size, 0):
                self._pipelines.popitem(last=False)
                self.stats["pipelines_evicted"] += 1
        return p

    def target(self):
        """This device as a compile ``Target`` (its WGSL is final as rendered)."""
        from ..compilation.target import Target
        return Target("wgpu", limits=dict(self.limits), features=frozenset(self.features),
                      software=self.is_software, adapter=dict(self.adapter_info), unroll=False, coopmat="off",
                      coopmat_reason="no cooperative matrices through wgpu", has_f16=self.has_f16)

    def pipelines(self, kernels, threads=None):
        """Pipelines for many ``FinalKernel``s (or ``(wgsl, label)`` pairs) at once (group-0
        layouts parsed from the WGSL), in order. The ones not cached yet are created on
        ``threads`` threads (default ``backends.compile_threads``): wgpu releases the GIL
        while naga and the driver compile, and on a hardware driver each pipeline takes tens
        of milliseconds of CPU."""
        shaders = [(k.text, k.label) if hasattr(k, "key") else tuple(k) for k in kernels]
        layouts: dict = {}
        keys = [(wgsl, "main", layouts.get(wgsl) or layouts.setdefault(wgsl, tuple(parse_bindings(wgsl))), 0)
                for wgsl, _ in shaders]
        from .backends import lookup_cached, parallel_map, store_cached
        with self._lock:
            found, missing = lookup_cached(self._pipelines, [(k, label) for k, (_, label) in zip(keys, shaders)],
                                           self.stats)
        if missing:
            t0 = time.perf_counter()
            jobs = list(missing.items())

            def make(job):
                (wgsl, entry, access, imm), label = job
                return self._compile(wgsl, entry, access, label, imm)
            made = parallel_map(make, jobs, threads)
            with self._lock:
                store_cached(self._pipelines, [(key, p) for (key, _), p in zip(jobs, made)],
                             self.pipeline_cache_size, self.stats, found)
                self.stats["pipeline_wall_seconds"] += time.perf_counter() - t0
        return [found[key] for key in keys]

    def pipelines_from(self, stream):
        """The pipelines of the kernels ``stream`` hands out, made on a thread as they come."""
        from concurrent.futures import ThreadPoolExecutor
        pool = ThreadPoolExecutor(1, thread_name_prefix="wgpu-pipelines")
        future = pool.submit(lambda: [self.pipelines(batch) for batch in stream.batches()])
        pool.shutdown(wait=False)
        return future

    def _compile(self, wgsl, entry, access, label, immediate_size):
        t0 = time.perf_counter()
        trusted = self.trusted
        module = self.shader_module(wgsl, label=label, trusted=trusted)
        t1 = time.perf_counter()
        entries = [
            {
                "binding": i,
                "visibility": wgpu.ShaderStage.COMPUTE,
                "buffer": {"type": (wgpu.BufferBindingType.read_only_storage if a == "read"
                                    else wgpu.BufferBindingType.storage)},
            }
            for i, a in enumerate(access)
        ]
        bgl = self.raw.create_bind_group_layout(label=label, entries=entries)
        layout = self.raw.create_pipeline_layout(
            label=label, bind_group_layouts=[bgl], immediate_size=immediate_size)
        raw = self.raw.create_compute_pipeline(
            label=label, layout=layout, compute={"module": module, "entry_point": entry})
        dt = time.perf_counter() - t0
        with self._lock:
            self.stats["pipelines_compiled"] += 1
            self.stats["compile_seconds"] += dt
            self.stats["shader_seconds"] += t1 - t0
        return Pipeline(raw, bgl, access, entry, label, immediate_size, dt, trusted)

    def bind_group(self, pipeline: Pipeline, buffers, label=""):
        """Bind group for `pipeline` (create once, reuse every step). Each entry of
        `buffers` is a GPUBuffer or (buffer, offset, size) for a sub-range."""
        if len(buffers) != pipeline.num_bindings:
            raise ValueError(
                f"pipeline {pipeline.label or pipeline.entry!r} has {pipeline.num_bindings} "
                f"bindings, got {len(buffers)} buffers")
        entries = []
        for i, b in enumerate(buffers):
            if isinstance(b, tuple):
                buf, off, size = b
                res = {"buffer": buf, "offset": int(off), "size": int(size)}
            else:
                res = {"buffer": b, "offset": 0, "size": b.size}
            entries.append({"binding": i, "resource": res})
        self.stats["bind_groups_created"] += 1
        return self.raw.create_bind_group(label=label, layout=pipeline.bind_group_layout,
                                          entries=entries)

    # ------------------------------------------------------------- timing
    def timestamp_period(self) -> float:
        """Nanoseconds per timestamp tick."""
        return float(lib.wgpuQueueGetTimestampPeriod(self.queue._internal))


_device = None
_device_lock = threading.Lock()


def get_device() -> Device:
    """The process-wide Device, created on first use."""
    global _device
    if _device is None:
        with _device_lock:
            if _device is None:
                _device = Device()
    return _device
