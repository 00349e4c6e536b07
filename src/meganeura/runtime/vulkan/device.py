"""The Vulkan device: instance and physical-device choice, the feature chain, memory
blocks with sub-allocation, uploads/downloads, compute kernels and the pipeline cache.

``VulkanDevice(selector=None)`` picks a device (``selector`` or ``$MEGANEURA_VK_DEVICE``:
an index or a name substring; else discrete > integrated > virtual > other > CPU) and
creates a logical device with one queue, enabling what the device offers of: 16-bit
storage, ``shaderFloat16``, 8-bit storage, the Vulkan memory model, subgroup size control
(with full subgroups) and ``VK_KHR_cooperative_matrix``. ``capabilities()`` reports all
of it as a dict (``meganeura info`` prints it).
"""
from __future__ import annotations

import hashlib
import os
import threading
import time
import weakref

import numpy as np

from . import _vk
from ._vk import VulkanError, VulkanUnavailable, check, new, string, version_str
from .cache import cache_dir, disk_cache_enabled, write_atomic
from .memory import BufferRange, OffsetAllocator, align_up
from .spirv import reflect

_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_RANK = {2: 0, 1: 1, 3: 2, 0: 3, 4: 4}
COMPONENT_TYPES = {0: "f16", 1: "f32", 2: "f64", 3: "s8", 4: "s16", 5: "s32", 6: "s64", 7: "u8",
                   8: "u16", 9: "u32", 10: "u64", 1000141000: "bf16"}
SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}
ACCESS = ("read", "write", "rw")

DEFAULT_BLOCK_BYTES = 64 << 20
# staging blocks for requests of at most a quarter of this, when none has room (see ``alloc``)
SMALL_STAGING_BYTES = 1 << 20
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


# host-mappable device-local memory holds inputs only on a heap this large (resizable BAR;
# without it the mappable window is 256 MiB, which the driver needs for itself)
INPUT_HEAP_BYTES = 1 << 30
# VkPipelineShaderStageCreateFlagBits (Vulkan 1.3 core; the cffi binding's headers predate
# the name, so the value is spelled out)
REQUIRE_FULL_SUBGROUPS = 0x00000002


class MemoryBlock:
    """One ``vkAllocateMemory`` with one ``VkBuffer`` bound over all of it; mapped when
    host-visible and wanted on the host. ``maker``: an executor that creates the Vulkan
    objects while the caller goes on (device memory the host never maps); ``buffer`` and
    ``memory`` wait for them, and raise the creation's error. The driver's allocation costs
    about 24 ms per GiB on an H200 and runs no faster on several threads, so it is what a
    warm compile waits for unless the plan's bookkeeping runs beside it."""

    def __init__(self, dev, size, mem_type, mapped, label, shared=True, maker=None):
        self.device, self.size, self.mem_type, self.label = dev, size, mem_type, label
        self.shared = shared           # sub-allocated (else one tensor's own block)
        self.mapped = None
        self.allocator = OffsetAllocator(size, dev.alignment)
        self._handles = self._pending = None
        if maker is not None and not mapped:
            self._pending = maker.submit(self._create, False)
        else:
            self._handles = self._create(mapped)

    def _create(self, mapped):
        dev, size, label = self.device, self.size, self.label
        ffi, lib = _vk.ffi, _vk.lib
        usage = (_vk.vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | _vk.vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | _vk.vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        bi = new("VkBufferCreateInfo", sType=_vk.vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size,
                 usage=usage, sharingMode=_vk.vk.VK_SHARING_MODE_EXCLUSIVE)
        pb = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev.handle, bi, ffi.NULL, pb), f"vkCreateBuffer({label}, {size} B)")
        buffer = pb[0]
        req = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(dev.handle, buffer, req)
        if not req.memoryTypeBits & (1 << self.mem_type):
            lib.vkDestroyBuffer(dev.handle, buffer, ffi.NULL)
            raise VulkanError(f"memory type {self.mem_type} not allowed for a storage buffer ({label})", -2)
        ai = new("VkMemoryAllocateInfo", sType=_vk.vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                 allocationSize=req.size, memoryTypeIndex=self.mem_type)
        pm = ffi.new("VkDeviceMemory*")
        res = lib.vkAllocateMemory(dev.handle, ai, ffi.NULL, pm)
        if res != 0:
            lib.vkDestroyBuffer(dev.handle, buffer, ffi.NULL)
            check(res, f"vkAllocateMemory({label}, {req.size} B, type {self.mem_type})")
        memory = pm[0]
        res = lib.vkBindBufferMemory(dev.handle, buffer, memory, 0)
        if res == 0 and mapped:
            pp = ffi.new("void**")
            res = lib.vkMapMemory(dev.handle, memory, 0, size, 0, pp)
            if res == 0:
                self.mapped = np.frombuffer(ffi.buffer(pp[0], size), dtype=np.uint8)
        if res != 0:
            lib.vkDestroyBuffer(dev.handle, buffer, ffi.NULL)
            lib.vkFreeMemory(dev.handle, memory, ffi.NULL)
            check(res, f"vkBindBufferMemory / vkMapMemory({label})")
        return buffer, memory

    @property
    def failed(self) -> bool:
        """Whether creating the block raised (``buffer`` raises it again)."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def created(self):
        """The block's VkBuffer once created (waiting for it), None if that failed."""
        if self._pending is not None and self._pending.exception() is not None:
            return None
        return self.buffer

    def _wait(self):
        if self._pending is not None:
            self._handles, self._pending = self._pending.result(), None   # raises the creation's error
        return self._handles

    @property
    def buffer(self):
        h = self._handles or self._wait()
        return h[0] if h else None      # None once destroyed

    @property
    def memory(self):
        h = self._handles or self._wait()
        return h[1] if h else None

    def destroy(self):
        try:
            handles = self._wait()
        except VulkanError:        # never created: nothing to give back
            handles = None
        self._handles = self._pending = None
        if handles is None:
            return
        lib, ffi, d = _vk.lib, _vk.ffi, self.device.handle
        if self.mapped is not None:
            self.mapped = None
            lib.vkUnmapMemory(d, handles[1])
        lib.vkDestroyBuffer(d, handles[0], ffi.NULL)
        lib.vkFreeMemory(d, handles[1], ffi.NULL)


def workgroup_memory_limit(dev) -> int:
    """Bytes of workgroup memory a kernel may declare: the device's limit, or
    ``MEGANEURA_VK_WORKGROUP_MEMORY`` (a software driver such as lavapipe runs larger
    workgroup arrays than it reports, which lets tests run the tiles of a larger GPU; on
    hardware, past the reported limit is undefined)."""
    raw = os.environ.get("MEGANEURA_VK_WORKGROUP_MEMORY", "").strip()
    if not raw:
        return dev.limits["maxComputeSharedMemorySize"]
    if not raw.isdigit() or int(raw) <= 0:
        raise ValueError(f"MEGANEURA_VK_WORKGROUP_MEMORY={raw!r}: expected a positive number of bytes")
    return int(raw)


class Kernel:
    """A compute pipeline from SPIR-V, with its descriptor-set and pipeline layouts (shared
    by every kernel of the device with as many bindings and push-constant bytes).

    ``access``: per binding 'read' | 'write' | 'rw' (read from the SPIR-V's readonly /
    writeonly qualifiers unless given); ``push_size``: bytes of push constants;
    ``info``: the SPIR-V's reflection (``spirv.reflect``) when the caller has it (read from
    the module otherwise); ``cache_hit``: whether the driver reported the pipeline found in
    the pipeline cache (None when it does not say). ``VulkanDevice.kernels`` makes many at
    once (one ``vkCreateComputePipelines`` per batch)."""

    def __init__(self, dev, spirv, name, access=None, push_size=None, required_subgroup_size=None, info=None):
        self._prepare(dev, spirv, name, access, push_size, required_subgroup_size, info)
        _create_pipelines(dev, [self])

    def _prepare(self, dev, spirv, name, access, push_size, required_subgroup_size, info):
        """Everything up to the pipeline: checks, the shared layouts, the shader module."""
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        self.device, self.name = dev, name
        self.pipeline = self._module = None
        info = reflect(spirv) if info is None else info
        found = info["bindings"]
        if sorted(found) != list(range(len(found))):
            raise ValueError(f"kernel {name!r}: storage bindings must be 0..N-1 in set 0, found {sorted(found)}")
        # a binding may be an array of buffers: ``access`` and the buffers bound are per
        # descriptor, the bindings' in order, each array's elements in order
        counts = info.get("counts") or {}
        self.counts = tuple(int(counts.get(i, 1)) for i in range(len(found)))
        if access is None:
            access = [found[i] for i in range(len(found)) for _ in range(self.counts[i])]
        access = tuple(access)
        if len(access) != sum(self.counts) or any(a not in ACCESS for a in access):
            raise ValueError(f"kernel {name!r}: access {access} does not match its {sum(self.counts)} buffers "
                             f"(each one of {ACCESS})")
        if len(access) > dev.limits["maxPerStageDescriptorStorageBuffers"]:
            # past the limit a software driver runs the kernel and crashes
            raise ValueError(f"kernel {name!r}: {len(access)} storage buffers, the device allows "
                             f"{dev.limits['maxPerStageDescriptorStorageBuffers']} a kernel")
        self.access, self.local_size = access, info["local_size"]
        self.push_size = info["push_constant_size"] if push_size is None else int(push_size)
        if self.push_size % 4 or self.push_size > dev.limits["maxPushConstantsSize"]:
            raise ValueError(f"kernel {name!r}: {self.push_size} B of push constants (multiple of 4, "
                             f"at most {dev.limits['maxPushConstantsSize']})")
        shared, limit = info["workgroup_memory"], workgroup_memory_limit(dev)
        if shared > limit:
            # past the limit a driver may accept the pipeline and lose the device when it runs
            raise ValueError(f"kernel {name!r}: {shared} B of workgroup memory, the device allows {limit} "
                             "(a smaller tile or K step: MEGANEURA_MATMUL_BLOCK, MEGANEURA_MATMUL_TK)")
        self.capabilities = info["capabilities"]
        self.required_subgroup_size = int(required_subgroup_size) if required_subgroup_size else None
        if self.required_subgroup_size and not dev.features.get("subgroupSizeControl"):
            raise ValueError(f"kernel {name!r} requires subgroup size {required_subgroup_size}; "
                             "the device has no subgroup size control")
        self.set_layout, self._set_layouts, self.layout = dev._layouts(self.counts, self.push_size)
        code = ffi.from_buffer("uint32_t[]", spirv)
        si = new("VkShaderModuleCreateInfo", sType=vk.VK_STRUCTURE_TYPE_SHADER_MODULE_CREATE_INFO,
                 codeSize=len(spirv), pCode=code)
        pm = ffi.new("VkShaderModule*")
        check(lib.vkCreateShaderModule(dev.handle, si, ffi.NULL, pm), f"vkCreateShaderModule({name})")
        self._module = pm[0]
        self.spirv_bytes = len(spirv)

    def _drop_module(self):
        if self._module is not None:
            _vk.lib.vkDestroyShaderModule(self.device.handle, self._module, _vk.ffi.NULL)
            self._module = None

    def _created(self, pipeline, seconds, feedback):
        dev = self.device
        self.pipeline, self.create_seconds = pipeline, seconds
        self.cache_hit = None
        vk = _vk.vk
        if feedback is not None and feedback.flags & vk.VK_PIPELINE_CREATION_FEEDBACK_VALID_BIT:
            self.cache_hit = bool(feedback.flags & vk.VK_PIPELINE_CREATION_FEEDBACK_APPLICATION_PIPELINE_CACHE_HIT_BIT)
        dev._kernels.add(self)
        # a kernel nobody holds any more (evicted from a cache, its plans closed) is destroyed
        # when it is collected, not only when the device closes (its layouts are the device's)
        self._release = weakref.finalize(self, _destroy_kernel, dev, pipeline)

    def destroy(self):
        if self.pipeline is None:
            return
        self._release()
        self.pipeline = None

    def __repr__(self):
        return f"Kernel({self.name!r}, access={self.access}, push={self.push_size} B, local_size={self.local_size})"


def _destroy_kernel(dev, pipeline):
    if dev.handle is None:          # the device is gone, and everything with it
        return
    _vk.lib.vkDestroyPipeline(dev.handle, pipeline, _vk.ffi.NULL)


# pipelines per vkCreateComputePipelines call (a batch runs on one thread)
PIPELINE_BATCH = 16


def _create_pipelines(dev, kernels, threads=1, batch=PIPELINE_BATCH):
    """Create the pipelines of prepared ``kernels`` (``Kernel._prepare``): one
    ``vkCreateComputePipelines`` per batch of ``batch`` (or of each size of the list ``batch``
    in order, the last one repeated), the batches on ``threads`` threads
    (the calls release the GIL; the pipeline cache is internally synchronised). A failing
    batch is retried one pipeline at a time, so the error names the kernel; on any error the
    pipelines already made are destroyed. The shader modules are destroyed in every case."""
    ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
    n = len(kernels)
    if not n:
        return
    try:
        ci = ffi.new("VkComputePipelineCreateInfo[]", n)
        out = ffi.new("VkPipeline[]", n)
        entry = ffi.new("char[]", b"main")
        feedback = dev.api >= (1, 3)
        if feedback:
            fb = ffi.new("VkPipelineCreationFeedback[]", 2 * n)
            fci = ffi.new("VkPipelineCreationFeedbackCreateInfo[]", n)
        keep = []
        for i, k in enumerate(kernels):
            c = ci[i]
            c.sType = vk.VK_STRUCTURE_TYPE_COMPUTE_PIPELINE_CREATE_INFO
            c.stage.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_CREATE_INFO
            c.stage.stage = vk.VK_SHADER_STAGE_COMPUTE_BIT
            c.stage.module = k._module
            c.stage.pName = entry
            c.layout = k.layout
            if k.required_subgroup_size:
                rs = new("VkPipelineShaderStageRequiredSubgroupSizeCreateInfo",
                         sType=vk.VK_STRUCTURE_TYPE_PIPELINE_SHADER_STAGE_REQUIRED_SUBGROUP_SIZE_CREATE_INFO,
                         requiredSubgroupSize=k.required_subgroup_size)
                keep.append(rs)
                c.stage.pNext = rs
                if dev.features.get("computeFullSubgroups"):
                    c.stage.flags = REQUIRE_FULL_SUBGROUPS
            if feedback:
                f = fci[i]
                f.sType = vk.VK_STRUCTURE_TYPE_PIPELINE_CREATION_FEEDBACK_CREATE_INFO
                f.pPipelineCreationFeedback = fb + 2 * i
                f.pipelineStageCreationFeedbackCount = 1
                f.pPipelineStageCreationFeedbacks = fb + 2 * i + 1
                c.pNext = fci + i

        def create(span):
            s, e = span
            t0 = time.perf_counter()
            res = lib.vkCreateComputePipelines(dev.handle, dev.pipeline_cache, e - s, ci + s, ffi.NULL, out + s)
            if res != 0:        # some may exist: destroy them, then one at a time for the name
                for i in range(s, e):
                    if out[i] != ffi.NULL:
                        lib.vkDestroyPipeline(dev.handle, out[i], ffi.NULL)
                        out[i] = ffi.NULL
                for i in range(s, e):
                    check(lib.vkCreateComputePipelines(dev.handle, dev.pipeline_cache, 1, ci + i, ffi.NULL, out + i),
                          f"vkCreateComputePipelines({kernels[i].name})")
            return (time.perf_counter() - t0) / (e - s)

        sizes = [max(int(b), 1) for b in (batch if isinstance(batch, (list, tuple)) else [batch])] or [PIPELINE_BATCH]
        spans, s = [], 0
        while s < n:
            size = sizes[min(len(spans), len(sizes) - 1)]
            spans.append((s, min(s + size, n)))
            s = spans[-1][1]
        try:
            if len(spans) > 1 and (threads or 0) != 1:
                from ..backends import parallel_map
                per = parallel_map(create, spans, threads)
            else:
                per = [create(sp) for sp in spans]
        except BaseException:
            for i in range(n):
                if out[i] != ffi.NULL:
                    lib.vkDestroyPipeline(dev.handle, out[i], ffi.NULL)
            raise
        for (s, e), sec in zip(spans, per):
            for i in range(s, e):
                kernels[i]._created(out[i], sec, fb[2 * i] if feedback else None)
    finally:
        for k in kernels:
            k._drop_module()


def _env_selector():
    s = os.environ.get("MEGANEURA_VK_DEVICE", "").strip()
    return s or None


def _create_instance():
    """(VkInstance, instance version, the application name it points at: keep it alive)."""
    ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
    v = ffi.new("uint32_t*")
    version = version_str(v[0]) if lib.vkEnumerateInstanceVersion(v) == 0 else "1.0.0"
    name = ffi.new("char[]", b"meganeura")
    app = new("VkApplicationInfo", sType=vk.VK_STRUCTURE_TYPE_APPLICATION_INFO, pApplicationName=name,
              applicationVersion=1, pEngineName=name, engineVersion=1, apiVersion=vk.VK_MAKE_VERSION(1, 3, 0))
    ci = new("VkInstanceCreateInfo", sType=vk.VK_STRUCTURE_TYPE_INSTANCE_CREATE_INFO, pApplicationInfo=app)
    p = ffi.new("VkInstance*")
    res = lib.vkCreateInstance(ci, ffi.NULL, p)
    if res != 0:
        raise VulkanUnavailable(f"vkCreateInstance failed ({_vk.result_name(res)}): is a Vulkan driver "
                                "installed? (no GPU: apt-get install mesa-vulkan-drivers)")
    return p[0], version, name


def _physical_devices(instance):
    ffi, lib = _vk.ffi, _vk.lib
    arr, n = _vk.enumerate_array(lambda c, a: lib.vkEnumeratePhysicalDevices(instance, c, a), "VkPhysicalDevice")
    out = []
    for i in range(n):
        pr = ffi.new("VkPhysicalDeviceProperties*")
        lib.vkGetPhysicalDeviceProperties(arr[i], pr)
        out.append((arr[i], dict(index=i, name=string(pr.deviceName), type=_TYPE_NAMES.get(pr.deviceType, "other"),
                                 type_code=int(pr.deviceType), api_version=version_str(pr.apiVersion))))
    return out


def list_physical_devices() -> list:
    """Summaries (index, name, type, ...) of the physical devices, without opening one (to
    choose a device before the process-wide one is created)."""
    _vk.require()
    instance, _, _ = _create_instance()
    try:
        return [s for _, s in _physical_devices(instance)]
    finally:
        _vk.lib.vkDestroyInstance(instance, _vk.ffi.NULL)


def device_rank(summary) -> int:
    """Preference of a device type (lower first): discrete > integrated > virtual > other > CPU."""
    return _TYPE_RANK.get(summary["type_code"], 3)


def choose_physical(devices, selector=None) -> dict:
    """The summary in ``devices`` that ``selector`` (an index or a name substring) names, or
    the preferred one (``device_rank``, then the lowest index)."""
    if not devices:
        raise VulkanUnavailable("no Vulkan physical device (no GPU: apt-get install mesa-vulkan-drivers)")
    if selector is None:
        return min(devices, key=lambda d: (device_rank(d), d["index"]))
    sel = str(selector).strip()
    if sel.isdigit():
        if not 0 <= int(sel) < len(devices):
            raise VulkanUnavailable(f"Vulkan device index {sel}: only {len(devices)} device(s): "
                                    f"{[d['name'] for d in devices]}")
        return devices[int(sel)]
    hits = [d for d in devices if sel.lower() in d["name"].lower()]
    if not hits:
        raise VulkanUnavailable(f"Vulkan device {sel!r} matches none of {[d['name'] for d in devices]}")
    return hits[0]


class VulkanDevice:
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

    def _query_features(self, want_coop):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        pd = self.physical
        arr, n = _vk.enumerate_array(lambda c, a: lib.vkEnumerateDeviceExtensionProperties(pd, ffi.NULL, c, a),
                                     "VkExtensionProperties")
        self.extensions = sorted(string(arr[i].extensionName) for i in range(n))
        # properties: base, 1.1 (subgroups), 1.2 (float controls), 1.3 (subgroup size range), driver
        drv = new("VkPhysicalDeviceDriverProperties", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_DRIVER_PROPERTIES)
        p12 = new("VkPhysicalDeviceVulkan12Properties", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_PROPERTIES,
                  pNext=drv)
        p11 = new("VkPhysicalDeviceVulkan11Properties", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_PROPERTIES,
                  pNext=p12)
        pr = ffi.new("VkPhysicalDeviceProperties*")
        lib.vkGetPhysicalDeviceProperties(pd, pr)
        api = pr.apiVersion
        self.api = (api >> 22, (api >> 12) & 0x3FF)
        if self.api < (1, 2):
            raise VulkanUnavailable(f"{self.summary['name']}: Vulkan {version_str(api)}; the backend needs 1.2")
        head = p11
        p13 = None
        if self.api >= (1, 3):
            p13 = new("VkPhysicalDeviceVulkan13Properties",
                      sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_PROPERTIES, pNext=p11)
            head = p13
        p2 = new("VkPhysicalDeviceProperties2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_PROPERTIES_2, pNext=head)
        lib.vkGetPhysicalDeviceProperties2(pd, p2)
        prop = p2.properties
        lim = prop.limits
        self.name = string(prop.deviceName)
        self.device_type = _TYPE_NAMES.get(prop.deviceType, "other")
        self.is_software = prop.deviceType == vk.VK_PHYSICAL_DEVICE_TYPE_CPU
        self.driver = dict(name=string(drv.driverName), info=string(drv.driverInfo),
                           version=int(prop.driverVersion), vendor_id=int(prop.vendorID), device_id=int(prop.deviceID))
        self.pipeline_cache_uuid = bytes(ffi.buffer(prop.pipelineCacheUUID, 16))
        # whether a kernel may ask to keep Inf, NaN and signed zeros (SPV_KHR_float_controls'
        # SignedZeroInfNanPreserve, core in 1.2): the GLSL asks only where this is on
        self.float_controls = dict(signed_zero_inf_nan_f32=bool(p12.shaderSignedZeroInfNanPreserveFloat32),
                                   signed_zero_inf_nan_f16=bool(p12.shaderSignedZeroInfNanPreserveFloat16))
        self.subgroup = dict(size=int(p11.subgroupSize),
                             min_size=int(p13.minSubgroupSize) if p13 else int(p11.subgroupSize),
                             max_size=int(p13.maxSubgroupSize) if p13 else int(p11.subgroupSize),
                             operations=int(p11.subgroupSupportedOperations))
        self.limits = dict(
            maxComputeSharedMemorySize=int(lim.maxComputeSharedMemorySize),
            maxComputeWorkGroupInvocations=int(lim.maxComputeWorkGroupInvocations),
            maxComputeWorkGroupSize=tuple(int(lim.maxComputeWorkGroupSize[i]) for i in range(3)),
            maxComputeWorkGroupCount=tuple(int(lim.maxComputeWorkGroupCount[i]) for i in range(3)),
            maxStorageBufferRange=int(lim.maxStorageBufferRange),
            maxPushConstantsSize=int(lim.maxPushConstantsSize),
            minStorageBufferOffsetAlignment=int(lim.minStorageBufferOffsetAlignment),
            maxPerStageDescriptorStorageBuffers=int(lim.maxPerStageDescriptorStorageBuffers),
            maxMemoryAllocationCount=int(lim.maxMemoryAllocationCount),
            timestampPeriod=float(lim.timestampPeriod),
            timestampComputeAndGraphics=bool(lim.timestampComputeAndGraphics),
            maxMemoryAllocationSize=int(p11.maxMemoryAllocationSize),
        )
        # features: 1.0 base, 1.1, 1.2, 1.3, cooperative matrix
        has_coop = "VK_KHR_cooperative_matrix" in self.extensions
        chain = ffi.NULL
        qcoop = None
        if has_coop:
            qcoop = new("VkPhysicalDeviceCooperativeMatrixFeaturesKHR",
                        sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_COOPERATIVE_MATRIX_FEATURES_KHR)
            chain = qcoop
        q13 = None
        if self.api >= (1, 3):
            q13 = new("VkPhysicalDeviceVulkan13Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_3_FEATURES,
                      pNext=chain)
            chain = q13
        q12 = new("VkPhysicalDeviceVulkan12Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_2_FEATURES,
                  pNext=chain)
        q11 = new("VkPhysicalDeviceVulkan11Features", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_VULKAN_1_1_FEATURES,
                  pNext=q12)
        f2 = new("VkPhysicalDeviceFeatures2", sType=vk.VK_STRUCTURE_TYPE_PHYSICAL_DEVICE_FEATURES_2, pNext=q11)
        lib.vkGetPhysicalDeviceFeatures2(pd, f2)
        feat = dict(
            shaderInt16=f2.features.shaderInt16, shaderInt64=f2.features.shaderInt64,
            shaderFloat64=f2.features.shaderFloat64,
            shaderStorageBufferArrayDynamicIndexing=f2.features.shaderStorageBufferArrayDynamicIndexing,
            storageBuffer16BitAccess=q11.storageBuffer16BitAccess,
            shaderFloat16=q12.shaderFloat16, shaderInt8=q12.shaderInt8,
            storageBuffer8BitAccess=q12.storageBuffer8BitAccess,
            vulkanMemoryModel=q12.vulkanMemoryModel,
            vulkanMemoryModelDeviceScope=q12.vulkanMemoryModelDeviceScope,
            shaderSubgroupExtendedTypes=q12.shaderSubgroupExtendedTypes,
            subgroupSizeControl=q13.subgroupSizeControl if q13 else 0,
            computeFullSubgroups=q13.computeFullSubgroups if q13 else 0,
            cooperativeMatrix=(qcoop.cooperativeMatrix if qcoop else 0) if want_coop else 0,
        )
        self.features = {k: bool(v) for k, v in feat.items()}
        self.cooperative_matrix_shapes = self._coop_shapes() if self.features["cooperativeMatrix"] else []
        if not want_coop and has_coop:
            self.cooperative_matrix_reason = "turned off (cooperative_matrix=False)"
        elif not has_coop:
            self.cooperative_matrix_reason = "VK_KHR_cooperative_matrix not offered by the driver"
        else:
            self.cooperative_matrix_reason = "" if self.features["cooperativeMatrix"] else "feature not supported"

        fams, nf = _vk.enumerate_array(lambda c, a: lib.vkGetPhysicalDeviceQueueFamilyProperties(pd, c, a),
                                       "VkQueueFamilyProperties")
        cands = [i for i in range(nf) if fams[i].queueFlags & vk.VK_QUEUE_COMPUTE_BIT]
        if not cands:
            raise VulkanUnavailable(f"{self.name}: no compute queue family")
        # prefer timestamps, then the universal (graphics + compute) family
        cands.sort(key=lambda i: (fams[i].timestampValidBits == 0,
                                  not fams[i].queueFlags & vk.VK_QUEUE_GRAPHICS_BIT, i))
        self.queue_family = cands[0]
        self.timestamp_bits = int(fams[self.queue_family].timestampValidBits)

        mp = ffi.new("VkPhysicalDeviceMemoryProperties*")
        lib.vkGetPhysicalDeviceMemoryProperties(pd, mp)
        self.memory_types = [int(mp.memoryTypes[i].propertyFlags) for i in range(mp.memoryTypeCount)]
        self.memory_type_heaps = [int(mp.memoryTypes[i].heapIndex) for i in range(mp.memoryTypeCount)]
        self.memory_heaps = [dict(size=int(mp.memoryHeaps[i].size),
                                  device_local=bool(mp.memoryHeaps[i].flags & vk.VK_MEMORY_HEAP_DEVICE_LOCAL_BIT))
                             for i in range(mp.memoryHeapCount)]

    def _proc(self, name):
        f = _vk.lib.vkGetInstanceProcAddr(self.instance, name.encode())
        return None if f == _vk.ffi.NULL else _vk.ffi.cast("PFN_" + name, f)

    def _coop_shapes(self):
        ffi, vk = _vk.ffi, _vk.vk
        fn = self._proc("vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        if fn is None:
            return []
        n = ffi.new("uint32_t*")
        check(fn(self.physical, n, ffi.NULL), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        arr = ffi.new("VkCooperativeMatrixPropertiesKHR[]", max(n[0], 1))
        for i in range(n[0]):
            arr[i].sType = vk.VK_STRUCTURE_TYPE_COOPERATIVE_MATRIX_PROPERTIES_KHR
        check(fn(self.physical, n, arr), "vkGetPhysicalDeviceCooperativeMatrixPropertiesKHR")
        t = COMPONENT_TYPES.get
        return [dict(M=int(a.MSize), N=int(a.NSize), K=int(a.KSize), A=t(a.AType, a.AType), B=t(a.BType, a.BType),
                     C=t(a.CType, a.CType), result=t(a.ResultType, a.ResultType),
                     saturating=bool(a.saturatingAccumulation), scope=SCOPES.get(a.scope, a.scope))
                for a in arr[0:n[0]]]

    def has_coop_shape(self, M=16, N=16, K=16, A="f16", B="f16", C="f32", scope="subgroup"):
        return any(s["M"] == M and s["N"] == N and s["K"] == K and s["A"] == A and s["B"] == B and s["C"] == C
                   and s["result"] == C and s["scope"] == scope for s in self.cooperative_matrix_shapes)

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

    # ------------------------------------------------------------------ memory
    def _find_type(self, want, avoid=0):
        for i, fl in enumerate(self.memory_types):
            if fl & want == want and not fl & avoid:
                return i
        return None

    def _find_type_on_heap(self, want, least_heap_bytes):
        for i, fl in enumerate(self.memory_types):
            if fl & want == want and self.memory_heaps[self.memory_type_heaps[i]]["size"] >= least_heap_bytes:
                return i
        return None

    def _init_memory(self, direct):
        vk = _vk.vk
        DL, HV = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
        HC, HCA = vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
        self.alignment = max(256, self.limits["minStorageBufferOffsetAlignment"])
        uma_type = self._find_type(DL | HV | HC)
        if direct is None:
            direct = uma_type is not None and self.device_type in ("cpu", "integrated")
        if direct and uma_type is None:
            raise VulkanUnavailable(f"{self.name}: no host-visible device-local memory for direct host access")
        self.direct_host_access = bool(direct)
        if direct:
            self.device_mem_type = uma_type
        else:
            self.device_mem_type = self._find_type(DL, avoid=HV)
            if self.device_mem_type is None:
                self.device_mem_type = self._find_type(DL)
        if self.device_mem_type is None:
            self.device_mem_type = 0
        # a call's inputs, which the host writes before every step: device-local memory the
        # host maps, where all of it is mappable (resizable BAR), takes one memcpy and no copy
        # in the step (Whisper-tiny's 0.96 MB input on an H200: 0.17 -> 0.07 ms a call)
        self.input_mem_type = None if direct else self._find_type_on_heap(DL | HV | HC, INPUT_HEAP_BYTES)
        st = self._find_type(HV | HC | HCA)
        self.staging_mem_type = st if st is not None else self._find_type(HV | HC)
        if self.staging_mem_type is None:
            raise VulkanUnavailable(f"{self.name}: no host-visible coherent memory type for staging")

    def alloc(self, nbytes, host=False, label=None, zeroed=False, input=False) -> BufferRange:
        """``nbytes`` (rounded up to the alignment) of device memory, or of host-visible
        staging memory when ``host``; ``input``: device memory the host writes directly where
        the device has it (``input_mem_type``), else ordinary device memory. Free with
        ``free``. ``zeroed``: the range holds zeros. Device-only blocks are created on a
        thread of their own while the caller goes on, and filled with zeros once, all new
        ones together before the next GPU work (``_one_shot``, ``submit``), so only a range
        that reuses freed bytes costs a fill of its own. A small staging request with no room
        takes a small block (``SMALL_STAGING_BYTES``): pinning host memory costs about 0.23
        ms per MiB (an H200's host), 15 ms for a whole block, which a plan uploading a few
        constants or reading back a loss would wait for."""
        nbytes = int(nbytes)
        kind = "staging" if host else "input" if input and self.input_mem_type is not None else "device"
        # a large tensor gets a block of its own, so that freeing it gives the memory back
        dedicated = nbytes >= self.block_bytes // 4
        with self._lock:
            # newest block first: while a session allocates its tensors the older blocks are
            # full, and asking each of them first made SmolLM2's 1643 allocations 16 times
            # as many block queries; a hole a free left in an older block is still found
            # before a new block is made
            for blk in ([] if dedicated else reversed(self._blocks[kind])):
                if not blk.shared:
                    continue
                high_water = blk.allocator.high_water
                off = blk.allocator.alloc(nbytes)
                if off is not None:
                    rng = BufferRange(blk, off, nbytes)
                    if zeroed and (blk.mapped is not None or off < high_water):
                        self.zero(rng)
                    return rng
            if dedicated:
                size = align_up(max(nbytes, 1), self.alignment)
            elif kind == "staging" and nbytes <= SMALL_STAGING_BYTES // 4:
                size = min(SMALL_STAGING_BYTES, self.block_bytes)
            else:
                size = self.block_bytes
            size = min(size, max(self.limits["maxMemoryAllocationSize"], align_up(nbytes, self.alignment)))
            mapped = kind != "device" or self.direct_host_access
            mem_type = {"staging": self.staging_mem_type, "input": self.input_mem_type}.get(kind, self.device_mem_type)
            blk = MemoryBlock(self, size, mem_type, mapped, f"{kind}#{len(self._blocks[kind])}",
                              shared=not dedicated, maker=None if mapped else self._block_maker())
            self._blocks[kind].append(blk)
            rng = BufferRange(blk, blk.allocator.alloc(nbytes), nbytes)
            if zeroed and blk.mapped is not None:
                self.zero(rng)
            elif blk.mapped is None:
                self._unfilled.append(blk)      # the block's one fill, before the next GPU work
            return rng

    def _block_maker(self):
        """The thread that creates device blocks (``MemoryBlock``'s ``maker``), started on first use."""
        if self._maker is None:
            from concurrent.futures import ThreadPoolExecutor
            self._maker = ThreadPoolExecutor(1, thread_name_prefix="vk-memory")
        return self._maker

    def free(self, rng: BufferRange):
        """Give a range back. A device block left empty goes back to the driver (closing a
        session frees its memory); one empty staging block of each size is kept for the next
        transfer."""
        with self._lock:
            blk = rng.block
            blk.allocator.free(rng.offset)
            if blk.allocator.used:
                return
            staging = self._blocks["staging"]
            if blk in staging and blk.shared and \
                    not any(b is not blk and b.size == blk.size and not b.allocator.used for b in staging):
                return
            next(blocks for blocks in self._blocks.values() if blk in blocks).remove(blk)
            if blk in self._unfilled:
                self._unfilled.remove(blk)
            blk.destroy()

    def memory_report(self) -> dict:
        return {k: [dict(label=b.label, size=b.size, used=b.allocator.bytes_used, mapped=b.mapped is not None)
                    for b in blocks] for k, blocks in self._blocks.items()}

    def _one_shot(self, record):
        """Record ``record(cmd)`` into the transfer command buffer between full barriers
        (earlier GPU writes -> this work -> host reads), after the fills of new blocks, submit
        and wait."""
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        pc = self._xfer_cmd
        with self._lock:
            fills, self._unfilled = self._unfilled, []
            try:
                check(lib.vkResetCommandBuffer(pc[0], 0), "vkResetCommandBuffer")
                bi = new("VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                         flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)
                check(lib.vkBeginCommandBuffer(pc[0], bi), "vkBeginCommandBuffer")
                for blk in fills:
                    # waits for a block still being created; one that failed raises where it is used
                    buffer = blk.created()
                    if buffer is not None:
                        lib.vkCmdFillBuffer(pc[0], buffer, 0, blk.size, 0)
                full_barrier(pc[0], entry=True)
                record(pc[0])
                full_barrier(pc[0], entry=False)
                check(lib.vkEndCommandBuffer(pc[0]), "vkEndCommandBuffer")
                self.submit(pc, self._xfer_fence)
            except BaseException:
                self._unfilled = fills + self._unfilled      # the fills run with the next GPU work
                raise

    def copy(self, src: BufferRange, dst: BufferRange, nbytes=None):
        self.copy_many([(src, dst, nbytes)])

    def copy_many(self, copies):
        """Run (src, dst, nbytes or None) copies in one submit and wait."""
        regions = []
        for src, dst, n in copies:
            n = min(src.size, dst.size) if n is None else int(n)
            regions.append((src.block.buffer, dst.block.buffer,
                            new("VkBufferCopy", srcOffset=src.offset, dstOffset=dst.offset, size=n)))

        def record(cmd):
            for sb, db, r in regions:
                _vk.lib.vkCmdCopyBuffer(cmd, sb, db, 1, r)
        if regions:
            self._one_shot(record)

    def zero(self, rng: BufferRange):
        """Fill ``rng`` with zeros (synchronously; its size a multiple of 4)."""
        if rng.block.mapped is not None:
            rng.block.mapped[rng.offset:rng.offset + rng.size] = 0
        elif rng.size:
            self._one_shot(lambda cmd: _vk.lib.vkCmdFillBuffer(cmd, rng.block.buffer, rng.offset, rng.size, 0))

    def upload(self, dst: BufferRange, array):
        """Write ``array``'s bytes at the start of ``dst`` (synchronously)."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if raw.size > dst.size:
            raise ValueError(f"upload of {raw.size} B into a range of {dst.size} B ({dst})")
        if raw.size == 0:
            return
        if dst.block.mapped is not None:
            dst.block.mapped[dst.offset:dst.offset + raw.size] = raw
            return
        stage = self.alloc(raw.size, host=True)
        try:
            stage.block.mapped[stage.offset:stage.offset + raw.size] = raw
            self.copy(stage, dst, raw.size)
        finally:
            self.free(stage)

    def download(self, src: BufferRange, dtype=np.uint8, shape=None) -> np.ndarray:
        """A copy of ``src``'s bytes as ``dtype`` (and ``shape``)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if shape is not None else src.size // dtype.itemsize
        n = count * dtype.itemsize
        if n > src.size:
            raise ValueError(f"download of {n} B from a range of {src.size} B ({src})")
        if src.block.mapped is not None:
            out = src.block.mapped[src.offset:src.offset + n].copy()
        else:
            stage = self.alloc(max(n, 4), host=True)
            try:
                self.copy(src, stage, n)
                out = stage.block.mapped[stage.offset:stage.offset + n].copy()
            finally:
                self.free(stage)
        out = out.view(dtype)
        return out.reshape(shape) if shape is not None else out

    def array(self, array, label=None) -> BufferRange:
        """A new device range holding ``array``."""
        arr = np.ascontiguousarray(array)
        rng = self.alloc(max(arr.nbytes, 4), label=label)
        self.upload(rng, arr)
        return rng

    # ------------------------------------------------------------------ pipelines
    def _cache_path(self):
        d = self.driver
        tag = f"{d['vendor_id']:04x}-{d['device_id']:04x}-{d['version']:x}-{self.pipeline_cache_uuid.hex()}"
        return cache_dir() / "pipelines" / f"{tag}.bin"

    def _init_pipeline_cache(self, on_disk):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        self.pipeline_cache_on_disk = bool(on_disk)
        self.pipeline_cache_loaded_bytes = 0
        data = b""
        if on_disk:
            try:
                data = self._cache_path().read_bytes()
            except OSError:
                data = b""
        init = ffi.new("char[]", data) if data else ffi.NULL
        ci = new("VkPipelineCacheCreateInfo", sType=vk.VK_STRUCTURE_TYPE_PIPELINE_CACHE_CREATE_INFO,
                 initialDataSize=len(data), pInitialData=init)
        p = ffi.new("VkPipelineCache*")
        res = lib.vkCreatePipelineCache(self.handle, ci, ffi.NULL, p)
        self.pipeline_cache_rejected = bool(res != 0 and data)
        if self.pipeline_cache_rejected:  # stale or corrupt data: start empty
            ci.initialDataSize, ci.pInitialData, data = 0, ffi.NULL, b""
            res = lib.vkCreatePipelineCache(self.handle, ci, ffi.NULL, p)
        check(res, "vkCreatePipelineCache")
        self.pipeline_cache = p[0]
        self.pipeline_cache_loaded_bytes = len(data)
        self._saved_digest = hashlib.sha256(data).digest() if data else None

    def pipeline_cache_data(self) -> bytes:
        ffi, lib = _vk.ffi, _vk.lib
        n = ffi.new("size_t*")
        check(lib.vkGetPipelineCacheData(self.handle, self.pipeline_cache, n, ffi.NULL), "vkGetPipelineCacheData")
        buf = ffi.new("char[]", max(n[0], 1))
        check(lib.vkGetPipelineCacheData(self.handle, self.pipeline_cache, n, buf), "vkGetPipelineCacheData")
        return bytes(ffi.buffer(buf, n[0]))

    def save_pipeline_cache(self):
        """Write the driver's pipeline cache to the user cache folder (when on disk and changed)."""
        if not self.pipeline_cache_on_disk or self.handle is None:
            return None
        data = self.pipeline_cache_data()
        digest = hashlib.sha256(data).digest()
        if data and digest != self._saved_digest:
            try:
                write_atomic(self._cache_path(), data)
                self._saved_digest = digest
            except OSError:
                return None
        return self._cache_path()

    def kernel(self, spirv: bytes, name="kernel", access=None, push_size=None, required_subgroup_size=None,
               info=None) -> Kernel:
        """A compute pipeline from SPIR-V (see ``Kernel``)."""
        return Kernel(self, spirv, name, access, push_size, required_subgroup_size, info)

    def kernels(self, specs, threads=None, batch=PIPELINE_BATCH) -> list:
        """Kernels for many ``specs`` at once, in order: dicts of ``Kernel``'s arguments
        (``spirv``, ``name``, and optionally ``access``, ``push_size``, ``required_subgroup_size``,
        ``info``). The pipelines are created in batches (``batch`` per
        ``vkCreateComputePipelines``, or a list of batch sizes in order, its last repeated) on
        ``threads`` threads (``backends.parallel_map``'s default when None). The shader modules
        are made here, on the calling thread, so the threads run little Python. A failure
        raises and leaves no pipeline behind."""
        made = []
        try:
            for sp in specs:
                k = Kernel.__new__(Kernel)
                made.append(k)
                k._prepare(self, sp["spirv"], sp.get("name", "kernel"), sp.get("access"), sp.get("push_size"),
                           sp.get("required_subgroup_size"), sp.get("info"))
        except BaseException:
            for k in made:
                if getattr(k, "_module", None) is not None:
                    k._drop_module()
            raise
        _create_pipelines(self, made, threads, batch)
        return made

    def _layouts(self, counts, push_size: int):
        """(descriptor-set layout, a VkDescriptorSetLayout[1] of it, pipeline layout) for storage
        buffer bindings of ``counts`` descriptors each and ``push_size`` bytes of push constants:
        made once per device and shared by every kernel with that signature (destroyed with the
        device)."""
        key = (tuple(counts), int(push_size))
        found = self._layout_cache.get(key)
        if found is not None:
            return found
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        with self._lock:
            found = self._layout_cache.get(key)
            if found is not None:
                return found
            counts, push = key
            n = len(counts)
            binds = ffi.new("VkDescriptorSetLayoutBinding[]", max(n, 1))
            for i in range(n):
                binds[i].binding, binds[i].descriptorCount = i, counts[i]
                binds[i].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                binds[i].stageFlags = vk.VK_SHADER_STAGE_COMPUTE_BIT
            dl = new("VkDescriptorSetLayoutCreateInfo", sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_LAYOUT_CREATE_INFO,
                     bindingCount=n, pBindings=binds)
            p = ffi.new("VkDescriptorSetLayout*")
            check(lib.vkCreateDescriptorSetLayout(self.handle, dl, ffi.NULL, p),
                  f"vkCreateDescriptorSetLayout({n} bindings)")
            set_layouts = ffi.new("VkDescriptorSetLayout[1]", [p[0]])
            pcr = new("VkPushConstantRange", stageFlags=vk.VK_SHADER_STAGE_COMPUTE_BIT, offset=0, size=push)
            pl = new("VkPipelineLayoutCreateInfo", sType=vk.VK_STRUCTURE_TYPE_PIPELINE_LAYOUT_CREATE_INFO,
                     setLayoutCount=1, pSetLayouts=set_layouts,
                     pushConstantRangeCount=1 if push else 0, pPushConstantRanges=pcr if push else ffi.NULL)
            q = ffi.new("VkPipelineLayout*")
            res = lib.vkCreatePipelineLayout(self.handle, pl, ffi.NULL, q)
            if res != 0:
                lib.vkDestroyDescriptorSetLayout(self.handle, p[0], ffi.NULL)
                check(res, f"vkCreatePipelineLayout({n} bindings, {push} B of push constants)")
            found = self._layout_cache[key] = (set_layouts[0], set_layouts, q[0])
            return found

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


def full_barrier(cmd, entry):
    """entry: earlier writes (GPU and host) -> compute/transfer reads and writes of this
    command buffer; exit: its compute/transfer writes -> host reads."""
    ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
    CT = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
    W = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
    RW = W | vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT
    if entry:
        mb = new("VkMemoryBarrier", sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=W | vk.VK_ACCESS_HOST_WRITE_BIT,
                 dstAccessMask=RW)
        src, dst = CT | vk.VK_PIPELINE_STAGE_HOST_BIT, CT
    else:
        mb = new("VkMemoryBarrier", sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=W,
                 dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT | vk.VK_ACCESS_HOST_WRITE_BIT)
        src, dst = CT, vk.VK_PIPELINE_STAGE_HOST_BIT
    lib.vkCmdPipelineBarrier(cmd, src, dst, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)


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
