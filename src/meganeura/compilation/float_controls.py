"""Whether the Vulkan kernels of a compile ask the driver to keep Inf, NaN and signed zeros.

The GLSL of every kernel asks for SPV_KHR_float_controls' ``SignedZeroInfNanPreserve`` on
f32 (``codegen.glsl_target.IEEE_PRESERVE``), which stops a driver's float optimisations folding
``x / 0.0``, ``x * 0.0`` or ``x - x`` to plain numbers. A kernel may ask only where the device
reports ``shaderSignedZeroInfNanPreserveFloat32`` (``Target.ieee_preserve``); elsewhere the
kernels are compiled without it, with a warning once per device, and the results of those
folds are the driver's (``MEGANEURA_REQUIRE_IEEE=1`` refuses to compile instead).
"""
from __future__ import annotations

import threading
import warnings

from .. import env

_warned: set = set()
_warned_lock = threading.Lock()


class IeeeUnsupported(RuntimeError):
    """The device cannot keep Inf, NaN and signed zeros and ``MEGANEURA_REQUIRE_IEEE`` is on."""


def ieee_preserve(target) -> bool:
    """Whether the kernels for ``target`` ask for SignedZeroInfNanPreserve (see the module)."""
    if target.ieee_preserve:
        return True
    name = target.adapter.get("name", "this Vulkan device")
    what = (f"{name} does not report shaderSignedZeroInfNanPreserveFloat32 (Vulkan float controls): its "
            "kernels are compiled without SignedZeroInfNanPreserve, so the driver may fold Inf, NaN and "
            "signed zeros away inside a kernel (x / 0.0, x * 0.0, x - x give plain numbers)")
    if env.flag("MEGANEURA_REQUIRE_IEEE"):
        raise IeeeUnsupported(f"{what}; MEGANEURA_REQUIRE_IEEE=1 refuses that (unset it to compile anyway, "
                              "or use backend='wgpu', whose kernels guard these folds)")
    with _warned_lock:
        first = name not in _warned
        _warned.add(name)
    if first:
        warnings.warn(what + " (MEGANEURA_REQUIRE_IEEE=1 makes this an error)", RuntimeWarning, stacklevel=3)
    return False
