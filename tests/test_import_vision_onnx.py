"""mg.from_onnx on the vision models of test_import_vision.py (torchvision's ResNet-18,
MobileNetV3-Small and ViT, timm's ConvNeXt-Atto and EfficientNet-B0, random-initialised at
32x32) exported by ``torch.onnx.export`` (dynamo=True): the optimized export (batch norm folded
into the convolutions; HardSwish, HardSigmoid, LayerNormalization, Gelu as ONNX operators)
matches torch to 1e-4 relative on the interpreter and both GPU backends, and the gradients of
the plain export's graph (batch norm as BatchNormalization in inference mode, weights under
torch's names) are torch's in eval mode. LR-ASPP (bilinear upsampling as Resize) and Swin-T
(its shifted-window masks, built by slice assignment, as ScatterND) are held to their outputs."""
import warnings

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("onnxscript")
pytest.importorskip("torchvision")
pytest.importorskip("timm")

import meganeura as mg  # noqa: E402
from meganeura.bench.gates import rel_l2  # noqa: E402

from .vision_models import NAMES, make  # noqa: E402

BACKENDS = ["numpy", "gpu", "wgpu"]
# exporting takes 4-10 s a model on 2 shared cores, compiling its kernels for lavapipe as much
# again: ViT's cases run in the fast job, the others in the slow one
FAST = {"vit"}


def cases(backends=BACKENDS, names=NAMES):
    return [pytest.param(name, backend, marks=[] if name in FAST else [pytest.mark.slow])
            for name in names for backend in backends]


class Exported(dict):
    """(module, input, path) per (model, optimize), exported on first use."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, key):
        name, optimize = key
        module, x = make(name)
        path = self.folder / f"{name}{'' if optimize else '_plain'}.onnx"
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, (x,), str(path), dynamo=True, optimize=optimize, verbose=False)
        self[key] = (module, x, path)
        return self[key]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    return Exported(tmp_path_factory.mktemp("vision_onnx"))


# LR-ASPP's bilinear upsampling exports as Resize; Swin-T's shifted-window masks as ScatterND
@pytest.mark.parametrize("name,backend", cases(names=NAMES + ["lraspp_mobilenet_v3_large", "swin_t"]))
def test_vision_onnx_outputs_match_torch(exported, name, backend):
    module, x, path = exported[name, True]
    imported = mg.from_onnx(path)
    with torch.no_grad():
        ref = module(x).numpy()
    out = imported.compile(backend=backend).run(imported.feeds(x))[0]
    err = rel_l2(out, ref)
    print(f"[{backend}] {name} (onnx): {len(imported.graph.nodes)} nodes, rel L2 {err:.2e}")
    assert out.shape == ref.shape
    assert err < 1e-4, err


@pytest.mark.parametrize("name,backend", cases(["numpy", "gpu"]))
def test_vision_onnx_gradients_match_torch(exported, name, backend):
    """A mean-square loss on the logits of the plain export: the loss and the gradient of every
    weight (each under its torch name) are torch's, the module in eval mode as exported."""
    module, x, path = exported[name, False]
    imported = mg.from_onnx(path)
    target = np.random.default_rng(7).standard_normal(imported.output.shape).astype(np.float32)
    t = imported.graph.input("target", imported.output.shape)
    s = imported.compile(loss=mg.ops.mse_loss(imported.output, t), optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    ours = s.compute_grads({**imported.feeds(x), "target": target})
    grads = s.grads()
    module.zero_grad()
    ref = torch.nn.functional.mse_loss(module(x), torch.from_numpy(target))
    ref.backward()
    assert abs(ours - ref.item()) <= 1e-5 * abs(ref.item())
    worst, checked = 0.0, 0
    for pname, p in module.named_parameters():
        assert pname in grads, pname
        err = rel_l2(grads[pname], p.grad.numpy())
        worst = max(worst, err)
        assert err < 1e-4, (pname, err)
        checked += 1
    print(f"[{backend}] {name} (onnx): {checked} gradients, worst rel L2 {worst:.2e}")
    assert checked == len(list(module.parameters()))
