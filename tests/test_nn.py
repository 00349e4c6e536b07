"""mg.nn against torch.nn: state-dict names, initialisations, forward outputs, training
steps (with batch norm's running statistics) and train/eval mode, on both backends."""
import math

import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura import nn
from meganeura.models.digits import DigitsCNN

BACKENDS = ["numpy", "gpu"]


class TorchDigitsCNN(torch.nn.Module):
    """DigitsCNN written with torch.nn: the same code, the other library."""

    def __init__(self, channels=(8, 16), hidden=32, dropout=0.1):
        super().__init__()
        tnn = torch.nn
        c1, c2 = channels
        self.features = tnn.Sequential(
            tnn.Conv2d(1, c1, 3, padding=1), tnn.ReLU(), tnn.MaxPool2d(2),
            tnn.Conv2d(c1, c2, 3, padding=1), tnn.BatchNorm2d(c2), tnn.ReLU(), tnn.MaxPool2d(2))
        self.classifier = tnn.Sequential(tnn.Flatten(), tnn.Linear(c2 * 4, hidden), tnn.ReLU(), tnn.Dropout(dropout),
                                         tnn.Linear(hidden, 10))

    def forward(self, x):
        return self.classifier(self.features(x))


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / max(np.abs(b).max(), 1e-12))


def _torch_cnn(seed=0, dropout=0.1):
    torch.manual_seed(seed)
    t = TorchDigitsCNN(dropout=dropout)
    bn = t.features[4]
    with torch.no_grad():        # non-trivial running statistics, so eval mode is really tested
        bn.running_mean.copy_(torch.randn(16) * 0.3)
        bn.running_var.copy_(torch.rand(16) + 0.5)
        bn.weight.copy_(torch.rand(16) + 0.5)
        bn.bias.copy_(torch.randn(16) * 0.1)
    return t


def _images(n, seed=1):
    return np.random.default_rng(seed).uniform(0, 1, (n, 1, 8, 8)).astype(np.float32)


@pytest.mark.parametrize("backend", BACKENDS)
def test_digits_cnn_loads_torch_state_dict_and_matches_torch(backend):
    t = _torch_cnn()
    ours = DigitsCNN()
    assert list(ours.state_dict()) == list(t.state_dict())
    assert ours.load_state_dict(t.state_dict()) == ([], [])
    x = _images(6)
    t.eval()
    ours.eval()
    predict = mg.jit(ours, backend=backend)
    want = t(torch.tensor(x)).detach().numpy()
    got = predict(x)
    assert got.shape == (6, 10) and _rel(got, want) < 1e-4, _rel(got, want)
    # a different batch size: one more program, the same weights
    got3 = predict(x[:3])
    assert len(predict.sessions) == 2 and _rel(got3, want[:3]) < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_digits_cnn_training_step_matches_torch(backend):
    """One SGD step in train mode: batch statistics, the gradients through them, and the
    running-statistics update all match torch (dropout off so the step is deterministic)."""
    t = _torch_cnn(seed=3, dropout=0.0)
    ours = DigitsCNN(dropout=0.0)
    ours.load_state_dict(t.state_dict())
    x, y = _images(8, seed=4), np.random.default_rng(5).integers(0, 10, 8).astype(np.int32)
    t.train()
    opt = torch.optim.SGD(t.parameters(), lr=0.5)
    loss_t = torch.nn.functional.cross_entropy(t(torch.tensor(x)), torch.tensor(y, dtype=torch.long))
    loss_t.backward()
    opt.step()
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(ours(x), y), optimizer=mg.optim.SGD(lr=0.5), backend=backend)
    loss = step(x, y)
    loss_t = float(loss_t.detach())
    assert abs(loss - loss_t) < 1e-5 * max(1.0, abs(loss_t))
    got = step.state_dict(include_optimizer=True)
    for k, v in t.state_dict().items():
        if k.endswith("num_batches_tracked"):       # counted as torch does: one per training call
            assert got[k].dtype == np.int64 and int(got[k]) == int(v) == 1, k
            continue
        assert _rel(got[k], v.numpy()) < 1e-4, (k, _rel(got[k], v.numpy()))
    # write_back puts the trained values into the module
    step.write_back(ours)
    np.testing.assert_allclose(ours.state_dict()["features.4.running_var"], t.features[4].running_var.numpy(),
                               rtol=1e-5)
    step(x, y)
    ours.eval()
    mg.jit(ours, backend=backend, share_with=step)(x)  # eval calls do not count
    n = step.write_back(ours).state_dict()["features.4.num_batches_tracked"]
    assert isinstance(n, np.ndarray) and n.shape == () and n.dtype == np.int64 and int(n) == 2


def test_every_layer_has_torch_names_shapes_and_outputs():
    """A model using every parametrised layer: same state-dict keys and shapes as its torch
    twin, and the same outputs once torch's weights are loaded."""
    def build(lib):
        class Net(lib.Module):
            def __init__(self):
                super().__init__()
                self.emb = lib.Embedding(11, 8, padding_idx=0)
                self.conv1 = lib.Conv1d(8, 12, 3, padding=1, groups=2)
                self.gn = lib.GroupNorm(3, 12)
                self.ln = lib.LayerNorm(12)
                self.rms = lib.RMSNorm(12, eps=1e-6)
                self.blocks = lib.ModuleList([lib.Linear(12, 12), lib.Linear(12, 12, bias=False)])
                self.conv2 = lib.Conv2d(1, 2, (3, 2), stride=(1, 2), padding=(1, 0))
                self.bn = lib.BatchNorm2d(2)
                self.head = lib.Sequential(lib.GELU(), lib.Linear(12, 5))

            def forward(self, ids):
                h = self.emb(ids)                                    # (N, L, 8)
                h = self.conv1(h.permute(0, 2, 1))                   # (N, 12, L)
                h = self.gn(h).permute(0, 2, 1)                      # (N, L, 12)
                h = self.rms(self.ln(h))
                for blk in self.blocks:
                    h = h + blk(h)
                img = self.bn(self.conv2(h.reshape(h.shape[0], 1, h.shape[1], 12)))   # (N, 2, L, 6)
                return self.head(h) + img.reshape(h.shape[0], h.shape[1], 12).sum(-1, keepdim=True)
        return Net()

    torch.manual_seed(0)
    tm = build(torch.nn).eval()
    with torch.no_grad():
        tm.bn.running_mean.uniform_(-0.5, 0.5)
        tm.bn.running_var.uniform_(0.5, 1.5)
    om = build(nn).eval()
    assert [(k, tuple(v.shape)) for k, v in om.state_dict().items()] == \
           [(k, tuple(v.shape)) for k, v in tm.state_dict().items()]
    om.load_state_dict(tm.state_dict())
    ids = np.random.default_rng(0).integers(0, 11, (2, 5)).astype(np.int32)
    want = tm(torch.tensor(ids, dtype=torch.long)).detach().numpy()
    got = mg.jit(om)(ids)
    assert _rel(got, want) < 1e-4, _rel(got, want)


def test_default_initialisations_follow_torch():
    nn.init.manual_seed(0)
    lin = nn.Linear(400, 300)
    b = 1 / math.sqrt(400)
    w = lin.weight.data
    assert np.abs(w).max() <= b and abs(w.std() - b / math.sqrt(3)) < 0.02 * b
    assert np.abs(lin.bias.data).max() <= b and np.abs(lin.bias.data).max() > 0.9 * b
    conv = nn.Conv2d(6, 8, 5, groups=2)            # fan_in = 3 * 5 * 5
    assert conv.weight.shape == (8, 3, 5, 5) and np.abs(conv.weight.data).max() <= 1 / math.sqrt(75)
    emb = nn.Embedding(1000, 64, padding_idx=3)
    assert abs(emb.weight.data.std() - 1.0) < 0.02 and not emb.weight.data[3].any()
    mha = nn.MultiheadAttention(32, 4)
    bx = math.sqrt(6 / (32 + 96))                  # xavier on (96, 32)
    assert np.abs(mha.in_proj_weight.data).max() <= bx and np.abs(mha.in_proj_weight.data).max() > 0.9 * bx
    assert not mha.in_proj_bias.data.any() and not mha.out_proj.bias.data.any()
    ln, bn = nn.LayerNorm(5), nn.BatchNorm2d(3)
    assert (ln.weight.data == 1).all() and (ln.bias.data == 0).all()
    assert (bn.running_var == 1).all() and (bn.running_mean == 0).all() and bn.num_batches_tracked.dtype == np.int64
    # torch's own modules land in the same ranges
    tl = torch.nn.Linear(400, 300)
    assert abs(float(tl.weight.detach().std()) - w.std()) < 0.02 * b
    nn.init.manual_seed(0)
    np.testing.assert_array_equal(nn.Linear(400, 300).weight.data, w)      # seeded: repeatable


@pytest.mark.filterwarnings("ignore:Support for mismatched key_padding_mask")
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("need_weights", [True, False])
def test_multihead_attention_matches_torch(batch_first, need_weights):
    torch.manual_seed(1)
    tm = torch.nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=12, vdim=10)
    om = nn.MultiheadAttention(16, 4, batch_first=batch_first, kdim=12, vdim=10)
    assert list(om.state_dict()) == list(tm.state_dict())
    with torch.no_grad():
        tm.in_proj_bias.uniform_(-0.2, 0.2)
        tm.out_proj.bias.uniform_(-0.2, 0.2)
    om.load_state_dict(tm.state_dict())
    rng = np.random.default_rng(2)
    lq, ls, n = 5, 7, 3
    shp = (lambda l, e: (n, l, e)) if batch_first else (lambda l, e: (l, n, e))
    q, k, v = (rng.standard_normal(shp(l, e)).astype(np.float32) for l, e in ((lq, 16), (ls, 12), (ls, 10)))
    kpm = np.zeros((n, ls), bool)
    kpm[0, -2:] = True
    attn_mask = rng.standard_normal((lq, ls)).astype(np.float32)
    to = tm(*(torch.tensor(a) for a in (q, k, v)), key_padding_mask=torch.tensor(kpm),
            attn_mask=torch.tensor(attn_mask), need_weights=need_weights)

    def f(q, k, v):
        return om(q, k, v, key_padding_mask=kpm, attn_mask=attn_mask, need_weights=need_weights)
    oo = mg.jit(f)(q, k, v)
    assert _rel(oo[0], to[0].detach().numpy()) < 1e-4
    if need_weights:
        assert _rel(oo[1], to[1].detach().numpy()) < 1e-4
    else:
        assert oo[1] is None and to[1] is None


def test_multihead_attention_on_gpu_and_causal():
    torch.manual_seed(2)
    tm = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    om = nn.MultiheadAttention(8, 2, batch_first=True)
    om.load_state_dict(tm.state_dict())
    x = np.random.default_rng(3).standard_normal((2, 6, 8)).astype(np.float32)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(6)
    want = tm(*(torch.tensor(x),) * 3, attn_mask=causal, is_causal=True, need_weights=False)[0].detach().numpy()
    got = mg.jit(lambda x: om(x, x, x, need_weights=False, is_causal=True)[0], backend="gpu")(x)
    assert _rel(got, want) < 1e-4


def test_dropout_train_and_eval_modes():
    drop = nn.Dropout(0.25)
    f = mg.jit(drop, seed=0)
    x = np.ones((200, 50), np.float32)
    a, b = f(x), f(x)
    for y in (a, b):
        kept = y != 0
        assert abs(kept.mean() - 0.75) < 0.02
        np.testing.assert_allclose(y[kept], 1 / 0.75, rtol=1e-6)
    assert (a != b).any()                       # a fresh mask every call
    drop.eval()
    np.testing.assert_array_equal(f(x), x)      # eval: identity (a second program)
    assert len(f.sessions) == 1 and len(f._entries[next(iter(f._entries))]) == 2


def test_batch_norm_modes_on_gpu_match_torch():
    torch.manual_seed(4)
    tb = torch.nn.BatchNorm2d(3, momentum=0.2)
    ob = nn.BatchNorm2d(3, momentum=0.2)
    x = np.random.default_rng(6).standard_normal((4, 3, 5, 5)).astype(np.float32) * 2 + 1
    f = mg.jit(ob, backend="gpu")
    for _ in range(2):       # train mode: batch statistics, running stats updated by every call
        want = tb(torch.tensor(x)).detach().numpy()
        assert _rel(f(x), want) < 1e-4
    st = f.state_dict(include_optimizer=True)
    np.testing.assert_allclose(st["running_mean"], tb.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st["running_var"], tb.running_var.numpy(), rtol=1e-5)
    tb.eval()
    ob.eval()
    assert _rel(f(x), tb(torch.tensor(x)).detach().numpy()) < 1e-4


def test_custom_module_reads_like_torch():
    class Scale(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(3, 2)
            self.gain = nn.Parameter(np.full(2, 3.0))

        def forward(self, x):
            return self.fc(x) * self.gain
    m = Scale()
    g = mg.Graph()
    y = m(g.input("x", (4, 3)))
    assert set(g.parameters) == {"fc.weight", "fc.bias", "gain"}
    x = np.ones((4, 3), np.float32)
    out = mg.compile(g, outputs=[y]).run({"x": x})[0]
    np.testing.assert_allclose(out, (x @ m.fc.weight.data.T + m.fc.bias.data) * 3.0, rtol=1e-6)
    with pytest.raises(TypeError, match="call it on mg Tensors"):
        m(x)


def test_load_state_dict_strict_false_and_prefix_hint():
    m = nn.Sequential(nn.Linear(3, 2))
    sd = {"model." + k: v for k, v in m.state_dict().items()}
    with pytest.raises(ValueError) as e:
        m.load_state_dict(sd)
    msg = str(e.value)
    assert "2 missing key(s)" in msg and "2 unexpected key(s)" in msg and "starts with 'model.'" in msg
    res = m.load_state_dict({**m.state_dict(), "extra": np.zeros(1)}, strict=False)
    assert res.missing_keys == [] and res.unexpected_keys == ["extra"]
    with pytest.raises(ValueError, match=r"'0.weight': got shape \(3, 3\), expected \(2, 3\)"):
        m.load_state_dict({"0.weight": np.zeros((3, 3))}, strict=False)
    # the same on a compiled session
    g = mg.Graph()
    y = m(g.input("x", (1, 3)))
    s = mg.compile(g, outputs=[y])
    with pytest.raises(ValueError, match="starts with 'model.'"):
        s.load_state_dict(sd)
    res = s.load_state_dict({"0.weight": np.ones((2, 3)), "junk": np.ones(2)}, strict=False)
    assert res.missing_keys == ["0.bias"] and res.unexpected_keys == ["junk"]
    np.testing.assert_array_equal(s.state_dict()["0.weight"], np.ones((2, 3)))
    with pytest.raises(ValueError, match="expected key starts with"):
        s.load_state_dict({k[2:]: v for k, v in m.state_dict().items()})
