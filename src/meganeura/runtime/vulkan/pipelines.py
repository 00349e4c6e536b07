"""Compute pipelines of the Vulkan device: a ``Kernel`` from SPIR-V with its shared
descriptor-set and pipeline layouts, pipelines created in batches on threads, and the
pipeline cache on disk (``DevicePipelines``, a part of ``VulkanDevice``)."""
from __future__ import annotations

import hashlib
import os
import time
import weakref

from . import _vk
from ._vk import check, new
from .cache import cache_dir, write_atomic
from .spirv import reflect


ACCESS = ("read", "write", "rw")

# VkPipelineShaderStageCreateFlagBits (Vulkan 1.3 core; the cffi binding's headers predate
# the name, so the value is spelled out)
REQUIRE_FULL_SUBGROUPS = 0x00000002


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


class DevicePipelines:
    """The part of ``VulkanDevice`` that makes compute pipelines from SPIR-V, their shared
    layouts, and keeps the pipeline cache on disk."""

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
