"""Which GPU runtime runs a ``gpu`` session: wgpu (WGSL, every platform: Vulkan, Metal,
DX12) or the direct Vulkan backend (SPIR-V compiled from GLSL by the compile stage,
dependency levels instead of a barrier per dispatch, cooperative matrices).

``backend="gpu"`` follows ``MEGANEURA_BACKEND`` (``vulkan`` or ``wgpu``) when it is set;
otherwise it takes the Vulkan backend where the ``vulkan`` extra is installed and a
Vulkan device exists, and wgpu elsewhere (macOS, Windows without the extra, browsers).
``backend="vulkan"`` / ``backend="wgpu"`` ask for one explicitly.
"""
from __future__ import annotations

import functools
import os

GPU_BACKENDS = ("gpu", "vulkan", "wgpu")
KINDS = ("vulkan", "wgpu")
# Compiled pipelines either runtime keeps for reuse by later plans (a plan holds its own
# pipelines, so evicting one only costs a recompile if the same kernel is needed again).
PIPELINE_CACHE_SIZE = 1024


def env_flag(name: str, default: bool = False) -> bool:
    """Whether the switch ``name`` is set on in the environment (1 / true / yes / on);
    ``default`` where it is not set (or empty)."""
    value = os.environ.get(name, "").strip().lower()
    return default if not value else value in ("1", "true", "yes", "on")


@functools.lru_cache(maxsize=1)
def vulkan_unavailable_reason(selector=None) -> str | None:
    """None when the direct Vulkan backend can run here, else why not. The check opens the
    process-wide Vulkan device, on ``selector``'s physical device if it is not open yet
    (a data-parallel rank's own GPU, not the first one)."""
    try:
        from .vulkan import _vk
        _vk.require()
        from .vulkan.device import get_vulkan_device
        get_vulkan_device(selector)
    except Exception as e:      # the package, the loader or a device is missing
        return f"{type(e).__name__}: {e}"
    return None


def resolve(backend: str = "gpu", vulkan_selector=None) -> str:
    """The runtime (``vulkan`` or ``wgpu``) that runs ``backend`` (``vulkan_selector``: the
    device the Vulkan check opens, see ``vulkan_unavailable_reason``)."""
    if backend in KINDS:
        return backend
    if backend != "gpu":
        raise ValueError(f"unknown GPU backend {backend!r}; choose one of {GPU_BACKENDS}")
    env = os.environ.get("MEGANEURA_BACKEND", "").strip().lower()
    if env:
        if env not in KINDS:
            raise ValueError(f"MEGANEURA_BACKEND={env!r}: must be one of {KINDS} (or unset)")
        return env
    return "vulkan" if vulkan_unavailable_reason(vulkan_selector) is None else "wgpu"


def get_runtime_device(kind: str):
    """The process-wide device object of runtime ``kind`` (the executor's device interface)."""
    if kind == "vulkan":
        from .vulkan.backend import get_vulkan_runtime
        return get_vulkan_runtime()
    from .device import get_device
    return get_device()


def gpu_device():
    """The device object that ``backend="gpu"`` sessions run on."""
    return get_runtime_device(resolve("gpu"))


def make_recorder(dev):
    if dev.backend == "vulkan":
        from .vulkan.backend import VulkanRecorder
        return VulkanRecorder(dev)
    from .recorder import StepRecorder
    return StepRecorder(dev)


# ---------------------------------------------------------------- pipeline caches of both runtimes
def lookup_cached(cache, keyed, stats):
    """Split ``keyed`` [(key, label)] into ({key: cached pipeline}, {key: label} to create),
    counting hits (a repeated key is one creation and hits after it); ``cache`` is an
    OrderedDict kept in least-recently-used order. Call under the cache's lock."""
    found, missing = {}, {}
    for key, label in keyed:
        p = cache.get(key)
        if p is not None:
            cache.move_to_end(key)
            stats["pipeline_cache_hits"] += 1
            found[key] = p
        elif key not in missing:
            missing[key] = label
        else:
            stats["pipeline_cache_hits"] += 1
    return found, missing


def store_cached(cache, made, size, stats, found):
    """Put ``made`` [(key, pipeline)] into ``cache`` (and ``found``), evicting the least
    recently used past ``size``. Call under the cache's lock."""
    for key, p in made:
        found[key] = cache.setdefault(key, p)
    while len(cache) > max(size, 0):
        cache.popitem(last=False)
        stats["pipelines_evicted"] += 1


def compile_threads(threads=None, jobs=None) -> int:
    """Threads for creating pipelines: ``threads``, else ``MEGANEURA_COMPILE_THREADS``, else
    one per CPU up to 16 (the shader compilers run with the GIL released); at most ``jobs``."""
    n = threads or int(os.environ.get("MEGANEURA_COMPILE_THREADS", "0") or 0) or min(16, os.cpu_count() or 1)
    return max(1, min(n, jobs)) if jobs is not None else max(1, n)


def parallel_map(make, jobs, threads=None) -> list:
    """``[make(j) for j in jobs]`` on ``compile_threads(threads)`` threads: pipeline creation
    releases the GIL while the shader compilers run."""
    n = compile_threads(threads, len(jobs))
    if n > 1:
        from concurrent.futures import ThreadPoolExecutor
        with ThreadPoolExecutor(n) as pool:
            return list(pool.map(make, jobs))
    return [make(j) for j in jobs]


def return_freed_memory() -> bool:
    """Hand the C heap's free pages back to the system (glibc's ``malloc_trim``), as
    ``clear_caches`` does after dropping what it kept: freed memory otherwise stays in the
    process (compiling and creating pipelines frees many small blocks, on several threads'
    heaps). False where the C library has no such call."""
    import ctypes
    import ctypes.util
    try:
        trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    trim(0)
    return True
