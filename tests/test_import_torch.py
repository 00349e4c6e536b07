"""mg.from_torch: torch modules nobody here wrote (transformers' families: test_import_transformers.py,
random-initialised) and small handwritten CNN / MLP, imported through torch.export and
checked against torch: outputs to 1e-4 relative on the interpreter and both GPU backends,
gradients of the imported training graph, errors that list every unsupported op."""
import subprocess
import sys

import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.bench.gates import rel_l2
from meganeura.importers import ModelImportError, UnsupportedOpsError

BACKENDS = ["numpy", "gpu", "wgpu"]


class SmallCNN(torch.nn.Module):
    """conv2d (plain, strided, grouped), batch norm, relu, max / avg / adaptive pooling, linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.fc = torch.nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = torch.relu(self.bn(self.conv1(x)))
        x = torch.nn.functional.max_pool2d(x, 2)
        x = torch.nn.functional.avg_pool2d(torch.relu(self.conv2(x)), 1)
        x = torch.nn.functional.adaptive_avg_pool2d(x, 2)
        return self.fc(x.flatten(1))


class SmallMLP(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(12, 16), torch.nn.GELU(), torch.nn.LayerNorm(16),
                                       torch.nn.Linear(16, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))

    def forward(self, x):
        return torch.softmax(self.net(x), dim=-1)


def cnn():
    torch.manual_seed(0)
    m = SmallCNN()
    with torch.no_grad():        # running statistics that are not the identity
        m.bn.running_mean.uniform_(-0.5, 0.5)
        m.bn.running_var.uniform_(0.5, 2.0)
    return m


def check_outputs(module, args, backend, tol=1e-4):
    module.eval()
    imported = mg.from_torch(module, args)
    with torch.no_grad():
        ref = module(*args)
    refs = [ref] if isinstance(ref, torch.Tensor) else [r for r in ref.values()] if hasattr(ref, "values") else list(ref)
    s = imported.compile(backend=backend)
    outs = s.run(imported.feeds(*args))
    assert len(outs) == len(refs)
    for name, ours, theirs in zip(imported.output_names, outs, refs):
        err = rel_l2(ours, theirs.numpy())
        print(f"[{backend}] {type(module).__name__}.{name}: rel L2 {err:.2e}")
        assert err < tol, (name, err)
    return imported, s


@pytest.mark.parametrize("backend", BACKENDS)
def test_cnn_forward_matches_torch(backend):
    torch.manual_seed(1)
    check_outputs(cnn(), (torch.randn(2, 3, 16, 16),), backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_mlp_forward_matches_torch(backend):
    torch.manual_seed(2)
    m = SmallMLP()
    check_outputs(m, (torch.randn(4, 12),), backend)


def test_weights_keep_torch_names_and_load_back():
    m = cnn()
    x = torch.randn(2, 3, 16, 16)
    imported = mg.from_torch(m, (x,))
    assert set(imported.state_dict()) == set(m.state_dict())
    s = imported.compile(backend="numpy")
    assert set(s.state_dict()) == set(m.state_dict())
    for name, value in m.state_dict().items():
        np.testing.assert_array_equal(s.state_dict()[name], value.numpy().astype(s.state_dict()[name].dtype))
    # other weights, loaded by their torch names, give the other model's outputs
    other = cnn()
    torch.manual_seed(5)
    other = SmallCNN().eval()
    s.load_state_dict(other.state_dict())
    with torch.no_grad():
        ref = other(x).numpy()
    assert rel_l2(s.run(imported.feeds(x))[0], ref) < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_cnn_training_gradients_and_running_stats_match_torch(backend):
    """training=True: batch norm normalises with the batch's statistics; the gradients of a
    cross-entropy loss and the running statistics after one step are torch's."""
    torch.manual_seed(3)
    m = cnn()
    x, labels = torch.randn(4, 3, 16, 16), torch.tensor([0, 3, 1, 4])
    imported = mg.from_torch(m, (x,), training=True)
    g = imported.graph
    y = g.input("labels", (4,), mg.i32)
    loss = mg.ops.cross_entropy(imported.output, y)
    s = imported.compile(loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    ours_loss = s.compute_grads({**imported.feeds(x), "labels": labels.numpy()})
    grads = s.grads()
    m.train()
    ref_loss = torch.nn.functional.cross_entropy(m(x), labels)
    ref_loss.backward()
    assert abs(ours_loss - ref_loss.item()) < 1e-5 * abs(ref_loss.item())
    scale = max(np.linalg.norm(p.grad.numpy()) for p in m.parameters())
    for name, p in m.named_parameters():
        ref = p.grad.numpy()
        if np.linalg.norm(ref) < 1e-5 * scale:      # conv1.bias before batch norm: zero but for rounding
            assert np.linalg.norm(grads[name]) < 1e-5 * scale, name
            continue
        err = rel_l2(grads[name], ref)
        assert err < 1e-4, (name, err)
    s.step({**imported.feeds(x), "labels": labels.numpy()})     # running statistics of the forward before the update
    state = s.state_dict(include_optimizer=True)
    for name in ("bn.running_mean", "bn.running_var"):
        assert rel_l2(state[name], m.state_dict()[name].numpy()) < 1e-5, name
    assert int(state["bn.num_batches_tracked"]) == 1


def test_mlp_fine_tunes_like_torch():
    """Three AdamW steps of the imported MLP on the interpreter against torch's."""
    torch.manual_seed(4)
    m = SmallMLP()
    x, target = torch.randn(8, 12), torch.softmax(torch.randn(8, 3), -1)
    imported = mg.from_torch(m, (x,), training=True)
    t = imported.graph.input("target", (8, 3))
    loss = mg.ops.mse_loss(imported.output, t)
    s = imported.compile(loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="numpy")
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    for _ in range(3):
        ours = s.step({**imported.feeds(x), "target": target.numpy()})
        opt.zero_grad()
        ref = torch.nn.functional.mse_loss(m(x), target)
        ref.backward()
        opt.step()
        assert abs(ours - ref.item()) <= 1e-5 * abs(ref.item()) + 1e-9
    for name, p in m.named_parameters():
        assert rel_l2(s.state_dict()[name], p.detach().numpy()) < 1e-4, name


class Strided(torch.nn.Module):
    """as_strided over a value's storage: a transposed read and overlapping windows."""

    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)                                         # (2, 6), contiguous
        windows = h.as_strided((2, 4, 3), (6, 1, 1))            # rows' overlapping windows of 3
        flipped = h.as_strided((6, 2), (1, 6))                  # h.t() read from the storage
        return windows.sum(-1) * flipped[:4].t()


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_as_strided_reads_the_storage_and_differentiates(backend):
    torch.manual_seed(5)
    m, x = Strided(), torch.randn(2, 6)
    imported, _ = check_outputs(m, (x,), backend, tol=1e-5)
    imported = mg.from_torch(m, (x,), training=True)
    loss = mg.ops.sum(imported.output * imported.output)
    s = imported.compile(loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    s.compute_grads(imported.feeds(x))
    m.zero_grad()
    (m(x) ** 2).sum().backward()
    for name, p in m.named_parameters():
        assert rel_l2(s.grads()[name], p.grad.numpy()) < 1e-5, name


class StridedOutside(torch.nn.Module):
    def forward(self, x):
        return x[1:].as_strided((2, 3), (3, 1), 0) * 2          # storage before the slice's own


def test_as_strided_outside_its_input_is_named():
    with pytest.raises(ModelImportError, match=r"aten.as_strided.default \(node as_strided\): "
                       r"NotImplementedError: as_strided\(size=\[2, 3\], stride=\[3, 1\]\) reads storage "
                       r"position 0 outside the input \(3, 3\)"):
        mg.from_torch(StridedOutside(), (torch.randn(4, 3),))


class Unsupported(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x):
        y = torch.sin(self.lin(x))             # no sin op in meganeura
        z = torch.cumsum(y, dim=1)             # nor a running sum
        return torch.cos(z) + torch.sin(y)


def test_unsupported_ops_are_listed_at_once_with_their_source_lines():
    with pytest.raises(UnsupportedOpsError) as info:
        mg.from_torch(Unsupported(), (torch.randn(2, 4),))
    text = str(info.value)
    for target in ("aten.sin.default", "aten.cumsum.default", "aten.cos.default"):
        assert target in text
    assert text.count("aten.sin.default (node") == 2          # every node, not one per try
    assert "test_import_torch.py" in text and "torch.cumsum(y, dim=1)" in text
    assert len(info.value.problems) == 4


class DataDependent(torch.nn.Module):
    def forward(self, x):
        if x.sum() > 0:                        # control flow on a value: torch.export refuses it
            return x * 2
        return x


def test_module_that_fails_to_export_names_the_cause():
    with pytest.raises(ModelImportError) as info:
        mg.from_torch(DataDependent(), (torch.randn(3),))
    text = str(info.value)
    assert "torch.export could not export DataDependent" in text
    assert info.value.__cause__ is None and info.value.__suppress_context__


def test_import_meganeura_imports_neither_torch_nor_onnx():
    code = "import sys, meganeura; print(sorted(m for m in ('torch', 'onnx', 'onnxscript') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
    assert callable(mg.from_torch) and callable(mg.from_onnx)
