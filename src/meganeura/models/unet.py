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

from .. import nn, ops
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


class ResnetBlock2D(nn.Module):
    def __init__(self, c_in, c_out, temb_dim, cfg: UNetConfig):
        super().__init__()
        g, eps = cfg.norm_num_groups, cfg.norm_eps
        self.norm1 = nn.GroupNorm(g, c_in, eps)
        self.conv1 = nn.Conv2d(c_in, c_out, 3, padding=1)
        self.time_emb_proj = nn.Linear(temb_dim, c_out)
        self.norm2 = nn.GroupNorm(g, c_out, eps)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1)
        if c_in != c_out:
            self.conv_shortcut = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x, temb):
        h = self.conv1(ops.silu(self.norm1(x)))
        t = self.time_emb_proj(ops.silu(temb))
        h = h + ops.reshape(t, t.shape + (1, 1))
        # dropout is 0 in SD's config and absent here
        h = self.conv2(ops.silu(self.norm2(h)))
        skip = self.conv_shortcut(x) if "conv_shortcut" in self._modules else x
        return skip + h


class Attention(nn.Module):
    """Multi-head attention with unbiased q/k/v projections (k/v from ``kv_dim``)."""

    def __init__(self, dim, kv_dim, heads):
        super().__init__()
        self.heads = heads
        self.to_q = nn.Linear(dim, dim, bias=False)
        self.to_k = nn.Linear(kv_dim, dim, bias=False)
        self.to_v = nn.Linear(kv_dim, dim, bias=False)
        self.to_out = nn.ModuleList([nn.Linear(dim, dim), nn.Dropout(0.0)])

    def forward(self, x, ctx=None):
        b, n, dim = x.shape
        d = dim // self.heads
        src = x if ctx is None else ctx

        def split_heads(t):
            return ops.transpose(ops.reshape(t, (b, t.shape[1], self.heads, d)), 1, 2)
        q, k, v = split_heads(self.to_q(x)), split_heads(self.to_k(src)), split_heads(self.to_v(src))
        o = ops.scaled_dot_product_attention(q, k, v)
        return self.to_out[0](ops.reshape(ops.transpose(o, 1, 2), (b, n, dim)))


class GEGLU(nn.Module):
    """``proj`` to 2 x inner, split into value and gate: value * gelu(gate) (exact erf gelu)."""

    def __init__(self, dim, inner):
        super().__init__()
        self.inner = inner
        self.proj = nn.Linear(dim, inner * 2)

    def forward(self, x):
        h = self.proj(x)
        val, gate = ops.slice(h, -1, 0, self.inner), ops.slice(h, -1, self.inner, 2 * self.inner)
        return val * ops.gelu(gate)


class FeedForward(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.net = nn.ModuleList([GEGLU(dim, dim * 4), nn.Dropout(0.0), nn.Linear(dim * 4, dim)])

    def forward(self, x):
        return self.net[2](self.net[0](x))


class BasicTransformerBlock(nn.Module):
    """Self-attention, cross-attention to the context, GEGLU feed-forward; pre-LayerNorm, residuals."""

    def __init__(self, dim, ctx_dim, heads):
        super().__init__()
        self.norm1, self.attn1 = nn.LayerNorm(dim), Attention(dim, dim, heads)
        self.norm2, self.attn2 = nn.LayerNorm(dim), Attention(dim, ctx_dim, heads)
        self.norm3, self.ff = nn.LayerNorm(dim), FeedForward(dim)

    def forward(self, x, ctx):
        x = x + self.attn1(self.norm1(x))
        x = x + self.attn2(self.norm2(x), ctx)
        return x + self.ff(self.norm3(x))


class Transformer2DModel(nn.Module):
    """GroupNorm (eps 1e-6) -> proj_in (1x1 conv, or a linear on tokens) -> one
    BasicTransformerBlock on the H*W tokens -> proj_out -> + input."""

    def __init__(self, c, cfg: UNetConfig, heads):
        super().__init__()
        self.linear = cfg.use_linear_projection
        self.norm = nn.GroupNorm(cfg.norm_num_groups, c, 1e-6)
        self.proj_in = nn.Linear(c, c) if self.linear else nn.Conv2d(c, c, 1)
        self.transformer_blocks = nn.ModuleList([BasicTransformerBlock(c, cfg.cross_attention_dim, heads)])
        self.proj_out = nn.Linear(c, c) if self.linear else nn.Conv2d(c, c, 1)

    def forward(self, x, ctx):
        b, c, hh, ww = x.shape
        h = self.norm(x)

        def to_tokens(t):
            return ops.reshape(ops.permute(t, (0, 2, 3, 1)), (b, hh * ww, c))

        def to_image(t):
            return ops.permute(ops.reshape(t, (b, hh, ww, c)), (0, 3, 1, 2))
        h = self.proj_in(to_tokens(h)) if self.linear else to_tokens(self.proj_in(h))
        h = self.transformer_blocks[0](h, ctx)
        h = to_image(self.proj_out(h)) if self.linear else self.proj_out(to_image(h))
        return h + x


class Sampler(nn.Module):
    """Downsample2D (a stride-2 3x3 ``conv``) or Upsample2D (nearest x2, then ``conv``)."""

    def __init__(self, c, up):
        super().__init__()
        self.up = up
        self.conv = nn.Conv2d(c, c, 3, 1 if up else 2, 1)

    def forward(self, x):
        return self.conv(ops.upsample_nearest2d(x, 2) if self.up else x)


class UNetBlock(nn.Module):
    """A down, mid or up block: ``resnets`` each followed by its attention (cross-attention
    blocks), then a sampler. Up blocks take one skip per resnet, concatenated on channels."""

    def __init__(self, resnets, attentions, samplers, kind):
        super().__init__()
        self.resnets = nn.ModuleList(resnets)
        if attentions:
            self.attentions = nn.ModuleList(attentions)
        if samplers:
            setattr(self, "downsamplers" if kind == "down" else "upsamplers", nn.ModuleList(samplers))
        self.kind = kind

    def forward(self, h, temb, ctx, skips):
        attns = self._modules.get("attentions")
        if self.kind == "mid":
            h = self.resnets[0](h, temb)
            h = attns[0](h, ctx)
            return self.resnets[1](h, temb)
        for j, resnet in enumerate(self.resnets):
            if self.kind == "up":
                h = ops.concat([h, skips.pop()], 1)
            h = resnet(h, temb)
            if attns is not None:
                h = attns[j](h, ctx)
            if self.kind == "down":
                skips.append(h)
        for sampler in self._modules.get("downsamplers", self._modules.get("upsamplers", ())):
            h = sampler(h)
            if self.kind == "down":
                skips.append(h)
        return h


class TimestepEmbedding(nn.Module):
    def __init__(self, c_in, dim):
        super().__init__()
        self.linear_1, self.linear_2 = nn.Linear(c_in, dim), nn.Linear(dim, dim)

    def forward(self, t):
        return self.linear_2(ops.silu(self.linear_1(t)))


class UNet2DConditionModel(nn.Module):
    """(sample, timestep features, context) -> the noise prediction; diffusers' module tree
    and names. Parameters are deferred (see ``nn.init.deferred``)."""

    def __init__(self, cfg: UNetConfig):
        super().__init__()
        _check(cfg)
        chans, heads, ted = cfg.block_out_channels, cfg.heads(), cfg.time_embed_dim
        last = len(chans) - 1
        with nn.init.deferred():
            self.time_embedding = TimestepEmbedding(chans[0], ted)
            self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1)
            skips, c_prev, down = [chans[0]], chans[0], []
            for i, kind in enumerate(cfg.down_block_types):
                c, cross = chans[i], kind.startswith("CrossAttn")
                res, att = [], []
                for j in range(cfg.layers_per_block):
                    res.append(ResnetBlock2D(c_prev, c, ted, cfg))
                    att += [Transformer2DModel(c, cfg, heads[i])] if cross else []
                    skips.append(c_prev := c)
                samp = [Sampler(c, up=False)] if i < last else []
                skips += [c] if i < last else []
                down.append(UNetBlock(res, att, samp, "down"))
            self.down_blocks = nn.ModuleList(down)
            self.mid_block = UNetBlock([ResnetBlock2D(c_prev, c_prev, ted, cfg), ResnetBlock2D(c_prev, c_prev, ted, cfg)],
                                       [Transformer2DModel(c_prev, cfg, heads[-1])], [], "mid")
            up = []
            for i, kind in enumerate(cfg.up_block_types):
                c, cross = chans[::-1][i], kind.startswith("CrossAttn")
                res, att = [], []
                for j in range(cfg.layers_per_block + 1):
                    res.append(ResnetBlock2D(c_prev + skips.pop(), c, ted, cfg))
                    att += [Transformer2DModel(c, cfg, heads[::-1][i])] if cross else []
                    c_prev = c
                up.append(UNetBlock(res, att, [Sampler(c, up=True)] if i < last else [], "up"))
            self.up_blocks = nn.ModuleList(up)
            self.conv_norm_out = nn.GroupNorm(cfg.norm_num_groups, chans[0], cfg.norm_eps)
            self.conv_out = nn.Conv2d(chans[0], cfg.out_channels, 3, padding=1)

    def forward(self, sample, tfeat, ctx):
        temb = self.time_embedding(tfeat)
        h = self.conv_in(sample)
        skips = [h]
        for block in self.down_blocks:
            h = block(h, temb, ctx, skips)
        h = self.mid_block(h, temb, ctx, skips)
        for block in self.up_blocks:
            h = block(h, temb, ctx, skips)
        return self.conv_out(ops.silu(self.conv_norm_out(h)))


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
    model = UNet2DConditionModel(cfg)
    g = graph if graph is not None else Graph()
    s = cfg.sample_size
    inputs = {
        "sample": g.input("sample", (batch, cfg.in_channels, s, s)),
        "timestep": g.input("timestep", (batch, cfg.block_out_channels[0])),
        "context": g.input("context", (batch, cfg.context_len, cfg.cross_attention_dim)),
    }
    out = model(inputs["sample"], inputs["timestep"], inputs["context"])
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
