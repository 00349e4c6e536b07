"""Which Vulkan device: the instance, every physical device summarised as plain data, and the
choice among them (``selector`` or ``$MEGANEURA_VK_DEVICE``: an index or a name substring;
else discrete > integrated > virtual > other > CPU)."""
from __future__ import annotations

import os

from . import _vk
from ._vk import VulkanUnavailable, new, string, version_str


_TYPE_NAMES = {0: "other", 1: "integrated", 2: "discrete", 3: "virtual", 4: "cpu"}
_TYPE_RANK = {2: 0, 1: 1, 3: 2, 0: 3, 4: 4}


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
