"""Low-level GPU runtime: device, pipelines, one-pass step recording, profiling."""
import os
import tempfile

# Mesa's Vulkan loader complains on every adapter query when this is unset (headless
# machines, CI); compute needs no display, so any private folder will do.
os.environ.setdefault("XDG_RUNTIME_DIR", tempfile.gettempdir())

# The wgpu runtime's names load on first use (PEP 562): a process on the direct Vulkan backend
# never imports wgpu, whose bindings take 0.24-0.34 s to load here (cffi parsing its C declarations).
_LAZY = {name: ".device" for name in ("WANTED_LIMITS", "Device", "Pipeline", "get_device", "enumerate_adapters",
                                      "adapter_summary", "is_software_adapter")}
_LAZY.update({"PreparedStep": ".recorder", "StepRecorder": ".recorder", "format_kernel_table": ".profiler",
              "kernel_table": ".profiler", "write_chrome_trace": ".profiler"})


def __getattr__(name):
    if name in _LAZY:
        import importlib
        return getattr(importlib.import_module(_LAZY[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "Device", "Pipeline", "get_device", "StepRecorder", "PreparedStep",
    "write_chrome_trace", "kernel_table", "format_kernel_table", "describe",
]


def describe(device=None) -> str:
    """Adapters, the chosen one, its features and key limits (for `meganeura info`)."""
    import wgpu

    from .device import WANTED_LIMITS, adapter_summary, enumerate_adapters, get_device, is_software_adapter
    dev = get_device() if device is None else device
    lines = [f"wgpu-py {wgpu.__version__}", "adapters:"]
    for i, a in enumerate(enumerate_adapters()):
        s = adapter_summary(a)
        mark = "*" if a is dev.adapter else " "
        soft = " (software/CPU)" if is_software_adapter(a) else ""
        lines.append(f" {mark}[{i}] {s['name']} | {s['backend']} | {s['type']}{soft}")
    kind = "a SOFTWARE/CPU adapter (timings are not GPU performance)" if dev.is_software \
        else "a hardware GPU"
    lines.append(f"chosen: {dev.name} ({dev.adapter_info['backend']}), {kind}")
    lines.append(f"  driver: {dev.adapter_info.get('description', '')}")
    mode = "trusted (no runtime bounds checks)" if dev.trusted else "checked"
    lines.append(f"  shader modules: {mode}")
    if dev.trusted_unavailable_reason:
        lines.append(f"  trusted unavailable: {dev.trusted_unavailable_reason}")
    lines.append(f"  disk pipeline cache: {'on' if dev.disk_pipeline_cache else 'off'}"
                 f" ({dev.pipeline_cache_reason})")
    lines.append("  features: " + ", ".join(sorted(dev.features)))
    lines.append("  limits:")
    for k in (k for k in WANTED_LIMITS if k != "max-bindings-per-bind-group"):   # the per-group count aside
        if k in dev.limits:
            lines.append(f"    {k}: {dev.limits[k]}")
    return "\n".join(lines)
