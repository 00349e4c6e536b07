"""The device interface the executor is written against, met by both runtimes (wgpu's
``runtime.device.Device`` and ``runtime.vulkan.backend.VulkanRuntime``): it describes
itself as a compile ``Target``, makes pipelines of finished kernels, and moves memory.
It compiles nothing: kernels come final from the compile stage."""
from __future__ import annotations

from typing import Protocol, runtime_checkable


@runtime_checkable
class RuntimeDevice(Protocol):
    name: str
    backend: str                    # "wgpu" or "vulkan"
    checked: bool                   # checked mode: kernels compiled with index reports
    has_f16: bool
    limits: dict
    adapter_info: dict
    # pipelines may be created on other threads while memory is allocated, and a compile's
    # kernels streamed into ``pipelines_from`` as they are finished
    concurrent_pipelines: bool

    def target(self):
        """This device as a ``compilation.target.Target``."""

    def pipelines(self, kernels) -> list:
        """A pipeline per ``FinalKernel`` of ``kernels``, in order (equal keys once)."""

    def pipelines_from(self, stream):
        """Start creating the pipelines of the kernels ``stream`` (a ``KernelStream``) hands
        out, on threads; returns a Future that ends when the stream is closed and they are made."""

    def bind_group(self, pipeline, buffers, label=""): ...

    def create_buffer(self, nbytes, usage_kind="storage", label=""): ...

    def upload(self, buffer, array, offset=0): ...

    def upload_input(self, buffer, array): ...

    def readback(self, buffer, nbytes, dtype=None, shape=None, offset=0): ...

    def read_staging(self, staging, nbytes, dtype=None, shape=None): ...

    def sync(self): ...
