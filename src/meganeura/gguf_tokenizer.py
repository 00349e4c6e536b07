"""Tokenizers stored in GGUF files, to and from the ``tokenizers`` package.

Reading: a file whose ``tokenizer.huggingface.json`` holds a whole tokenizer.json loads
that exactly. Otherwise the tokenizer is built from llama.cpp's fields:
  * ``tokenizer.ggml.model = "gpt2"``: byte-level BPE from ``tokens`` and ``merges``, split
    into words by the regex ``tokenizer.ggml.pre`` names (GPT-2's where the name is not one
    of ``PRE_TOKENIZERS``);
  * ``"llama"``: SentencePiece BPE (``▁`` for spaces, ``<0xNN>`` byte fallback) with merges
    ranked by the merged piece's score, as SentencePiece merges.
Tokens of type CONTROL are special tokens, USER_DEFINED ones added tokens; with
``tokenizer.ggml.add_bos_token`` encoding prepends the BOS token.

Writing (``tokenizer_fields``): a Hugging Face byte-level BPE tokenizer.json becomes the
"gpt2" fields llama.cpp reads, plus the tokenizer.json itself.
"""
from __future__ import annotations

import json
import os

from .io import ModelFileError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6
HF_JSON = "tokenizer.huggingface.json"

# word-splitting regexes of the byte-level BPE families by their tokenizer.ggml.pre name
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
           r"\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
          r"\s*[\r\n]+|\s+(?!\S)|\s+")
PRE_TOKENIZERS = {"default": None, "gpt-2": None, "gpt2": None, "llama-bpe": _LLAMA3, "llama3": _LLAMA3,
                  "qwen2": _QWEN2, "smollm": "digits"}


def _need_tokenizers():
    try:
        import tokenizers
    except ImportError as e:
        raise ImportError("building the GGUF file's tokenizer needs the 'tokenizers' package: "
                          "pip install tokenizers") from e
    return tokenizers


def _pre_tokenizer(pre):
    from tokenizers import Regex, pre_tokenizers as pt
    rx = PRE_TOKENIZERS.get(pre)
    if rx is None:
        return pt.ByteLevel(add_prefix_space=False, use_regex=True)
    if rx == "digits":
        return pt.Sequence([pt.Digits(individual_digits=True), pt.ByteLevel(add_prefix_space=False, use_regex=True)])
    return pt.Sequence([pt.Split(Regex(rx), behavior="isolated"), pt.ByteLevel(add_prefix_space=False, use_regex=False)])


def _spm_merges(tokens, scores, types):
    """SentencePiece BPE as merges: every split of a piece into two pieces of the vocabulary,
    the higher the merged piece's score the earlier."""
    vocab = {t: i for i, t in enumerate(tokens) if types[i] in (NORMAL, USER_DEFINED)}
    found = []
    for t, i in vocab.items():
        for k in range(1, len(t)):
            a, b = t[:k], t[k:]
            if a in vocab and b in vocab:
                found.append((-scores[i], vocab[a], vocab[b], a, b))
    found.sort()
    return [(a, b) for *_, a, b in found]


def tokenizer_from_metadata(path, meta: dict):
    """A ``tokenizers.Tokenizer`` of a GGUF file's metadata, or None where it has none."""
    if isinstance(meta.get(HF_JSON), str):
        tk = _need_tokenizers()
        try:
            return tk.Tokenizer.from_str(meta[HF_JSON])
        except Exception as e:       # noqa: BLE001 -- the tokenizers package raises plain Exception
            raise ModelFileError(f"{path}: {HF_JSON} is not a valid tokenizer.json ({e})") from None
    kind = meta.get("tokenizer.ggml.model")
    if kind is None:
        return None
    tokens = meta.get("tokenizer.ggml.tokens")
    if not isinstance(tokens, list) or not tokens:
        raise ModelFileError(f"{path}: tokenizer.ggml.model is {kind!r} but tokenizer.ggml.tokens is missing or empty")
    types = meta.get("tokenizer.ggml.token_type") or [NORMAL] * len(tokens)
    if len(types) != len(tokens):
        raise ModelFileError(f"{path}: tokenizer.ggml.token_type has {len(types)} entries for {len(tokens)} tokens")
    tk = _need_tokenizers()
    from tokenizers import AddedToken, decoders, models, normalizers, processors
    if kind == "gpt2":
        merges = meta.get("tokenizer.ggml.merges") or []
        pairs = []
        for m in merges:
            p = m.split(" ")
            if len(p) != 2:
                raise ModelFileError(f"{path}: tokenizer.ggml.merges entry {m!r} is not two tokens split by a space")
            pairs.append((p[0], p[1]))
        pre = meta.get("tokenizer.ggml.pre", "default")
        tok = tk.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, pairs,
                                      ignore_merges=PRE_TOKENIZERS.get(pre) == _LLAMA3))
        tok.pre_tokenizer = _pre_tokenizer(pre)
        tok.decoder = decoders.ByteLevel()
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", False))
    elif kind == "llama":
        scores = meta.get("tokenizer.ggml.scores")
        if not isinstance(scores, list) or len(scores) != len(tokens):
            raise ModelFileError(f"{path}: a 'llama' (SentencePiece) tokenizer needs tokenizer.ggml.scores, one per token")
        unk = meta.get("tokenizer.ggml.unknown_token_id", 0)
        tok = tk.Tokenizer(models.BPE({t: i for i, t in enumerate(tokens)}, _spm_merges(tokens, scores, types),
                                      unk_token=tokens[unk], fuse_unk=True, byte_fallback=True))
        steps = [normalizers.Replace(" ", "\u2581")]
        if meta.get("tokenizer.ggml.add_space_prefix", True):
            steps.insert(0, normalizers.Prepend("\u2581"))
        tok.normalizer = normalizers.Sequence(steps)
        strip = [decoders.Strip(" ", 1, 0)] if meta.get("tokenizer.ggml.add_space_prefix", True) else []
        tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                         *strip])
        add_bos = bool(meta.get("tokenizer.ggml.add_bos_token", True))
    else:
        raise NotImplementedError(f"{path}: tokenizer.ggml.model {kind!r} is not supported; supported: gpt2, llama")
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t, ty in zip(tokens, types) if ty == CONTROL])
    tok.add_tokens([AddedToken(t, normalized=False) for t, ty in zip(tokens, types) if ty == USER_DEFINED])
    bos = meta.get("tokenizer.ggml.bos_token_id")
    if add_bos and bos is not None and 0 <= bos < len(tokens):
        tok.post_processor = processors.TemplateProcessing(single=f"{tokens[bos]} $A",
                                                           pair=f"{tokens[bos]} $A {tokens[bos]} $B",
                                                           special_tokens=[(tokens[bos], bos)])
    return tok


# ----------------------------------------------------------------------------- writing
def _guess_pre(pre):
    """tokenizer.ggml.pre of a tokenizer.json pre_tokenizer (llama.cpp picks its regex by it)."""
    if pre is None:
        return "default"
    steps = pre.get("pretokenizers", [pre]) if pre.get("type") == "Sequence" else [pre]
    kinds = [s.get("type") for s in steps]
    if kinds == ["Digits", "ByteLevel"] and steps[0].get("individual_digits"):
        return "smollm"
    if kinds == ["ByteLevel"] and steps[0].get("use_regex", True):
        return "gpt-2"
    if kinds[:1] == ["Split"]:
        rx = (steps[0].get("pattern") or {}).get("Regex")
        for name in ("llama-bpe", "qwen2"):
            if rx == PRE_TOKENIZERS[name]:
                return name
    return "default"


def _special_id(value, vocab):
    if isinstance(value, dict):
        value = value.get("content")
    return vocab.get(value) if isinstance(value, str) else None


def tokenizer_fields(folder, vocab_size: int) -> dict:
    """GGUF metadata {key: value} of a Hugging Face folder's tokenizer (tokenizer.json,
    tokenizer_config.json, chat template), or {} where the folder has no tokenizer.json.
    Only byte-level BPE tokenizers have llama.cpp fields; others keep just the tokenizer.json."""
    file = os.path.join(folder, "tokenizer.json")
    if not os.path.isfile(file):
        return {}
    with open(file, encoding="utf-8") as f:
        text = f.read()
    try:
        tj = json.loads(text)
    except ValueError as e:
        raise ModelFileError(f"{file}: not valid JSON ({e})") from None
    out = {HF_JSON: text}
    cfg_file = os.path.join(folder, "tokenizer_config.json")
    tc = {}
    if os.path.isfile(cfg_file):
        with open(cfg_file, encoding="utf-8") as f:
            tc = json.load(f)
    template = tc.get("chat_template")
    jinja = os.path.join(folder, "chat_template.jinja")
    if template is None and os.path.isfile(jinja):
        with open(jinja, encoding="utf-8") as f:
            template = f.read()
    if isinstance(template, str):
        out["tokenizer.chat_template"] = template
    model = tj.get("model") or {}
    byte_level = "ByteLevel" in json.dumps(tj.get("decoder"))
    if model.get("type") != "BPE" or not byte_level:
        return out
    vocab = dict(model.get("vocab") or {})
    added = {a["content"]: a for a in tj.get("added_tokens") or []}
    for a in added.values():
        vocab[a["content"]] = a["id"]
    n = max(vocab_size, max(vocab.values()) + 1)
    tokens, types = [None] * n, [NORMAL] * n
    for t, i in vocab.items():
        tokens[i] = t
        if t in added:
            types[i] = CONTROL if added[t].get("special") else USER_DEFINED
    for i in range(n):
        if tokens[i] is None:
            tokens[i], types[i] = f"[PAD{i}]", UNUSED
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    out.update({"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": _guess_pre(tj.get("pre_tokenizer")),
                "tokenizer.ggml.tokens": tokens, "tokenizer.ggml.token_type": types, "tokenizer.ggml.merges": merges})
    for key, field in (("bos_token", "tokenizer.ggml.bos_token_id"), ("eos_token", "tokenizer.ggml.eos_token_id"),
                       ("pad_token", "tokenizer.ggml.padding_token_id"), ("unk_token", "tokenizer.ggml.unknown_token_id")):
        i = _special_id(tc.get(key), vocab)
        if i is not None:
            out[field] = i
    if isinstance(tc.get("add_bos_token"), bool):
        out["tokenizer.ggml.add_bos_token"] = tc["add_bos_token"]
    return out
