"""The vision models the importer tests run (test_import_vision.py, test_import_vision_onnx.py):
torchvision's and timm's own classes, random-initialised at small sizes (no downloads), each
with an input of the smallest size that keeps every stage's feature map at least 1x1."""
import torch

torchvision = None
timm = None


def _packages():
    global torchvision, timm
    import timm as _timm
    import torchvision as _torchvision
    torchvision, timm = _torchvision, _timm


def lively(module, seed):
    """Weights a test can see through: initialisations that make a layer the identity or
    zero (batch norm's running statistics, LayerNorm's ones and zeros, ViT's zero head and class
    token, ConvNeXt's 1e-6 layer scale) are replaced by seeded values near them."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for m in module.modules():
            if isinstance(m, torch.nn.modules.batchnorm._BatchNorm) and m.running_mean is not None:
                m.running_mean.copy_(torch.rand(m.running_mean.shape, generator=g) * 0.4 - 0.2)
                m.running_var.copy_(torch.rand(m.running_var.shape, generator=g) + 0.5)
        for p in module.parameters():
            if p.numel() > 1 and bool((p == p.flatten()[0]).all()):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return module


class SegmentationLogits(torch.nn.Module):
    """A torchvision segmentation model's ``out`` map (its forward returns a dict)."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, x):
        return self.model(x)["out"]


def make(name, training=False):
    """(module in eval mode, example input). ``training``: no dropout or stochastic depth
    (training mode would draw random masks, which imported graphs do not); else stochastic
    depth where the model has it, which eval mode skips."""
    _packages()
    torch.manual_seed(0)
    dp = 0.0 if training else 0.1
    if name == "resnet18":
        m, size = torchvision.models.resnet18(num_classes=10), 32
    elif name == "mobilenet_v3_small":
        m, size = torchvision.models.mobilenet_v3_small(num_classes=10, width_mult=0.5, dropout=0.0 if training else 0.2), 32
    elif name == "vit":             # the class vit_b_16 builds, at a small width and depth
        m = torchvision.models.vision_transformer.VisionTransformer(
            image_size=32, patch_size=16, num_layers=2, num_heads=4, hidden_dim=32, mlp_dim=64, num_classes=10)
        size = 32
    elif name == "vit_b_16":        # at its own width and depth (86M weights): the slow job's
        m, size = torchvision.models.vit_b_16(image_size=32, num_classes=10), 32
    elif name == "convnext_atto":
        m, size = timm.create_model("convnext_atto", num_classes=10, drop_path_rate=dp), 32
    elif name == "efficientnet_b0":
        m, size = timm.create_model("efficientnet_b0", num_classes=10, drop_rate=0.0 if training else 0.2,
                                    drop_path_rate=dp), 32
    elif name == "swin_t":          # shifted windows: padding to whole windows, roll, masks
        m, size = torchvision.models.swin_t(num_classes=10), 64          # stochastic depth 0.2
    elif name == "lraspp_mobilenet_v3_large":      # segmentation: bilinear upsampling to the input's size
        m, size = SegmentationLogits(torchvision.models.segmentation.lraspp_mobilenet_v3_large(
            num_classes=3, weights_backbone=None)), 64
    else:
        raise KeyError(name)
    lively(m, 1)
    batch = 2 if training else 1
    if training and any(isinstance(b, torch.nn.BatchNorm2d) for b in m.modules()):
        size *= 2       # batch statistics over a 2x2 map of two samples: over 1x1 they are ill-conditioned
    x = torch.randn(batch, 3, size, size, generator=torch.Generator().manual_seed(2))
    return m.eval(), x


NAMES = ["resnet18", "mobilenet_v3_small", "vit", "convnext_atto", "efficientnet_b0"]
FULL_SIZE = ["vit_b_16"]          # from_torch only (its ONNX export would write 340 MB)
FORWARD_ONLY = ["swin_t", "lraspp_mobilenet_v3_large"]     # from_torch, outputs only
