"""Where the Vulkan backend keeps what it can reuse across processes: compiled SPIR-V and
the driver's pipeline cache.

- ``spirv/<sha256>.spv``: glslang's output, keyed by the GLSL source (``compilation.glslang``);
- ``kernels/<sha256>.bin``: a kernel text's SPIR-V with its reflection, keyed by the text as
  the renderers wrote it (``CompiledKernel``): a warm process reads it without translating
  the text to GLSL, running glslang or parsing the SPIR-V;
- ``kernel_sets/<sha256>.bin``: the compiled kernels of one request for many pipelines (a
  plan's kernels), keyed by all their texts in order: a warm process reads one file where it
  read one per kernel (``load_kernel_set``);
- ``coopmat/<sha256>[.set].json``: cooperative-matrix variants of kernel texts (``load_json``);
- ``pipelines/<device>.bin``: the driver's ``VkPipelineCache`` (checked by the driver).

Every entry of ours is a self-checking ``disk`` entry (a digest of its name and content), and
the SPIR-V in it is checked whole (``spirv.validate``) before a driver gets it: a flipped,
truncated, foreign or unreadable entry is a miss, compiled again and rewritten. The folder is
``disk.cache_dir()``; ``MEGANEURA_NO_DISK_CACHE=1`` turns every disk cache off.
"""
from __future__ import annotations

import hashlib
import itertools
import json
import pathlib
import struct
from dataclasses import dataclass

from ... import disk
from ...disk import cache_dir, write_atomic  # noqa: F401  (the device's pipeline cache writes through it)
from .spirv import is_whole


def disk_cache_enabled() -> bool:
    return disk.enabled()


# ------------------------------------------------------------------ SPIR-V
def spirv_path(key: str) -> pathlib.Path:
    return cache_dir() / "spirv" / f"{key}.spv"


def load_spirv(key: str) -> bytes | None:
    """glslang's stored output of ``key`` (``glslang.spirv_key``), whole, or None."""
    path = spirv_path(key)
    code = disk.load(path)
    if code is not None and not is_whole(code):
        disk.report(path, "SPIR-V that is not a whole module")
        return None
    return code


def store_spirv(key: str, code: bytes) -> bool:
    return disk.store(spirv_path(key), code)


# ------------------------------------------------------------------ JSON tables
def load_json(path):
    """The JSON value stored at ``path`` (``store_json``), or None."""
    data = disk.load(path)
    if data is None:
        return None
    try:
        return json.loads(data)
    except (ValueError, UnicodeDecodeError):
        disk.report(path, "not JSON")
        return None


def store_json(path, value) -> bool:
    return disk.store(path, json.dumps(value, separators=(",", ":")).encode())


# ------------------------------------------------------------------ compiled kernels
# A kernel text (the renderers' WGSL, or GLSL) compiled for the Vulkan backend: its SPIR-V
# and what the runtime reads from the SPIR-V (bindings and their access, workgroup size,
# push-constant bytes, capabilities), stored under a key of everything that decides them
# (the text, the GLSL translation switches, the target, the glslang version, the package's
# source digest), so that a later process finds the SPIR-V without translating the text to
# GLSL, running glslang or reading the SPIR-V again.
KERNEL_FORMAT = 3      # 2: the reflection keeps each binding's count of buffers; 3: ``disk`` entries


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
    """The kernel of ``_head``'s ``head`` and its SPIR-V, or None where they disagree or the
    SPIR-V is not a whole module."""
    if len(spirv) != head["spirv_bytes"] or not is_whole(spirv):
        return None
    info = dict(bindings={int(b): str(a) for b, a in head["bindings"]},
                local_size=tuple(head["local_size"]) if head["local_size"] is not None else None,
                push_constant_size=int(head["push_constant_size"]), workgroup_memory=int(head["workgroup_memory"]),
                capabilities=list(head["capabilities"]), extensions=list(head["extensions"]))
    if "counts" in head:            # bindings that are arrays of buffers
        info["counts"] = {int(b): int(c) for b, c in head["counts"]}
    return CompiledKernel(spirv, info, bool(head["subgroup32"]))


def _with_head(head: dict, body: bytes) -> bytes:
    """An entry's content: a JSON head (its length first) and the SPIR-V."""
    text = json.dumps(head, separators=(",", ":")).encode()
    return struct.pack("<I", len(text)) + text + body


def _split_head(content: bytes) -> tuple[dict, memoryview]:
    (n,) = struct.unpack_from("<I", content)
    return json.loads(content[4:4 + n]), memoryview(content)[4 + n:]


def encode_kernel(key: str, ck: CompiledKernel) -> bytes:
    """The entry of ``key``'s kernel as it is stored (``disk.encode`` under its file name)."""
    return disk.encode(kernel_path(key).name, _with_head(_head(ck), ck.spirv))


def _kernel_of(content: bytes | None) -> CompiledKernel | None:
    if content is None:
        return None
    try:
        head, spirv = _split_head(content)
        return _kernel(head, bytes(spirv))
    except (ValueError, KeyError, TypeError, struct.error):
        return None


def decode_kernel(key: str, data: bytes) -> CompiledKernel | None:
    """The entry in ``data`` if it is whole and ``key``'s, else None."""
    return _kernel_of(disk.decode(kernel_path(key).name, data))


def load_kernel(key: str) -> CompiledKernel | None:
    """The stored entry of ``key``, or None (missing, unreadable, corrupt or another key's:
    the caller compiles it again and rewrites it)."""
    path = kernel_path(key)
    content = disk.load(path)
    ck = _kernel_of(content)
    if ck is None and content is not None:
        disk.report(path, "a kernel entry whose head or SPIR-V is not whole")
    return ck


def store_kernel(key: str, ck: CompiledKernel) -> bool:
    """Write the entry of ``key`` atomically; False when it could not be written (a read-only
    or full cache folder only costs a compile in the next process)."""
    return disk.store(kernel_path(key), _with_head(_head(ck), ck.spirv))


# ------------------------------------------------------------------ kernel sets
# The kernels of a request for many pipelines, one file: U-Net's training plan read its 448
# kernel entries one by one in 31-41 ms on the H200 host, on the thread that then creates the
# pipelines, before the first was created. A set is written once all of its kernels are made:
# one head (each kernel's reflection and SPIR-V size) and the SPIR-V, checked whole by the
# entry's digest and each module by ``spirv.validate`` when read.
SET_MIN_KERNELS = 8               # fewer: the kernels' own entries are read
SET_MAX_BYTES = 1 << 30           # the oldest sets go once the folder holds more than this


def kernel_set_key(texts, *, unroll: bool, target: str, glslang: str, package: str) -> str:
    """The key of the kernels of ``texts`` (in order): as ``kernel_key``, over every text."""
    head = ("set", str(KERNEL_FORMAT), package, glslang, target, "unroll" if unroll else "")
    return sha256_of(itertools.chain(head, texts)).hexdigest()


def kernel_set_path(key: str) -> pathlib.Path:
    return cache_dir() / "kernel_sets" / f"{key}.bin"


def load_kernel_set(key: str, n: int) -> list[CompiledKernel] | None:
    """The ``n`` kernels stored under ``key``, in order, or None (missing, unreadable, corrupt,
    another key's or of another length)."""
    path = kernel_set_path(key)
    content = disk.load(path)
    if content is None:
        return None
    try:
        head, body = _split_head(content)
        if len(head["kernels"]) != n:
            return None
        out, at = [], 0
        for h in head["kernels"]:
            ck = _kernel(h, bytes(body[at:at + h["spirv_bytes"]]))
            if ck is None:
                break
            out.append(ck)
            at += len(ck.spirv)
        else:
            if at == len(body):
                return out
    except (ValueError, KeyError, TypeError, struct.error):
        pass
    disk.report(path, "a kernel set whose head or SPIR-V is not whole")
    return None


def store_kernel_set(key: str, kernels: list[CompiledKernel]) -> bool:
    """Write the set ``key`` atomically, then drop the oldest sets past ``SET_MAX_BYTES``;
    False when it could not be written."""
    path = kernel_set_path(key)
    if not disk.store(path, _with_head({"kernels": [_head(ck) for ck in kernels]},
                                       b"".join(ck.spirv for ck in kernels))):
        return False
    disk.prune(path.parent, SET_MAX_BYTES, ("*.bin",))
    return True
