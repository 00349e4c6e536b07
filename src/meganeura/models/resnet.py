"""ResNet image classifier, as transformers' ``ResNetForImageClassification``.

Stem: 7x7 stride-2 conv + batch norm + ReLU, then a 3x3 stride-2 max pool. Stages of
residual blocks follow (bottleneck: 1x1 reduce, 3x3, 1x1 expand, each conv followed by a
batch norm; basic: two 3x3). The first block of a stage carries a 1x1 conv + BN shortcut
when channels or stride change. As in transformers (``downsample_in_bottleneck=False``,
the default, i.e. "ResNet v1.5"), a stage's stride sits on the bottleneck's 3x3 conv, not
on its first 1x1; the first stage does not downsample. Global average pool, then
``classifier.1`` (a Linear after a Flatten at index 0).

Names are those of the torch state dict. Batch-norm modes (``bn=``):

- "train": batch statistics (biased variance), as torch in train mode. ``running_mean``,
  ``running_var`` and ``num_batches_tracked`` (i32) are graph *state* (not parameters, so
  never trained), and every training ``step`` applies torch's momentum update to them
  itself (``Graph.update``, recorded by ``nn.BatchNorm2d``); ``ResNetGraph.state_updates``
  lists those updates, e.g. for ``mg.compile(state_updates=...)`` to apply them on ``run``.
- "eval": running statistics (graph state, fed by ``load_state_dict``).
- "folded": inference with batch norm folded into each conv at load time
  (``fold_batch_norm``): parameters are ``<conv>.weight`` and a new ``<conv>.bias``.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .. import nn, ops
from ..graph import Graph, Tensor, i32

BN_MODES = ("train", "eval", "folded")


@dataclass(frozen=True)
class ResNetConfig:
    num_channels: int = 3
    embedding_size: int = 64
    hidden_sizes: tuple = (256, 512, 1024, 2048)
    depths: tuple = (3, 4, 6, 3)
    layer_type: str = "bottleneck"
    num_labels: int = 1000
    image_size: int = 224
    downsample_in_first_stage: bool = False
    downsample_in_bottleneck: bool = False
    bn_eps: float = 1e-5        # nn.BatchNorm2d's defaults, which transformers uses
    bn_momentum: float = 0.1

    @classmethod
    def resnet50(cls):
        """microsoft/resnet-50: ImageNet's 1000 classes on 224x224 images."""
        return cls()

    @classmethod
    def tiny(cls):
        """Test size: 32x32 images, 10 classes; stage 0 has a (stride-1) projection shortcut
        and an identity block, stage 1 a stride-2 one."""
        return cls(embedding_size=8, hidden_sizes=(16, 32), depths=(2, 1), num_labels=10, image_size=32)

    def hf_kwargs(self) -> dict:
        """Keyword arguments for ``transformers.ResNetConfig`` describing the same model."""
        return dict(num_channels=self.num_channels, embedding_size=self.embedding_size,
                    hidden_sizes=list(self.hidden_sizes), depths=list(self.depths), layer_type=self.layer_type,
                    num_labels=self.num_labels, downsample_in_first_stage=self.downsample_in_first_stage,
                    downsample_in_bottleneck=self.downsample_in_bottleneck)

    def __post_init__(self):
        if self.layer_type not in ("bottleneck", "basic"):
            raise ValueError(f"layer_type must be 'bottleneck' or 'basic', got {self.layer_type!r}")
        if len(self.hidden_sizes) != len(self.depths):
            raise ValueError("hidden_sizes and depths must have one entry per stage")


@dataclass
class ResNetGraph:
    graph: Graph
    pixel_values: Tensor
    logits: Tensor
    labels: Tensor | None = None
    loss: Tensor | None = None
    state_updates: dict = field(default_factory=dict)   # {batch-norm state: value after a step} ("train")


class ResNetConvLayer(nn.Module):
    """``convolution`` (no bias, padding kernel // 2) + ``normalization`` (batch norm), or,
    with ``folded``, a biased convolution alone; then an optional ReLU."""

    def __init__(self, c_in, c_out, kernel, stride, relu, cfg: ResNetConfig, folded):
        super().__init__()
        self.relu = relu
        self.convolution = nn.Conv2d(c_in, c_out, kernel, stride, kernel // 2, bias=folded)
        self.normalization = (nn.Identity() if folded
                              else nn.BatchNorm2d(c_out, eps=cfg.bn_eps, momentum=cfg.bn_momentum))

    def forward(self, x):
        y = self.normalization(self.convolution(x))
        return ops.relu(y) if self.relu else y


class ResNetLayer(nn.Module):
    """A residual block (bottleneck or basic) with a projection ``shortcut`` where channels
    or stride change."""

    def __init__(self, c_in, c_out, stride, cfg: ResNetConfig, folded):
        super().__init__()
        conv = (lambda *a: ResNetConvLayer(*a, cfg, folded))
        self.shortcut = conv(c_in, c_out, 1, stride, False) if c_in != c_out or stride != 1 else nn.Identity()
        if cfg.layer_type == "bottleneck":
            mid = c_out // 4
            first, second = (stride, 1) if cfg.downsample_in_bottleneck else (1, stride)
            self.layer = nn.Sequential(conv(c_in, mid, 1, first, True), conv(mid, mid, 3, second, True),
                                       conv(mid, c_out, 1, 1, False))
        else:
            self.layer = nn.Sequential(conv(c_in, c_out, 3, stride, True), conv(c_out, c_out, 3, 1, False))

    def forward(self, x):
        shortcut = self.shortcut(x)
        return ops.relu(self.layer(x) + shortcut)


class ResNetStage(nn.Module):
    def __init__(self, c_in, c_out, depth, stride, cfg, folded):
        super().__init__()
        self.layers = nn.Sequential(*(ResNetLayer(c_in if k == 0 else c_out, c_out, stride if k == 0 else 1, cfg,
                                                  folded) for k in range(depth)))

    def forward(self, x):
        return self.layers(x)


class ResNetEmbeddings(nn.Module):
    def __init__(self, cfg: ResNetConfig, folded):
        super().__init__()
        self.embedder = ResNetConvLayer(cfg.num_channels, cfg.embedding_size, 7, 2, True, cfg, folded)
        self.pooler = nn.MaxPool2d(3, 2, 1)

    def forward(self, x):
        return self.pooler(self.embedder(x))


class ResNetEncoder(nn.Module):
    def __init__(self, cfg: ResNetConfig, folded):
        super().__init__()
        c_in, stages = cfg.embedding_size, []
        for s, (c_out, depth) in enumerate(zip(cfg.hidden_sizes, cfg.depths)):
            stride = 2 if s > 0 or cfg.downsample_in_first_stage else 1
            stages.append(ResNetStage(c_in, c_out, depth, stride, cfg, folded))
            c_in = c_out
        self.stages = nn.ModuleList(stages)

    def forward(self, x):
        for stage in self.stages:
            x = stage(x)
        return x


class ResNetModel(nn.Module):
    def __init__(self, cfg: ResNetConfig, folded):
        super().__init__()
        self.embedder = ResNetEmbeddings(cfg, folded)
        self.encoder = ResNetEncoder(cfg, folded)

    def forward(self, x):
        return ops.adaptive_avg_pool2d(self.encoder(self.embedder(x)), 1)


class ResNetForImageClassification(nn.Module):
    """transformers' module tree and names. ``bn``: "train" / "eval" set the batch norms'
    mode (``train()`` / ``eval()`` switch it later); "folded" has no batch norms and biased
    convolutions (load ``fold_batch_norm(state)``). Parameters are deferred (see
    ``nn.init.deferred``)."""

    def __init__(self, cfg: ResNetConfig, bn="folded"):
        super().__init__()
        if bn not in BN_MODES:
            raise ValueError(f"bn must be one of {BN_MODES}, got {bn!r}")
        with nn.init.deferred():
            self.resnet = ResNetModel(cfg, bn == "folded")
            self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(cfg.hidden_sizes[-1], cfg.num_labels))
        self.train(bn == "train")

    def forward(self, pixel_values):
        return self.classifier(self.resnet(pixel_values))


def build_resnet(cfg: ResNetConfig, batch: int, bn="folded", with_loss=False) -> ResNetGraph:
    """ResNet graph on ``pixel_values`` (batch, channels, image_size, image_size).

    bn: "folded" (inference, load ``fold_batch_norm(state)``), "eval" (inference with
    running statistics) or "train" (batch statistics). ``with_loss`` adds an i32 ``labels``
    input (batch,) and the mean class cross-entropy."""
    model = ResNetForImageClassification(cfg, bn)
    g = Graph()
    x = g.input("pixel_values", (batch, cfg.num_channels, cfg.image_size, cfg.image_size))
    logits = model(x)
    out = ResNetGraph(g, x, logits, state_updates=nn.state_updates(g))
    if with_loss:
        out.labels = g.input("labels", (batch,), i32)
        out.loss = ops.cross_entropy(logits, out.labels)
    return out


def build_resnet_training(cfg: ResNetConfig, batch: int) -> ResNetGraph:
    """Training graph: batch-statistics batch norm, cross-entropy loss, running-stat updates."""
    return build_resnet(cfg, batch, bn="train", with_loss=True)


def torch_state_dict(state: dict) -> dict:
    """A torch ResNet state dict as numpy arrays: float32, and ``num_batches_tracked`` as
    its integers (the "train" and "eval" graphs hold it as state)."""
    out = {}
    for k, v in state.items():
        arr = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v)
        out[k] = arr if k.endswith("num_batches_tracked") else arr.astype(np.float32)
    return out


def fold_batch_norm(state: dict, eps: float = 1e-5) -> dict:
    """Fold every ``X.normalization`` (eval-mode batch norm) into ``X.convolution``:
    w' = w * s, b' = beta - mean * s with s = gamma / sqrt(var + eps) per output channel.
    Returns a state dict for ``build_resnet(..., bn="folded")``; other entries pass through
    and every ``normalization`` entry (``num_batches_tracked`` too) is dropped. Computed in
    float64, stored as float32."""
    state = torch_state_dict(state)
    out = {}
    for k, v in state.items():
        if ".normalization." in k:
            continue
        if k.endswith(".convolution.weight"):
            n = k[: -len("convolution.weight")] + "normalization."
            gamma, beta, mean, var = (state[n + s].astype(np.float64)
                                      for s in ("weight", "bias", "running_mean", "running_var"))
            s = gamma / np.sqrt(var + eps)
            out[k] = (v.astype(np.float64) * s[:, None, None, None]).astype(np.float32)
            out[k[: -len("weight")] + "bias"] = (beta - mean * s).astype(np.float32)
        else:
            out[k] = v
    return out
