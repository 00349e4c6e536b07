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

from .. import nn, ops
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


class ExpertAttention(nn.Module):
    """Self-attention among the action tokens (RoPE), or cross-attention from them to the
    VLM features (k/v projected from ``vlm_kv_dim``); unbiased projections."""

    def __init__(self, cfg: SmolVLAConfig, cross: bool):
        super().__init__()
        dim, d, kv_in = cfg.hidden_size, cfg.head_dim, cfg.vlm_kv_dim if cross else cfg.hidden_size
        self.cross, self.hq, self.hkv, self.d, self.theta = cross, cfg.num_heads, cfg.num_kv_heads, d, cfg.rope_theta
        self.q_proj = nn.Linear(dim, self.hq * d, bias=False)
        self.k_proj = nn.Linear(kv_in, self.hkv * d, bias=False)
        self.v_proj = nn.Linear(kv_in, self.hkv * d, bias=False)
        self.o_proj = nn.Linear(self.hq * d, dim, bias=False)

    def forward(self, x, vlm):
        b, n, _ = x.shape
        src = vlm if self.cross else x

        def heads(proj, t, h):                         # (B, L, h * d) -> (B, h, L, d)
            return ops.transpose(ops.reshape(proj(t), (b, t.shape[1], h, self.d)), 1, 2)
        q, k, v = heads(self.q_proj, x, self.hq), heads(self.k_proj, src, self.hkv), heads(self.v_proj, src, self.hkv)
        if not self.cross:
            q, k = ops.rope(q, base=self.theta), ops.rope(k, base=self.theta)
        o = ops.scaled_dot_product_attention(q, k, v, enable_gqa=self.hq != self.hkv)
        return self.o_proj(ops.reshape(ops.transpose(o, 1, 2), (b, n, self.hq * self.d)))


class ExpertMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x))."""

    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        dim, inter = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(dim, inter, bias=False)
        self.up_proj = nn.Linear(dim, inter, bias=False)
        self.down_proj = nn.Linear(inter, dim, bias=False)

    def forward(self, x):
        gate, up = self.gate_proj(x), self.up_proj(x)
        return self.down_proj(ops.silu(gate) * up)


class ExpertLayer(nn.Module):
    """Pre-RMSNorm attention and MLP, each with a residual."""

    def __init__(self, cfg: SmolVLAConfig, cross: bool):
        super().__init__()
        self.self_attn = ExpertAttention(cfg, cross)
        self.mlp = ExpertMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h, vlm):
        h = h + self.self_attn(self.input_layernorm(h), vlm)
        return h + self.mlp(self.post_attention_layernorm(h))


class SmolVLAExpert(nn.Module):
    """(action tokens, VLM features) -> the final-normed hidden state. Parameters are
    deferred (see ``nn.init.deferred``): torch's Linear rule for projections, ones for norms."""

    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        if cfg.num_heads % cfg.num_kv_heads:
            raise ValueError("SmolVLAConfig: num_heads must be a multiple of num_kv_heads")
        with nn.init.deferred():
            self.layers = nn.ModuleList(ExpertLayer(cfg, cfg.is_cross(i)) for i in range(cfg.num_layers))
            self.norm = nn.RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, action_tokens, vlm_features):
        h = action_tokens
        for layer in self.layers:
            h = layer(h, vlm_features)
        return self.norm(h)


def build_smolvla_expert(cfg: SmolVLAConfig, batch: int, training: bool = False,
                         graph: Optional[Graph] = None) -> SmolVLAGraph:
    """Inputs ``action_tokens`` (B, chunk_size, hidden_size) and ``vlm_features`` (B, vlm_len,
    vlm_kv_dim); output the final-normed hidden state. With ``training``, also ``target``
    (the output's shape) and loss = mse_loss(output, target)."""
    model = SmolVLAExpert(cfg)
    g = graph if graph is not None else Graph()
    inputs = {
        "action_tokens": g.input("action_tokens", (batch, cfg.chunk_size, cfg.hidden_size)),
        "vlm_features": g.input("vlm_features", (batch, cfg.vlm_len, cfg.vlm_kv_dim)),
    }
    out = model(inputs["action_tokens"], inputs["vlm_features"])
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
