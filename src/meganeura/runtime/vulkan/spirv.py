"""A small SPIR-V reader: what the runtime needs to know about a compute module without
being told — its storage-buffer bindings and how each is accessed, its workgroup size,
its push-constant block size, its workgroup memory, the capabilities and extensions it
declares — and whether a module is whole (``validate``) before a driver sees it: a driver
given a truncated module may crash the process instead of failing.

Storage buffers declared ``readonly`` in GLSL carry ``NonWritable`` on every member of
their block (``writeonly``: ``NonReadable``), so access comes from the member decorations
of the struct the variable points to. Device-free.
"""
from __future__ import annotations

import struct
import sys

MAGIC = 0x07230203
# opcodes
_OP_EXTENSION, _OP_MEMORY_MODEL, _OP_EXECUTION_MODE, _OP_CAPABILITY = 10, 14, 16, 17
_OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_VECTOR, _OP_TYPE_ARRAY = 21, 22, 23, 28
_OP_TYPE_STRUCT, _OP_TYPE_POINTER, _OP_CONSTANT, _OP_VARIABLE = 30, 32, 43, 59
_OP_DECORATE, _OP_MEMBER_DECORATE, _OP_FUNCTION = 71, 72, 54
_OP_ENTRY_POINT, _EXECUTION_MODEL_GL_COMPUTE = 15, 5
_OP_FUNCTION_END, _OP_FUNCTION_CALL = 56, 57
MAX_BOUND = 1 << 22       # ids a module may declare (SPIR-V's universal limit)
# decorations, storage classes, execution modes
_DEC_NON_WRITABLE, _DEC_NON_READABLE, _DEC_BINDING, _DEC_SET, _DEC_OFFSET = 24, 25, 33, 34, 35
_SC_UNIFORM, _SC_WORKGROUP, _SC_PUSH_CONSTANT, _SC_STORAGE_BUFFER = 2, 4, 9, 12
_DEC_BUFFER_BLOCK = 3
_EM_LOCAL_SIZE = 17
CAPABILITY_NAMES = {
    1: "Shader", 9: "Float16", 10: "Float64", 11: "Int64", 22: "Int16", 39: "Int8",
    61: "GroupNonUniform", 63: "GroupNonUniformArithmetic", 4433: "StorageBuffer16BitAccess",
    4448: "StorageBuffer8BitAccess", 5345: "VulkanMemoryModel", 5346: "VulkanMemoryModelDeviceScope",
    5357: "CooperativeMatrixNV", 6022: "CooperativeMatrixKHR",
}


class SpirvError(ValueError):
    pass


def validate(code: bytes, name: str = "kernel") -> None:
    """Raise ``SpirvError`` unless ``code`` is a whole SPIR-V compute module, structurally:
    the magic number, a version 1.0-1.6, an id bound, every instruction's word count walking
    exactly to the end, a GLCompute ``OpEntryPoint``, every function ended (the module ends
    with ``OpFunctionEnd``) and every function an entry point or a call names defined.
    Whether it is valid SPIR-V beyond that is the validator's job (``MEGANEURA_SPIRV_VALIDATE``)."""
    if len(code) < 20 or len(code) % 4:
        raise SpirvError(f"{name}: not a SPIR-V module: {len(code)} bytes (at least 20, a multiple of 4)")
    magic, version, _, bound, schema = struct.unpack_from("<5I", code)
    if magic != MAGIC:
        raise SpirvError(f"{name}: not a SPIR-V module: magic {magic:#x}")
    if version & 0xFF0000FF or not (0x10000 <= version <= 0x10600):
        raise SpirvError(f"{name}: SPIR-V version word {version:#x} is not 1.0-1.6")
    if not 0 < bound <= MAX_BOUND or schema:
        raise SpirvError(f"{name}: id bound {bound} / schema {schema} out of range")
    # the walk is the cost (about 9 us a KiB here, once per module read from disk): native
    # words where the host is little-endian, one range test per instruction, and the index
    # past the end caught once instead of tested per instruction
    words = memoryview(code).cast("I") if sys.byteorder == "little" else struct.unpack(f"<{len(code) // 4}I", code)
    entries, functions, calls, open_function = [], set(), set(), False
    i, n, op = 5, len(words), None
    try:
        while i < n:
            w = words[i]
            count = w >> 16
            if not count:
                raise SpirvError(f"{name}: instruction at word {i} has 0 words")
            if 14 < (w & 0xFFFF) < 58:      # the four opcodes checked below, and few others
                op = w & 0xFFFF
                if op == _OP_ENTRY_POINT and count > 2 and words[i + 1] == _EXECUTION_MODEL_GL_COMPUTE:
                    entries.append(words[i + 2])
                elif op == _OP_FUNCTION and count > 2:
                    if open_function:
                        raise SpirvError(f"{name}: OpFunction at word {i} inside another function")
                    functions.add(words[i + 2])
                    open_function = True
                elif op == _OP_FUNCTION_END:
                    open_function = False
                elif op == _OP_FUNCTION_CALL and count > 3:
                    calls.add(words[i + 3])
            last = i
            i += count
    except IndexError:
        i = n + 1
    if i != n:
        raise SpirvError(f"{name}: the instructions' word counts do not walk to the module's end ({n} words)")
    op = words[last] & 0xFFFF if n > 5 else None
    # a module cut at an instruction boundary: its last function unended or missing
    if not entries:
        raise SpirvError(f"{name}: no GLCompute OpEntryPoint")
    if open_function or op != _OP_FUNCTION_END:
        raise SpirvError(f"{name}: the module does not end with a whole function")
    missing = (set(entries) | calls) - functions
    if missing:
        raise SpirvError(f"{name}: entry points or calls name functions the module lacks: {sorted(missing)[:4]}")


def is_whole(code: bytes) -> bool:
    """Whether ``validate`` accepts ``code``."""
    try:
        validate(code)
    except SpirvError:
        return False
    return True


def reflect(code: bytes) -> dict:
    """{bindings: {binding: 'read' | 'write' | 'rw'} (descriptor set 0), counts: {binding: its
    descriptors} (an array of buffers: more than 1), local_size: (x, y, z),
    push_constant_size: bytes, workgroup_memory: bytes of its workgroup (shared) variables,
    capabilities: [names], extensions: [names]}."""
    if len(code) < 20 or len(code) % 4:
        raise SpirvError(f"not a SPIR-V module: {len(code)} bytes")
    words = struct.unpack(f"<{len(code) // 4}I", code)
    if words[0] != MAGIC:
        raise SpirvError(f"not a SPIR-V module: magic {words[0]:#x}")
    caps, exts = [], []
    local_size = None
    decor: dict = {}          # id -> {decoration: value}
    member_decor: dict = {}   # struct id -> {member: {decoration: value}}
    types: dict = {}          # id -> (opcode, operands)
    constants: dict = {}
    variables = []            # (type id, id, storage class)
    i = 5
    while i < len(words):
        n, op = words[i] >> 16, words[i] & 0xFFFF
        if n == 0:
            raise SpirvError(f"corrupt instruction at word {i}")
        args = words[i + 1:i + n]
        if op == _OP_CAPABILITY:
            caps.append(CAPABILITY_NAMES.get(args[0], str(args[0])))
        elif op == _OP_EXTENSION:
            exts.append(struct.pack(f"<{len(args)}I", *args).split(b"\0")[0].decode())
        elif op == _OP_EXECUTION_MODE and args[1] == _EM_LOCAL_SIZE:
            local_size = tuple(args[2:5])
        elif op == _OP_DECORATE:
            decor.setdefault(args[0], {})[args[1]] = args[2] if len(args) > 2 else True
        elif op == _OP_MEMBER_DECORATE:
            member_decor.setdefault(args[0], {}).setdefault(args[1], {})[args[2]] = \
                args[3] if len(args) > 3 else True
        elif op in (_OP_TYPE_INT, _OP_TYPE_FLOAT, _OP_TYPE_VECTOR, _OP_TYPE_ARRAY, _OP_TYPE_STRUCT,
                    _OP_TYPE_POINTER):
            types[args[0]] = (op, args[1:])
        elif op == _OP_CONSTANT:
            constants[args[1]] = args[2]
        elif op == _OP_VARIABLE:
            variables.append((args[0], args[1], args[2]))
        elif op == _OP_FUNCTION:
            break
        i += n

    def size_of(tid):
        op, a = types.get(tid, (None, ()))
        if op in (_OP_TYPE_INT, _OP_TYPE_FLOAT):
            return a[0] // 8
        if op == _OP_TYPE_VECTOR:
            return size_of(a[0]) * a[1]
        if op == _OP_TYPE_ARRAY:
            return size_of(a[0]) * constants.get(a[1], 0)
        if op == _OP_TYPE_STRUCT:
            offs = member_decor.get(tid, {})
            return max((offs.get(m, {}).get(_DEC_OFFSET, 0) + size_of(t) for m, t in enumerate(a)), default=0)
        return 0

    bindings, counts, push, shared = {}, {}, 0, 0
    for ptr, vid, sc in variables:
        pointee = types.get(ptr, (None, (0, 0)))[1][1]
        if sc == _SC_PUSH_CONSTANT:
            push = max(push, size_of(pointee))
            continue
        if sc == _SC_WORKGROUP:
            shared += size_of(pointee)
            continue
        count = 1
        if types.get(pointee, (None,))[0] == _OP_TYPE_ARRAY:     # an array of buffers
            pointee, count = types[pointee][1][0], constants.get(types[pointee][1][1], 1)
        storage = sc == _SC_STORAGE_BUFFER or (sc == _SC_UNIFORM and _DEC_BUFFER_BLOCK in decor.get(pointee, {}))
        if not storage or _DEC_BINDING not in decor.get(vid, {}):
            continue
        if decor[vid].get(_DEC_SET, 0) != 0:
            raise SpirvError(f"binding {decor[vid][_DEC_BINDING]} is in descriptor set "
                             f"{decor[vid][_DEC_SET]}; the runtime binds set 0 only")
        members = types.get(pointee, (None, ()))[1]
        md = member_decor.get(pointee, {})
        ro = bool(members) and all(_DEC_NON_WRITABLE in md.get(m, {}) for m in range(len(members)))
        wo = bool(members) and all(_DEC_NON_READABLE in md.get(m, {}) for m in range(len(members)))
        ro = ro or _DEC_NON_WRITABLE in decor[vid]
        wo = wo or _DEC_NON_READABLE in decor[vid]
        bindings[decor[vid][_DEC_BINDING]] = "read" if ro else "write" if wo else "rw"
        counts[decor[vid][_DEC_BINDING]] = count
    return dict(bindings=dict(sorted(bindings.items())), counts=dict(sorted(counts.items())),
                local_size=local_size, push_constant_size=push,
                workgroup_memory=shared, capabilities=caps, extensions=exts)
