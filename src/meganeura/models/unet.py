"""A scaled Stable Diffusion 1.x U-Net, graph-for-graph with ``diffusers.UNet2DConditionModel``.

Built from a ``UNetConfig`` whose ``diffusers_kwargs()`` constructs the matching diffusers
model; every parameter is named exactly as that model's ``state_dict`` keys, so its state
dict loads unchanged (``Session.load_state_dict``).

Architecture (SD 1.x layout, "positional" time embedding, no class/additional embeddings):

* time: sinusoidal features of the timestep -> ``time_embedding.linear_1`` -> SiLU ->
  ``linear_2`` = temb (block_out_channels[0] * 4 wide), fed to every ResNet block.
* ``conv_in`` 3x3, then down blocks: ``layers_per_block`` x (ResnetBlock2D [+ Transformer2D
  for CrossAttnDownBlock2D]), then a stride-2 3x3 conv (all but the last block). Every
  resnet/attention output and downsample output is kept as a skip.
* mid block: resnet, Transformer2D, resnet.
* up blocks (mirrored): ``layers_per_block + 1`` x (concat the last skip on channels ->
  resnet [+ Transformer2D]), then nearest x2 upsampling + 3x3 conv (all but the last).
* ``conv_norm_out`` GroupNorm -> SiLU -> ``conv_out``.

ResnetBlock2D: GroupNorm -> SiLU -> conv3x3 -> + time_emb_proj(SiLU(temb)) -> GroupNorm ->
SiLU -> conv3x3, plus the input (through a 1x1 ``conv_shortcut`` when channels change).

Transformer2DModel: GroupNorm (eps 1e-6) -> proj_in (1x1 conv, or a linear on tokens when
``use_linear_projection``) -> BasicTransformerBlock on the H*W tokens -> proj_out -> + input.
BasicTransformerBlock: LayerNorm -> self-attention; LayerNorm -> cross-attention to the
context (keys/values projected from ``cross_attention_dim``); LayerNorm -> GEGLU feed-forward
(``ff.net.0.proj`` to 2 x 4 x dim, split into value and gate, value * gelu(gate), exact erf
gelu, then ``ff.net.2``); each with a residual. q/k/v projections carry no bias, ``to_out.0``
does.

The timestep: the graph has no sin/cos op, and the sinusoidal projection has no parameters,
so the graph's ``timestep`` input is the precomputed (batch, block_out_channels[0]) feature
matrix. ``timestep_features(timesteps, cfg)`` computes it on the host in float32 the way
diffusers' ``get_timestep_embedding`` does (flip_sin_to_cos=True: [cos, sin]).

Note on ``attention_head_dim``: in diffusers' UNet2DConditionModel this value (a per-block
tuple or an int) is really the number of heads per transformer (head width = channels /
heads), a long-standing naming quirk kept so the config maps across one-to-one.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from typing import Optional

import numpy as np

from .. import ops
from ..graph import Graph, Tensor


@dataclass(frozen=True)
class UNetConfig:
    sample_size: int = 32
    in_channels: int = 4
    out_channels: int = 4
    block_out_channels: tuple = (64, 128, 224)
    down_block_types: tuple = ("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D")
    up_block_types: tuple = ("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D")
    layers_per_block: int = 1
    cross_attention_dim: int = 768
    context_len: int = 77               # tokens of the text-encoder context (CLIP: 77)
    attention_head_dim: object = (2, 4, 7)   # heads per block (diffusers' naming, see module doc)
    norm_num_groups: int = 32
    norm_eps: float = 1e-5
    use_linear_projection: bool = False
    flip_sin_to_cos: bool = True
    freq_shift: int = 0

    @classmethod
    def sd_scaled(cls, **kw) -> "UNetConfig":
        """SD 1.x shape at ~11.6M parameters: 32x32x4 latents, 77x768 context, three levels
        (64, 128, 224) with 32-wide heads throughout (2, 4, 7 heads). (64, 128, 256) with
        heads (2, 4, 8) would give 13.7M."""
        return replace(cls(), **kw)

    @classmethod
    def tiny(cls, **kw) -> "UNetConfig":
        """For tests: 8x8x4 latents, channels (8, 16, 16) in 4 groups, a 4x16 context; heads
        (2, 2, 4) differ per level so a wrong level-to-heads mapping shows."""
        return replace(cls(sample_size=8, block_out_channels=(8, 16, 16), cross_attention_dim=16,
                           context_len=4, attention_head_dim=(2, 2, 4), norm_num_groups=4), **kw)

    @property
    def time_embed_dim(self) -> int:
        return self.block_out_channels[0] * 4

    def heads(self) -> tuple:
        """Heads per level, down-block order."""
        h = self.attention_head_dim
        return tuple(h) if isinstance(h, (tuple, list)) else (int(h),) * len(self.block_out_channels)

    def diffusers_kwargs(self) -> dict:
        """Keyword arguments for ``diffusers.UNet2DConditionModel`` building the same model."""
        d = asdict(self)
        d.pop("context_len")
        d["block_out_channels"] = tuple(self.block_out_channels)
        d["attention_head_dim"] = (tuple(self.attention_head_dim)
                                   if isinstance(self.attention_head_dim, (tuple, list)) else self.attention_head_dim)
        return d


def timestep_features(timesteps, cfg: UNetConfig, max_period=10000.0) -> np.ndarray:
    """(batch,) timesteps -> (batch, block_out_channels[0]) sinusoidal features, float32,
    computed in the same order as diffusers' get_timestep_embedding."""
    dim = cfg.block_out_channels[0]
    half = dim // 2
    t = np.asarray(timesteps, dtype=np.float32).reshape(-1)
    exponent = np.float32(-math.log(max_period)) * np.arange(half, dtype=np.float32)
    exponent = exponent / np.float32(half - cfg.freq_shift)
    # exp correctly rounded (via float64) lands on torch's float32 exp for all but rare
    # frequencies; a one-ulp frequency difference moves t * freq by up to ~1e-4 at t ~ 1000
    freqs = np.exp(exponent.astype(np.float64)).astype(np.float32)
    args = t[:, None] * freqs[None, :]
    sin, cos = np.sin(args), np.cos(args)
    emb = np.concatenate([cos, sin] if cfg.flip_sin_to_cos else [sin, cos], axis=1)
    if dim % 2:
        emb = np.pad(emb, ((0, 0), (0, 1)))
    return emb.astype(np.float32)


@dataclass
class UNetGraph:
    """A built U-Net: ``inputs`` by name (sample, timestep, context [, noise]), the noise
    prediction ``output`` and, for training graphs, the MSE ``loss``."""
    graph: Graph
    inputs: dict
    output: Tensor
    loss: Optional[Tensor] = None


class _Builder:
    def __init__(self, g: Graph, cfg: UNetConfig):
        self.g, self.cfg = g, cfg

    def p(self, name, shape, init=None):
        return self.g.parameter(name, shape, init=init)

    # ------------------------------------------------------------------ primitives
    def linear(self, name, x, n_in, n_out, bias=True):
        w = self.p(f"{name}.weight", (n_out, n_in))
        b = self.p(f"{name}.bias", (n_out,)) if bias else None
        return ops.linear(x, w, b)

    def conv(self, name, x, c_out, k=3, stride=1):
        c_in = x.shape[1]
        w = self.p(f"{name}.weight", (c_out, c_in, k, k))
        b = self.p(f"{name}.bias", (c_out,))
        return ops.conv2d(x, w, b, stride=stride, padding=k // 2)

    def group_norm(self, name, x, eps):
        c = x.shape[1]
        return ops.group_norm(x, self.cfg.norm_num_groups, self.p(f"{name}.weight", (c,), "ones"),
                              self.p(f"{name}.bias", (c,)), eps)

    def layer_norm(self, name, x):
        c = x.shape[-1]
        return ops.layer_norm(x, (c,), self.p(f"{name}.weight", (c,), "ones"), self.p(f"{name}.bias", (c,)), 1e-5)

    # ---------------------------------------------------------------------- blocks
    def resnet(self, name, x, temb, c_out):
        eps = self.cfg.norm_eps
        h = self.conv(f"{name}.conv1", ops.silu(self.group_norm(f"{name}.norm1", x, eps)), c_out)
        t = self.linear(f"{name}.time_emb_proj", ops.silu(temb), temb.shape[1], c_out)
        h = h + ops.reshape(t, t.shape + (1, 1))
        # dropout is 0 in SD's config and absent here
        h = self.conv(f"{name}.conv2", ops.silu(self.group_norm(f"{name}.norm2", h, eps)), c_out)
        skip = self.conv(f"{name}.conv_shortcut", x, c_out, k=1) if x.shape[1] != c_out else x
        return skip + h

    def attention(self, name, x, ctx, heads):
        b, n, dim = x.shape
        d = dim // heads
        src = x if ctx is None else ctx

        def split_heads(t):
            return ops.transpose(ops.reshape(t, (b, t.shape[1], heads, d)), 1, 2)
        q = split_heads(self.linear(f"{name}.to_q", x, dim, dim, bias=False))
        k = split_heads(self.linear(f"{name}.to_k", src, src.shape[-1], dim, bias=False))
        v = split_heads(self.linear(f"{name}.to_v", src, src.shape[-1], dim, bias=False))
        o = ops.scaled_dot_product_attention(q, k, v)
        o = ops.reshape(ops.transpose(o, 1, 2), (b, n, dim))
        return self.linear(f"{name}.to_out.0", o, dim, dim)

    def transformer_block(self, name, x, ctx, heads):
        dim = x.shape[-1]
        x = x + self.attention(f"{name}.attn1", self.layer_norm(f"{name}.norm1", x), None, heads)
        x = x + self.attention(f"{name}.attn2", self.layer_norm(f"{name}.norm2", x), ctx, heads)
        h = self.linear(f"{name}.ff.net.0.proj", self.layer_norm(f"{name}.norm3", x), dim, dim * 8)
        val, gate = ops.slice(h, -1, 0, dim * 4), ops.slice(h, -1, dim * 4, dim * 8)
        return x + self.linear(f"{name}.ff.net.2", val * ops.gelu(gate), dim * 4, dim)

    def transformer2d(self, name, x, ctx, heads):
        b, c, hh, ww = x.shape
        h = self.group_norm(f"{name}.norm", x, 1e-6)

        def to_tokens(t):
            return ops.reshape(ops.permute(t, (0, 2, 3, 1)), (b, hh * ww, c))

        def to_image(t):
            return ops.permute(ops.reshape(t, (b, hh, ww, c)), (0, 3, 1, 2))
        if self.cfg.use_linear_projection:
            h = self.linear(f"{name}.proj_in", to_tokens(h), c, c)
        else:
            h = to_tokens(self.conv(f"{name}.proj_in", h, c, k=1))
        h = self.transformer_block(f"{name}.transformer_blocks.0", h, ctx, heads)
        if self.cfg.use_linear_projection:
            h = to_image(self.linear(f"{name}.proj_out", h, c, c))
        else:
            h = self.conv(f"{name}.proj_out", to_image(h), c, k=1)
        return h + x

    # ------------------------------------------------------------------------ model
    def unet(self, sample, tfeat, ctx):
        cfg = self.cfg
        chans, heads = cfg.block_out_channels, cfg.heads()
        c0, ted = chans[0], cfg.time_embed_dim
        temb = self.linear("time_embedding.linear_1", tfeat, c0, ted)
        temb = self.linear("time_embedding.linear_2", ops.silu(temb), ted, ted)

        h = self.conv("conv_in", sample, c0)
        skips = [h]
        for i, kind in enumerate(cfg.down_block_types):
            name, c = f"down_blocks.{i}", chans[i]
            for j in range(cfg.layers_per_block):
                h = self.resnet(f"{name}.resnets.{j}", h, temb, c)
                if kind.startswith("CrossAttn"):
                    h = self.transformer2d(f"{name}.attentions.{j}", h, ctx, heads[i])
                skips.append(h)
            if i < len(chans) - 1:
                h = self.conv(f"{name}.downsamplers.0.conv", h, c, stride=2)
                skips.append(h)

        h = self.resnet("mid_block.resnets.0", h, temb, chans[-1])
        h = self.transformer2d("mid_block.attentions.0", h, ctx, heads[-1])
        h = self.resnet("mid_block.resnets.1", h, temb, chans[-1])

        rchans, rheads = chans[::-1], heads[::-1]
        for i, kind in enumerate(cfg.up_block_types):
            name, c = f"up_blocks.{i}", rchans[i]
            for j in range(cfg.layers_per_block + 1):
                h = ops.concat([h, skips.pop()], 1)
                h = self.resnet(f"{name}.resnets.{j}", h, temb, c)
                if kind.startswith("CrossAttn"):
                    h = self.transformer2d(f"{name}.attentions.{j}", h, ctx, rheads[i])
            if i < len(chans) - 1:
                h = self.conv(f"{name}.upsamplers.0.conv", ops.upsample_nearest2d(h, 2), c)

        h = ops.silu(self.group_norm("conv_norm_out", h, cfg.norm_eps))
        return self.conv("conv_out", h, cfg.out_channels)


def _check(cfg: UNetConfig):
    n = len(cfg.block_out_channels)
    if len(cfg.down_block_types) != n or len(cfg.up_block_types) != n or len(cfg.heads()) != n:
        raise ValueError("UNetConfig: down/up block types and heads need one entry per level")
    for c, h in zip(cfg.block_out_channels, cfg.heads()):
        if c % cfg.norm_num_groups or c % h:
            raise ValueError(f"UNetConfig: {c} channels must divide into {cfg.norm_num_groups} groups and {h} heads")
    if cfg.sample_size % (2 ** (n - 1)):
        raise ValueError(f"UNetConfig: sample_size {cfg.sample_size} must be divisible by {2 ** (n - 1)}")


def build_unet(cfg: UNetConfig, batch: int, training: bool = False, graph: Optional[Graph] = None) -> UNetGraph:
    """The U-Net graph. Inputs: ``sample`` (B, in_channels, S, S), ``timestep`` (B, C0)
    sinusoidal features (see ``timestep_features``), ``context`` (B, context_len,
    cross_attention_dim); output: the noise prediction (B, out_channels, S, S). With
    ``training``, also ``noise`` (the target) and loss = mse_loss(output, noise)."""
    _check(cfg)
    g = graph if graph is not None else Graph()
    s = cfg.sample_size
    inputs = {
        "sample": g.input("sample", (batch, cfg.in_channels, s, s)),
        "timestep": g.input("timestep", (batch, cfg.block_out_channels[0])),
        "context": g.input("context", (batch, cfg.context_len, cfg.cross_attention_dim)),
    }
    out = _Builder(g, cfg).unet(inputs["sample"], inputs["timestep"], inputs["context"])
    loss = None
    if training:
        inputs["noise"] = g.input("noise", out.shape)
        loss = ops.mse_loss(out, inputs["noise"])
    return UNetGraph(g, inputs, out, loss)


def build_unet_inference(cfg: UNetConfig, batch: int) -> UNetGraph:
    return build_unet(cfg, batch, training=False)


def build_unet_training(cfg: UNetConfig, batch: int) -> UNetGraph:
    return build_unet(cfg, batch, training=True)


def parameter_count(cfg: UNetConfig) -> int:
    g = build_unet(cfg, 1).graph
    return int(sum(np.prod(p.shape) for p in g.parameters.values()))
