"""The SmolVLA action expert as a graph, parameter-for-parameter with the PyTorch reference
in ``bench/smolvla_reference.py`` (see its docstring for the architecture and the
simplifications against the full SmolVLA).

Layers alternate self-attention among the action tokens (with RoPE) and cross-attention
from the action tokens to the VLM features (k/v projected from ``vlm_kv_dim``); each layer
is pre-RMSNorm attention + pre-RMSNorm SwiGLU MLP with residuals, and a final RMSNorm gives
the output. Grouped-query attention goes through ``scaled_dot_product_attention`` with
``enable_gqa`` so kv heads are never copied.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import numpy as np

from .. import ops
from ..graph import Graph, Tensor


@dataclass(frozen=True)
class SmolVLAConfig:
    hidden_size: int = 720
    num_layers: int = 16
    num_heads: int = 15
    num_kv_heads: int = 5
    head_dim: int = 64
    intermediate_size: int = 2048
    chunk_size: int = 50          # action tokens
    vlm_len: int = 16             # VLM tokens attended to by cross-attention layers
    vlm_kv_dim: int = 320         # width of the VLM features the cross k/v project from
    rms_norm_eps: float = 1e-5
    rope_theta: float = 100000.0
    self_attn_every_n_layers: int = 2

    @classmethod
    def real(cls, **kw) -> "SmolVLAConfig":
        """SmolVLA's published expert sizes (about 98M parameters)."""
        return replace(cls(), **kw)

    @classmethod
    def tiny(cls, **kw) -> "SmolVLAConfig":
        """For tests: width 32, 4 layers, 3 q heads / 1 kv head of 8, 6 action and 4 VLM tokens."""
        return replace(cls(hidden_size=32, num_layers=4, num_heads=3, num_kv_heads=1, head_dim=8,
                           intermediate_size=48, chunk_size=6, vlm_len=4, vlm_kv_dim=8), **kw)

    def is_cross(self, layer: int) -> bool:
        """SmolVLA's rule: every n-th layer (0, n, 2n...) is self-attention, the rest cross."""
        n = self.self_attn_every_n_layers
        return not (n > 0 and layer % n == 0)


@dataclass
class SmolVLAGraph:
    """A built expert: ``inputs`` by name (action_tokens, vlm_features [, target]), the
    ``output`` (B, chunk, hidden) and, for training graphs, the MSE ``loss``."""
    graph: Graph
    inputs: dict
    output: Tensor
    loss: Optional[Tensor] = None


def _attention(g, cfg: SmolVLAConfig, name, x, vlm, cross):
    b, n, dim = x.shape
    hq, hkv, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    src = vlm if cross else x
    kv_in = src.shape[-1]

    def proj(what, t, n_in, heads):
        w = g.parameter(f"{name}.{what}_proj.weight", (heads * d, n_in))
        return ops.transpose(ops.reshape(ops.linear(t, w), (b, t.shape[1], heads, d)), 1, 2)
    q = proj("q", x, dim, hq)
    k = proj("k", src, kv_in, hkv)
    v = proj("v", src, kv_in, hkv)
    if not cross:
        q, k = ops.rope(q, base=cfg.rope_theta), ops.rope(k, base=cfg.rope_theta)
    o = ops.scaled_dot_product_attention(q, k, v, enable_gqa=hq != hkv)
    o = ops.reshape(ops.transpose(o, 1, 2), (b, n, hq * d))
    return ops.linear(o, g.parameter(f"{name}.o_proj.weight", (dim, hq * d)))


def _mlp(g, cfg: SmolVLAConfig, name, x):
    dim, inter = cfg.hidden_size, cfg.intermediate_size
    gate = ops.linear(x, g.parameter(f"{name}.gate_proj.weight", (inter, dim)))
    up = ops.linear(x, g.parameter(f"{name}.up_proj.weight", (inter, dim)))
    return ops.linear(ops.silu(gate) * up, g.parameter(f"{name}.down_proj.weight", (dim, inter)))


def _rms(g, cfg, name, x):
    w = g.parameter(f"{name}.weight", (cfg.hidden_size,), init="ones")
    return ops.rms_norm(x, (cfg.hidden_size,), w, cfg.rms_norm_eps)


def build_smolvla_expert(cfg: SmolVLAConfig, batch: int, training: bool = False,
                         graph: Optional[Graph] = None) -> SmolVLAGraph:
    """Inputs ``action_tokens`` (B, chunk_size, hidden_size) and ``vlm_features`` (B, vlm_len,
    vlm_kv_dim); output the final-normed hidden state. With ``training``, also ``target``
    (the output's shape) and loss = mse_loss(output, target)."""
    if cfg.num_heads % cfg.num_kv_heads:
        raise ValueError("SmolVLAConfig: num_heads must be a multiple of num_kv_heads")
    g = graph if graph is not None else Graph()
    inputs = {
        "action_tokens": g.input("action_tokens", (batch, cfg.chunk_size, cfg.hidden_size)),
        "vlm_features": g.input("vlm_features", (batch, cfg.vlm_len, cfg.vlm_kv_dim)),
    }
    h, vlm = inputs["action_tokens"], inputs["vlm_features"]
    for i in range(cfg.num_layers):
        name = f"layers.{i}"
        h = h + _attention(g, cfg, f"{name}.self_attn", _rms(g, cfg, f"{name}.input_layernorm", h), vlm,
                           cfg.is_cross(i))
        h = h + _mlp(g, cfg, f"{name}.mlp", _rms(g, cfg, f"{name}.post_attention_layernorm", h))
    out = _rms(g, cfg, "norm", h)
    loss = None
    if training:
        inputs["target"] = g.input("target", out.shape)
        loss = ops.mse_loss(out, inputs["target"])
    return SmolVLAGraph(g, inputs, out, loss)


def build_smolvla_inference(cfg: SmolVLAConfig, batch: int) -> SmolVLAGraph:
    return build_smolvla_expert(cfg, batch, training=False)


def build_smolvla_training(cfg: SmolVLAConfig, batch: int) -> SmolVLAGraph:
    return build_smolvla_expert(cfg, batch, training=True)


def parameter_count(cfg: SmolVLAConfig) -> int:
    g = build_smolvla_expert(cfg, 1).graph
    return int(sum(np.prod(p.shape) for p in g.parameters.values()))
