"""Every ``MEGANEURA_*`` environment switch in one table, with typed readers.

A switch is a ``Switch`` record: its name, its type (``flag``: 1 / true / yes / on; ``int``;
``float``; ``text``; ``path``; ``list``: comma-separated), its default as a user would read it,
what it does, the modules that read it, and whether it can change a compiled plan (``keyed``:
such switches are part of every plan-cache key, see ``plan_keyed``). Reading a switch that is
not in the table is an error, so the table stays complete; ``markdown_table`` renders it for
the documentation. Ground floor: imports nothing from the package.
"""
from __future__ import annotations

import os
from dataclasses import dataclass

_ON = ("1", "true", "yes", "on")


@dataclass(frozen=True)
class Switch:
    name: str
    type: str              # flag | int | float | text | path | list
    default: str           # as documented ("" : unset)
    meaning: str
    read_by: str
    keyed: bool = True     # part of the plan-cache key (may change a compiled plan)


_TABLE = [
    # caches and files
    Switch("MEGANEURA_CACHE_DIR", "path", "the user cache folder",
           "folder of every disk cache (plans, SPIR-V, kernels, pipelines)", "disk", keyed=False),
    Switch("MEGANEURA_NO_DISK_CACHE", "flag", "0", "turn every disk cache off", "disk", keyed=False),
    Switch("MEGANEURA_NO_PLAN_CACHE", "flag", "0", "turn the compiled-plan cache off", "plan_cache", keyed=False),
    Switch("MEGANEURA_TRACE", "path", "", "append a Chrome trace of every step to this file",
           "runtime.executor, runtime.profiler", keyed=False),
    Switch("MEGANEURA_DEBUG", "flag", "0", "the command line shows tracebacks", "cli", keyed=False),
    # devices and backends
    Switch("MEGANEURA_BACKEND", "text", "", "what backend='gpu' runs on: vulkan or wgpu (unset: vulkan where "
           "it runs)", "runtime.backends"),
    Switch("MEGANEURA_ADAPTER", "text", "", "wgpu adapter: an index or a name substring",
           "runtime.device, distributed", keyed=False),
    Switch("MEGANEURA_VK_DEVICE", "text", "", "Vulkan physical device: an index or a name substring",
           "runtime.vulkan.selection, distributed.ranks"),
    Switch("MEGANEURA_VK_LOADER", "path", "", "the libvulkan.so.1 to load", "runtime.vulkan._vk"),
    Switch("MEGANEURA_VK_WORKGROUP_MEMORY", "int", "the device's", "bytes of workgroup memory the kernels may use",
           "runtime.vulkan.pipelines"),
    Switch("MEGANEURA_GLSLANG_LIB", "path", "", "folder holding another glslang library",
           "runtime.vulkan.glslang"),
    Switch("MEGANEURA_SPIRV_VALIDATE", "flag", "0", "run SPIRV-Tools' validator on every compile",
           "runtime.vulkan.glslang"),
    Switch("MEGANEURA_CHECKED", "flag", "0", "index checks on the GPU report bad indices",
           "runtime.vulkan.backend, runtime.device"),
    Switch("MEGANEURA_BINDING_ARRAYS", "flag", "1", "merged launches bind arrays of buffers on Vulkan (0: one body "
           "per part)", "runtime.vulkan.backend"),
    Switch("MEGANEURA_COOPMAT", "text", "auto", "cooperative-matrix kernels: auto, off or emulate",
           "runtime.vulkan.backend, cli"),
    Switch("MEGANEURA_COOPMAT_CONFIG", "text", "", "cooperative-matrix tile configurations "
           "(T:BMxBNxSG_MxSG_NxBK[xDEPTH],...)", "codegen.coopmat"),
    Switch("MEGANEURA_SPIN_MS", "float", "20 (0 on software devices)", "milliseconds to poll a fence before a "
           "blocking wait", "runtime.vulkan.device", keyed=False),
    # compile threads and workers
    Switch("MEGANEURA_COMPILE_THREADS", "int", "one per CPU, at most 16", "threads creating pipelines",
           "runtime.backends", keyed=False),
    Switch("MEGANEURA_EARLY_KERNELS", "flag", "1", "start making pipelines while the plan is still rendered",
           "runtime.executor"),
    Switch("MEGANEURA_DETECT_ANOMALY", "flag", "0", "check every dispatch's output for Inf/NaN",
           "runtime.executor", keyed=False),
    # compiler and kernels
    Switch("MEGANEURA_NO_FUSE", "list", "", "fusion passes to switch off (or all)", "compiler"),
    Switch("MEGANEURA_TILED_PROLOGUE_READ_ELEMENTS", "int", str(6 << 20), "largest input a tiled kernel's "
           "prologue may read", "passes.fuse_prologue"),
    Switch("MEGANEURA_SHARED_MAX_ELEMENTS", "int", str(1 << 16), "largest row a pointwise kernel stages in "
           "workgroup memory", "codegen.pointwise"),
    Switch("MEGANEURA_GLSL_UNROLL", "flag", "hardware drivers only", "mark short constant loops [[unroll]]",
           "codegen.glsl_target, runtime.vulkan.backend"),
    Switch("MEGANEURA_REQUIRE_IEEE", "flag", "0", "refuse a Vulkan device without float controls that keep "
           "Inf, NaN and signed zeros (instead of a warning)", "compilation.float_controls", keyed=False),
    Switch("MEGANEURA_MATMUL_TILE", "int", "automatic", "force the matmul tile",
           "codegen.matmul_tiles, runtime.executor"),
    Switch("MEGANEURA_MATMUL_BLOCK", "text", "automatic", "force the matmul block TMxTN/WYxWX",
           "codegen.matmul_tiles, runtime.executor"),
    Switch("MEGANEURA_MATMUL_TK", "int", "the tile's", "K per matmul step: 8, 16 or 32", "codegen.matmul_tiles"),
    Switch("MEGANEURA_MATMUL_SPLIT", "int", "0 (automatic)", "force the matmul K split",
           "codegen.matmul_tiles, runtime.executor"),
    Switch("MEGANEURA_MATMUL_GROUPS", "int", "256", "workgroups a matmul aims for", "codegen.matmul_tiles"),
    Switch("MEGANEURA_MATMUL_MAX_SPLIT", "int", "32", "most K splits of a matmul", "codegen.matmul_tiles"),
    Switch("MEGANEURA_FLASH_SMEM", "int", "the device's", "bytes of workgroup memory flash attention tiles use",
           "codegen.flash"),
    Switch("MEGANEURA_FLASH_SPLIT", "int", "automatic", "splits of a flash attention forward (1: none)",
           "codegen.flash_split, codegen.flash_grad"),
    # data-parallel training
    Switch("MEGANEURA_DP_STREAMS", "int", "4", "concurrent all-reduce streams", "distributed.ranks"),
    Switch("MEGANEURA_DP_TRANSPORT", "text", "gloo", "gradient all-reduce transport: auto, shm or gloo",
           "distributed.transports"),
]
SWITCHES = {s.name: s for s in _TABLE}


def _switch(name: str) -> Switch:
    try:
        return SWITCHES[name]
    except KeyError:
        raise KeyError(f"{name} is not a meganeura switch (add it to meganeura.env's table)") from None


def raw(name: str) -> str:
    """The switch's value as set, stripped; "" when unset."""
    _switch(name)
    return os.environ.get(name, "").strip()


def flag(name: str, default: bool = False) -> bool:
    """Whether the switch is on (1 / true / yes / on); ``default`` where unset or empty."""
    value = raw(name).lower()
    return default if not value else value in _ON


def integer(name: str, default: int | None = None) -> int | None:
    """The switch as a decimal integer, ``default`` where unset; an error names the switch."""
    value = raw(name)
    if not value:
        return default
    try:
        return int(value, 10)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected an integer ({_switch(name).meaning})") from None


def number(name: str, default: float | None = None) -> float | None:
    """The switch as a float, ``default`` where unset; an error names the switch."""
    value = raw(name)
    if not value:
        return default
    try:
        return float(value)
    except ValueError:
        raise ValueError(f"{name}={value!r}: expected a number ({_switch(name).meaning})") from None


def text(name: str, default: str | None = None) -> str | None:
    """The switch's text, ``default`` where unset or empty."""
    return raw(name) or default


def names(name: str) -> list[str]:
    """The comma-separated items of a list switch."""
    return [s.strip() for s in raw(name).split(",") if s.strip()]


def plan_keyed() -> list[tuple[str, str]]:
    """(name, value) of every ``MEGANEURA_*`` variable set that may change a plan, sorted: the
    table's keyed switches and any name the table does not know (a misspelt switch may be a
    new one, so it keys too)."""
    return sorted((k, v) for k, v in os.environ.items()
                  if k.startswith("MEGANEURA_") and (k not in SWITCHES or SWITCHES[k].keyed))


def markdown_table() -> str:
    """The table as Markdown: switch, type, default, meaning, read by."""
    rows = ["| switch | type | default | meaning | read by |", "|---|---|---|---|---|"]
    for s in sorted(_TABLE, key=lambda s: s.name):
        rows.append(f"| `{s.name}` | {s.type} | {s.default or 'unset'} | {s.meaning} | {s.read_by} |")
    return "\n".join(rows) + "\n"
