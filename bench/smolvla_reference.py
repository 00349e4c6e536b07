"""PyTorch reference for the SmolVLA action expert (the flow-matching "expert" transformer).

SmolVLA pairs a SmolVLM2 vision-language backbone with a smaller Llama-style transformer,
the action expert, that turns a chunk of noisy action tokens into velocity features. This
module is that expert alone, at SmolVLA's published sizes (``SmolVLAConfig.real()``):

* width 720 (0.75 x the VLM's 960), 16 layers, RMSNorm (eps 1e-5), SwiGLU MLP with an
  intermediate width of 2048 (``down(silu(gate(x)) * up(x))``), no biases anywhere;
* attention with 15 query heads and 5 key/value heads (grouped-query, 3 q heads per kv
  head) of width 64, so ``q_proj`` is 720 -> 960, ``o_proj`` 960 -> 720;
* layers alternate (``self_attn_every_n_layers = 2``): even layers are self-attention
  among the 50 action tokens (bidirectional, Llama rotate-half RoPE on q and k, theta
  100000), odd layers are cross-attention: the action tokens' queries attend to the 16
  VLM tokens, whose keys and values are the VLM features projected by that layer's own
  ``k_proj``/``v_proj`` (width ``vlm_kv_dim`` = 320 = 5 x 64 -> 320); no RoPE there.
* a final RMSNorm ``norm``; the output is the normalised hidden state (B, 50, 720).

Simplifications against the full SmolVLA, chosen so the block is self-contained: the
self-attention layers see only the action tokens (SmolVLA also lets them attend to the
prefix), and one VLM feature tensor (B, 16, vlm_kv_dim) feeds every cross-attention layer
(SmolVLA feeds each layer the matching VLM layer's key/value states). Parameter names
follow the Llama/SmolVLA expert (``layers.{i}.self_attn.q_proj.weight``...; cross-attention
layers keep the ``self_attn`` prefix, as in SmolVLA, where only their k/v projections are
swapped for the VLM-sized ones).

The training objective used with it here is the MSE between the output and a target.
"""
from __future__ import annotations

import math
import os
import sys

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))
from meganeura.models.smolvla import SmolVLAConfig  # noqa: E402


class RMSNorm(nn.Module):
    def __init__(self, dim, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_angles(n, d, theta):
    """(n, d) rotary angles of positions 0..n-1 (float64, as the model's tables are made)."""
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    ang = torch.outer(torch.arange(n, dtype=torch.float64), inv)
    return torch.cat([ang, ang], -1)


def rope(x, cos, sin):
    """Llama rotate-half rotary embedding on (B, H, L, D) with (>= L, D) cos/sin tables."""
    d, n = x.shape[-1], x.shape[-2]
    x1, x2 = x[..., : d // 2], x[..., d // 2:]
    return x * cos[:n] + torch.cat([-x2, x1], -1) * sin[:n]


class Attention(nn.Module):
    def __init__(self, cfg: SmolVLAConfig, cross: bool):
        super().__init__()
        kv_in = cfg.vlm_kv_dim if cross else cfg.hidden_size
        self.cfg, self.cross = cfg, cross
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * cfg.head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in, cfg.num_kv_heads * cfg.head_dim, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * cfg.head_dim, cfg.hidden_size, bias=False)
        if not cross:
            # device buffers (not in the state dict), so the forward copies nothing from the
            # host and can be captured in a CUDA graph
            ang = rope_angles(cfg.chunk_size, cfg.head_dim, cfg.rope_theta)
            self.register_buffer("rope_cos", ang.cos().float(), persistent=False)
            self.register_buffer("rope_sin", ang.sin().float(), persistent=False)

    def forward(self, x, vlm):
        c = self.cfg
        b, n, _ = x.shape
        src = vlm if self.cross else x
        q = self.q_proj(x).view(b, n, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(src).view(b, src.shape[1], c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(src).view(b, src.shape[1], c.num_kv_heads, c.head_dim).transpose(1, 2)
        if not self.cross:
            q, k = rope(q, self.rope_cos, self.rope_sin), rope(k, self.rope_cos, self.rope_sin)
        o = F.scaled_dot_product_attention(q, k, v, enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o_proj(o.transpose(1, 2).reshape(b, n, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: SmolVLAConfig, cross: bool):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, cross)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, vlm):
        x = x + self.self_attn(self.input_layernorm(x), vlm)
        return x + self.mlp(self.post_attention_layernorm(x))


class SmolVLAExpert(nn.Module):
    """forward(action_tokens (B, chunk, hidden), vlm_features (B, vlm_len, vlm_kv_dim))
    -> (B, chunk, hidden)."""

    def __init__(self, cfg: SmolVLAConfig):
        super().__init__()
        self.cfg = cfg
        self.layers = nn.ModuleList(Layer(cfg, cfg.is_cross(i)) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, action_tokens, vlm_features):
        h = action_tokens
        for layer in self.layers:
            h = layer(h, vlm_features)
        return self.norm(h)


if __name__ == "__main__":
    cfg = SmolVLAConfig.real()
    m = SmolVLAExpert(cfg)
    n = sum(p.numel() for p in m.parameters())
    with torch.no_grad():
        y = m(torch.randn(1, cfg.chunk_size, cfg.hidden_size), torch.randn(1, cfg.vlm_len, cfg.vlm_kv_dim))
    assert math.isfinite(float(y.sum()))
    print(f"SmolVLA expert: {n / 1e6:.2f}M parameters, output {tuple(y.shape)}")
