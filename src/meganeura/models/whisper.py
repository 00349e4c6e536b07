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

A 1-D convolution runs as ``conv2d`` on an (N, C, 1, L) view with the weight viewed as
(C_out, C_in, 1, k): the parameter keeps torch's (C_out, C_in, k) shape.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import ops
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


def _conv1d(x, weight, bias, stride):
    """(N, C, L) conv with kernel 3 and padding 1, through conv2d on an (N, C, 1, L) view."""
    n, c, length = x.shape
    co, ci, k = weight.shape
    y = ops.conv2d(ops.reshape(x, (n, c, 1, length)), ops.reshape(weight, (co, ci, 1, k)), bias,
                   stride=(1, stride), padding=(0, k // 2))
    return ops.reshape(y, (n, co, y.shape[-1]))


def _linear(g, prefix, x, n_out, n_in, bias=True):
    w = g.parameter(f"{prefix}.weight", (n_out, n_in))
    b = g.parameter(f"{prefix}.bias", (n_out,)) if bias else None
    return ops.linear(x, w, b)


def _layer_norm(g, prefix, x, cfg):
    w = g.parameter(f"{prefix}.weight", (cfg.d_model,), init="ones")
    b = g.parameter(f"{prefix}.bias", (cfg.d_model,))
    return ops.layer_norm(x, (cfg.d_model,), w, b, eps=cfg.layer_norm_eps)


def _self_attention(g, prefix, x, cfg):
    n, length, d = x.shape
    h, hd = cfg.encoder_attention_heads, cfg.head_dim

    def heads(t):  # (N, L, D) -> (N, H, L, hd)
        return ops.permute(ops.reshape(t, (n, length, h, hd)), (0, 2, 1, 3))

    q = heads(_linear(g, f"{prefix}.q_proj", x, d, d))
    k = heads(_linear(g, f"{prefix}.k_proj", x, d, d, bias=False))
    v = heads(_linear(g, f"{prefix}.v_proj", x, d, d))
    # torch scales q by head_dim ** -0.5 before the product: the same as sdpa's default scale
    o = ops.scaled_dot_product_attention(q, k, v)
    o = ops.reshape(ops.permute(o, (0, 2, 1, 3)), (n, length, d))
    return _linear(g, f"{prefix}.out_proj", o, d, d)


def whisper_encoder(g: Graph, input_features, cfg: WhisperEncoderConfig, train_positions=True):
    """Adds the encoder's parameters to ``g`` and returns last_hidden_state (N, positions, d_model)
    for ``input_features`` (N, num_mel_bins, 2 * positions)."""
    n, mel, frames = input_features.shape
    if mel != cfg.num_mel_bins or frames != cfg.input_length:
        raise ValueError(f"whisper encoder: input_features must be (N, {cfg.num_mel_bins}, {cfg.input_length}), "
                         f"got {input_features.shape}")
    d, p = cfg.d_model, cfg.max_source_positions
    x = input_features
    for name, c_in, stride in (("conv1", mel, 1), ("conv2", d, 2)):
        w = g.parameter(f"{name}.weight", (d, c_in, 3))
        b = g.parameter(f"{name}.bias", (d,))
        x = ops.gelu(_conv1d(x, w, b, stride))
    x = ops.permute(x, (0, 2, 1))                                   # (N, positions, d_model)
    pos = (g.parameter("embed_positions.weight", (p, d), init="normal") if train_positions
           else g.state("embed_positions.weight", (p, d), init=0.0))
    x = x + pos
    for i in range(cfg.encoder_layers):
        pre = f"layers.{i}"
        x = x + _self_attention(g, f"{pre}.self_attn", _layer_norm(g, f"{pre}.self_attn_layer_norm", x, cfg), cfg)
        ff = _layer_norm(g, f"{pre}.final_layer_norm", x, cfg)
        ff = ops.gelu(_linear(g, f"{pre}.fc1", ff, cfg.encoder_ffn_dim, d))
        x = x + _linear(g, f"{pre}.fc2", ff, d, cfg.encoder_ffn_dim)
    return _layer_norm(g, "layer_norm", x, cfg)


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
