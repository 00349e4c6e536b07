"""The SmolVLA action expert graph (tiny config) against the PyTorch reference module in
bench/smolvla_reference.py: forward, MSE loss and every parameter gradient, on the numpy
and gpu backends. The reference runs in float64 on the same float32 weights."""
import importlib.util
import pathlib

import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.bench.gates import rel_l2 as rel

from .harness import check_training_graph
from meganeura.models.smolvla import SmolVLAConfig, build_smolvla_inference, build_smolvla_training

_REF_PATH = pathlib.Path(__file__).resolve().parents[1] / "bench" / "smolvla_reference.py"
_spec = importlib.util.spec_from_file_location("smolvla_reference", _REF_PATH)
smolvla_reference = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(smolvla_reference)

CFG = SmolVLAConfig.tiny()
BATCH = 2


@pytest.fixture(scope="module")
def case():
    torch.manual_seed(0)
    model = smolvla_reference.SmolVLAExpert(CFG)
    with torch.no_grad():
        # norm weights away from 1 so their gradients and scaling are really tested
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    model = model.double()    # float32 values held exactly in float64
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    feeds = {"action_tokens": rng.standard_normal((BATCH, CFG.chunk_size, CFG.hidden_size)).astype(np.float32),
             "vlm_features": rng.standard_normal((BATCH, CFG.vlm_len, CFG.vlm_kv_dim)).astype(np.float32),
             "target": rng.standard_normal((BATCH, CFG.chunk_size, CFG.hidden_size)).astype(np.float32)}
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in feeds.items()}
    out = model(t["action_tokens"], t["vlm_features"])
    loss = torch.nn.functional.mse_loss(out, t["target"])
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return state, feeds, out.detach().numpy(), float(loss.detach()), grads


def check(backend, case):
    check_training_graph("smolvla tiny", build_smolvla_training(CFG, BATCH), backend, case)


def test_smolvla_tiny_numpy(case):
    check("numpy", case)
    # the inference graph gives the same output as the training graph's forward
    state, feeds, ref_out, _, _ = case
    inf = build_smolvla_inference(CFG, BATCH)
    sess = mg.compile(inf.graph, outputs=[inf.output], backend="numpy")
    sess.load_state_dict(state)
    out = sess.run({k: feeds[k] for k in ("action_tokens", "vlm_features")})[0]
    assert rel(out, ref_out) < 1e-4


def test_smolvla_tiny_gpu(case):
    check("gpu", case)


def test_smolvla_configs():
    real = SmolVLAConfig.real()
    assert (real.num_heads * real.head_dim, real.num_kv_heads * real.head_dim) == (960, 320)
    assert [real.is_cross(i) for i in range(4)] == [False, True, False, True]
    g = build_smolvla_inference(real, 1).graph
    ref = smolvla_reference.SmolVLAExpert(real)
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: t.shape for k, t in g.parameters.items()} == shapes
    assert sum(int(np.prod(s)) for s in shapes.values()) == 98_245_840


def test_smolvla_tiny_trains_numpy(case):
    # a few AdamW steps on one batch lower the output MSE
    state, feeds, _, ref_loss, _ = case
    built = build_smolvla_training(CFG, BATCH)
    sess = mg.compile(built.graph, outputs=[built.output], loss=built.loss, optimizer=mg.optim.AdamW(lr=1e-2),
                      backend="numpy")
    sess.load_state_dict(state)
    losses = [sess.step(feeds) for _ in range(6)]
    print(f"\nsmolvla tiny AdamW losses: {' '.join(f'{v:.4f}' for v in losses)}")
    assert abs(losses[0] - ref_loss) / ref_loss < 1e-4
    assert losses[-1] < 0.9 * losses[0]
