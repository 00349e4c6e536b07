"""Llama-family causal language models (Llama 2/3, SmolLM2, TinyLlama ...).

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
from dataclasses import dataclass

import numpy as np

from .. import ops
from ..graph import Graph, i32

NEG_INF = float("-inf")


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

    def __post_init__(self):
        if self.num_key_value_heads is None:
            self.num_key_value_heads = self.num_attention_heads
        if self.head_dim is None:
            self.head_dim = self.hidden_size // self.num_attention_heads
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                             f"num_key_value_heads ({self.num_key_value_heads})")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

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
        """From a config.json dict (transformers 4.x ``rope_theta`` or 5.x ``rope_parameters``)."""
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise NotImplementedError(f"LlamaConfig: hidden_act {act!r} is not supported (only 'silu')")
        if d.get("attention_bias") or d.get("mlp_bias"):
            raise NotImplementedError("LlamaConfig: attention_bias / mlp_bias are not supported")
        rope = d.get("rope_parameters") or {}
        scaling = d.get("rope_scaling") or {}
        kind = rope.get("rope_type", scaling.get("rope_type", scaling.get("type", "default")))
        if kind != "default":
            raise NotImplementedError(f"LlamaConfig: rope type {kind!r} is not supported (only 'default')")
        theta = rope.get("rope_theta", d.get("rope_theta", 10000.0))
        fields = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in fields}
        kw["rope_theta"] = float(theta)
        return cls(**kw)

    def to_hf_dict(self) -> dict:
        """A config.json dict transformers' LlamaConfig reads."""
        d = dataclasses.asdict(self)
        d.update(model_type="llama", architectures=["LlamaForCausalLM"], hidden_act="silu")
        return d


# ------------------------------------------------------------------------- pieces
def _params(g: Graph, cfg: LlamaConfig):
    """Create every parameter, named as transformers does; returns (embed, layers, norm, head)."""
    H, hd = cfg.hidden_size, cfg.head_dim
    nq, nkv, F = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.intermediate_size
    embed = g.parameter("model.embed_tokens.weight", (cfg.vocab_size, H), init="normal")
    layers = []
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        layers.append(dict(
            ln1=g.parameter(p + "input_layernorm.weight", (H,), init="ones"),
            q=g.parameter(p + "self_attn.q_proj.weight", (nq * hd, H), init="normal"),
            k=g.parameter(p + "self_attn.k_proj.weight", (nkv * hd, H), init="normal"),
            v=g.parameter(p + "self_attn.v_proj.weight", (nkv * hd, H), init="normal"),
            o=g.parameter(p + "self_attn.o_proj.weight", (H, nq * hd), init="normal"),
            ln2=g.parameter(p + "post_attention_layernorm.weight", (H,), init="ones"),
            gate=g.parameter(p + "mlp.gate_proj.weight", (F, H), init="normal"),
            up=g.parameter(p + "mlp.up_proj.weight", (F, H), init="normal"),
            down=g.parameter(p + "mlp.down_proj.weight", (H, F), init="normal"),
        ))
    norm = g.parameter("model.norm.weight", (H,), init="ones")
    head = embed if cfg.tie_word_embeddings else g.parameter("lm_head.weight", (cfg.vocab_size, H), init="normal")
    return embed, layers, norm, head


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


def _mlp(h, L):
    return ops.linear(ops.silu(ops.linear(h, L["gate"])) * ops.linear(h, L["up"]), L["down"])


def _trunk(cfg, layers, x, attend):
    """The decoder layers; ``attend(i, L, h)`` is the attention block of layer i."""
    H, eps = cfg.hidden_size, cfg.rms_norm_eps
    for i, L in enumerate(layers):
        h = ops.rms_norm(x, (H,), L["ln1"], eps)
        x = x + ops.linear(attend(i, L, h), L["o"])
        h = ops.rms_norm(x, (H,), L["ln2"], eps)
        x = x + _mlp(h, L)
    return x


def _qkv(cfg, L, h):
    hd = cfg.head_dim
    return (_heads(ops.linear(h, L["q"]), cfg.num_attention_heads, hd),
            _heads(ops.linear(h, L["k"]), cfg.num_key_value_heads, hd),
            _heads(ops.linear(h, L["v"]), cfg.num_key_value_heads, hd))


def _hidden(g, cfg, ids):
    """Final-normed hidden states (b, s, H) of a full causal pass, and the head weight."""
    embed, layers, norm, head = _params(g, cfg)

    def attend(i, L, h):
        q, k, v = _qkv(cfg, L, h)
        q, k = ops.rope(q, cfg.rope_theta), ops.rope(k, cfg.rope_theta)
        return _merge(ops.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))

    x = _trunk(cfg, layers, ops.embedding(ids, embed), attend)
    return ops.rms_norm(x, (cfg.hidden_size,), norm, cfg.rms_norm_eps), head


# ------------------------------------------------------------------------- builders
def build_causal_lm(cfg: LlamaConfig, batch: int, seq: int):
    """Full-sequence forward. Returns (graph, ids input (batch, seq) i32, logits (batch, seq, vocab))."""
    g = Graph()
    ids = g.input("input_ids", (batch, seq), i32)
    h, head = _hidden(g, cfg, ids)
    return g, ids, ops.linear(h, head)


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
    h, head = _hidden(g, cfg, ids)
    logits = ops.linear(h, head)
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


def build_decoder(cfg: LlamaConfig, batch: int, tokens: int, max_len: int, cache_as_state: bool = False):
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
    compile with ``state_updates`` mapping them to the new caches) instead of inputs. The cache update is a blend, cache * (1 - written) + cache_write @ k_new, so a
    slot is replaced exactly where a token is written."""
    g = Graph()
    hd, nkv = cfg.head_dim, cfg.num_key_value_heads
    ids = g.input("input_ids", (batch, tokens), i32)
    cos = g.input("rope_cos", (tokens, hd))
    sin = g.input("rope_sin", (tokens, hd))
    mask = g.input("attn_mask", (tokens, max_len))
    write = g.input("cache_write", (max_len, tokens))
    make = g.state if cache_as_state else g.input
    past = [make(n, (batch, nkv, max_len, hd)) for n in cache_names(cfg)]
    embed, layers, norm, head = _params(g, cfg)
    keep = 1.0 - ops.sum(write, 1, keepdim=True)             # (max_len, 1): slots not written
    new_cache = []

    def attend(i, L, h):
        q, k, v = _qkv(cfg, L, h)
        q, k = rope_fed(q, cos, sin), rope_fed(k, cos, sin)
        if tokens == 1:   # one new row: a broadcast product, pointwise with the blend
            kc = past[2 * i] * keep + write * k              # (batch, kv, max_len, hd)
            vc = past[2 * i + 1] * keep + write * v
        else:
            kc = past[2 * i] * keep + ops.mm(write, k)
            vc = past[2 * i + 1] * keep + ops.mm(write, v)
        new_cache.extend([kc, vc])
        return _merge(ops.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=True))

    x = _trunk(cfg, layers, ops.embedding(ids, embed), attend)
    last = x if tokens == 1 else ops.slice(x, 1, tokens - 1, tokens)
    last = ops.rms_norm(ops.reshape(last, (batch, cfg.hidden_size)), (cfg.hidden_size,), norm, cfg.rms_norm_eps)
    return g, ops.linear(last, head), new_cache


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
