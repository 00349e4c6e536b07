"""Batched decoding of Llama-family models with continuous batching.

``SlotCache`` keeps one key/value cache of ``slots`` rows of ``max_len`` positions on the
device, shared (``share_with``) by two compiled programs of ``llama.LlamaForCausalLM``'s
decoding path: a prefill program that feeds ``chunk`` tokens per row and a decode program
that feeds one. Every row has its own positions: the RoPE tables, the additive attention
mask and the one-hot cache write are fed per row, so prompts of different lengths share a
call, and a row that takes no part in a call (a free slot, a request still waiting) writes
nothing (its write column is zero) and reads only slot 0 (its output is dropped). A
prompt longer than ``chunk`` is fed in several calls, its first chunk left-padded so that
the last call ends with its last token (the programs return the last column's logits).
By default a joining request is prefilled alone, by a one-row program that reads and
writes the slot a fed one-hot selects (a join then costs ``chunk`` tokens of compute, not
``slots * chunk``).

``BatchDecoder`` schedules requests over the slots: between two decode steps finished
requests leave and waiting ones join. Each request has
its own ``SamplingParams`` and random generator, and samples with ``models.generate``'s
``sample`` / ``penalize_repetition`` exactly as ``generate`` does for one prompt alone, so a
request's tokens do not depend on what else is in the batch. ``Engine`` runs a decoder in a
background thread for many callers (the HTTP server's).
"""
from __future__ import annotations

import collections
import itertools
import threading
from dataclasses import dataclass

import numpy as np

from .. import api, ops
from ..graph import Graph, i32
from ..models import llama
from ..models.generate import penalize_repetition, sample


class ContextLengthError(ValueError):
    """A request whose prompt and ``max_tokens`` do not fit a slot."""


# ------------------------------------------------------------------------ the graphs
def build_slot_decoder(cfg, slots: int, tokens: int, max_len: int, one_row: bool = False, model=None):
    """``tokens`` new tokens per row against a device cache of ``slots`` rows (``g.state``
    tensors ``past.{i}.key/value`` of shape (slots, kv_heads, max_len, head_dim)). Fed, with
    R = slots rows: input_ids (R, tokens) i32; rope_cos, rope_sin (R, 1, tokens, head_dim);
    attn_mask (R, 1, tokens, max_len) additive; cache_write (R, 1, max_len, tokens) one-hot.
    ``one_row``: R = 1, and slot_select (slots, 1, 1, 1), one-hot, names the slot that row
    reads and writes (the others are kept as they are). Returns (graph, last column's
    logits (R, vocab), new caches). ``model``: the module to build from (e.g. one whose
    weights ``nn.quantize_weights`` made quantized), else a fresh ``LlamaForCausalLM``."""
    g = Graph()
    hd, nkv = cfg.head_dim, cfg.num_key_value_heads
    rows = 1 if one_row else slots
    ids = g.input("input_ids", (rows, tokens), i32)
    cos = g.input("rope_cos", (rows, 1, tokens, hd))
    sin = g.input("rope_sin", (rows, 1, tokens, hd))
    mask = g.input("attn_mask", (rows, 1, tokens, max_len))
    write = g.input("cache_write", (rows, 1, max_len, tokens))
    past = [g.state(n, (slots, nkv, max_len, hd)) for n in llama.cache_names(cfg)]
    own = past
    if one_row:
        select = g.input("slot_select", (slots, 1, 1, 1))
        own = [ops.sum(p * select, 0, keepdim=True) for p in past]      # the selected slot's cache
    keep = 1.0 - ops.sum(write, -1, keepdim=True)          # (R, 1, max_len, 1)
    step = llama.DecodeStep(tokens, cos, sin, mask, write, keep)
    logits, new_cache = (model if model is not None else llama.LlamaForCausalLM(cfg))(ids, step, own)
    if one_row:
        new_cache = [p * (1.0 - select) + select * n for p, n in zip(past, new_cache)]
    return g, logits, new_cache


def slot_feeds(cfg, ids: np.ndarray, pos: np.ndarray, max_len: int) -> dict:
    """Feeds of ``build_slot_decoder`` for token ``ids`` (slots, tokens) at positions ``pos``
    (same shape; -1 marks padding: not written, attends slot 0 only)."""
    b, t = ids.shape
    real = pos >= 0
    cos, sin = llama.rope_tables(np.maximum(pos, 0).ravel(), cfg.head_dim, cfg.rope_theta)
    slots = np.arange(max_len)
    allowed = np.where(real[..., None], slots <= pos[..., None], slots == 0)        # (b, t, max_len)
    mask = np.where(allowed, 0.0, llama.NEG_INF).astype(np.float32)
    write = (real[:, None, :] & (slots[None, :, None] == pos[:, None, :])).astype(np.float32)
    return {"input_ids": ids.astype(np.int32), "rope_cos": cos.reshape(b, 1, t, -1),
            "rope_sin": sin.reshape(b, 1, t, -1), "attn_mask": mask[:, None], "cache_write": write[:, None]}


class SlotCache:
    """The model's weights and a cache of ``slots`` rows of ``max_len`` positions on the
    device, with a ``chunk``-token prefill program and a one-token decode program.
    ``prefill_rows``: "one" prefills one request per call (its slot selected by a fed
    one-hot, so a join computes ``chunk`` tokens, not ``slots * chunk``), "all" feeds every
    joining request in one call of all the slots."""

    def __init__(self, config, state: dict, slots: int = 4, max_len: int = 256, chunk: int = 16,
                 backend: str = "gpu", precision: str = "strict", prefill_rows: str = "one", blocks=None):
        if prefill_rows not in ("one", "all"):
            raise ValueError(f"SlotCache: prefill_rows must be 'one' or 'all', got {prefill_rows!r}")
        for name, v in (("slots", slots), ("max_len", max_len), ("chunk", chunk)):
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"SlotCache: {name} must be a positive integer, got {v!r}")
        if max_len > config.max_position_embeddings:
            raise ValueError(f"SlotCache: max_len {max_len} exceeds the model's max_position_embeddings "
                             f"({config.max_position_embeddings})")
        self.config, self.slots, self.max_len, self.chunk = config, slots, max_len, min(chunk, max_len)
        self.backend, self.one_row = backend, prefill_rows == "one" and slots > 1
        self.sessions = {}
        model, self.quantized = None, sorted(blocks or {})
        if blocks:                   # GGUF blocks kept quantized on the device (generate.split_quantized)
            from .. import nn
            model = llama.LlamaForCausalLM(config)
            nn.quantize_weights(model, blocks)
        for key in ((1, False), (self.chunk, self.one_row)):
            if key in self.sessions:
                continue
            g, logits, cache = build_slot_decoder(config, slots, key[0], max_len, one_row=key[1], model=model)
            past = [g.states[n] for n in llama.cache_names(config)]
            peer = next(iter(self.sessions.values()), None)
            s = api.compile(g, outputs=[logits], state_updates=dict(zip(past, cache)), backend=backend,
                            precision=precision, share_with=peer)
            if peer is None:
                s.load_state_dict(llama.graph_state_dict(g, state), strict=True)
                self.parameters = sum(int(np.prod(t.shape)) for t in g.parameters.values())
            self.sessions[key] = s

    @classmethod
    def from_generator(cls, gen, slots: int = 4, max_len: int = 256, chunk: int = 16, prefill_rows: str = "one"):
        """A slot cache for a ``models.generate.LlamaGenerator``'s model, backend and precision."""
        return cls(gen.config, gen.state, slots, max_len, chunk, gen.backend, gen.precision, prefill_rows)

    @property
    def cache_bytes(self) -> int:
        c = self.config
        return 4 * 2 * c.num_hidden_layers * self.slots * c.num_key_value_heads * self.max_len * c.head_dim

    def _run(self, key, ids, pos, slot=None):
        feeds = slot_feeds(self.config, ids, pos, self.max_len)
        if slot is not None:
            feeds["slot_select"] = (np.arange(self.slots) == slot).astype(np.float32).reshape(-1, 1, 1, 1)
        return self.sessions[key].run(feeds)[0]

    def prefill(self, prompts: dict) -> dict:
        """Write each ``{slot: prompt ids}`` at positions 0.. of its slot (what the slot held
        before is ignored from then on); returns ``{slot: logits after the last token}``."""
        for slot, p in prompts.items():
            if not 0 < len(p) <= self.max_len:
                raise ContextLengthError(f"prefill: slot {slot}: a prompt of {len(p)} tokens does not fit "
                                         f"a slot of {self.max_len} positions")
        if self.one_row:
            return {slot: self._prefill({0: p}, slot)[0] for slot, p in prompts.items()}
        return self._prefill(prompts)

    def _prefill(self, prompts: dict, slot=None) -> dict:
        """``prompts`` by row, in as many calls as the longest needs, each row's first chunk
        left-padded so that every row ends in the last call."""
        t = self.chunk
        b = 1 if slot is not None else self.slots
        calls = {r: -(-len(p) // t) for r, p in prompts.items()}
        n = max(calls.values())
        for call in range(n):
            ids, pos = np.zeros((b, t), np.int64), np.full((b, t), -1, np.int64)
            for r, p in prompts.items():
                k = call - (n - calls[r])             # this row's chunk index (its last is the last call)
                if k < 0:
                    continue
                end = len(p) - (calls[r] - 1 - k) * t
                start = max(end - t, 0)
                ids[r, t - (end - start):] = p[start:end]
                pos[r, t - (end - start):] = np.arange(start, end)
            logits = self._run((t, slot is not None), ids, pos, slot)
        return {r: logits[r] for r in prompts}

    def decode(self, rows: dict) -> dict:
        """One token per ``{slot: (token, position)}``; returns ``{slot: logits}``."""
        ids, pos = np.zeros((self.slots, 1), np.int64), np.full((self.slots, 1), -1, np.int64)
        for slot, (tok, p) in rows.items():
            if not 0 <= p < self.max_len:
                raise ContextLengthError(f"decode: slot {slot}: position {p} is outside a slot of "
                                         f"{self.max_len} positions")
            ids[slot, 0], pos[slot, 0] = tok, p
        logits = self._run((1, False), ids, pos)
        return {slot: logits[slot] for slot in rows}

    def close(self):
        for s in self.sessions.values():
            s.close()


# ------------------------------------------------------------------------ requests
@dataclass
class SamplingParams:
    """Per-request options, as ``models.generate.generate`` takes them: ``temperature`` 0 is
    greedy; ``stop``: strings that end the request (its text stops before the first one;
    needs the decoder's tokenizer); ``eos_token_id`` None: the model config's."""
    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop: tuple = ()
    seed: int = 0
    eos_token_id: object = None
    stop_at_eos: bool = True

    def __post_init__(self):
        self.stop = (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())
        num = (int, float)
        bad = [("max_tokens", self.max_tokens, "an integer >= 1",
                isinstance(self.max_tokens, int) and not isinstance(self.max_tokens, bool) and self.max_tokens >= 1),
               ("temperature", self.temperature, "a number >= 0", isinstance(self.temperature, num)
                and self.temperature >= 0),
               ("top_k", self.top_k, "an integer >= 0", self.top_k is None or isinstance(self.top_k, int)
                and self.top_k >= 0),
               ("top_p", self.top_p, "a number in (0, 1]", self.top_p is None or isinstance(self.top_p, num)
                and 0 < self.top_p <= 1),
               ("min_p", self.min_p, "a number in [0, 1]", self.min_p is None or isinstance(self.min_p, num)
                and 0 <= self.min_p <= 1),
               ("repetition_penalty", self.repetition_penalty, "a number > 0", self.repetition_penalty is None
                or isinstance(self.repetition_penalty, num) and self.repetition_penalty > 0),
               ("stop", self.stop, "non-empty strings", all(isinstance(s, str) and s for s in self.stop)),
               ("seed", self.seed, "an integer", isinstance(self.seed, int))]
        for name, value, want, ok in bad:
            if not ok:
                raise ValueError(f"SamplingParams: {name} must be {want}, got {value!r}")


class Request:
    """One prompt being generated. ``tokens``: the new ids so far (a stop token included);
    ``text``: their text (without the eos token, cut before a stop string) once the decoder
    has a tokenizer; ``finish_reason``: None while running, then "stop" (eos or a stop
    string), "length" (``max_tokens``) or "cancelled"."""

    def __init__(self, rid, prompt, params, eos, on_update=None):
        self.id, self.prompt, self.params, self.on_update = rid, list(prompt), params, on_update
        self.eos = eos
        self.rng = np.random.default_rng(params.seed)
        self.tokens, self.text, self.sent = [], "", ""
        self.slot, self.pos, self.finish_reason, self.cancelled, self.error = None, 0, None, False, None
        self.finished = threading.Event()

    @property
    def done(self):
        return self.finish_reason is not None

    def wait(self, timeout=None):
        """Block until the request finishes; returns its tokens."""
        self.finished.wait(timeout)
        return self.tokens


class BatchDecoder:
    """Continuous batching over a ``SlotCache``: ``submit`` queues a request (from any
    thread), ``step`` admits waiting requests into free slots (one prefill for all of
    them), then feeds every running request one token (one decode call). ``tokenizer``
    (a ``tokenizers.Tokenizer``) gives requests their text and makes stop strings work."""

    def __init__(self, cache: SlotCache, tokenizer=None):
        self.cache, self.tokenizer = cache, tokenizer
        self.waiting: collections.deque = collections.deque()
        self.running: dict = {}                       # slot -> Request
        self.lock = threading.Lock()
        self._ids = itertools.count()
        self.steps = self.generated = self.cancelled = 0

    @property
    def active(self) -> int:
        """Requests holding a slot."""
        return len(self.running)

    def pending(self) -> int:
        """Requests submitted and not finished."""
        with self.lock:
            return len(self.running) + len(self.waiting)

    def check(self, n_prompt: int, params: SamplingParams):
        """Raise ContextLengthError unless a prompt of ``n_prompt`` tokens and ``max_tokens``
        new ones fit a slot."""
        if n_prompt < 1:
            raise ValueError("the prompt has no tokens")
        if n_prompt + params.max_tokens > self.cache.max_len:
            raise ContextLengthError(f"a prompt of {n_prompt} tokens plus max_tokens {params.max_tokens} needs "
                                     f"{n_prompt + params.max_tokens} positions; a slot has {self.cache.max_len}")

    def submit(self, prompt_ids, params: SamplingParams | None = None, on_update=None) -> Request:
        """Queue ``prompt_ids``; ``on_update(request, new_tokens, new_text)`` is called by the
        stepping thread after each new token and once more when it finishes."""
        params = params or SamplingParams()
        prompt = [int(t) for t in prompt_ids]
        vocab = self.cache.config.vocab_size
        if any(not 0 <= t < vocab for t in prompt):
            raise ValueError(f"submit: prompt ids must lie in [0, {vocab})")
        self.check(len(prompt), params)
        if params.stop and self.tokenizer is None:
            raise ValueError("submit: stop strings need the decoder's tokenizer")
        eos = self.cache.config.eos_token_id if params.eos_token_id is None else params.eos_token_id
        eos = set() if eos is None or not params.stop_at_eos else set(np.atleast_1d(eos).tolist())
        req = Request(next(self._ids), prompt, params, eos, on_update)
        with self.lock:
            self.waiting.append(req)
        return req

    def cancel(self, req: Request):
        """Stop ``req`` at the next step (its slot is freed there)."""
        req.cancelled = True

    def cancel_all(self):
        with self.lock:
            for r in list(self.waiting) + list(self.running.values()):
                r.cancelled = True

    # ------------------------------------------------------------------ stepping
    def step(self) -> bool:
        """One scheduling step; returns whether there was anything to do."""
        with self.lock:
            gone = [r for r in self.waiting if r.cancelled] + [r for r in self.running.values() if r.cancelled]
            for r in gone:
                if r in self.waiting:
                    self.waiting.remove(r)
                self._finish(r, "cancelled")
            free = [s for s in range(self.cache.slots) if s not in self.running]
            joining = []
            while free and self.waiting:
                r = self.waiting.popleft()
                r.slot = free.pop(0)
                self.running[r.slot] = r
                joining.append(r)
        for r in gone:
            self._tell(r, [], "")
        if not self.running:
            return False
        if joining:
            logits = self.cache.prefill({r.slot: r.prompt for r in joining})
            for r in joining:
                r.pos = len(r.prompt)
                self._advance(r, logits[r.slot])
        rows = [r for r in self.running.values() if not r.done]
        if rows:
            logits = self.cache.decode({r.slot: (r.tokens[-1], r.pos) for r in rows})
            for r in rows:
                r.pos += 1
                self._advance(r, logits[r.slot])
        self.steps += 1
        return True

    def _advance(self, r: Request, logits):
        p = r.params
        lg = logits[None]
        if p.repetition_penalty is not None:
            lg = penalize_repetition(lg, np.array([r.prompt + r.tokens]), p.repetition_penalty)
        tok = int(sample(lg, p.temperature, p.top_k, p.top_p, r.rng, min_p=p.min_p)[0])
        r.tokens.append(tok)
        self.generated += 1
        reason = "stop" if tok in r.eos else None
        delta = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(r.tokens[:-1] if reason else r.tokens)
            hits = [text.find(s) for s in p.stop if s in text]
            if hits:
                text, reason = text[:min(hits)], "stop"
            if reason is None and len(r.tokens) >= p.max_tokens:
                reason = "length"
            r.text = text
            delta = self._safe_delta(r, text, final=reason is not None)
        elif reason is None and len(r.tokens) >= p.max_tokens:
            reason = "length"
        if reason is not None:
            with self.lock:
                self._finish(r, reason)
        self._tell(r, [tok], delta)

    @staticmethod
    def _tell(r: Request, tokens, delta):
        if r.on_update is not None:
            r.on_update(r, tokens, delta)

    def _safe_delta(self, r: Request, text: str, final: bool) -> str:
        """The text newly safe to show: not ending inside a character (U+FFFD of a split
        byte sequence) nor in what could be the start of a stop string."""
        safe = text
        if not final:
            safe = safe.rstrip("\ufffd")
            for s in r.params.stop:
                for k in range(min(len(s) - 1, len(safe)), 0, -1):
                    if safe.endswith(s[:k]):
                        safe = safe[:-k]
                        break
        if not safe.startswith(r.sent) or len(safe) <= len(r.sent):
            return ""
        delta, r.sent = safe[len(r.sent):], safe
        return delta

    def _finish(self, r: Request, reason: str):
        """(holding the lock) mark ``r`` finished and free its slot."""
        r.finish_reason = reason
        self.cancelled += reason == "cancelled"
        if r.slot is not None and self.running.get(r.slot) is r:
            del self.running[r.slot]
        r.finished.set()

    def generate(self, prompts, params=None) -> list:
        """Generate every prompt (a list of id lists) batched; ``params``: one
        SamplingParams or one per prompt. Returns each prompt's new tokens."""
        params = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        reqs = [self.submit(p, q) for p, q in zip(prompts, params)]
        while self.step():
            pass
        return [r.tokens for r in reqs]


# ------------------------------------------------------------------------ the thread
class Engine:
    """Steps a ``BatchDecoder`` in a background thread while requests are pending.
    ``pause``/``resume`` hold stepping (requests queue meanwhile); ``stop`` cancels what is
    left and joins the thread."""

    def __init__(self, decoder: BatchDecoder):
        self.decoder = decoder
        self._wake = threading.Condition()
        self._stop = False
        self._paused = False
        self.error = None
        self.thread = threading.Thread(target=self._loop, name="meganeura-engine", daemon=True)

    def start(self):
        self.thread.start()
        return self

    def submit(self, prompt_ids, params=None, on_update=None) -> Request:
        if self._stop:
            raise RuntimeError("the engine is stopped")
        req = self.decoder.submit(prompt_ids, params, on_update)
        self.notify()
        return req

    def cancel(self, req):
        self.decoder.cancel(req)
        self.notify()

    def notify(self):
        with self._wake:
            self._wake.notify()

    def pause(self):
        with self._wake:
            self._paused = True

    def resume(self):
        with self._wake:
            self._paused = False
            self._wake.notify()

    def _loop(self):
        d = self.decoder
        while True:
            with self._wake:
                while not self._stop and (self._paused or not d.pending()):
                    self._wake.wait()
                if self._stop:
                    break
            try:
                d.step()
            except Exception as e:    # noqa: BLE001 -- fail every pending request, keep serving
                self.error = e
                with d.lock:
                    failed = list(d.waiting) + list(d.running.values())
                    d.waiting.clear()
                    for r in failed:
                        r.error = e
                        d._finish(r, "error")
                for r in failed:
                    d._tell(r, [], "")
        d.cancel_all()
        d.step()                              # cancelled requests leave and are told

    def stop(self, timeout=30.0):
        with self._wake:
            self._stop = True
            self._paused = False
            self._wake.notify()
        if self.thread.is_alive():
            self.thread.join(timeout)
