"""What a compiled plan is compiled for: a ``Target`` names the API and everything about a
device that decides a kernel's final text (limits, features, subgroup sizes, the
cooperative-matrix shapes) and the switches the kernel finishing reads (loop unrolling,
cooperative-matrix mode).

A runtime describes itself as one (``device.target()``); a target can also be made with no
device at all (``Target.lavapipe()``, ``Target.h200()``, ``Target.from_dict`` of a saved
description), so that an executable is built, counted and saved device-free.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field, replace

APIS = ("vulkan", "wgpu")
COOPMAT_MODES = ("auto", "off", "emulate")


def coopmat_mode() -> str:
    """``MEGANEURA_COOPMAT``: ``auto`` (default: cooperative-matrix matmuls and flash attention
    in accelerated precision where the device has them), ``off``, or ``emulate`` (the same
    kernels with the fragment operations as plain loops, on any device: for testing; slow)."""
    raw = os.environ.get("MEGANEURA_COOPMAT", "").strip().lower() or "auto"
    raw = {"0": "off", "false": "off", "no": "off", "1": "auto", "on": "auto", "yes": "auto"}.get(raw, raw)
    if raw not in COOPMAT_MODES:
        raise ValueError(f"MEGANEURA_COOPMAT={raw!r}: must be one of {COOPMAT_MODES} (or unset)")
    return raw


@dataclass(frozen=True)
class Target:
    """A device as the compile stage sees it. ``limits`` under wgpu's names (both runtimes
    report them so: ``max-storage-buffers-per-shader-stage``, ``max-compute-workgroup-storage-size``,
    ``binding-arrays``, ...); ``adapter``: name, driver and backend (part of the plan cache's
    key); ``vulkan``: the API version kernels are compiled for (SPIR-V environment);
    ``coopmat_reason``: why cooperative matrices cannot be used ('' where they can);
    ``unroll``: ``[[unroll]]`` hints in the GLSL (hardware drivers only: a software driver's
    compile time explodes on unrolled kernels); ``coopmat``: ``coopmat_mode()``;
    ``ieee_preserve``: the device keeps Inf, NaN and signed zeros in f32 when a kernel asks
    (Vulkan's shaderSignedZeroInfNanPreserveFloat32): the GLSL asks only where it is on
    (``compilation.vulkan.ieee_preserve``)."""
    api: str
    limits: dict = field(default_factory=dict)
    features: frozenset = frozenset()
    subgroup: dict = field(default_factory=lambda: {"size": 32, "min_size": 32, "max_size": 32})
    coop_shapes: tuple = ()
    vulkan: tuple = (1, 3)
    software: bool = False
    adapter: dict = field(default_factory=dict)
    coopmat_reason: str = ""
    unroll: bool = True
    coopmat: str = "auto"
    has_f16: bool = True
    ieee_preserve: bool = True

    def __post_init__(self):
        if self.api not in APIS:
            raise ValueError(f"Target.api {self.api!r}: must be one of {APIS}")
        if self.coopmat not in COOPMAT_MODES:
            raise ValueError(f"Target.coopmat {self.coopmat!r}: must be one of {COOPMAT_MODES}")

    __hash__ = None       # limits and subgroup are dicts: compared, never hashed

    @property
    def spirv_env(self) -> str:
        """glslang's target environment for this Vulkan version."""
        return "vulkan1.3" if tuple(self.vulkan) >= (1, 3) else "vulkan1.2"

    @property
    def workgroup_storage(self) -> int:
        return int(self.limits.get("max-compute-workgroup-storage-size", 0))

    def tensor_cores(self, precision: str):
        """None where every kernel runs as rendered (strict precision, ``coopmat`` off, or auto
        where the device has no cooperative matrices), else whether the cooperative-matrix
        kernels are emulated (plain loops in place of the fragment operations)."""
        if self.api != "vulkan" or precision != "accelerated" or self.coopmat == "off" \
                or (self.coopmat == "auto" and self.coopmat_reason):
            return None
        return self.coopmat == "emulate"

    def with_switches(self) -> "Target":
        """This target with the switches read from the environment now (``MEGANEURA_COOPMAT``)."""
        return replace(self, coopmat=coopmat_mode())

    # ------------------------------------------------------------ saved descriptions
    def to_dict(self) -> dict:
        return {"api": self.api, "limits": dict(self.limits), "features": sorted(self.features),
                "subgroup": dict(self.subgroup), "coop_shapes": [dict(s) for s in self.coop_shapes],
                "vulkan": list(self.vulkan), "software": self.software, "adapter": dict(self.adapter),
                "coopmat_reason": self.coopmat_reason, "unroll": self.unroll, "coopmat": self.coopmat,
                "has_f16": self.has_f16, "ieee_preserve": self.ieee_preserve}

    @staticmethod
    def from_dict(d: dict) -> "Target":
        known = set(Target.__dataclass_fields__)
        extra = set(d) - known
        if extra:
            raise ValueError(f"Target.from_dict: unknown field(s) {sorted(extra)}; known: {sorted(known)}")
        d = dict(d)
        d["features"] = frozenset(d.get("features", ()))
        d["coop_shapes"] = tuple(dict(s) for s in d.get("coop_shapes", ()))
        d["vulkan"] = tuple(d.get("vulkan", (1, 3)))
        return Target(**d)

    # ------------------------------------------------------------ devices described device-free
    @staticmethod
    def lavapipe() -> "Target":
        """Mesa's lavapipe (llvmpipe, Vulkan 1.3 on the CPU) as Debian 12's Mesa 22.3 reports it:
        the driver CI runs on."""
        return Target(
            api="vulkan",
            limits={"max-storage-buffers-per-shader-stage": 32, "max-compute-workgroup-storage-size": 32768,
                    "max-storage-buffer-binding-size": 134217728, "max-buffer-size": 134217728,
                    "max-compute-workgroups-per-dimension": 65535, "max-compute-invocations-per-workgroup": 1024,
                    "binding-arrays": True},
            features=frozenset({"computeFullSubgroups", "shaderFloat16", "shaderFloat64", "shaderInt16",
                                "shaderInt64", "shaderInt8", "shaderStorageBufferArrayDynamicIndexing",
                                "shaderSubgroupExtendedTypes", "storageBuffer16BitAccess", "storageBuffer8BitAccess",
                                "subgroupSizeControl", "vulkanMemoryModel", "vulkanMemoryModelDeviceScope"}),
            subgroup={"size": 8, "min_size": 8, "max_size": 8}, vulkan=(1, 3), software=True,
            adapter={"name": "llvmpipe", "backend": "Vulkan (direct)", "type": "cpu"},
            coopmat_reason="no cooperative matrices (VK_KHR_cooperative_matrix not offered by the driver)",
            unroll=False)

    @staticmethod
    def h200() -> "Target":
        """The lent NVIDIA H200 (Vulkan 580 driver) as the device-free benchmarks take it: a large
        GPU's storage-buffer limit, 48 KiB of workgroup memory, arrays of buffers, 16x16x16
        f16 -> f32 cooperative matrices on subgroups of 32."""
        f16 = {"M": 16, "N": 16, "K": 16, "A": "f16", "B": "f16", "C": "f32", "result": "f32", "scope": "subgroup"}
        return Target(
            api="vulkan",
            limits={"max-storage-buffers-per-shader-stage": 1 << 16, "max-compute-workgroup-storage-size": 49152,
                    "max-storage-buffer-binding-size": 1 << 32, "max-buffer-size": 1 << 32,
                    "max-compute-workgroups-per-dimension": 65535, "max-compute-invocations-per-workgroup": 1024,
                    "binding-arrays": True},
            features=frozenset({"cooperativeMatrix", "shaderFloat16", "storageBuffer16BitAccess",
                                "shaderStorageBufferArrayDynamicIndexing", "subgroupSizeControl"}),
            subgroup={"size": 32, "min_size": 32, "max_size": 32}, coop_shapes=(f16,), vulkan=(1, 3),
            adapter={"name": "NVIDIA H200", "backend": "Vulkan (direct)", "type": "discrete-gpu"}, unroll=True)
