"""Writing GGUF files: a Hugging Face Llama-family folder quantized (``meganeura quantize``).

The file is laid out as llama.cpp's converter writes one: architecture metadata under
``<arch>.*``, tensors by llama.cpp's names, ``attn_q`` / ``attn_k`` rows permuted for the
``llama`` architecture, Gemma's norms stored as ``1 + w``, no ``output`` tensor for tied
embeddings, and the tokenizer's llama.cpp fields (see ``gguf_tokenizer``). Matrices whose
rows divide into the type's blocks are quantized (Q8_0 and Q5_0 by ``gguf.quants.quantize``;
Q4_K by ``quantize_q4_k`` here, which the gguf package lacks); vectors stay f32, and matrices
whose rows do not divide fall back as llama.cpp's quantizer does (Q4_K to Q5_0), then to F16. The file is written beside its destination and renamed over
it when whole.
"""
from __future__ import annotations

import os

import numpy as np

from .gguf_io import ARCHITECTURES, gguf_name, need_gguf, permute_rows

QTYPES = ("Q8_0", "Q4_K")
_FILE_TYPE = {"Q8_0": "MOSTLY_Q8_0", "Q4_K": "MOSTLY_Q4_K_S"}
_FALLBACK = {"Q4_K": "Q5_0", "Q5_0": "F16", "Q8_0": "F16"}
QK_K = 256


def _pack_q4_k_scales(sc, mn):
    """The 12 bytes of eight 6-bit scales and eight 6-bit mins of a Q4_K block (n, 8) each:
    bytes 0-3 the low 6 bits of scales 0-3 with the top 2 bits of scales 4-7, bytes 4-7 the
    same for the mins, bytes 8-11 the low 4 bits of scales 4-7 and (high nibble) of mins 4-7."""
    lo_s, hi_s, lo_m, hi_m = sc[:, :4], sc[:, 4:], mn[:, :4], mn[:, 4:]
    b0 = lo_s | ((hi_s >> 4) << 6)
    b1 = lo_m | ((hi_m >> 4) << 6)
    b2 = (hi_s & 0x0F) | ((hi_m & 0x0F) << 4)
    return np.concatenate([b0, b1, b2], axis=1).astype(np.uint8)


def quantize_q4_k(x: np.ndarray) -> np.ndarray:
    """Q4_K blocks (uint8 rows, 144 bytes per 256 values) of f32 ``x`` (rows, cols), cols a
    multiple of 256: per block of 256, eight groups of 32 as x = d*sc*q - dmin*m with 4-bit
    q, 6-bit sc and m, f16 d and dmin (each group's range [min(x, 0), max(x)] spread on 0..15)."""
    x = np.asarray(x, np.float32)
    rows, cols = x.shape
    if cols % QK_K:
        raise ValueError(f"quantize_q4_k: rows of {cols} values do not divide into blocks of {QK_K}")
    g = x.reshape(-1, 8, 32)
    lo = np.minimum(g.min(-1), 0.0)
    hi = g.max(-1)
    offset = -lo                                                   # >= 0
    dmin = (offset.max(-1) / 63).astype(np.float16)
    dmin32 = dmin.astype(np.float32)[:, None]
    m = np.where(dmin32 > 0, np.rint(offset / np.where(dmin32 > 0, dmin32, 1)), 0).clip(0, 63)
    off_q = dmin32 * m                                              # the offset the block stores
    span = (hi + off_q) / 15                                        # the scale that reaches max(x)
    d = (span.max(-1) / 63).astype(np.float16)
    d32 = d.astype(np.float32)[:, None]
    sc = np.where(d32 > 0, np.ceil(span / np.where(d32 > 0, d32, 1) - 1e-6), 0).clip(0, 63)
    step = (d32 * sc)[..., None]
    q = np.where(step > 0, np.rint((g + off_q[..., None]) / np.where(step > 0, step, 1)), 0).clip(0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)          # group 2j low nibble, 2j+1 high
    scales = _pack_q4_k_scales(sc.astype(np.uint8), m.astype(np.uint8))
    blocks = np.concatenate([d.reshape(-1, 1).view(np.uint8), dmin.reshape(-1, 1).view(np.uint8), scales, qs],
                            axis=1)
    return blocks.reshape(rows, cols // QK_K * 144)


def quantize_tensor(w: np.ndarray, qtype: str):
    """(data, ggml type name) of one weight: vectors f32; matrices ``qtype`` where their rows
    divide into its blocks, else the next type down (Q4_K -> Q5_0 -> F16, Q8_0 -> F16)."""
    gguf = need_gguf()
    if w.ndim < 2:
        return np.ascontiguousarray(w, np.float32), "F32"
    while qtype in _FALLBACK:
        block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
        if w.shape[-1] % block == 0:
            break
        qtype = _FALLBACK[qtype]
    if qtype == "F16":
        return w.astype(np.float16), "F16"
    if qtype == "Q4_K":
        return quantize_q4_k(w.reshape(-1, w.shape[-1])).reshape(*w.shape[:-1], -1), "Q4_K"
    return gguf.quants.quantize(w, gguf.GGMLQuantizationType[qtype]), qtype


def gguf_tensors(cfg, state: dict):
    """(GGUF name, f32 array) of a model's weights as llama.cpp lays them out."""
    from . import io
    want = io.expected_weights(cfg)
    for name in want:
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        g, w = gguf_name(name), np.asarray(state[name], np.float32)
        if cfg.model_type == "llama" and g.endswith(("attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias")):
            w = permute_rows(w, cfg.num_attention_heads if ".attn_q." in g else cfg.num_key_value_heads)
        if cfg.gemma_norm and g.endswith("norm.weight"):
            w = w + np.float32(1.0)
        yield g, w


def _add_metadata(writer, cfg, name):
    writer.add_name(name)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(cfg.head_dim)
    writer.add_value_length(cfg.head_dim)
    writer.add_rope_dimension_count(cfg.head_dim)
    writer.add_rope_freq_base(cfg.rope_theta)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(cfg.vocab_size)


def _add_fields(writer, fields: dict):
    for key, v in fields.items():
        if isinstance(v, bool):
            writer.add_bool(key, v)
        elif isinstance(v, int):
            writer.add_uint32(key, v)
        elif isinstance(v, str):
            writer.add_string(key, v)
        else:
            writer.add_array(key, v)


def write_gguf(path, cfg, state: dict, qtype: str, name: str = "model", tokenizer: dict | None = None,
               progress: bool = True) -> dict:
    """Write ``state`` (our names, f32) of a Llama-family ``cfg`` to the GGUF file ``path``
    with matrices in ``qtype`` (see ``quantize_tensor``). Returns {ggml type: tensor count}."""
    gguf = need_gguf()
    from tqdm import tqdm

    from .disk import fsync_folder, temp_name
    if qtype not in QTYPES:
        raise ValueError(f"write_gguf: qtype must be one of {QTYPES}, got {qtype!r}")
    arch = {v: k for k, v in ARCHITECTURES.items()}[cfg.model_type]
    path = os.fspath(path)
    folder = os.path.dirname(os.path.abspath(path))
    tmp = os.path.join(folder, temp_name(os.path.basename(path)))
    writer = gguf.GGUFWriter(tmp, arch)
    counts = {}
    try:
        _add_metadata(writer, cfg, name)
        writer.add_file_type(int(gguf.LlamaFileType[_FILE_TYPE[qtype]]))
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
        fields = dict(tokenizer or {})
        if cfg.bos_token_id is not None:
            fields.setdefault("tokenizer.ggml.bos_token_id", int(cfg.bos_token_id))
        eos = cfg.eos_token_id[0] if isinstance(cfg.eos_token_id, list) else cfg.eos_token_id
        if eos is not None:
            fields.setdefault("tokenizer.ggml.eos_token_id", int(eos))
        _add_fields(writer, fields)
        items = list(gguf_tensors(cfg, state))
        for g, w in tqdm(items, desc=f"quantizing to {qtype}", unit="tensor", disable=not progress):
            data, t = quantize_tensor(w, qtype)
            counts[t] = counts.get(t, 0) + 1
            if t in ("F32", "F16"):
                writer.add_tensor(g, data)
            else:
                writer.add_tensor(g, data, raw_dtype=gguf.GGMLQuantizationType[t])
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file(progress=progress)
        for f in writer.fout or []:
            f.flush()
            os.fsync(f.fileno())
        writer.close()
        os.replace(tmp, path)
        fsync_folder(folder)
    except BaseException:
        writer.close()
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return counts


def quantize_folder(src, out, qtype: str, progress: bool = True) -> dict:
    """``meganeura quantize``: the Hugging Face folder ``src`` (Llama, Qwen2 or Gemma) as the
    GGUF file ``out`` with its tokenizer and chat template. Returns {ggml type: tensor count}."""
    from .gguf_tokenizer import tokenizer_fields
    from .io import load_hf
    cfg, state = load_hf(src)
    name = os.path.basename(os.path.normpath(os.fspath(src))) or "model"
    return write_gguf(out, cfg, state, qtype, name=name, tokenizer=tokenizer_fields(src, cfg.vocab_size),
                      progress=progress)
