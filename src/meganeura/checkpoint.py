"""Checkpoints in safetensors: parameters under their own names, optimizer state under
theirs (``<param>.exp_avg`` ...), and metadata (format version, step, optimizer).

Writes are atomic: the file is written here (the safetensors layout: an 8-byte header
length, a JSON header, the tensors' bytes) into a temp file of ours in the same folder,
``.<name>.meganeura-tmp-<pid>-<nonce>``, flushed to disk and renamed over the checkpoint, so a
crash never leaves a half-written checkpoint; the temp files of saves that were killed are
removed by the next save or load of that path. Files get the mode the umask gives (as
``open`` would). Loading validates the file, its metadata and every name, shape and dtype
before anything reaches the session, and reports every mismatch at once, naming the file.
"""
from __future__ import annotations

import json
import os
import re
import struct

import numpy as np
from safetensors import safe_open
from safetensors.numpy import load_file

from . import disk

FORMAT = "meganeura-checkpoint"
FORMAT_VERSION = 1
_LEGACY_TMP_SUFFIX = ".tmp"          # temp files of earlier versions: ".<name>.<pid>.<hex>.tmp"
# numpy dtype -> safetensors dtype
_SAFETENSORS_DTYPES = {"f8": "F64", "f4": "F32", "f2": "F16", "i8": "I64", "i4": "I32", "i2": "I16", "i1": "I8",
                       "u8": "U64", "u4": "U32", "u2": "U16", "u1": "U8", "b1": "BOOL"}


class CheckpointError(ValueError):
    pass


def _legacy_tmp_prefix(path):
    return f".{os.path.basename(path)}."


def clean_temp_files(path):
    """Remove the temp files of saves to ``path`` whose process no longer runs (killed
    mid-save); saves in progress, here or in another process, are left alone."""
    folder = os.path.dirname(os.path.abspath(path))
    disk.clean_temp_files(folder, os.path.basename(path))
    prefix = _legacy_tmp_prefix(path)
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        if not (name.startswith(prefix) and name.endswith(_LEGACY_TMP_SUFFIX)):
            continue
        pid = name[len(prefix):].split(".", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not disk.process_alive(int(pid)):
            try:
                os.unlink(os.path.join(folder, name))
            except OSError:
                pass


def write_safetensors(f, tensors: dict, metadata: dict) -> None:
    """Write ``tensors`` (name -> numpy array) and ``metadata`` (str -> str) to the binary
    file ``f`` in the safetensors layout, one tensor at a time (no copy of the whole file)."""
    header, arrays, at = {}, [], 0
    for name in sorted(tensors):
        # asarray keeps 0-d tensors (a batch counter) 0-d; ascontiguousarray would make them (1,)
        arr = np.asarray(tensors[name], order="C")
        code = _SAFETENSORS_DTYPES.get(f"{arr.dtype.kind}{arr.dtype.itemsize}")
        if code is None:
            raise CheckpointError(f"tensor {name!r}: dtype {arr.dtype} cannot be saved in safetensors")
        arr = arr.astype(arr.dtype.newbyteorder("<"), copy=False)
        header[name] = {"dtype": code, "shape": list(arr.shape), "data_offsets": [at, at + arr.nbytes]}
        arrays.append(arr)
        at += arr.nbytes
    header["__metadata__"] = dict(metadata)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)                 # the data section starts 8-byte aligned
    f.write(struct.pack("<Q", len(text)))
    f.write(text)
    for arr in arrays:
        if arr.nbytes:
            f.write(memoryview(np.ascontiguousarray(arr)).cast("B"))


def save(session, path, include_optimizer=True):
    """Write ``session``'s parameters (and optimizer state) to ``path`` atomically."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint {path!r} is a folder; give a file name")
    tensors = session.state_dict(include_optimizer=include_optimizer)
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "step": str(session.steps_done),
            "parameters": json.dumps(sorted(session.parameter_names)),
            "optimizer": type(session.optimizer).__name__ if session.optimizer is not None else ""}
    folder = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(folder, exist_ok=True)
        clean_temp_files(path)
        with disk.atomic_file(path) as f:
            write_safetensors(f, tensors, meta)
    except OSError as e:
        raise type(e)(e.errno, f"cannot write checkpoint {path!r}: {e.strerror or e}") from e
    except CheckpointError as e:
        raise CheckpointError(f"cannot write checkpoint {path!r}: {e}") from e
    disk.fsync_folder(folder)
    return path


def read(path):
    """(tensors, metadata) of a checkpoint file, with its format and metadata checked."""
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    clean_temp_files(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"checkpoint {path!r} is a folder, not a safetensors file")
    try:
        with safe_open(path, framework="numpy") as f:
            meta = f.metadata() or {}
        tensors = load_file(path)
    except Exception as e:   # the reader's own errors do not say which file
        raise CheckpointError(f"{path!r} is not a readable safetensors file: {e}") from e
    if meta.get("format") not in (None, FORMAT):
        raise CheckpointError(f"{path!r} is not a meganeura checkpoint (format {meta.get('format')!r})")
    version = _count(path, meta, "format_version", FORMAT_VERSION)
    if version > FORMAT_VERSION:
        raise CheckpointError(f"{path!r} has format version {version}, newer than this "
                              f"meganeura understands ({FORMAT_VERSION})")
    _count(path, meta, "step", 0)
    _parameter_names(path, meta)
    return tensors, meta


def _count(path, meta, key, default):
    """A non-negative decimal integer of the metadata ("5", not "-5" or "1e3")."""
    v = meta.get(key)
    if v is None:
        return default
    if not re.fullmatch(r"[0-9]+", v):
        raise CheckpointError(f"{path!r}: metadata {key}={v!r} is not a non-negative integer")
    return int(v)


def _parameter_names(path, meta):
    """The names the file lists as parameters (None when it does not say: all are)."""
    v = meta.get("parameters")
    if v is None:
        return None
    try:
        names = json.loads(v)
    except ValueError:
        names = None
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise CheckpointError(f"{path!r}: metadata 'parameters' is not a JSON list of names: {v[:80]!r}")
    return set(names)


def load(session, path, strict=True):
    """Load a checkpoint into ``session``; nothing changes unless all of it is valid.

    strict: every parameter of the session must be in the file, and every parameter in
    the file must be one of the session's; optimizer state in the file must be the
    session's own if it has an optimizer (it is ignored by a session without one).
    Otherwise the names both sides have are loaded and the rest is ignored."""
    path = os.fspath(path)
    tensors, meta = read(path)
    listed = _parameter_names(path, meta)
    in_file_params = set(tensors) if listed is None else listed
    kept = {t.name: t for t in session.program.kept}
    problems = []
    for name, arr in tensors.items():
        t = kept.get(name)
        if t is None:
            if not strict:
                continue
            if name in in_file_params:
                problems.append(f"unexpected parameter {name!r} {tuple(arr.shape)} (not in this graph)")
            elif session.optimizer is not None:
                problems.append(f"unexpected optimizer state {name!r} (written by "
                                f"{meta.get('optimizer') or 'an unknown optimizer'}, this session's is "
                                f"{type(session.optimizer).__name__})")
            continue
        if tuple(arr.shape) != t.shape:
            problems.append(f"{name!r}: shape {tuple(arr.shape)} in the checkpoint, expected {t.shape}")
        elif arr.dtype != t.dtype.np:
            problems.append(f"{name!r}: dtype {arr.dtype} in the checkpoint, expected {t.dtype.np}")
    if strict:
        problems += [f"missing parameter {n!r}" for n in session.parameter_names if n not in tensors]
    if problems:
        raise CheckpointError(f"cannot load {path!r}: " + "; ".join(problems))
    step = _count(path, meta, "step", 0)
    session.assign({name: arr for name, arr in tensors.items() if name in kept})
    if session.optimizer is not None and any(n in session.state_names for n in tensors):
        session.steps_done = step
    return meta
