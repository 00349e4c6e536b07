"""Whisper encoder vs transformers' WhisperEncoder (random weights, tiny config): forward,
MSE loss and per-parameter gradients on the numpy and GPU backends."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.bench.gates import backward_check, rel_l2 as rel
from meganeura.models.whisper import (WhisperEncoderConfig, build_whisper_encoder,
                                      build_whisper_encoder_training)

transformers = pytest.importorskip("transformers")
from transformers.models.whisper.modeling_whisper import WhisperEncoder  # noqa: E402

BACKENDS = ["numpy", "gpu"]
BATCH = 2


def reference(cfg, seed=0):
    torch.manual_seed(seed)
    m = WhisperEncoder(transformers.WhisperConfig(**cfg.hf_kwargs())).eval()
    with torch.no_grad():   # the default init leaves biases and norms at 0/1: perturb them
        for n, p in m.named_parameters():
            if p.ndim == 1:
                p.add_(torch.randn_like(p) * 0.1)
    return m


def state_of(m):
    return {k: v.detach().numpy().astype(np.float32) for k, v in m.state_dict().items()}


@pytest.fixture(scope="module")
def setup():
    cfg = WhisperEncoderConfig.tiny()
    ref = reference(cfg)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, cfg.num_mel_bins, cfg.input_length)).astype(np.float32)
    target = rng.standard_normal((BATCH, cfg.max_source_positions, cfg.d_model)).astype(np.float32)
    ref64 = reference(cfg).double()
    xt = torch.tensor(x, dtype=torch.float64)
    out = ref64(xt).last_hidden_state
    loss = torch.nn.functional.mse_loss(out, torch.tensor(target, dtype=torch.float64))
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in ref64.named_parameters() if p.requires_grad}
    return cfg, state_of(ref), x, target, out.detach().numpy(), float(loss.detach()), grads


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_matches_transformers(setup, backend):
    cfg, state, x, _, y, _, _ = setup
    g, _, out = build_whisper_encoder(cfg, BATCH)
    sess = mg.compile(g, outputs=[out], backend=backend)
    sess.load_state_dict(state)
    err = rel(sess.run({"input_features": x})[0], y)
    print(f"\nwhisper forward [{backend}]: rel L2 {err:.2e}")
    assert err < 1e-4


@pytest.mark.parametrize("backend", BACKENDS)
def test_loss_and_gradients_match_torch(setup, backend):
    cfg, state, x, target, _, tloss, tgrads = setup
    g, _, _, _, loss = build_whisper_encoder_training(cfg, BATCH)
    sess = mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.05), backend=backend)
    sess.load_state_dict(state)   # embed_positions.weight goes to its (frozen) state
    feeds = {"input_features": x, "target": target}
    ours_loss = sess.compute_grads(feeds)
    grads = sess.grads()
    assert sorted(grads) == sorted(tgrads)   # embed_positions is frozen on both sides
    gate = backward_check(grads, tgrads)
    loss_err = abs(ours_loss - tloss) / abs(tloss)
    total_err, norms_err = gate["total_norm_err"], gate["norms_rel_l2"]
    full = {n: rel(grads[n], tgrads[n]) for n in
            ("conv1.weight", "conv2.bias", "layers.0.self_attn.k_proj.weight", "layers.0.self_attn.q_proj.bias",
             "layers.1.fc1.weight", "layer_norm.weight")}
    print(f"\nwhisper [{backend}]: loss err {loss_err:.2e}, total grad norm err {total_err:.2e}, "
          f"per-param norm rel L2 {norms_err:.2e}, worst full grad {max(full.values()):.2e}")
    assert loss_err < 1e-4 and total_err < 1e-3 and norms_err < 1e-3
    assert max(full.values()) < 1e-3, full
    # a few steps: the loss falls and the frozen positions stay put
    pos = state["embed_positions.weight"]
    losses = [sess.step(feeds) for _ in range(3)]
    assert losses[-1] < losses[0]
    np.testing.assert_array_equal(sess.state_dict(include_optimizer=True)["embed_positions.weight"], pos)


def test_tiny_real_names_and_shapes_match_transformers():
    cfg = WhisperEncoderConfig.tiny_real()
    ref = WhisperEncoder(transformers.WhisperConfig(**cfg.hf_kwargs()))
    g, x, out = build_whisper_encoder(cfg, 1)
    assert x.shape == (1, 80, 3000) and out.shape == (1, 1500, 384)
    ours = {n: t.shape for n, t in g.parameters.items()}
    assert ours == {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    gt = build_whisper_encoder_training(cfg, 1)[0]
    assert "embed_positions.weight" in gt.states and "embed_positions.weight" not in gt.parameters
