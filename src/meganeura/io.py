"""Reading Hugging Face model folders: config.json plus safetensors weights.

The safetensors format is read directly (an 8-byte little-endian header length, a JSON
header of name -> dtype/shape/byte range, then the raw little-endian data) because the
numpy loader of the safetensors package has no bfloat16. Floating tensors come back as
f32: bf16 is the top half of an f32, so widening is a 16-bit shift.
"""
from __future__ import annotations

import json
import os
import struct

import numpy as np

_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?", "U16": "<u2", "U32": "<u4", "U64": "<u8"}

ARCHITECTURES = ("LlamaForCausalLM",)


def read_safetensors(path, names=None, to_f32=True) -> dict:
    """Tensors of one .safetensors file (only ``names`` if given); floats as f32 when ``to_f32``."""
    out = {}
    with open(path, "rb") as f:
        raw = f.read(8)
        if len(raw) != 8:
            raise ValueError(f"{path}: not a safetensors file (too short)")
        (n,) = struct.unpack("<Q", raw)
        header = json.loads(f.read(n))
        base = 8 + n
        for name, info in header.items():
            if name == "__metadata__" or (names is not None and name not in names):
                continue
            dt, shape = info["dtype"], tuple(info["shape"])
            start, end = info["data_offsets"]
            f.seek(base + start)
            buf = f.read(end - start)
            if len(buf) != end - start:
                raise ValueError(f"{path}: tensor {name!r} is truncated")
            if dt == "BF16":
                bits = np.frombuffer(buf, "<u2").astype(np.uint32) << 16
                arr = bits.view(np.float32)
            elif dt in _NUMPY:
                arr = np.frombuffer(buf, _NUMPY[dt])
            else:
                raise TypeError(f"{path}: tensor {name!r} has unsupported dtype {dt}")
            arr = arr.reshape(shape)
            if to_f32 and arr.dtype.kind == "f":
                arr = arr.astype(np.float32)       # also makes a writable copy
            else:
                arr = arr.copy()
            out[name] = arr
    return out


def load_weights(path) -> dict:
    """All tensors of a folder: model.safetensors, or the shards of model.safetensors.index.json."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        by_file = {}
        for name, file in weight_map.items():
            by_file.setdefault(file, set()).add(name)
        state = {}
        for file, names in sorted(by_file.items()):
            state.update(read_safetensors(os.path.join(path, file), names))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise KeyError(f"{path}: index lists tensors missing from their shards: {missing[:5]}")
        return state
    if os.path.exists(single):
        return read_safetensors(single)
    others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
    hint = f" (found {others}: convert them to safetensors)" if others else ""
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")


def load_config(path):
    """The model config of a folder's config.json, by architecture."""
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    archs = d.get("architectures") or []
    if "LlamaForCausalLM" in archs or (not archs and d.get("model_type") == "llama"):
        from .models.llama import LlamaConfig
        return LlamaConfig.from_hf_dict(d)
    raise NotImplementedError(f"{path}: architecture {archs or d.get('model_type')} is not supported; "
                              f"supported: {list(ARCHITECTURES)}")


def load_hf(path):
    """Read a Hugging Face model folder. Returns (config, state dict of f32 numpy arrays),
    names as in the files (a tied model usually has no ``lm_head.weight``)."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder")
    return load_config(path), load_weights(path)
