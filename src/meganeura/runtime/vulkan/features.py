"""What a physical device offers, read into the device's attributes: extensions, the feature
chain (16-bit and 8-bit storage, ``shaderFloat16``, the Vulkan memory model, subgroup size
control, ``VK_KHR_cooperative_matrix``), limits, subgroup properties, memory types and heaps,
and the cooperative-matrix shapes (``DeviceFeatures``, a part of ``VulkanDevice``)."""
from __future__ import annotations

from . import _vk
from ._vk import VulkanUnavailable, check, new, string, version_str
from .selection import _TYPE_NAMES


COMPONENT_TYPES = {0: "f16", 1: "f32", 2: "f64", 3: "s8", 4: "s16", 5: "s32", 6: "s64", 7: "u8",
                   8: "u16", 9: "u32", 10: "u64", 1000141000: "bf16"}
SCOPES = {1: "device", 2: "workgroup", 3: "subgroup", 5: "queue_family"}


class DeviceFeatures:
    """The part of ``VulkanDevice`` that reads what its physical device offers into its
    attributes (features, limits, subgroups, memory types and heaps, cooperative-matrix
    shapes)."""

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
