"""Checkpoints in safetensors: parameters under their own names, optimizer state under
theirs (``<param>.exp_avg`` ...), and metadata (format version, step, optimizer).

Writes are atomic (a temp file in the same folder, fsync, rename), so a crash never leaves
a half-written checkpoint. Loading validates every name, shape and dtype before anything
reaches the device, and reports every mismatch at once.
"""
from __future__ import annotations

import json
import os
import tempfile

import numpy as np
from safetensors.numpy import load_file, save_file

FORMAT = "meganeura-checkpoint"
FORMAT_VERSION = 1


class CheckpointError(ValueError):
    pass


def save(session, path, include_optimizer=True):
    """Write ``session``'s parameters (and optimizer state) to ``path`` atomically."""
    tensors = session.state_dict(include_optimizer=include_optimizer)
    meta = {"format": FORMAT, "format_version": str(FORMAT_VERSION), "step": str(session.steps_done),
            "parameters": json.dumps(sorted(session.graph.parameters)),
            "optimizer": type(session.optimizer).__name__ if session.optimizer is not None else ""}
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file({k: np.ascontiguousarray(v) for k, v in tensors.items()}, tmp, metadata=meta)
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return path


def read(path):
    """(tensors, metadata) of a checkpoint file, with its format checked."""
    from safetensors import safe_open
    path = os.fspath(path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"checkpoint {path!r} does not exist")
    with safe_open(path, framework="numpy") as f:
        meta = f.metadata() or {}
    if meta.get("format") not in (None, FORMAT):
        raise CheckpointError(f"{path!r} is not a meganeura checkpoint (format {meta.get('format')!r})")
    if int(meta.get("format_version", FORMAT_VERSION)) > FORMAT_VERSION:
        raise CheckpointError(f"{path!r} has format version {meta['format_version']}, newer than this "
                              f"meganeura understands ({FORMAT_VERSION})")
    return load_file(path), meta


def load(session, path, strict=True):
    """Load a checkpoint into ``session``. Parameters must all be present when ``strict``;
    optimizer state is loaded when the session has it and ignored otherwise."""
    tensors, meta = read(path)
    kept = {t.name: t for t in session.program.kept}
    problems = []
    for name, arr in tensors.items():
        t = kept.get(name)
        if t is None:
            if name not in session.graph.states and strict and name in json.loads(meta.get("parameters", "[]")):
                problems.append(f"unknown parameter {name!r}")
            continue
        if tuple(arr.shape) != t.shape:
            problems.append(f"{name!r}: shape {tuple(arr.shape)} in the checkpoint, expected {t.shape}")
        elif arr.dtype != t.dtype.np:
            problems.append(f"{name!r}: dtype {arr.dtype} in the checkpoint, expected {t.dtype.np}")
    if strict:
        problems += [f"missing parameter {n!r}" for n in session.graph.parameters if n not in tensors]
    if problems:
        raise CheckpointError(f"cannot load {os.fspath(path)!r}: " + "; ".join(problems))
    session.assign({name: arr for name, arr in tensors.items() if name in kept})
    if session.optimizer is not None and any(n in session.graph.states for n in tensors):
        session.steps_done = int(meta.get("step", 0))
    return meta
