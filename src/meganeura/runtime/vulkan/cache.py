"""Where the Vulkan backend keeps what it can reuse across processes: compiled SPIR-V and
the driver's pipeline cache.

- ``spirv/<sha256>.spv``: glslang's output, keyed by the GLSL source (``compilation.glslang``);
- ``kernels/<sha256>.bin``: a kernel text's SPIR-V with its reflection, keyed by the text as
  the renderers wrote it (``CompiledKernel``): a warm process reads it without translating
  the text to GLSL, running glslang or parsing the SPIR-V;
- ``kernel_sets/<sha256>.bin``: the compiled kernels of one request for many pipelines (a
  plan's kernels), keyed by all their texts in order: a warm process reads one file where it
  read one per kernel (``load_kernel_set``);
- ``pipelines/<device>.bin``: the driver's ``VkPipelineCache``.

The folder is ``$MEGANEURA_CACHE_DIR`` when set, else the platform's user cache folder
(``$XDG_CACHE_HOME/meganeura`` or ``~/.cache/meganeura`` on Linux, ``~/Library/Caches/
meganeura`` on macOS, ``%LOCALAPPDATA%\\meganeura\\Cache`` on Windows). Setting
``MEGANEURA_NO_DISK_CACHE=1`` turns every disk cache off (everything is rebuilt each process).
"""
from __future__ import annotations

import hashlib
import itertools
import json
import os
import pathlib
import struct
import sys
import tempfile
import zlib
from dataclasses import dataclass

from ..backends import env_flag


def disk_cache_enabled() -> bool:
    return not env_flag("MEGANEURA_NO_DISK_CACHE")


def cache_dir() -> pathlib.Path:
    """The user cache folder of meganeura (not created here)."""
    env = os.environ.get("MEGANEURA_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    home = pathlib.Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "meganeura"
    if os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return pathlib.Path(base) / "meganeura" / "Cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(home / ".cache")
    return pathlib.Path(base) / "meganeura"


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a concurrent
    reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


# ------------------------------------------------------------------ compiled kernels
# A kernel text (the renderers' WGSL, or GLSL) compiled for the Vulkan backend: its SPIR-V
# and what the runtime reads from the SPIR-V (bindings and their access, workgroup size,
# push-constant bytes, capabilities), stored under a key of everything that decides them
# (the text, the GLSL translation switches, the target, the glslang version, the package's
# source digest), so that a later process finds the SPIR-V without translating the text to
# GLSL, running glslang or reading the SPIR-V again.
KERNEL_FORMAT = 2      # 2: the reflection keeps each binding's count of buffers
_KERNEL_MAGIC = b"MGKSPV1\n"


@dataclass(frozen=True)
class CompiledKernel:
    """SPIR-V of a kernel text and its reflection (``spirv.reflect``'s dict); ``subgroup32``:
    the kernel maps subgroups of 32 to cooperative-matrix fragments."""
    spirv: bytes
    info: dict
    subgroup32: bool = False


def sha256_of(parts):
    """sha256 over ``parts`` (strings), each ended by a zero byte."""
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h


def kernel_key(text: str, *, unroll: bool, target: str, glslang: str, package: str) -> str:
    """The key of a kernel text's SPIR-V: sha256 over the format, the package digest, the
    glslang version, the target environment, the GLSL translation switches and the text."""
    return sha256_of((str(KERNEL_FORMAT), package, glslang, target, "unroll" if unroll else "", text)).hexdigest()


def kernel_path(key: str) -> pathlib.Path:
    return cache_dir() / "kernels" / f"{key}.bin"


def _head(ck: CompiledKernel) -> dict:
    """A kernel's reflection and SPIR-V size as JSON values."""
    info = ck.info
    counts = {"counts": [[int(b), int(c)] for b, c in info["counts"].items()]} if "counts" in info else {}
    return {"bindings": [[int(b), a] for b, a in info["bindings"].items()], **counts,
            "local_size": list(info["local_size"]) if info["local_size"] is not None else None,
            "push_constant_size": int(info["push_constant_size"]), "workgroup_memory": int(info["workgroup_memory"]),
            "capabilities": list(info["capabilities"]), "extensions": list(info["extensions"]),
            "subgroup32": bool(ck.subgroup32), "spirv_bytes": len(ck.spirv)}


def _kernel(head: dict, spirv: bytes) -> CompiledKernel | None:
    """The kernel of ``_head``'s ``head`` and its SPIR-V, or None where they disagree."""
    if len(spirv) != head["spirv_bytes"] or len(spirv) < 20 or len(spirv) % 4 or spirv[:4] != b"\x03\x02\x23\x07":
        return None
    info = dict(bindings={int(b): str(a) for b, a in head["bindings"]},
                local_size=tuple(head["local_size"]) if head["local_size"] is not None else None,
                push_constant_size=int(head["push_constant_size"]), workgroup_memory=int(head["workgroup_memory"]),
                capabilities=list(head["capabilities"]), extensions=list(head["extensions"]))
    if "counts" in head:            # bindings that are arrays of buffers
        info["counts"] = {int(b): int(c) for b, c in head["counts"]}
    return CompiledKernel(spirv, info, bool(head["subgroup32"]))


def encode_kernel(key: str, ck: CompiledKernel) -> bytes:
    head = json.dumps({"key": key, **_head(ck), "crc32": zlib.crc32(ck.spirv)}, separators=(",", ":")).encode()
    return _KERNEL_MAGIC + struct.pack("<I", len(head)) + head + ck.spirv


def decode_kernel(key: str, data: bytes) -> CompiledKernel | None:
    """The entry in ``data`` if it is whole and ``key``'s, else None."""
    try:
        m = len(_KERNEL_MAGIC)
        if data[:m] != _KERNEL_MAGIC:
            return None
        (n,) = struct.unpack_from("<I", data, m)
        head = json.loads(data[m + 4:m + 4 + n])
        spirv = data[m + 4 + n:]
        if head["key"] != key or zlib.crc32(spirv) != head["crc32"]:
            return None
        return _kernel(head, spirv)
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def load_kernel(key: str) -> CompiledKernel | None:
    """The stored entry of ``key``, or None (missing, unreadable, corrupt or another key's:
    the caller compiles it again and rewrites it)."""
    try:
        data = kernel_path(key).read_bytes()
    except OSError:
        return None
    return decode_kernel(key, data)


def store_kernel(key: str, ck: CompiledKernel) -> bool:
    """Write the entry of ``key`` atomically; False when it could not be written (a read-only
    or full cache folder only costs a compile in the next process)."""
    try:
        write_atomic(kernel_path(key), encode_kernel(key, ck))
        return True
    except OSError:
        return False


# ------------------------------------------------------------------ kernel sets
# The kernels of a request for many pipelines, one file: U-Net's training plan read its 448
# kernel entries one by one in 31-41 ms on the H200 host, on the thread that then creates the
# pipelines, before the first was created. A set is written once all of its kernels are made:
# one header (each kernel's reflection and SPIR-V size) and the SPIR-V, checked whole by one
# CRC when read.
SET_MIN_KERNELS = 8               # fewer: the kernels' own entries are read
SET_MAX_BYTES = 1 << 30           # the oldest sets go once the folder holds more than this
_SET_MAGIC = b"MGKSET1\n"


def kernel_set_key(texts, *, unroll: bool, target: str, glslang: str, package: str) -> str:
    """The key of the kernels of ``texts`` (in order): as ``kernel_key``, over every text."""
    head = ("set", str(KERNEL_FORMAT), package, glslang, target, "unroll" if unroll else "")
    return sha256_of(itertools.chain(head, texts)).hexdigest()


def kernel_set_path(key: str) -> pathlib.Path:
    return cache_dir() / "kernel_sets" / f"{key}.bin"


def load_kernel_set(key: str, n: int) -> list[CompiledKernel] | None:
    """The ``n`` kernels stored under ``key``, in order, or None (missing, unreadable, corrupt,
    another key's or of another length)."""
    try:
        data = kernel_set_path(key).read_bytes()
        m = len(_SET_MAGIC)
        if data[:m] != _SET_MAGIC:
            return None
        size, crc = struct.unpack_from("<II", data, m)
        head = json.loads(data[m + 8:m + 8 + size])
        body = memoryview(data)[m + 8 + size:]
        if head["key"] != key or len(head["kernels"]) != n or zlib.crc32(body) != crc:
            return None
        out, at = [], 0
        for h in head["kernels"]:
            ck = _kernel(h, bytes(body[at:at + h["spirv_bytes"]]))
            if ck is None:
                return None
            out.append(ck)
            at += len(ck.spirv)
        return out if at == len(body) else None
    except (OSError, ValueError, KeyError, TypeError, struct.error):
        return None


def store_kernel_set(key: str, kernels: list[CompiledKernel]) -> bool:
    """Write the set ``key`` atomically, then drop the oldest sets past ``SET_MAX_BYTES``;
    False when it could not be written."""
    from ...plan_cache import prune
    body = b"".join(ck.spirv for ck in kernels)
    head = json.dumps({"key": key, "kernels": [_head(ck) for ck in kernels]}, separators=(",", ":")).encode()
    path = kernel_set_path(key)
    try:
        write_atomic(path, _SET_MAGIC + struct.pack("<II", len(head), zlib.crc32(body)) + head + body)
    except OSError:
        return False
    prune(path.parent, SET_MAX_BYTES, ("*.bin",))
    return True
