"""Llama-family causal language models (Llama 2/3, SmolLM2, TinyLlama, Qwen2, Gemma ...).

Qwen2 and Gemma are Llama with three switches of ``LlamaConfig``: ``qkv_bias`` (Qwen2's
biased q/k/v projections), ``hidden_act`` ("gelu_pytorch_tanh": Gemma's GeGLU MLP) and
``gemma_norm`` (Gemma: RMSNorm scales by ``1 + weight`` and the embeddings are multiplied by
sqrt(hidden_size)). ``from_hf_dict`` sets them from a qwen2 or gemma config.json.

Parameter names are those of transformers' ``LlamaForCausalLM.state_dict()``, so a Hugging
Face checkpoint loads unchanged. With tied embeddings the head reuses
``model.embed_tokens.weight`` and the graph has no ``lm_head.weight``: transformers'
state_dict still lists that key (it aliases the embedding), so pass state dicts through
``graph_state_dict`` (or drop the key) before ``load_state_dict``.

Three graphs:
  * ``build_causal_lm``: logits for a whole sequence (inference, evaluation);
  * ``build_training``: the same plus the token cross-entropy, shifted as transformers does;
  * ``build_decoder``: ``tokens`` new tokens against a key/value cache of ``max_len``
    positions (prompt prefill with tokens = prompt length, then decoding with tokens = 1).
    Shapes are static, so one compiled graph serves every position: the position enters
    through fed inputs (RoPE cos/sin, an additive attention mask, a one-hot write matrix),
    never through a graph attribute. See ``decode_feeds``.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import numpy as np

from .. import nn, ops
from ..graph import Graph, Tensor, i32

NEG_INF = float("-inf")
# hidden_act -> the MLP's gate activation
ACTIVATIONS = {"silu": ops.silu, "gelu_pytorch_tanh": lambda x: ops.gelu(x, approximate="tanh")}
# model_type -> transformers' class (config.json "architectures")
HF_CLASSES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "gemma": "GemmaForCausalLM"}


@dataclass
class LlamaConfig:
    """The fields of transformers' LlamaConfig that shape the computation."""
    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 11008
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int | None = None
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 2048
    head_dim: int | None = None
    bos_token_id: int | None = 1
    eos_token_id: int | list | None = 2
    qkv_bias: bool = False
    hidden_act: str = "silu"
    gemma_norm: bool = False
    model_type: str = "llama"

    def __post_init__(self):
        if self.hidden_act not in ACTIVATIONS:
            raise NotImplementedError(f"LlamaConfig: hidden_act {self.hidden_act!r} is not supported; "
                                      f"supported: {sorted(ACTIVATIONS)}")
        if self.model_type not in HF_CLASSES:
            raise NotImplementedError(f"LlamaConfig: model_type {self.model_type!r} is not supported; "
                                      f"supported: {sorted(HF_CLASSES)}")
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        for name in ("rms_norm_eps", "rope_theta"):         # 0, negative, NaN or inf: NaN logits
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                raise ValueError(f"LlamaConfig: {name} must be a positive finite number, got {v!r}")

    @classmethod
    def smollm2_135m(cls):
        """HuggingFaceTB/SmolLM2-135M."""
        return cls(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                   num_attention_heads=9, num_key_value_heads=3, rms_norm_eps=1e-5, rope_theta=100000.0,
                   tie_word_embeddings=True, max_position_embeddings=8192, bos_token_id=0, eos_token_id=0)

    @classmethod
    def tiny(cls):
        """2 layers, hidden 32, 4 query / 2 key-value heads, vocab 64: for tests."""
        return cls(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0,
                   tie_word_embeddings=False, max_position_embeddings=128)

    @classmethod
    def from_hf_dict(cls, d: dict):
        """From a config.json dict (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``)
        of a llama, qwen2 or gemma model."""
        mt = d.get("model_type", "llama")
        if mt not in HF_CLASSES:
            raise NotImplementedError(f"LlamaConfig: model_type {mt!r} is not supported; supported: {sorted(HF_CLASSES)}")
        act = d.get("hidden_act", "gelu_pytorch_tanh" if mt == "gemma" else "silu")
        if mt == "gemma" and act == "gelu":      # transformers reads Gemma's legacy "gelu" as the tanh form
            act = "gelu_pytorch_tanh"
        if act not in ACTIVATIONS:
            raise NotImplementedError(f"LlamaConfig: hidden_act {act!r} is not supported; supported: {sorted(ACTIVATIONS)}")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise NotImplementedError("LlamaConfig: attention_bias / mlp_bias are not supported")
        if d.get("use_sliding_window"):
            raise NotImplementedError("LlamaConfig: sliding-window attention (use_sliding_window) is not supported")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if kind != "default":
            raise NotImplementedError(f"LlamaConfig: rope type {kind!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        fields = {f.name for f in dataclasses.fields(cls)} - {"qkv_bias", "gemma_norm"}
        kw = {k: v for k, v in d.items() if k in fields}
        kw.update(rope_theta=float(theta), hidden_act=act, model_type=mt, qkv_bias=mt == "qwen2",
                  gemma_norm=mt == "gemma")
        if mt == "gemma":
            kw.setdefault("tie_word_embeddings", True)
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        """A config.json dict transformers' config class of ``model_type`` reads."""
        d = dataclasses.asdict(self)
        for k in ("qkv_bias", "gemma_norm"):     # implied by model_type
            del d[k]
        d["architectures"] = [HF_CLASSES[self.model_type]]
        return d


# ------------------------------------------------------------------------- pieces
def _heads(x, n, hd):
    """(b, s, n*hd) -> (b, n, s, hd)."""
    b, s, _ = x.shape
    return ops.transpose(ops.reshape(x, (b, s, n, hd)), 1, 2)


def _merge(x):
    """(b, n, s, hd) -> (b, s, n*hd)."""
    b, n, s, hd = x.shape
    return ops.reshape(ops.transpose(x, 1, 2), (b, s, n * hd))


def rope_fed(x, cos, sin):
    """Rotate-half RoPE with cos/sin tables given as tensors (seq, head_dim), each half
    repeated: x*cos + concat(-x2, x1)*sin. Used where the positions are only known at run
    time (decoding); ``ops.rope`` bakes them into the graph."""
    return x * cos + ops.rotate_half(x) * sin


def rope_tables(positions, head_dim, base):
    """cos and sin (len(positions), head_dim) in f32, computed in f64 as ``ops.rope`` does."""
    inv_freq = 1.0 / base ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    ang = np.outer(np.asarray(positions, dtype=np.float64), inv_freq)
    ang = np.concatenate([ang, ang], axis=1)
    return np.cos(ang).astype(np.float32), np.sin(ang).astype(np.float32)


@dataclass
class DecodeStep:
    """The fed position inputs of one decoding call (see ``build_decoder``), shared by every
    layer; ``keep`` (max_len, 1) marks the cache slots no new token writes."""
    tokens: int
    cos: Tensor
    sin: Tensor
    mask: Tensor
    write: Tensor
    keep: Tensor


# ------------------------------------------------------------------------- modules
class LlamaAttention(nn.Module):
    """Grouped-query self-attention; ``forward`` is causal over the whole sequence (RoPE
    baked in), ``decode`` attends new tokens against a key/value cache."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H, hd = cfg.hidden_size, cfg.head_dim
        self.nq, self.nkv, self.hd, self.theta = cfg.num_attention_heads, cfg.num_key_value_heads, hd, cfg.rope_theta
        self.q_proj = nn.Linear(H, self.nq * hd, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(H, self.nkv * hd, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(H, self.nkv * hd, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.nq * hd, H, bias=False)

    def _qkv(self, h):
        return (_heads(self.q_proj(h), self.nq, self.hd), _heads(self.k_proj(h), self.nkv, self.hd),
                _heads(self.v_proj(h), self.nkv, self.hd))

    def forward(self, h):
        q, k, v = self._qkv(h)
        q, k = ops.rope(q, self.theta), ops.rope(k, self.theta)
        return self.o_proj(_merge(ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)))

    def decode(self, h, step: DecodeStep, past_key, past_value):
        """(output, new key cache, new value cache). The cache update is a blend,
        cache * (1 - written) + cache_write @ k_new, so a slot is replaced exactly where a
        token is written. ``h`` is (batch, tokens, hidden), or (1, batch * tokens, hidden)
        for a batch of several rows (see ``LlamaForCausalLM.forward``)."""
        b, t = past_key.shape[0], step.tokens
        if h.shape[0] != b:        # rows stacked: one matmul per projection, then split per row
            q, k, v = (_heads(ops.reshape(p(h), (b, t, n * self.hd)), n, self.hd) for p, n in
                       ((self.q_proj, self.nq), (self.k_proj, self.nkv), (self.v_proj, self.nkv)))
        else:
            q, k, v = self._qkv(h)
        q, k = rope_fed(q, step.cos, step.sin), rope_fed(k, step.cos, step.sin)
        keep, write = step.keep, step.write
        if step.tokens == 1:   # one new row: a broadcast product, pointwise with the blend
            kc = past_key * keep + write * k                 # (batch, kv, max_len, hd)
            vc = past_value * keep + write * v
        else:
            kc = past_key * keep + ops.mm(write, k)
            vc = past_value * keep + ops.mm(write, v)
        out = _merge(ops.scaled_dot_product_attention(q, kc, vc, attn_mask=step.mask, enable_gqa=True))
        if h.shape[0] != b:
            out = ops.reshape(out, h.shape[:2] + (out.shape[-1],))
        return self.o_proj(out), kc, vc


class LlamaMLP(nn.Module):
    """SwiGLU, down(silu(gate(x)) * up(x)), or with Gemma's tanh GELU for silu (GeGLU)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        H, F = cfg.hidden_size, cfg.intermediate_size
        self.act = ACTIVATIONS[cfg.hidden_act]
        self.gate_proj = nn.Linear(H, F, bias=False)
        self.up_proj = nn.Linear(H, F, bias=False)
        self.down_proj = nn.Linear(F, H, bias=False)

    def forward(self, x):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class GemmaRMSNorm(nn.RMSNorm):
    """RMSNorm scaling by ``1 + weight`` (the weight starts at zero), as Gemma's."""

    def forward(self, x):
        return ops.rms_norm(x, self.normalized_shape, self.weight + 1.0, self.eps)


def _norm(cfg: LlamaConfig):
    return (GemmaRMSNorm if cfg.gemma_norm else nn.RMSNorm)(cfg.hidden_size, cfg.rms_norm_eps)


class LlamaDecoderLayer(nn.Module):
    """Pre-RMSNorm attention and MLP, each with a residual."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = _norm(cfg)
        self.post_attention_layernorm = _norm(cfg)

    def _mlp_block(self, x):
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward(self, x):
        return self._mlp_block(x + self.self_attn(self.input_layernorm(x)))

    def decode(self, x, step: DecodeStep, past_key, past_value):
        a, kc, vc = self.self_attn.decode(self.input_layernorm(x), step, past_key, past_value)
        return self._mlp_block(x + a), kc, vc


class LlamaModel(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers))
        self.norm = _norm(cfg)
        # Gemma scales the embeddings by sqrt(hidden), rounded to the f32 it computes in
        self.scale = float(np.float32(cfg.hidden_size ** 0.5)) if cfg.gemma_norm else None

    def embed(self, ids):
        x = self.embed_tokens(ids)
        return x if self.scale is None else x * self.scale

    def forward(self, ids):
        """Final-normed hidden states (b, s, H) of a full causal pass."""
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """transformers' LlamaForCausalLM: ``model`` and, unless tied to the embedding,
    ``lm_head``. Parameters are deferred (see ``nn.init.deferred``) with Hugging Face's
    initialisation rules: N(0, 0.02) for projections and the embedding, ones for norms."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.config = cfg
        with nn.init.deferred():
            self.model = LlamaModel(cfg)
            if not cfg.tie_word_embeddings:
                self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
            for m in self.modules():
                if isinstance(m, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(m._parameters["weight"], std=0.02)
                if isinstance(m, GemmaRMSNorm):
                    nn.init.zeros_(m._parameters["weight"])

    def head(self, h):
        if self.config.tie_word_embeddings:
            emb = self.model.embed_tokens
            if isinstance(emb, nn.QuantizedEmbedding):     # GGUF blocks (nn.quantize_weights)
                return emb.as_linear(h)
            return ops.linear(h, emb.weight)
        return self.lm_head(h)

    def forward(self, ids, step: DecodeStep | None = None, past=None):
        """Logits (b, s, vocab); with a decoding ``step`` and the ``past`` caches
        (``cache_names`` order), the last new token's logits (b, vocab) and the new caches."""
        if step is None:
            return self.head(self.model(ids))
        m, cfg = self.model, self.config
        batch, tokens = ids.shape
        # several rows: the hidden states stay (1, batch * tokens, hidden), so each weight
        # is one matmul over every row (a batched (batch, 1, hidden) product would read the
        # weights once per row); attention splits them per row
        flat = ops.reshape(ids, (1, batch * tokens)) if batch > 1 else ids
        x, new_cache = m.embed(flat), []
        for i, layer in enumerate(m.layers):
            x, kc, vc = layer.decode(x, step, past[2 * i], past[2 * i + 1])
            new_cache.extend([kc, vc])
        if batch > 1:
            x = ops.reshape(x, (batch, tokens, cfg.hidden_size))
        last = x if tokens == 1 else ops.slice(x, 1, tokens - 1, tokens)
        return self.head(m.norm(ops.reshape(last, (batch, cfg.hidden_size)))), new_cache


def _params(g: Graph, cfg: LlamaConfig) -> dict:
    """Add every parameter of ``LlamaForCausalLM(cfg)`` to ``g`` (transformers' names, no
    ops); ``mg.io`` lists a checkpoint's expected weights with it."""
    return {n: g.parameter(n, p.shape, init=p.graph_init()) for n, p in LlamaForCausalLM(cfg).named_parameters()}


# ------------------------------------------------------------------------- builders
def build_causal_lm(cfg: LlamaConfig, batch: int, seq: int, model: "LlamaForCausalLM | None" = None):
    """Full-sequence forward. Returns (graph, ids input (batch, seq) i32, logits (batch, seq, vocab)).
    ``model``: the module to build (one with quantized layers, ``nn.quantize_weights``); a new one by default."""
    g = Graph()
    ids = g.input("input_ids", (batch, seq), i32)
    return g, ids, (model if model is not None else LlamaForCausalLM(cfg))(ids)


def build_training(cfg: LlamaConfig, batch: int, seq: int, shift_labels: bool = True):
    """Forward + token cross-entropy. Returns (graph, ids, labels, loss) (the logits are
    the loss's input; build_causal_lm gives them as an output).

    ``labels`` (batch, seq) i32 are what transformers' LlamaForCausalLM takes: with
    ``shift_labels`` (default) position t is scored against labels[t + 1], the last position
    is dropped, and -100 marks ignored tokens; the loss is the mean over counted tokens, as
    transformers computes it. ``shift_labels=False``: labels already aligned with the
    logits (position t against labels[t])."""
    g = Graph()
    ids = g.input("input_ids", (batch, seq), i32)
    labels = g.input("labels", (batch, seq), i32)
    logits = LlamaForCausalLM(cfg)(ids)
    if shift_labels:
        # scoring labels[:, 1:] with an ignored last column keeps the logits whole (no slice copy)
        pad = g.constant(np.full((batch, 1), -100, np.int32))
        target = ops.concat([ops.slice(labels, 1, 1, None), pad], 1)
    else:
        target = labels
    loss = ops.cross_entropy(ops.reshape(logits, (batch * seq, cfg.vocab_size)),
                             ops.reshape(target, (batch * seq,)), ignore_index=-100)
    return g, ids, labels, loss


def cache_names(cfg: LlamaConfig):
    """Names of the per-layer cache inputs; the outputs of ``build_decoder`` follow this order."""
    return [f"past.{i}.{kv}" for i in range(cfg.num_hidden_layers) for kv in ("key", "value")]


def build_decoder(cfg: LlamaConfig, batch: int, tokens: int, max_len: int, cache_as_state: bool = False,
                  model: "LlamaForCausalLM | None" = None):
    """``tokens`` new tokens against a key/value cache of ``max_len`` positions.

    Inputs (see ``decode_feeds`` to make them):
      input_ids (batch, tokens) i32;
      rope_cos, rope_sin (tokens, head_dim): the RoPE tables at the tokens' positions;
      attn_mask (tokens, max_len): additive, 0 where token t may attend cache slot m (m <=
        its position), -inf elsewhere;
      cache_write (max_len, tokens): cache_write[m, t] = 1 if token t is stored in slot m;
      past.{i}.key / past.{i}.value (batch, kv_heads, max_len, head_dim): the cache.
    Returns (graph, logits of the last token (batch, vocab), new caches in ``cache_names``
    order). With ``cache_as_state`` the caches are ``g.state`` tensors (kept on the device;
    compile with ``state_updates`` mapping them to the new caches) instead of inputs. The
    cache update is ``LlamaAttention.decode``'s blend. ``model``: as ``build_causal_lm``'s."""
    g = Graph()
    hd, nkv = cfg.head_dim, cfg.num_key_value_heads
    ids = g.input("input_ids", (batch, tokens), i32)
    cos = g.input("rope_cos", (tokens, hd))
    sin = g.input("rope_sin", (tokens, hd))
    mask = g.input("attn_mask", (tokens, max_len))
    write = g.input("cache_write", (max_len, tokens))
    make = g.state if cache_as_state else g.input
    past = [make(n, (batch, nkv, max_len, hd)) for n in cache_names(cfg)]
    keep = 1.0 - ops.sum(write, 1, keepdim=True)             # (max_len, 1): slots not written
    step = DecodeStep(tokens, cos, sin, mask, write, keep)
    logits, new_cache = (model if model is not None else LlamaForCausalLM(cfg))(ids, step, past)
    return g, logits, new_cache



def decode_feeds(cfg: LlamaConfig, start: int, tokens: int, max_len: int) -> dict:
    """The position inputs of ``build_decoder`` for tokens at positions start .. start+tokens-1."""
    if start + tokens > max_len:
        raise ValueError(f"decode: positions up to {start + tokens - 1} do not fit a cache of {max_len}")
    pos = np.arange(start, start + tokens)
    cos, sin = rope_tables(pos, cfg.head_dim, cfg.rope_theta)
    slots = np.arange(max_len)
    mask = np.where(slots[None, :] <= pos[:, None], 0.0, NEG_INF).astype(np.float32)
    write = (slots[:, None] == pos[None, :]).astype(np.float32)
    return {"rope_cos": cos, "rope_sin": sin, "attn_mask": mask, "cache_write": write}


def graph_state_dict(graph: Graph, state: dict, strict: bool = True) -> dict:
    """The entries of a transformers state dict this graph has, as f32 arrays (drops the
    aliased ``lm_head.weight`` of tied models and RoPE buffers); with ``strict``, every
    parameter must be present."""
    out = {}
    for name in graph.parameters:
        if name in state:
            v = state[name]
            v = v.detach().cpu().float().numpy() if hasattr(v, "detach") else np.asarray(v, np.float32)
            out[name] = v
    missing = [n for n in graph.parameters if n not in out]
    if strict and missing:
        raise KeyError(f"state dict lacks parameter(s) {missing[:5]}{' ...' if len(missing) > 5 else ''}")
    return out
