"""Reading GGUF files (llama.cpp's model format) into our Llama-family models.

``load_gguf(path)`` maps a GGUF file onto ``models.llama``: the architecture metadata
(``general.architecture`` and its ``<arch>.*`` sizes) becomes a ``LlamaConfig``, the tensors
(``token_embd``, ``blk.N.attn_q`` ..., ``output_norm``, ``output``) become transformers'
parameter names, dequantized to f32 by the ``gguf`` package's own code, and the tokenizer
stored in the file becomes a ``tokenizers.Tokenizer`` (see ``gguf_tokenizer``).

What llama.cpp's converter changes on the way in is undone here: for the ``llama``
architecture it permutes the rows of ``attn_q`` / ``attn_k`` (rotate-half RoPE pairs become
adjacent pairs), and for ``gemma`` it stores RMSNorm weights as ``1 + w``.

The raw data (quantized blocks as uint8 rows, or f16/f32/bf16 values) stays available
beside the f32 weights, rows already in our order, with its ggml type: a quantized-kernel
path can read it. The ``gguf`` package is imported only when a file is read (``pip install
meganeura[gguf]``).
"""
from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field

import numpy as np

from .io import ModelFileError

MAGIC = b"GGUF"
# general.architecture -> our model_type (models.llama.HF_CLASSES)
ARCHITECTURES = {"llama": "llama", "qwen2": "qwen2", "gemma": "gemma"}
# ggml tensor types read (dequantized through gguf.quants)
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K")
# GGUF tensor name (per block: "blk.{i}." + key) -> transformers' name
LAYER_NAMES = {"attn_norm.weight": "input_layernorm.weight", "attn_q.weight": "self_attn.q_proj.weight",
               "attn_k.weight": "self_attn.k_proj.weight", "attn_v.weight": "self_attn.v_proj.weight",
               "attn_q.bias": "self_attn.q_proj.bias", "attn_k.bias": "self_attn.k_proj.bias",
               "attn_v.bias": "self_attn.v_proj.bias", "attn_output.weight": "self_attn.o_proj.weight",
               "ffn_norm.weight": "post_attention_layernorm.weight", "ffn_gate.weight": "mlp.gate_proj.weight",
               "ffn_up.weight": "mlp.up_proj.weight", "ffn_down.weight": "mlp.down_proj.weight"}
GLOBAL_NAMES = {"token_embd.weight": "model.embed_tokens.weight", "output_norm.weight": "model.norm.weight",
                "output.weight": "lm_head.weight"}
# tensors of features the model lacks: refused by name rather than ignored
_REFUSED = {"rope_freqs.weight": "per-frequency RoPE factors (Llama 3.1's rope scaling)"}


def need_gguf():
    """The ``gguf`` package, or an ImportError naming the extra."""
    try:
        import gguf
    except ImportError as e:
        raise ImportError("reading or writing GGUF files needs the 'gguf' package: pip install meganeura[gguf]") from e
    return gguf


def gguf_name(name: str) -> str:
    """The GGUF tensor name of one of our (transformers') parameter names."""
    for g, ours in GLOBAL_NAMES.items():
        if name == ours:
            return g
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and len(parts) > 3:
        rest = ".".join(parts[3:])
        for g, ours in LAYER_NAMES.items():
            if ours == rest:
                return f"blk.{parts[2]}.{g}"
    raise KeyError(f"no GGUF name for parameter {name!r}")


def our_name(gname: str) -> str | None:
    """Our parameter name of a GGUF tensor name, or None if it is none of ours."""
    if gname in GLOBAL_NAMES:
        return GLOBAL_NAMES[gname]
    parts = gname.split(".", 2)
    if len(parts) == 3 and parts[0] == "blk" and parts[1].isdigit() and parts[2] in LAYER_NAMES:
        return f"model.layers.{int(parts[1])}.{LAYER_NAMES[parts[2]]}"
    return None


def permute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of a q/k projection's rows (per head, the two
    rotate-half halves interleaved into adjacent pairs); works on raw quantized rows too."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def unpermute_rows(w: np.ndarray, heads: int) -> np.ndarray:
    """The inverse of ``permute_rows``."""
    return w.reshape(heads, w.shape[0] // heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# ----------------------------------------------------------------------------- the file
@dataclass
class GGUFTensor:
    """One tensor of a GGUF file: ``data`` as stored (uint8 block rows for quantized types,
    else f32/f16 values), ``shape`` the logical numpy shape (rows first), ``qtype`` the
    ggml type's name ("Q4_K", "F16" ...)."""
    name: str
    qtype: str
    shape: tuple
    data: np.ndarray

    def dequantize(self) -> np.ndarray:
        """f32 values of ``shape`` (the gguf package's dequantization)."""
        gguf = need_gguf()
        out = gguf.quants.dequantize(self.data, gguf.GGMLQuantizationType[self.qtype])
        return np.asarray(out, dtype=np.float32).reshape(self.shape)


@dataclass
class GGUFFile:
    """A GGUF file's metadata (scalars and arrays as Python values) and tensors by name."""
    path: str
    metadata: dict
    tensors: dict


def _check_magic(path):
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path}: no such GGUF file")
    if os.path.isdir(path):
        raise IsADirectoryError(f"{path}: is a folder, not a GGUF file")
    with open(path, "rb") as f:
        head = f.read(4)
    if head != MAGIC:
        raise ModelFileError(f"{path}: not a GGUF file: it starts with {head!r}, a GGUF file with {MAGIC!r}")


def read_gguf(path) -> GGUFFile:
    """Metadata and raw tensors of a GGUF file (any architecture; nothing dequantized yet)."""
    path = os.fspath(path)
    _check_magic(path)
    gguf = need_gguf()
    try:
        reader = gguf.GGUFReader(path)
    except (ValueError, IndexError, OverflowError, TypeError, KeyError) as e:
        raise ModelFileError(f"{path}: malformed or truncated GGUF file ({type(e).__name__}: {e})") from None
    meta = {}
    for key, f in reader.fields.items():
        if key.startswith("GGUF."):
            continue
        try:
            meta[key] = f.contents()
        except (UnicodeDecodeError, ValueError, IndexError) as e:
            raise ModelFileError(f"{path}: metadata field {key!r} cannot be read ({e})") from None
    tensors = {}
    for t in reader.tensors:
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))
        tensors[t.name] = GGUFTensor(t.name, t.tensor_type.name, shape, t.data)
    return GGUFFile(path, meta, tensors)


# ----------------------------------------------------------------------------- the model
@dataclass
class GGUFModel:
    """What ``load_gguf`` returns. ``config`` (a ``LlamaConfig``) and ``state`` (f32 numpy
    arrays by transformers' names, ready for ``LlamaGenerator`` or ``graph_state_dict``);
    ``tensors`` the raw data by the same names (rows in our order: read-only views of the
    file, copies where rows moved; Gemma's norms as stored, ``1 + w``), ``quant_types``
    their ggml type names, ``gguf_names`` their names in the file; ``tokenizer`` a ``tokenizers.Tokenizer`` (None if the file has none or the
    ``tokenizers`` package is missing), ``chat_template`` (None if absent), ``metadata``.
    Unpacks as ``config, state = load_gguf(path)``, as ``load_hf``."""
    path: str
    config: object
    state: dict
    tensors: dict
    quant_types: dict
    gguf_names: dict
    metadata: dict
    tokenizer: object = None
    chat_template: str | None = None
    tokenizer_error: str | None = field(default=None, repr=False)

    def __iter__(self):
        return iter((self.config, self.state))


def _get(meta, path, key, kind, default=dataclasses.MISSING):
    v = meta.get(key, default)
    if v is dataclasses.MISSING:
        raise ModelFileError(f"{path}: lacks the metadata field {key!r}; refusing to guess the model's size")
    if v is None or v is default:
        return v
    ok = (isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0) if kind is int else \
        (isinstance(v, (int, float, np.number)) and not isinstance(v, bool) and np.isfinite(v) and v > 0)
    if not ok:
        raise ModelFileError(f"{path}: metadata {key!r} must be a positive {kind.__name__}, got {v!r}")
    return kind(v)


def config_from_metadata(path, meta: dict, tensors: dict):
    """The ``LlamaConfig`` of a GGUF file's metadata (tied embeddings where there is no
    ``output.weight``)."""
    from .models.llama import LlamaConfig
    arch = meta.get("general.architecture")
    if arch is None:
        raise ModelFileError(f"{path}: no 'general.architecture' metadata")
    if arch not in ARCHITECTURES:
        raise NotImplementedError(f"{path}: architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    a = arch + "."
    hidden = _get(meta, path, a + "embedding_length", int)
    heads = _get(meta, path, a + "attention.head_count", int)
    kv = _get(meta, path, a + "attention.head_count_kv", int, heads)
    head_dim = _get(meta, path, a + "attention.key_length", int, hidden // heads)
    vdim = _get(meta, path, a + "attention.value_length", int, head_dim)
    if vdim != head_dim:
        raise NotImplementedError(f"{path}: {a}attention.value_length {vdim} differs from key_length {head_dim}")
    rope_dim = _get(meta, path, a + "rope.dimension_count", int, head_dim)
    if rope_dim != head_dim:
        raise NotImplementedError(f"{path}: {a}rope.dimension_count {rope_dim} is not the head size {head_dim} "
                                  "(partial rotary embeddings are not supported)")
    scaling = meta.get(a + "rope.scaling.type", "none")
    if scaling not in ("none", None):
        raise NotImplementedError(f"{path}: {a}rope.scaling.type {scaling!r} is not supported (only 'none')")
    if "token_embd.weight" not in tensors:
        raise ModelFileError(f"{path}: missing tensor 'token_embd.weight' (the token embedding)")
    vocab = _get(meta, path, a + "vocab_size", int, tensors["token_embd.weight"].shape[0])
    eos = meta.get("tokenizer.ggml.eos_token_id")
    d = dict(model_type=ARCHITECTURES[arch], vocab_size=vocab, hidden_size=hidden,
             intermediate_size=_get(meta, path, a + "feed_forward_length", int),
             num_hidden_layers=_get(meta, path, a + "block_count", int), num_attention_heads=heads,
             num_key_value_heads=kv, head_dim=head_dim,
             rms_norm_eps=_get(meta, path, a + "attention.layer_norm_rms_epsilon", float,
                               1e-6 if arch == "gemma" else 1e-5),
             rope_theta=_get(meta, path, a + "rope.freq_base", float, 10000.0),
             max_position_embeddings=_get(meta, path, a + "context_length", int, 2048),
             tie_word_embeddings="output.weight" not in tensors,
             bos_token_id=meta.get("tokenizer.ggml.bos_token_id"), eos_token_id=eos)
    try:
        return LlamaConfig.from_hf_dict(d)
    except (TypeError, ValueError) as e:
        raise ModelFileError(f"{path}: the metadata gives no valid model: {e}") from e


def load_gguf(path, tokenizer: bool = True) -> GGUFModel:
    """Read a GGUF file of a Llama, Qwen2 or Gemma model (see the module docstring). Every
    weight the config implies must be present with its shape; ``tokenizer=False`` skips
    building the tokenizer."""
    from . import io
    f = read_gguf(path)
    path, meta = f.path, f.metadata
    cfg = config_from_metadata(path, meta, f.tensors)
    want = io.expected_weights(cfg)
    if cfg.tie_word_embeddings:
        want.pop("lm_head.weight", None)
    for g, what in _REFUSED.items():
        if g in f.tensors:
            raise NotImplementedError(f"{path}: tensor {g!r} ({what}) is not supported")
    ours = {gguf_name(n) for n in want}
    extra = sorted(n for n in f.tensors if n not in ours)
    if extra:
        raise ModelFileError(f"{path}: {len(extra)} tensor(s) the model does not use, e.g. {extra[:3]} (does "
                             f"block_count={cfg.num_hidden_layers} match the tensors?)")
    for name, shape in want.items():        # every check before any dequantization
        g = gguf_name(name)
        t = f.tensors.get(g)
        if t is None:
            raise ModelFileError(f"{path}: missing tensor {g!r} ({name}, shape {shape}) that "
                                 f"{meta['general.architecture']} with {cfg.num_hidden_layers} blocks needs")
        if t.qtype not in TENSOR_TYPES:
            raise NotImplementedError(f"{path}: tensor {g!r} {t.shape} has type {t.qtype}, which is not supported; "
                                      f"supported: {', '.join(TENSOR_TYPES)}")
        if tuple(t.shape) != tuple(shape):
            raise ModelFileError(f"{path}: tensor {g!r} has shape {t.shape}, the metadata implies {tuple(shape)} "
                                 f"for {name}")
    state, raw, types, names = {}, {}, {}, {}
    for name in want:
        g = gguf_name(name)
        t = f.tensors[g]
        w, data = t.dequantize(), t.data
        if cfg.model_type == "llama" and g.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
            heads = cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads
            w, data = unpermute_rows(w, heads), unpermute_rows(np.asarray(data), heads)
        if cfg.gemma_norm and g.endswith("norm.weight"):
            w = w - np.float32(1.0)       # stored as the scale 1 + w
        state[name], raw[name], types[name], names[name] = np.ascontiguousarray(w, np.float32), data, t.qtype, g
    io.check_weights(path, cfg, state)
    out = GGUFModel(path, cfg, state, raw, types, names, meta, chat_template=meta.get("tokenizer.chat_template"))
    if tokenizer:
        from .gguf_tokenizer import tokenizer_from_metadata
        try:
            out.tokenizer = tokenizer_from_metadata(path, meta)
        except ImportError as e:            # the tokenizers package is an extra too
            out.tokenizer_error = str(e)
    return out
