"""The scaled SD 1.x U-Net graph (tiny config) against diffusers' UNet2DConditionModel built
from the same config: forward, noise-MSE loss and every parameter gradient, on the numpy
and gpu backends. The reference runs in float64 on the same float32 weights and takes the
raw timesteps; our graph takes the host-computed sinusoidal features."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.bench.gates import rel_l2 as rel

from .harness import check_training_graph
from meganeura.models.unet import (UNetConfig, build_unet_inference, build_unet_training, parameter_count,
                                   timestep_features)

diffusers = pytest.importorskip("diffusers")

CFG = UNetConfig.tiny()
BATCH = 2


def make_case(cfg):
    torch.manual_seed(0)
    model = diffusers.UNet2DConditionModel(**cfg.diffusers_kwargs())
    with torch.no_grad():
        # move norm affines and biases off their 1/0 init so they are really exercised
        for name, p in model.named_parameters():
            if name.endswith("bias") or "norm" in name:
                p.add_(0.1 * torch.randn_like(p))
    model = model.double()    # float32 values held exactly in float64
    state = {k: v.float().numpy() for k, v in model.state_dict().items()}
    rng = np.random.default_rng(0)
    s = cfg.sample_size
    timesteps = np.array([17.0, 981.0], np.float32)
    feeds = {"sample": rng.standard_normal((BATCH, cfg.in_channels, s, s)).astype(np.float32),
             "timestep": timestep_features(timesteps, cfg),
             "context": rng.standard_normal((BATCH, cfg.context_len, cfg.cross_attention_dim)).astype(np.float32),
             "noise": rng.standard_normal((BATCH, cfg.out_channels, s, s)).astype(np.float32)}
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in feeds.items()}
    out = model(t["sample"], torch.tensor(timesteps, dtype=torch.float64), t["context"]).sample
    loss = torch.nn.functional.mse_loss(out, t["noise"])
    loss.backward()
    grads = {n: p.grad.numpy() for n, p in model.named_parameters()}
    return state, feeds, out.detach().numpy(), float(loss.detach()), grads


@pytest.fixture(scope="module")
def case():
    return make_case(CFG)


def check(backend, case, cfg=CFG):
    label = "unet tiny linear-projection" if cfg.use_linear_projection else "unet tiny"
    check_training_graph(label, build_unet_training(cfg, BATCH), backend, case)


def test_unet_tiny_numpy(case):
    check("numpy", case)
    # the inference graph gives the same output as the training graph's forward
    state, feeds, ref_out, _, _ = case
    inf = build_unet_inference(CFG, BATCH)
    sess = mg.compile(inf.graph, outputs=[inf.output], backend="numpy")
    sess.load_state_dict(state)
    out = sess.run({k: feeds[k] for k in ("sample", "timestep", "context")})[0]
    assert rel(out, ref_out) < 1e-4


def test_unet_tiny_gpu(case):
    check("gpu", case)


def test_unet_tiny_linear_projection_numpy():
    # SD 2.x style: proj_in/proj_out as linears on the tokens instead of 1x1 convs
    cfg = UNetConfig.tiny(use_linear_projection=True)
    check("numpy", make_case(cfg), cfg)


def test_unet_timestep_features_match_diffusers():
    from diffusers.models.embeddings import get_timestep_embedding
    t = np.array([0.0, 1.0, 17.0, 500.0, 999.0], np.float32)
    for cfg in (CFG, UNetConfig.sd_scaled()):
        ref = get_timestep_embedding(torch.tensor(t), cfg.block_out_channels[0], flip_sin_to_cos=True,
                                     downscale_freq_shift=cfg.freq_shift).numpy()
        err = float(np.abs(timestep_features(t, cfg) - ref).max())
        print(f"\ntimestep features, {cfg.block_out_channels[0]} wide: max abs err {err:.1e}")
        # torch's float32 exp is off by one ulp at a rare frequency, and t * freq ~ 1000
        # turns that into up to ~6e-5 in the angle
        assert err < 1e-4


def test_unet_sd_scaled_names_and_shapes():
    cfg = UNetConfig.sd_scaled()
    with torch.device("meta"):
        ref = diffusers.UNet2DConditionModel(**cfg.diffusers_kwargs())
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    g = build_unet_inference(cfg, 1).graph
    assert {k: t.shape for k, t in g.parameters.items()} == shapes
    n = parameter_count(cfg)
    print(f"\nsd_scaled U-Net: {n / 1e6:.2f}M parameters")
    assert 10e6 < n < 13e6


def test_unet_tiny_trains_numpy():
    # a few AdamW steps on one batch lower the noise MSE
    state, feeds, _, ref_loss, _ = make_case(CFG)
    built = build_unet_training(CFG, BATCH)
    sess = mg.compile(built.graph, outputs=[built.output], loss=built.loss, optimizer=mg.optim.AdamW(lr=3e-3),
                      backend="numpy")
    sess.load_state_dict(state)
    losses = [sess.step(feeds) for _ in range(6)]
    print(f"\nunet tiny AdamW losses: {' '.join(f'{v:.4f}' for v in losses)}")
    assert abs(losses[0] - ref_loss) / ref_loss < 1e-4
    assert losses[-1] < 0.9 * losses[0]
