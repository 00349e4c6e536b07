"""The Vulkan device: a logical device with one compute queue, its command buffers, fences
and submissions, made of parts in modules of their own: the physical-device choice
(``selection``), the feature chain (``features``), memory blocks with sub-allocation and
uploads/downloads (``device_memory``), compute kernels and the pipeline cache (``pipelines``).

``VulkanDevice(selector=None)`` picks a device (``selector`` or ``$MEGANEURA_VK_DEVICE``:
an index or a name substring; else discrete > integrated > virtual > other > CPU) and
creates a logical device with one queue, enabling what the device offers of: 16-bit
storage, ``shaderFloat16``, 8-bit storage, the Vulkan memory model, subgroup size control
(with full subgroups) and ``VK_KHR_cooperative_matrix``. ``capabilities()`` reports all
of it as a dict (``meganeura info`` prints it).
"""
from __future__ import annotations

import os
import threading
import time
import weakref

from . import _vk
from ._vk import VulkanError, check, new
from .cache import disk_cache_enabled
from .device_memory import DEFAULT_BLOCK_BYTES, INPUT_HEAP_BYTES, SMALL_STAGING_BYTES, DeviceMemory, full_barrier
from .features import DeviceFeatures
from .pipelines import DevicePipelines, Kernel
from .selection import (_create_instance, _env_selector, _physical_devices, choose_physical, device_rank,
                        list_physical_devices)

# names of the parts' modules, as ``device.<name>``
__all__ = ["INPUT_HEAP_BYTES", "SMALL_STAGING_BYTES", "Kernel", "VulkanDevice", "choose_physical", "device_rank",
           "full_barrier", "get_vulkan_device", "list_physical_devices", "spin_seconds"]


# a wait for the GPU polls the fence this long before it blocks (MEGANEURA_SPIN_MS: 0 blocks
# at once), so a step shorter than that returns as soon as it is done; not on a software
# device unless asked, where the polling thread would take a core from the one doing the work
SPIN_MS = 20.0


def spin_seconds(software=False) -> float:
    raw = os.environ.get("MEGANEURA_SPIN_MS", "").strip()
    try:
        ms = float(raw) if raw else 0.0 if software else SPIN_MS
    except ValueError:
        raise ValueError(f"MEGANEURA_SPIN_MS={raw!r}: milliseconds to poll before a blocking wait "
                         "(0: block at once)") from None
    return max(0.0, ms) / 1e3


class VulkanDevice(DeviceFeatures, DeviceMemory, DevicePipelines):
    """One Vulkan logical device with a compute queue (see the module docstring).

    selector: index or name substring of the physical device; cooperative_matrix: enable
    ``VK_KHR_cooperative_matrix`` when offered; block_bytes: size of each device memory
    block (a larger request gets a block of its own); direct_host_access: None maps device
    memory for uploads/downloads when it is host-visible and the device is not discrete
    (lavapipe, integrated GPUs), False always goes through staging copies;
    pipeline_cache: None follows ``MEGANEURA_NO_DISK_CACHE`` for the on-disk cache."""

    def __init__(self, selector=None, *, cooperative_matrix=True, block_bytes=DEFAULT_BLOCK_BYTES,
                 direct_host_access=None, pipeline_cache=None):
        _vk.require()
        self.handle = None
        self._kernels = weakref.WeakSet()
        self._programs = weakref.WeakSet()
        self._layout_cache = {}       # (bindings, push-constant bytes) -> shared layouts
        self._blocks = {"device": [], "staging": [], "input": []}
        self._lock = threading.RLock()
        self._unfilled = []           # new device blocks awaiting their fill with zeros
        self._maker = None            # the thread creating device blocks (_block_maker)
        self.block_bytes = int(block_bytes)
        self._create_instance()
        self._choose_physical(selector if selector is not None else _env_selector())
        self._query_features(cooperative_matrix)
        self._create_device()
        self._create_common()
        self._init_memory(direct_host_access)
        self._init_pipeline_cache(disk_cache_enabled() if pipeline_cache is None else pipeline_cache)

    # ------------------------------------------------------------------ instance and device
    def _create_instance(self):
        self.instance, self.instance_version, self._name = _create_instance()

    def physical_devices(self):
        """[(handle, summary dict)] of every physical device."""
        return _physical_devices(self.instance)

    def _choose_physical(self, selector):
        devs = self.physical_devices()
        self.all_devices = [s for _, s in devs]
        self.summary = choose_physical(self.all_devices, selector)
        self.physical = devs[self.summary["index"]][0]
        self.index = self.summary["index"]

    def _create_device(self):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        f = self.features
        keep, exts, chain = [], [], ffi.NULL
        if f["cooperativeMatrix"]:
            exts.append(b"VK_KHR_cooperative_matrix")
            e = new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
                    sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR, cooperativeMatrix=1)
            keep.append(e)
            chain = e
        if self.api >= (1, 3):
            e = new("VkPhysicalDeviceVulkan13Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
                    pNext=chain, subgroupSizeControl=f["subgroupSizeControl"],
                    computeFullSubgroups=f["computeFullSubgroups"])
            keep.append(e)
            chain = e
        e12 = new("VkPhysicalDeviceVulkan12Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                  pNext=chain, shaderFloat16=f["shaderFloat16"], shaderInt8=f["shaderInt8"],
                  storageBuffer8BitAccess=f["storageBuffer8BitAccess"], vulkanMemoryModel=f["vulkanMemoryModel"],
                  vulkanMemoryModelDeviceScope=f["vulkanMemoryModelDeviceScope"],
                  shaderSubgroupExtendedTypes=f["shaderSubgroupExtendedTypes"])
        e11 = new("VkPhysicalDeviceVulkan11Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                  pNext=e12, storageBuffer16BitAccess=f["storageBuffer16BitAccess"])
        f2 = new("VkPhysicalDeviceFeatures2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=e11)
        f2.features.shaderInt16 = f["shaderInt16"]
        f2.features.shaderInt64 = f["shaderInt64"]
        f2.features.shaderFloat64 = f["shaderFloat64"]
        # arrays of buffers indexed by a workgroup-uniform value (the parts of a merged launch
        # that share one body, ``codegen.pointwise.render_multi``)
        f2.features.shaderStorageBufferArrayDynamicIndexing = f["shaderStorageBufferArrayDynamicIndexing"]
        prio = ffi.new("float[1]", [1.0])
        qci = new("VkDeviceQueueCreateInfo", sType=vk.VK_STRUCTURE_TYPE_DEVICE_QUEUE_CREATE_INFO,
                  queueFamilyIndex=self.queue_family, queueCount=1, pQueuePriorities=prio)
        names = [ffi.new("char[]", x) for x in exts]
        pnames = ffi.new("char*[]", names) if names else ffi.NULL
        dci = new("VkDeviceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_DEVICE_CREATE_INFO, pNext=f2,
                  queueCreateInfoCount=1, pQueueCreateInfos=qci, enabledExtensionCount=len(exts),
                  ppEnabledExtensionNames=pnames)
        p = ffi.new("VkDevice*")
        check(lib.vkCreateDevice(self.physical, dci, ffi.NULL, p),
              f"vkCreateDevice({self.name}, extensions {[x.decode() for x in exts]})")
        self.handle = p[0]
        self.enabled_extensions = [x.decode() for x in exts]
        q = ffi.new("VkQueue*")
        lib.vkGetDeviceQueue(self.handle, self.queue_family, 0, q)
        self.queue = q[0]

    def _create_common(self):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        cp = new("VkCommandPoolCreateInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_POOL_CREATE_INFO,
                 flags=vk.VK_COMMAND_POOL_CREATE_RESET_COMMAND_BUFFER_BIT, queueFamilyIndex=self.queue_family)
        p = ffi.new("VkCommandPool*")
        check(lib.vkCreateCommandPool(self.handle, cp, ffi.NULL, p), "vkCreateCommandPool")
        self.command_pool = p[0]
        self._xfer_cmd = self.allocate_command_buffer()
        self._xfer_fence = self.create_fence()

    def allocate_command_buffer(self):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        ca = new("VkCommandBufferAllocateInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_ALLOCATE_INFO,
                 commandPool=self.command_pool, level=vk.VK_COMMAND_BUFFER_LEVEL_PRIMARY, commandBufferCount=1)
        pc = ffi.new("VkCommandBuffer[1]")
        check(lib.vkAllocateCommandBuffers(self.handle, ca, pc), "vkAllocateCommandBuffers")
        return pc

    def free_command_buffer(self, pc):
        if self.handle is not None:
            _vk.lib.vkFreeCommandBuffers(self.handle, self.command_pool, 1, pc)

    def create_fence(self):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        fi = new("VkFenceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_FENCE_CREATE_INFO)
        pf = ffi.new("VkFence[1]")
        check(lib.vkCreateFence(self.handle, fi, ffi.NULL, pf), "vkCreateFence")
        return pf

    def submit(self, pcmd, pfence, wait=True, timeout_s=600.0):
        """Submit the command buffer ``pcmd`` (a cffi VkCommandBuffer[1]) signalling ``pfence``."""
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        si = new("VkSubmitInfo", sType=vk.VK_STRUCTURE_TYPE_SUBMIT_INFO, commandBufferCount=1, pCommandBuffers=pcmd)
        with self._lock:
            if self._unfilled and pcmd is not self._xfer_cmd:
                self._one_shot(lambda cmd: None)       # new blocks' fills first
            check(lib.vkQueueSubmit(self.queue, 1, si, pfence[0]), "vkQueueSubmit")
        if wait:
            self.wait_fence(pfence, timeout_s)

    def wait_fence(self, pfence, timeout_s=600.0):
        lib = _vk.lib
        # poll first, as CUDA's synchronize does: a blocking wait returns tens of
        # microseconds after the GPU is done, a large part of a millisecond step's overhead
        spin = spin_seconds(self.is_software)
        if spin > 0:
            deadline = time.perf_counter() + spin
            while lib.vkGetFenceStatus(self.handle, pfence[0]) == _vk.vk.VK_NOT_READY \
                    and time.perf_counter() < deadline:
                pass
        res = lib.vkWaitForFences(self.handle, 1, pfence, 1, int(timeout_s * 1e9))
        if res == _vk.vk.VK_TIMEOUT:
            raise VulkanError(f"GPU work did not finish within {timeout_s} s", res)
        check(res, "vkWaitForFences")
        check(lib.vkResetFences(self.handle, 1, pfence), "vkResetFences")

    # ------------------------------------------------------------------ report and teardown
    def capabilities(self) -> dict:
        """What the backend found and enabled, as plain data."""
        return dict(
            backend="vulkan", vulkan_package=_vk.VULKAN_PACKAGE_VERSION, instance_version=self.instance_version,
            devices=self.all_devices, index=self.index, name=self.name, type=self.device_type,
            is_software=self.is_software, api_version=f"{self.api[0]}.{self.api[1]}",
            driver=dict(self.driver), queue_family=self.queue_family, timestamp_bits=self.timestamp_bits,
            subgroup=dict(self.subgroup), features=dict(self.features), float_controls=dict(self.float_controls),
            enabled_extensions=list(self.enabled_extensions),
            cooperative_matrix=dict(enabled=self.features["cooperativeMatrix"], reason=self.cooperative_matrix_reason,
                                    shapes=list(self.cooperative_matrix_shapes)),
            limits=dict(self.limits), memory_heaps=list(self.memory_heaps),
            direct_host_access=self.direct_host_access, mapped_inputs=self.input_mem_type is not None,
            pipeline_cache=dict(on_disk=self.pipeline_cache_on_disk, loaded_bytes=self.pipeline_cache_loaded_bytes,
                                rejected=self.pipeline_cache_rejected,
                                path=str(self._cache_path()) if self.pipeline_cache_on_disk else None),
        )

    def close(self):
        """Save the pipeline cache and destroy everything (idempotent)."""
        if self.handle is None:
            return
        ffi, lib = _vk.ffi, _vk.lib
        if self._maker is not None:
            self._maker.shutdown(wait=True)
            self._maker = None
        self._unfilled = []
        lib.vkDeviceWaitIdle(self.handle)
        try:
            self.save_pipeline_cache()
        except VulkanError:
            pass
        for p in list(self._programs):
            p.close()
        for k in list(self._kernels):
            k.destroy()
        for set_layout, _, layout in self._layout_cache.values():
            lib.vkDestroyPipelineLayout(self.handle, layout, ffi.NULL)
            lib.vkDestroyDescriptorSetLayout(self.handle, set_layout, ffi.NULL)
        self._layout_cache.clear()
        for blocks in self._blocks.values():
            for b in blocks:
                b.destroy()
            blocks.clear()
        lib.vkDestroyPipelineCache(self.handle, self.pipeline_cache, ffi.NULL)
        lib.vkDestroyFence(self.handle, self._xfer_fence[0], ffi.NULL)
        lib.vkDestroyCommandPool(self.handle, self.command_pool, ffi.NULL)
        lib.vkDestroyDevice(self.handle, ffi.NULL)
        lib.vkDestroyInstance(self.instance, ffi.NULL)
        self.handle = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"VulkanDevice({self.name!r}, {self.device_type}, Vulkan {self.api[0]}.{self.api[1]})"


_default = None
_default_lock = threading.Lock()


def get_vulkan_device(selector=None) -> VulkanDevice:
    """The process-wide Vulkan device (created on first use, closed at exit). ``selector``
    (as ``VulkanDevice``'s) picks it when this call creates it; an existing one is returned
    as it is (the caller compares ``index``)."""
    global _default
    with _default_lock:
        if _default is None:
            import atexit
            _default = VulkanDevice(selector)
            atexit.register(_default.close)
        return _default
