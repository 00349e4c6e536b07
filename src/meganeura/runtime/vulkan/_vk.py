"""The raw Vulkan edge: the PyPI ``vulkan`` package (cffi in ABI mode over the system's
``libvulkan.so.1``), result checking and a few struct helpers. Everything else in the backend
calls ``lib.vk*`` through these names; no other module imports ``vulkan`` directly."""
from __future__ import annotations

VULKAN_PACKAGE_VERSION = "1.3.275.1"


class VulkanUnavailable(RuntimeError):
    """The Vulkan loader, the ``vulkan`` package or a usable device is missing."""


class VulkanError(RuntimeError):
    """A Vulkan call returned an error code."""

    def __init__(self, what, code):
        self.what, self.code = what, code
        super().__init__(f"{what} failed: {result_name(code)} ({code})")


def _preload_loader():
    """``MEGANEURA_VK_LOADER`` (or ``VK_LOADER``): the path of a ``libvulkan.so.1`` to use when
    the system has none on its library path; loaded globally so the bindings find it by name."""
    import os
    path = os.environ.get("MEGANEURA_VK_LOADER") or os.environ.get("VK_LOADER")
    if path:
        import ctypes
        ctypes.CDLL(path, mode=ctypes.RTLD_GLOBAL)


try:
    _preload_loader()
    import vulkan as vk
except ImportError as e:  # the package itself is missing
    vk = None
    _IMPORT_ERROR = (f"the Vulkan backend needs the 'vulkan' package: pip install 'vulkan=={VULKAN_PACKAGE_VERSION}' "
                     f"(or pip install 'meganeura[vulkan]'): {e}")
except OSError as e:  # the package dlopens libvulkan.so.1 at import
    vk = None
    _IMPORT_ERROR = (f"cannot load the Vulkan loader libvulkan.so.1 ({e}); install it "
                     "(Debian/Ubuntu: apt-get install libvulkan1 mesa-vulkan-drivers)")
else:
    _IMPORT_ERROR = None

ffi = vk.ffi if vk is not None else None
lib = vk.lib if vk is not None else None
WHOLE_SIZE = (1 << 64) - 1  # the package's VK_WHOLE_SIZE is -1, which cffi refuses for uint64


def require():
    """Raise ``VulkanUnavailable`` with the install hint when the bindings cannot load."""
    if vk is None:
        raise VulkanUnavailable(_IMPORT_ERROR)
    return vk


def result_name(code) -> str:
    if vk is None:
        return str(code)
    for n in dir(vk):
        if n.startswith(("VK_ERROR_", "VK_TIMEOUT", "VK_NOT_READY", "VK_INCOMPLETE", "VK_SUBOPTIMAL")) \
                and getattr(vk, n) == code:
            return n
    return "VK_RESULT"


def check(res, what):
    """``res`` of a vk* call: anything but VK_SUCCESS raises ``VulkanError`` naming ``what``."""
    if res != 0:
        raise VulkanError(what, res)


def new(ctype, **fields):
    """A zero-initialised ``ctype`` struct with ``fields`` set (a cffi pointer)."""
    return ffi.new(ctype + "*", fields)


def string(chars) -> str:
    return ffi.string(chars).decode(errors="replace")


def version_str(v: int) -> str:
    return f"{v >> 22}.{(v >> 12) & 0x3FF}.{v & 0xFFF}"


def enumerate_array(fn, ctype, *args):
    """The two-call enumerate idiom: count, then fill. Returns a cffi array and its length."""
    n = ffi.new("uint32_t*")
    res = fn(*args, n, ffi.NULL)
    if res is not None:
        check(res, fn.__name__ if hasattr(fn, "__name__") else ctype)
    arr = ffi.new(ctype + "[]", max(n[0], 1))
    res = fn(*args, n, arr)
    if res is not None:
        check(res, ctype)
    return arr, n[0]
