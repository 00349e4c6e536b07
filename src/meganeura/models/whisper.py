"""Whisper's audio encoder, as transformers' ``WhisperEncoder``.

Two 1-D convolutions (kernel 3, padding 1, GELU; the second with stride 2, halving the
frame count) turn a log-mel spectrogram (N, mel, 2 * positions) into (N, positions,
d_model); learned position embeddings are added, then pre-LN transformer layers
(self-attention with biased q/v/out and an unbiased k projection, GELU feed-forward) and a
final layer norm.

Parameter names are those of ``WhisperEncoder(WhisperConfig(...)).state_dict()``, so a
torch state dict loads unchanged. ``embed_positions.weight`` is frozen in transformers
(``requires_grad_(False)``); the training graph therefore keeps it as graph state (loaded
by the same name, never updated) unless ``train_positions=True``.

The 1-D convolutions are ``nn.Conv1d`` (``conv2d`` on an (N, C, 1, L) view); the weights
keep torch's (C_out, C_in, k) shape.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

import numpy as np

from .. import nn, ops
from ..graph import Graph


@dataclass(frozen=True)
class WhisperEncoderConfig:
    d_model: int = 384
    encoder_layers: int = 4
    encoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    num_mel_bins: int = 80
    max_source_positions: int = 1500
    layer_norm_eps: float = 1e-5     # nn.LayerNorm's default, which Whisper uses

    @classmethod
    def tiny_real(cls):
        """openai/whisper-tiny's encoder: input (N, 80, 3000) -> (N, 1500, 384)."""
        return cls()

    @classmethod
    def tiny(cls):
        """Test size: input (N, 8, 16) -> (N, 8, 32)."""
        return cls(d_model=32, encoder_layers=2, encoder_attention_heads=4, encoder_ffn_dim=64,
                   num_mel_bins=8, max_source_positions=8)

    @property
    def input_length(self) -> int:
        """Mel frames the encoder expects: the stride-2 conv halves them to the positions."""
        return 2 * self.max_source_positions

    @property
    def head_dim(self) -> int:
        return self.d_model // self.encoder_attention_heads

    def hf_kwargs(self) -> dict:
        """Keyword arguments for ``transformers.WhisperConfig`` describing the same encoder."""
        d = asdict(self)
        d.pop("layer_norm_eps")
        return d

    def __post_init__(self):
        if self.d_model % self.encoder_attention_heads:
            raise ValueError(f"d_model {self.d_model} is not divisible by {self.encoder_attention_heads} heads")


class WhisperAttention(nn.Module):
    """Self-attention with biased q/v/out and an unbiased k projection."""

    def __init__(self, cfg: WhisperEncoderConfig):
        super().__init__()
        d = cfg.d_model
        self.h, self.hd = cfg.encoder_attention_heads, cfg.head_dim
        self.k_proj = nn.Linear(d, d, bias=False)
        self.v_proj = nn.Linear(d, d)
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)

    def forward(self, x):
        n, length, d = x.shape

        def heads(t):  # (N, L, D) -> (N, H, L, hd)
            return ops.permute(ops.reshape(t, (n, length, self.h, self.hd)), (0, 2, 1, 3))

        q, k, v = heads(self.q_proj(x)), heads(self.k_proj(x)), heads(self.v_proj(x))
        # torch scales q by head_dim ** -0.5 before the product: the same as sdpa's default scale
        o = ops.scaled_dot_product_attention(q, k, v)
        return self.out_proj(ops.reshape(ops.permute(o, (0, 2, 1, 3)), (n, length, d)))


class WhisperEncoderLayer(nn.Module):
    """Pre-LN self-attention and GELU feed-forward, each with a residual."""

    def __init__(self, cfg: WhisperEncoderConfig):
        super().__init__()
        d, eps = cfg.d_model, cfg.layer_norm_eps
        self.self_attn = WhisperAttention(cfg)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(ops.gelu(self.fc1(self.final_layer_norm(x))))


class PositionEmbedding(nn.Module):
    """``weight`` (positions, d_model), added to the frames: trained (N(0, 0.02)), or, as
    transformers freezes it, a buffer (graph state: loaded by name, never updated)."""

    def __init__(self, positions, d_model, trainable=True):
        super().__init__()
        if trainable:
            self.weight = nn.init.normal_(nn.Parameter(shape=(positions, d_model)), std=0.02)
        else:
            self.register_buffer("weight", np.zeros((positions, d_model), np.float32))

    def forward(self, x):
        return x + self.weight


class WhisperEncoder(nn.Module):
    """(N, num_mel_bins, 2 * positions) log-mel -> last_hidden_state (N, positions, d_model).
    Parameters are deferred (see ``nn.init.deferred``)."""

    def __init__(self, cfg: WhisperEncoderConfig, train_positions=True):
        super().__init__()
        self.cfg = cfg
        d = cfg.d_model
        with nn.init.deferred():
            self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, 3, padding=1)
            self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
            self.embed_positions = PositionEmbedding(cfg.max_source_positions, d, train_positions)
            self.layers = nn.ModuleList(WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers))
            self.layer_norm = nn.LayerNorm(d, cfg.layer_norm_eps)

    def forward(self, input_features):
        cfg = self.cfg
        n, mel, frames = input_features.shape
        if mel != cfg.num_mel_bins or frames != cfg.input_length:
            raise ValueError(f"whisper encoder: input_features must be (N, {cfg.num_mel_bins}, {cfg.input_length}), "
                             f"got {input_features.shape}")
        x = ops.gelu(self.conv2(ops.gelu(self.conv1(input_features))))
        x = self.embed_positions(ops.permute(x, (0, 2, 1)))           # (N, positions, d_model)
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


def whisper_encoder(g: Graph, input_features, cfg: WhisperEncoderConfig, train_positions=True):
    """Adds the encoder's parameters to ``g`` and returns last_hidden_state (N, positions, d_model)
    for ``input_features`` (N, num_mel_bins, 2 * positions)."""
    if input_features.graph is not g:
        raise ValueError("whisper encoder: input_features belongs to another graph")
    return WhisperEncoder(cfg, train_positions)(input_features)


def build_whisper_encoder(cfg: WhisperEncoderConfig, batch: int):
    """Inference graph: returns (graph, input_features input, last_hidden_state)."""
    g = Graph()
    x = g.input("input_features", (batch, cfg.num_mel_bins, cfg.input_length))
    return g, x, whisper_encoder(g, x, cfg)


def build_whisper_encoder_training(cfg: WhisperEncoderConfig, batch: int, train_positions=False):
    """Training graph with an MSE loss of last_hidden_state against the ``target`` input
    (N, positions, d_model). Returns (graph, input_features, target, last_hidden_state, loss).

    ``embed_positions.weight`` is graph state (frozen, as in transformers) unless
    ``train_positions``; either way ``load_state_dict`` takes it by its torch name."""
    g = Graph()
    x = g.input("input_features", (batch, cfg.num_mel_bins, cfg.input_length))
    target = g.input("target", (batch, cfg.max_source_positions, cfg.d_model))
    out = whisper_encoder(g, x, cfg, train_positions=train_positions)
    return g, x, target, out, ops.mse_loss(out, target)
