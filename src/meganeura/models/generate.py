"""Autoregressive text generation with a key/value cache (Llama family).

Two compiled graphs (``llama.build_decoder``): one runs the whole prompt at once and fills
the cache, the other feeds one token per call. Shapes are static, so the cache has a fixed
capacity (prompt + new tokens, rounded up to ``CACHE_ROUND`` so nearby lengths share a
compiled decode graph) and the position enters as fed tables. The cache is device state
(``state_updates``) shared by the prefill and decode programs, which also share one copy
of the weights (``share_with``): nothing but ids and logits crosses to the host per token. Sampling runs on the host from
the fetched logits in transformers' order: repetition penalty, then temperature, top-k,
top-p, min-p (greedy when the temperature is 0).

Prompts of different lengths (a list of lists, or an array with an ``attention_mask``, as
transformers' left-padded batches) run one length group at a time: each row is generated
as it would be alone, which is what transformers' left padding with its attention mask and
position ids computes.
"""
from __future__ import annotations

import os

import numpy as np

from .. import api
from . import llama

CACHE_ROUND = 32


class LlamaGenerator:
    """Holds a model's weights and its compiled decoding sessions (reused across calls)."""

    def __init__(self, config, state: dict, backend: str = "gpu", precision: str = "strict", blocks=None):
        """``blocks``: weights kept quantized on the device, {transformers name: (raw GGUF
        bytes, type name)} (``nn.quantize_weights``); ``state`` holds the rest."""
        self.config, self.backend, self.precision = config, backend, precision
        self.state = state
        self.blocks = dict(blocks or {})
        self._model = None
        self.sessions: dict = {}

    @classmethod
    def from_pretrained(cls, path, backend="gpu", precision="strict", quantized=True):
        """From a Hugging Face folder or a GGUF file (``*.gguf``). A GGUF file's quantized
        matrices stay in their blocks on the device (``quantized=False``: dequantized to f32)."""
        from ..io import load_gguf, load_hf
        if not _is_gguf(path):
            cfg, state = load_hf(path)
            return cls(cfg, state, backend, precision)
        m = load_gguf(path, tokenizer=False)
        state, blocks = split_quantized(m) if quantized else (m.state, {})
        return cls(m.config, state, backend, precision, blocks)

    def model(self):
        """The module the graphs are built from: None (the builder's own) unless weights
        stay quantized."""
        if self.blocks and self._model is None:
            from .. import nn
            self._model = llama.LlamaForCausalLM(self.config)
            nn.quantize_weights(self._model, self.blocks)
        return self._model

    def session(self, batch: int, tokens: int, max_len: int):
        key = (batch, tokens, max_len)
        if key not in self.sessions:
            g, logits, cache = llama.build_decoder(self.config, batch, tokens, max_len, cache_as_state=True,
                                                   model=self.model())
            past = [g.states[n] for n in llama.cache_names(self.config)]
            # programs with the same cache shape share weights and cache on the device
            peer = next((s for (b, _, m), s in self.sessions.items() if (b, m) == (batch, max_len)), None)
            s = api.compile(g, outputs=[logits], state_updates=dict(zip(past, cache)), backend=self.backend,
                            precision=self.precision, share_with=peer)
            if peer is None:
                s.load_state_dict(llama.graph_state_dict(g, self.state), strict=True)
            self.sessions[key] = s
        return self.sessions[key]

    def forward(self, ids: np.ndarray, start: int, max_len: int):
        """Run ``ids`` (batch, tokens) at positions start.. against the device cache; returns
        the last token's logits."""
        b, t = ids.shape
        feeds = llama.decode_feeds(self.config, start, t, max_len)
        feeds["input_ids"] = ids
        return self.session(b, t, max_len).run(feeds)[0]

    def generate(self, prompt_ids, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=0,
                 stream=None, eos_token_id=None, stop_at_eos=True, repetition_penalty=None, min_p=None,
                 stop_strings=None, tokenizer=None, num_beams=1, attention_mask=None):
        """See ``generate``."""
        if num_beams != 1:
            raise NotImplementedError(f"generate: beam search (num_beams={num_beams}) is not supported; "
                                      "use num_beams=1 (greedy or sampling)")
        if stop_strings is not None:
            if tokenizer is None:
                raise ValueError("generate: stop_strings needs tokenizer= (to decode the new tokens)")
            stop_strings = [stop_strings] if isinstance(stop_strings, str) else list(stop_strings)
        opts = dict(temperature=temperature, top_k=top_k, top_p=top_p, seed=seed, eos_token_id=eos_token_id,
                    stop_at_eos=stop_at_eos, repetition_penalty=repetition_penalty, min_p=min_p,
                    stop_strings=stop_strings, tokenizer=tokenizer)
        rows = _prompt_rows(prompt_ids, attention_mask)
        if rows is None:
            return self._generate(prompt_ids, max_new_tokens, stream=stream, **opts)
        if stream is not None:
            raise ValueError("generate: stream= needs prompts of one length (these differ: "
                             f"{sorted({len(r) for r in rows})})")
        # rows of different lengths: each length group on its own, results in the rows' order
        out = [None] * len(rows)
        for length in sorted({len(r) for r in rows}):
            idx = [i for i, r in enumerate(rows) if len(r) == length]
            got = self._generate(np.array([rows[i] for i in idx]), max_new_tokens, **opts)
            for i, g in zip(idx, got):
                out[i] = g
        width = max(len(o) for o in out)
        return [o + o[-1:] * (width - len(o)) for o in out]    # a finished row repeats its stop token

    def _generate(self, prompt_ids, max_new_tokens, temperature=0.0, top_k=None, top_p=None, seed=0,
                  stream=None, eos_token_id=None, stop_at_eos=True, repetition_penalty=None, min_p=None,
                  stop_strings=None, tokenizer=None):
        cfg = self.config
        one = np.ndim(prompt_ids) == 1
        ids = np.atleast_2d(np.asarray(prompt_ids, dtype=np.int64))
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError("generate: prompt_ids must be a non-empty list of ids or a (batch, length) array")
        if ids.min() < 0 or ids.max() >= cfg.vocab_size:
            raise ValueError(f"generate: prompt ids must lie in [0, {cfg.vocab_size})")
        b, p = ids.shape
        if max_new_tokens <= 0:
            return [] if one else [[] for _ in range(b)]
        eos = cfg.eos_token_id if eos_token_id is None else eos_token_id
        eos = set() if (eos is None or not stop_at_eos) else set(np.atleast_1d(eos).tolist())
        max_len = -(-(p + max_new_tokens) // CACHE_ROUND) * CACHE_ROUND
        rng = np.random.default_rng(seed)
        # slots past a token's position are masked out, so stale cache contents never matter
        logits = self.forward(ids.astype(np.int32), 0, max_len)
        out, done, pos = [], np.zeros(b, bool), p
        while True:
            if repetition_penalty is not None:
                seen = np.concatenate([ids] + [o[:, None] for o in out], 1)
                logits = penalize_repetition(logits, seen, repetition_penalty)
            nxt = sample(logits, temperature, top_k, top_p, rng, min_p=min_p)
            if done.any():     # finished rows repeat their stop token, like padding
                nxt = np.where(done, out[-1], nxt)
            out.append(nxt)
            if stream is not None:
                stream(int(nxt[0]) if one else nxt.tolist())
            done |= np.isin(nxt, list(eos))
            if stop_strings:
                new = np.stack(out, 1)
                done |= [any(st in tokenizer.decode(row.tolist()) for st in stop_strings) for row in new]
            if len(out) == max_new_tokens or done.all():
                break
            logits = self.forward(nxt[:, None].astype(np.int32), pos, max_len)
            pos += 1
        res = np.stack(out, 1).tolist()
        return res[0] if one else res


def _prompt_rows(prompt_ids, attention_mask):
    """The prompts as lists of ids when they differ in length (a ragged list, or padding
    that ``attention_mask`` marks with 0), else None (one rectangular batch)."""
    if attention_mask is not None:
        ids, mask = np.asarray(prompt_ids), np.asarray(attention_mask)
        if ids.ndim == 1:
            ids, mask = ids[None], mask[None]
        if mask.shape != ids.shape:
            raise ValueError(f"generate: attention_mask has shape {mask.shape}, prompt_ids {ids.shape}")
        if mask.all():
            return None
        rows = [[int(t) for t, m in zip(r, mr) if m] for r, mr in zip(ids, mask)]
    elif isinstance(prompt_ids, (list, tuple)) and prompt_ids and all(np.ndim(r) == 1 for r in prompt_ids):
        rows = [list(np.asarray(r).tolist()) for r in prompt_ids]
        if len({len(r) for r in rows}) == 1:
            return None
    else:
        return None
    empty = [i for i, r in enumerate(rows) if not r]
    if empty:
        raise ValueError(f"generate: prompt row(s) {empty} have no tokens")
    return rows


def penalize_repetition(logits, seen, penalty):
    """transformers' repetition penalty: the logit of every token already in the row (prompt
    or generated) divided by ``penalty`` where positive, multiplied where negative."""
    if not penalty > 0:
        raise ValueError(f"generate: repetition_penalty must be > 0, got {penalty!r}")
    logits = np.array(logits, np.float64)
    rows = np.arange(logits.shape[0])[:, None]
    picked = logits[rows, seen]
    logits[rows, seen] = np.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def sample(logits, temperature=0.0, top_k=None, top_p=None, rng=None, min_p=None):
    """Next token per row of ``logits`` (batch, vocab): argmax when temperature is 0/None,
    else softmax(logits / temperature) restricted to the top-k, then to the smallest set
    of tokens whose probability reaches top_p, then to those at least ``min_p`` times as
    probable as the most probable one."""
    logits = np.asarray(logits, np.float64)
    if not temperature:
        return np.argmax(logits, -1)
    z = logits / float(temperature)
    if top_k is not None and 0 < top_k < z.shape[-1]:
        kth = np.sort(z, -1)[:, -top_k][:, None]
        z = np.where(z < kth, -np.inf, z)
    if top_p is not None and top_p < 1.0:
        order = np.argsort(-z, -1, kind="stable")
        zs = np.take_along_axis(z, order, -1)
        ps = np.exp(zs - zs[:, :1])
        ps /= ps.sum(-1, keepdims=True)
        before = np.cumsum(ps, -1) - ps          # mass of the tokens ranked above
        drop_sorted = before >= top_p            # the top token is always kept
        drop = np.zeros_like(drop_sorted)
        np.put_along_axis(drop, order, drop_sorted, -1)
        z = np.where(drop, -np.inf, z)
    if min_p is not None and min_p > 0:
        rel = np.exp(z - z.max(-1, keepdims=True))      # probability over the most probable's
        z = np.where(rel < min_p, -np.inf, z)
    pr = np.exp(z - z.max(-1, keepdims=True))
    pr /= pr.sum(-1, keepdims=True)
    rng = rng if rng is not None else np.random.default_rng()
    return np.array([rng.choice(pr.shape[-1], p=row) for row in pr])


def split_quantized(gguf_model):
    """(f32 state, blocks) of a loaded GGUF file (``load_gguf``): ``blocks`` {name: (raw
    bytes, type)} holds the matrices of a type with quantized kernels (``ops.quantized``),
    the state everything else (a type without kernels is dequantized to f32 as loaded)."""
    from ..ops.quantized import QTYPES
    blocks = {n: (gguf_model.tensors[n], t) for n, t in gguf_model.quant_types.items() if t in QTYPES}
    return {n: v for n, v in gguf_model.state.items() if n not in blocks}, blocks


def _generator(model, backend):
    if isinstance(model, LlamaGenerator):
        return model
    if isinstance(model, (str, os.PathLike)):
        return LlamaGenerator.from_pretrained(model, backend)
    if isinstance(model, tuple) and len(model) == 2:
        return LlamaGenerator(model[0], model[1], backend)
    raise TypeError("model must be a folder path, a (config, state dict) pair or a LlamaGenerator, "
                    f"got {type(model).__name__}")


def generate(model_dir_or_weights, prompt_ids, max_new_tokens, temperature=0.0, top_k=None, top_p=None,
             seed=0, backend="gpu", stream=None, eos_token_id=None, stop_at_eos=True, **options):
    """Generate up to ``max_new_tokens`` tokens after ``prompt_ids``.

    ``model_dir_or_weights``: a Hugging Face folder, a GGUF file, a (LlamaConfig, state dict) pair, or a
    LlamaGenerator (keeps its compiled graphs between calls). ``prompt_ids``: a list of
    ids, or a (batch, length) array. ``temperature`` 0 is greedy; ``stream(token)`` is
    called with each new token (a list per row for batched prompts). Generation stops after
    ``eos_token_id`` (default: the config's) unless ``stop_at_eos`` is False. Returns the
    new tokens only (including the stop token), a list (or a list of lists).

    ``options``, as transformers' generate: ``repetition_penalty``, ``min_p``,
    ``stop_strings`` with ``tokenizer`` (stop a row once its new text contains one),
    ``attention_mask`` (0 marks padding of rows of different lengths; a list of lists of
    different lengths needs none), ``num_beams`` (1 only: beam search is refused)."""
    unknown = sorted(set(options) - {"repetition_penalty", "min_p", "stop_strings", "tokenizer", "num_beams",
                                     "attention_mask"})
    if unknown:
        raise TypeError(f"generate: unknown option(s) {unknown}; it takes temperature, top_k, top_p, seed, "
                        "eos_token_id, stop_at_eos, repetition_penalty, min_p, stop_strings (with tokenizer), "
                        "num_beams (1) and attention_mask")
    gen = _generator(model_dir_or_weights, backend)
    return gen.generate(prompt_ids, max_new_tokens, temperature, top_k, top_p, seed, stream,
                        eos_token_id, stop_at_eos, **options)


def _is_gguf(path):
    return isinstance(path, (str, os.PathLike)) and os.fspath(path).endswith(".gguf") and not os.path.isdir(path)


def load_tokenizer(model_dir):
    """The tokenizer of a Hugging Face folder (tokenizer.json) or of a GGUF file."""
    if _is_gguf(model_dir):
        from ..gguf_io import read_gguf
        from ..gguf_tokenizer import tokenizer_from_metadata
        f = read_gguf(model_dir)
        tok = tokenizer_from_metadata(f.path, f.metadata)
        if tok is None:
            raise FileNotFoundError(f"{model_dir}: the GGUF file holds no tokenizer")
        return tok
    from tokenizers import Tokenizer
    path = os.path.join(os.fspath(model_dir), "tokenizer.json")
    if not os.path.exists(path):
        raise FileNotFoundError(f"{model_dir}: no tokenizer.json")
    return Tokenizer.from_file(path)


def generate_text(model_dir, prompt, max_new_tokens=64, temperature=0.0, top_k=None, top_p=None, seed=0,
                  backend="gpu", stream=None, model=None, **options):
    """Generate text after ``prompt`` with the folder's tokenizer.json (or the GGUF file's
    tokenizer, where ``model_dir`` is a ``.gguf`` file). ``stream(text)``
    (e.g. ``lambda s: print(s, end="", flush=True)``) gets each new piece of text as soon
    as it decodes to whole characters. ``model``: a LlamaGenerator to reuse instead of
    loading ``model_dir``'s weights. ``options``: as ``generate``'s (``stop_strings`` uses the
    folder's tokenizer). Returns the generated text (without the prompt)."""
    tok = load_tokenizer(model_dir)
    if options.get("stop_strings") is not None:
        options.setdefault("tokenizer", tok)
    ids = tok.encode(prompt).ids
    if not ids:
        raise ValueError("generate_text: the prompt encodes to no tokens")
    new, shown = [], [""]

    def on_token(t):
        new.append(t)
        text = tok.decode(new)
        if (stream is not None and not text.endswith("\ufffd") and len(text) > len(shown[0])
                and text.startswith(shown[0])):
            # decode the whole suffix each time: tokens can split characters and spaces
            stream(text[len(shown[0]):])
            shown[0] = text

    generate(model if model is not None else model_dir, ids, max_new_tokens, temperature, top_k, top_p, seed,
             backend, on_token, **options)
    text = tok.decode(new)
    if stream is not None and len(text) > len(shown[0]) and text.startswith(shown[0]):
        stream(text[len(shown[0]):])
    return text
