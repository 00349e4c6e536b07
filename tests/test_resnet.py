"""ResNet vs transformers' ResNetForImageClassification (random weights, tiny config):
eval-mode forward with running statistics and with batch norm folded into the convs,
train-mode forward (batch statistics), cross-entropy loss, per-parameter gradients and
the running-statistic updates, on the numpy and GPU backends."""
import copy

import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.bench.gates import backward_check, rel_l2 as rel
from meganeura.bench.workloads import resnet_reference as reference
from meganeura.models.resnet import (ResNetConfig, build_resnet, build_resnet_training, fold_batch_norm,
                                     torch_state_dict)

transformers = pytest.importorskip("transformers")

BACKENDS = ["numpy", "gpu"]
BATCH = 4


@pytest.fixture(scope="module")
def setup():
    cfg = ResNetConfig.tiny()
    ref = reference(cfg)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((BATCH, cfg.num_channels, cfg.image_size, cfg.image_size)).astype(np.float32)
    labels = rng.integers(0, cfg.num_labels, BATCH).astype(np.int32)
    state = torch_state_dict(ref.state_dict())
    m64 = copy.deepcopy(ref).double()
    xt = torch.tensor(x, dtype=torch.float64)
    with torch.no_grad():
        eval_logits = m64.eval()(xt).logits.numpy()
    out = m64.train()(pixel_values=xt, labels=torch.tensor(labels, dtype=torch.long))   # updates running stats
    out.loss.backward()
    grads = {n: p.grad.numpy() for n, p in m64.named_parameters()}
    stats = {k: v.numpy() for k, v in m64.state_dict().items() if ".normalization." in k and "weight" not in k
             and "bias" not in k}     # running_mean, running_var, num_batches_tracked
    return dict(cfg=cfg, state=state, x=x, labels=labels, eval_logits=eval_logits,
                train_logits=out.logits.detach().numpy(), loss=float(out.loss.detach()), grads=grads, stats=stats)


@pytest.mark.parametrize("mode", ["eval", "folded"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_inference_matches_transformers(setup, backend, mode):
    s = setup
    m = build_resnet(s["cfg"], BATCH, bn=mode)
    sess = mg.compile(m.graph, outputs=[m.logits], backend=backend)
    sess.load_state_dict(fold_batch_norm(s["state"]) if mode == "folded" else s["state"])
    err = rel(sess.run({"pixel_values": s["x"]})[0], s["eval_logits"])
    print(f"\nresnet {mode} forward [{backend}]: rel L2 {err:.2e}")
    assert err < 1e-4


def test_fold_batch_norm_layout(setup):
    folded = fold_batch_norm(setup["state"])
    assert not any(".normalization." in k or "num_batches_tracked" in k for k in folded)
    m = build_resnet(setup["cfg"], BATCH, bn="folded")
    assert {k: v.shape for k, v in folded.items()} == {n: t.shape for n, t in m.graph.parameters.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_train_mode_forward_loss_gradients_and_running_stats(setup, backend):
    s = setup
    m = build_resnet_training(s["cfg"], BATCH)
    sess = mg.compile(m.graph, outputs=[m.logits], loss=m.loss, optimizer=mg.optim.SGD(lr=0.01), backend=backend)
    sess.load_state_dict(s["state"])   # batch norm's buffers go to graph state, not parameters
    feeds = {"pixel_values": s["x"], "labels": s["labels"]}
    logits, loss = sess.run(feeds)
    fwd_err = rel(logits, s["train_logits"])
    loss_err = abs(float(loss) - s["loss"]) / abs(s["loss"])
    sess.compute_grads(feeds)
    grads, tgrads = sess.grads(), s["grads"]
    assert sorted(grads) == sorted(tgrads)   # running stats are not trained
    gate = backward_check(grads, tgrads)
    total_err, norms_err = gate["total_norm_err"], gate["norms_rel_l2"]
    full = {n: rel(grads[n], tgrads[n]) for n in
            ("resnet.embedder.embedder.convolution.weight", "resnet.embedder.embedder.normalization.weight",
             "resnet.encoder.stages.0.layers.0.shortcut.convolution.weight",
             "resnet.encoder.stages.1.layers.0.layer.1.convolution.weight",
             "resnet.encoder.stages.1.layers.0.layer.2.normalization.bias", "classifier.1.weight")}
    # run and compute_grads left the statistics alone; one step applies torch's
    # running-statistic momentum update and counts the batch (state, not parameters)
    sess.step(feeds)
    after = sess.state_dict(include_optimizer=True)
    assert all(int(after[k]) == int(v) == 1 for k, v in s["stats"].items() if k.endswith("num_batches_tracked"))
    stats_err = max(rel(after[k], v) for k, v in s["stats"].items() if not k.endswith("num_batches_tracked"))
    print(f"\nresnet train [{backend}]: forward rel L2 {fwd_err:.2e}, loss err {loss_err:.2e}, "
          f"total grad norm err {total_err:.2e}, per-param norm rel L2 {norms_err:.2e}, "
          f"worst full grad {max(full.values()):.2e}, running stats {stats_err:.2e}")
    assert fwd_err < 1e-4 and loss_err < 1e-4
    assert total_err < 1e-3 and norms_err < 1e-3 and max(full.values()) < 1e-3, full
    assert stats_err < 1e-5


def test_resnet50_names_and_shapes_match_transformers():
    cfg = ResNetConfig.resnet50()
    ref = transformers.ResNetForImageClassification(transformers.ResNetConfig(**cfg.hf_kwargs()))
    theirs = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    for mode in ("train", "folded"):
        m = build_resnet(cfg, 1, bn=mode)
        assert m.logits.shape == (1, 1000)
        params = {n: t.shape for n, t in m.graph.parameters.items()}
        if mode == "train":
            states = {n: t.shape for n, t in m.graph.states.items()}
            assert {**params, **states} == theirs
            assert all(k.endswith(("running_mean", "running_var", "num_batches_tracked")) for k in states)
        else:
            assert params == {k: v.shape for k, v in fold_batch_norm(torch_state_dict(ref.state_dict())).items()}
    # the stage stride is on the bottleneck's 3x3 conv (transformers' downsample_in_bottleneck=False)
    blk = ref.resnet.encoder.stages[1].layers[0].layer
    assert blk[0].convolution.stride == (1, 1) and blk[1].convolution.stride == (2, 2)


@pytest.mark.parametrize("variant", [dict(layer_type="basic"), dict(downsample_in_bottleneck=True),
                                     dict(downsample_in_first_stage=True)], ids=["basic", "v1", "first_stage"])
def test_config_variants_forward_numpy(variant):
    cfg = ResNetConfig(**{**ResNetConfig.tiny().__dict__, **variant})
    ref = reference(cfg).eval()
    x = np.random.default_rng(1).standard_normal((2, 3, cfg.image_size, cfg.image_size)).astype(np.float32)
    with torch.no_grad():
        y = ref(torch.tensor(x)).logits.numpy()
    m = build_resnet(cfg, 2, bn="folded")
    sess = mg.compile(m.graph, outputs=[m.logits], backend="numpy")
    sess.load_state_dict(fold_batch_norm(ref.state_dict()))
    err = rel(sess.run({"pixel_values": x})[0], y)
    print(f"\nresnet {next(iter(variant))} folded forward [numpy]: rel L2 {err:.2e}")
    assert err < 1e-4
