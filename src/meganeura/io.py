"""Reading Hugging Face model folders: config.json plus safetensors weights.

The safetensors format is read directly (an 8-byte little-endian header length, a JSON
header of name -> dtype/shape/byte range, then the raw little-endian data) because the
numpy loader of the safetensors package has no bfloat16. Floating tensors come back as
f32: bf16 is the top half of an f32, so widening is a 16-bit shift.

Nothing in a file is trusted: the header's byte ranges must lie in the data section,
match the dtype and shape and not overlap; an index may only name shards inside the
folder; a config must give the model's sizes; and weights the config does not use are
refused unless ``allow_unused``. Every error names the file (and the field). Errors about the
files' contents are ``ModelFileError`` (a ValueError).

A snapshot folder of the Hugging Face hub cache (``models--org--name/snapshots/<rev>/``, whose
files are symlinks into ``../../blobs/``) loads as any folder: a shard may resolve into the
repository's ``blobs`` folder, and nowhere else outside the model folder.
"""
from __future__ import annotations

import json
import math
import os
import struct

import numpy as np

_NUMPY = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
          "I8": "i1", "U8": "u1", "BOOL": "?", "U16": "<u2", "U32": "<u4", "U64": "<u8"}
_ITEMSIZE = {**{k: np.dtype(v).itemsize for k, v in _NUMPY.items()}, "BF16": 2}

# the safetensors package refuses headers above 100 MB: so do we, before reading one
MAX_HEADER_BYTES = 100_000_000

# transformers class -> model_type; all build through models.llama (Qwen2 and Gemma by its switches)
ARCHITECTURES = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2", "GemmaForCausalLM": "gemma"}
# config.json fields without which the model's size is unknown (LlamaConfig would fall back
# to Llama-7B's); each must be a positive integer
REQUIRED_SIZES = {a: ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")
                  for a in ARCHITECTURES}
# buffers some checkpoints carry that are derived, not weights
_DERIVED = ("rotary_emb.inv_freq",)


class ModelFileError(ValueError):
    """A model file (weights, index or config) is malformed or does not fit the model."""


def _is_count(v):
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _is_positive_number(v):
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0


def _read_header(path, f, size):
    """{name: (dtype, shape, start, end)} with every entry checked against the file."""
    raw = f.read(8)
    if len(raw) != 8:
        raise ModelFileError(f"{path}: not a safetensors file (too short)")
    (n,) = struct.unpack("<Q", raw)
    if n > min(MAX_HEADER_BYTES, size - 8):
        raise ModelFileError(f"{path}: header length {n} exceeds the file ({size} bytes) or {MAX_HEADER_BYTES}")
    try:
        header = json.loads(f.read(n))
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: the header is not valid JSON ({e})") from None
    if not isinstance(header, dict):
        raise ModelFileError(f"{path}: the header is not a JSON object")
    data_size = size - 8 - n
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        where = f"{path}: tensor {name!r}"
        if not isinstance(info, dict):
            raise ModelFileError(f"{where}: entry is not an object")
        dt, shape, offs = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if dt not in _ITEMSIZE:
            raise ModelFileError(f"{where} has unsupported dtype {dt!r}; supported: {sorted(_ITEMSIZE)}")
        if not isinstance(shape, list) or not all(_is_count(s) for s in shape):
            raise ModelFileError(f"{where}: shape {shape!r} is not a list of non-negative integers")
        if not (isinstance(offs, list) and len(offs) == 2 and all(_is_count(o) for o in offs)):
            raise ModelFileError(f"{where}: data_offsets {offs!r} are not two non-negative integers")
        start, end = offs
        want = math.prod(shape) * _ITEMSIZE[dt]
        if end < start or end - start != want:
            raise ModelFileError(f"{where}: byte range [{start}, {end}) holds {end - start} bytes, expected "
                                 f"{want} for {dt} {tuple(shape)}")
        if end > data_size:
            raise ModelFileError(f"{where}: byte range [{start}, {end}) runs past the data section "
                                 f"({data_size} bytes): the file is truncated or corrupt")
        out[name] = (dt, tuple(shape), start, end)
    spans = sorted((s, e, nm) for nm, (_, _, s, e) in out.items() if e > s)
    for (s0, e0, a), (s1, e1, b) in zip(spans, spans[1:]):
        if s1 < e0:
            raise ModelFileError(f"{path}: tensors {a!r} [{s0}, {e0}) and {b!r} [{s1}, {e1}) overlap")
    return out, 8 + n


def read_safetensors(path, names=None, to_f32=True) -> dict:
    """Tensors of one .safetensors file (only ``names`` if given); floats as f32 when ``to_f32``."""
    path = os.fspath(path)
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a folder, not a safetensors file")
    out = {}
    with open(path, "rb") as f:
        header, base = _read_header(path, f, os.fstat(f.fileno()).st_size)
        for name, (dt, shape, start, end) in header.items():
            if names is not None and name not in names:
                continue
            f.seek(base + start)
            buf = f.read(end - start)
            if len(buf) != end - start:
                raise ModelFileError(f"{path}: tensor {name!r} is truncated")
            if dt == "BF16":
                bits = np.frombuffer(buf, "<u2").astype(np.uint32) << 16
                arr = bits.view(np.float32)
            else:
                arr = np.frombuffer(buf, _NUMPY[dt])
            arr = arr.reshape(shape)
            if to_f32 and arr.dtype.kind == "f":
                arr = arr.astype(np.float32)       # also makes a writable copy
            else:
                arr = arr.copy()
            out[name] = arr
    return out


def _read_json(path, what):
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: {what} is not valid JSON ({e})") from None
    if not isinstance(d, dict):
        raise ModelFileError(f"{path}: {what} is not a JSON object")
    return d


def _hub_blobs(folder):
    """The real ``blobs`` folder of the hub-cache repository whose snapshot ``folder`` is
    (``<repo>/snapshots/<rev>``, with ``<repo>/blobs`` beside), else None."""
    snapshots = os.path.dirname(os.path.abspath(folder))
    blobs = os.path.join(os.path.dirname(snapshots), "blobs")
    if os.path.basename(snapshots) == "snapshots" and os.path.isdir(blobs):
        return os.path.realpath(blobs)
    return None


def _inside(root, full):
    return os.path.commonpath([root, full]) == root and full != root


def _shard_path(folder, index, file):
    """The shard ``file`` of an index, refused unless it is a relative path inside ``folder``
    that resolves inside it, or (a hub-cache snapshot) inside its repository's blobs."""
    if not isinstance(file, str) or not file or os.path.isabs(file):
        raise ModelFileError(f"{index}: shard {file!r} must be a file name relative to the model folder")
    named = os.path.normpath(os.path.join(os.path.abspath(folder), file))
    full = os.path.realpath(named)
    root = os.path.realpath(folder)
    blobs = _hub_blobs(folder)
    if not _inside(os.path.abspath(folder), named) or not (
            _inside(root, full) or (blobs is not None and _inside(blobs, full))):
        raise ModelFileError(f"{index}: shard {file!r} lies outside the model folder {folder}")
    return full


def load_weights(path) -> dict:
    """All tensors of a folder: model.safetensors, or the shards of model.safetensors.index.json."""
    path = os.fspath(path)
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        weight_map = _read_json(index, "the index").get("weight_map")
        if not isinstance(weight_map, dict):
            raise ModelFileError(f"{index}: no 'weight_map' object of tensor name -> shard file")
        by_file = {}
        for name, file in weight_map.items():
            by_file.setdefault(_shard_path(path, index, file), set()).add(name)
        state = {}
        for file, names in sorted(by_file.items()):
            if not os.path.isfile(file):
                raise FileNotFoundError(f"{index}: shard {os.path.relpath(file, path)!r} does not exist")
            state.update(read_safetensors(file, names))
        missing = sorted(set(weight_map) - set(state))
        if missing:
            raise ModelFileError(f"{index}: lists tensors missing from their shards: {missing[:5]}")
        return state
    if os.path.exists(single):
        return read_safetensors(single)
    others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth"))]
    hint = f" (found {others}: convert them to safetensors)" if others else ""
    raise FileNotFoundError(f"{path}: no model.safetensors or model.safetensors.index.json{hint}")


def load_config(path):
    """The model config of a folder's config.json, by architecture; its size fields are required."""
    file = os.path.join(os.fspath(path), "config.json")
    if not os.path.isfile(file):
        raise FileNotFoundError(f"{file}: no config.json in the model folder")
    d = _read_json(file, "config.json")
    archs = d.get("architectures") or []
    if not isinstance(archs, list):
        raise ModelFileError(f"{file}: 'architectures' is not a list: {archs!r}")
    arch = next((a for a in archs if a in ARCHITECTURES), None)
    if arch is None and not archs:
        arch = next((a for a, mt in ARCHITECTURES.items() if d.get("model_type") == mt), None)
    if arch is not None:
        from .models.llama import LlamaConfig
        d = {**d, "model_type": ARCHITECTURES[arch]}
        missing = [k for k in REQUIRED_SIZES[arch] if k not in d]
        if missing:
            raise ModelFileError(f"{file}: lacks the size field(s) {missing}; refusing to guess the model's size")
        for k in REQUIRED_SIZES[arch] + ("num_key_value_heads", "head_dim", "max_position_embeddings"):
            v = d.get(k)
            if v is not None and not (_is_count(v) and v > 0):
                raise ModelFileError(f"{file}: {k} must be a positive integer, got {v!r}")
        rope = d.get("rope_parameters")
        if rope is not None and not isinstance(rope, dict):
            raise ModelFileError(f"{file}: rope_parameters must be an object, got {rope!r}")
        for k, v in (("rms_norm_eps", d.get("rms_norm_eps")), ("rope_theta", d.get("rope_theta")),
                     ("rope_parameters.rope_theta", (rope or {}).get("rope_theta"))):
            if v is not None and not _is_positive_number(v):
                raise ModelFileError(f"{file}: {k} must be a positive finite number, got {v!r}")
        tie = d.get("tie_word_embeddings")
        if tie is not None and not isinstance(tie, bool):
            raise ModelFileError(f"{file}: tie_word_embeddings must be true or false, got {tie!r}")
        try:
            return LlamaConfig.from_hf_dict(d)
        except (TypeError, ValueError) as e:
            raise ModelFileError(f"{file}: {e}") from e
    raise NotImplementedError(f"{file}: architecture {archs or d.get('model_type')} is not supported; "
                              f"supported: {list(ARCHITECTURES)}")


def expected_weights(config) -> dict:
    """{name: shape} of the weights a model of ``config`` has (transformers' names)."""
    from .graph import Graph
    from .models.llama import LlamaConfig, _params
    if not isinstance(config, LlamaConfig):
        raise NotImplementedError(f"no weight list for {type(config).__name__}")
    g = Graph()
    _params(g, config)
    out = {n: t.shape for n, t in g.parameters.items()}
    if config.tie_word_embeddings:   # transformers may still save the aliased head
        out.setdefault("lm_head.weight", out["model.embed_tokens.weight"])
    return out


def check_weights(path, config, state, allow_unused=False):
    """Every weight of ``config``'s model present with its shape, and (unless
    ``allow_unused``) no weight it would not use, e.g. layers beyond num_hidden_layers."""
    want = expected_weights(config)
    problems = []
    tied_head = config.tie_word_embeddings and "lm_head.weight" not in state
    missing = [n for n in want if n not in state and not (tied_head and n == "lm_head.weight")]
    if missing:
        problems.append(f"missing weight(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    problems += [f"{n!r} has shape {tuple(state[n].shape)}, the config implies {want[n]}"
                 for n in want if n in state and tuple(state[n].shape) != want[n]][:5]
    unused = sorted(n for n in state if n not in want and not n.endswith(_DERIVED))
    if unused and not allow_unused:
        problems.append(f"{len(unused)} weight(s) the config does not use, e.g. {unused[:3]} (does "
                        f"num_hidden_layers={config.num_hidden_layers} match the weights? pass "
                        f"allow_unused=True to ignore them)")
    if problems:
        raise ModelFileError(f"{path}: weights do not fit config.json: " + "; ".join(problems))


def load_hf(path, allow_unused=False):
    """Read a Hugging Face model folder. Returns (config, state dict of f32 numpy arrays),
    names as in the files (a tied model usually has no ``lm_head.weight``). The weights
    must fit the config: all present with their shapes, and none unused unless
    ``allow_unused``."""
    path = os.fspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(f"{path}: not a folder")
    config = load_config(path)
    state = load_weights(path)
    check_weights(path, config, state, allow_unused)
    return config, state


def load_gguf(path, tokenizer=True):
    """Read a GGUF file (llama.cpp's format) of a Llama, Qwen2 or Gemma model: a
    ``gguf_io.GGUFModel`` with ``config``, ``state`` (f32 weights by transformers' names),
    the raw quantized ``tensors`` with their ``quant_types``, ``tokenizer`` and
    ``chat_template``; unpacks as ``config, state = load_gguf(path)``. Needs the ``gguf``
    package (``pip install meganeura[gguf]``)."""
    from .gguf_io import load_gguf as load
    return load(path, tokenizer=tokenizer)
