"""The workload models as mg.nn modules: their state dicts carry the reference libraries'
names, the builders' graphs are the modules' graphs, and deferred parameters take the
graph's seeded initial values."""
import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura import nn
from meganeura.models import llama, mlp, resnet, smolvla, unet, whisper

transformers = pytest.importorskip("transformers")


def _graph_names(g):
    return set(g.parameters) | set(g.states)


def _torch_names(model):
    return {k for k in model.state_dict() if not k.endswith("num_batches_tracked")}


def test_llama_module_names_are_transformers_names():
    cfg = llama.LlamaConfig.tiny()
    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d))
    ours = llama.LlamaForCausalLM(cfg)
    assert set(ours.state_dict()) == _torch_names(ref)
    for k, v in ref.state_dict().items():
        assert ours.state_dict()[k].shape == tuple(v.shape), k
    g, _, _ = llama.build_causal_lm(cfg, 1, 4)
    assert set(g.parameters) == set(ours.state_dict())


def test_llama_module_loads_a_torch_state_dict_and_matches_it():
    cfg = llama.LlamaConfig.tiny()
    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    torch.manual_seed(0)
    ref = transformers.LlamaForCausalLM(transformers.LlamaConfig(**d, initializer_range=0.1,
                                                                 attn_implementation="eager")).eval()
    model = llama.LlamaForCausalLM(cfg)
    model.load_state_dict(ref.state_dict())
    assert not any(p.deferred for p in model.parameters())
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 6)).astype(np.int32)
    ours = mg.jit(model)(ids)
    with torch.no_grad():
        want = ref(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert np.abs(ours - want).max() <= 1e-4 * np.abs(want).max()


def test_whisper_resnet_unet_module_names_are_the_reference_names():
    wc = whisper.WhisperEncoderConfig.tiny()
    from transformers.models.whisper.modeling_whisper import WhisperEncoder as HFWhisperEncoder
    ref = HFWhisperEncoder(transformers.WhisperConfig(**wc.hf_kwargs()))
    assert set(whisper.WhisperEncoder(wc).state_dict()) == _torch_names(ref)

    rc = resnet.ResNetConfig.tiny()
    ref = transformers.ResNetForImageClassification(transformers.ResNetConfig(**rc.hf_kwargs()))
    ours = resnet.ResNetForImageClassification(rc, bn="train")
    assert set(ours.state_dict()) == set(ref.state_dict())        # num_batches_tracked too
    for bn in ("eval", "train"):       # batch norm's buffers are graph state, the counter too
        assert _graph_names(resnet.build_resnet(rc, 1, bn=bn).graph) == set(ref.state_dict())

    diffusers = pytest.importorskip("diffusers")
    uc = unet.UNetConfig.tiny()
    ref = diffusers.UNet2DConditionModel(**uc.diffusers_kwargs())
    ours = unet.UNet2DConditionModel(uc)
    assert set(ours.state_dict()) == _torch_names(ref)
    assert set(unet.build_unet(uc, 1).graph.parameters) == _torch_names(ref)


@pytest.mark.parametrize("name", ["smolvla", "whisper", "mlp", "resnet_folded"])
def test_builders_are_the_modules(name):
    """The builder's graph parameters are exactly the module's state dict."""
    if name == "smolvla":
        cfg = smolvla.SmolVLAConfig.tiny()
        module, g = smolvla.SmolVLAExpert(cfg), smolvla.build_smolvla_inference(cfg, 1).graph
    elif name == "whisper":
        cfg = whisper.WhisperEncoderConfig.tiny()
        module, g = whisper.WhisperEncoder(cfg), whisper.build_whisper_encoder(cfg, 1)[0]
    elif name == "mlp":
        module, g = mlp.mlp(16, 8, 3, 3), mlp.build_mlp(2, 16, 8, 3, 3)[0]
    else:
        cfg = resnet.ResNetConfig.tiny()
        module, g = resnet.ResNetForImageClassification(cfg), resnet.build_resnet(cfg, 1).graph
    assert set(g.parameters) == set(module.state_dict())
    for n, t in g.parameters.items():
        assert t.shape == module.state_dict()[n].shape, n


def test_deferred_parameters_take_the_graphs_seeded_rule():
    with nn.init.deferred():
        lin = nn.Linear(6, 4)
        emb = nn.Embedding(5, 3)
        nn.init.normal_(emb.weight, std=0.02)
        ln = nn.LayerNorm(4)
    assert lin.weight.deferred and lin.bias.deferred and emb.weight.deferred
    assert (lin.weight.init, lin.bias.init, emb.weight.init, ln.weight.init) == (None, None, "normal", "ones")

    def values(seed):
        g = mg.Graph()
        x = g.input("x", (2, 6))
        sess = mg.compile(g, outputs=[nn.Sequential(lin, ln)(x)], seed=seed)
        return {n: sess.executor.get_value(n).copy() for n in g.parameters}
    a, b, c = values(0), values(0), values(1)
    assert all(np.array_equal(a[n], b[n]) for n in a)                 # seeded by name: two builds agree
    assert not np.array_equal(a["0.weight"], c["0.weight"])
    bound = 1 / np.sqrt(6)                                            # torch's Linear rule
    assert np.abs(a["0.weight"]).max() <= bound and np.abs(a["0.weight"]).std() > bound / 4
    assert not a["0.bias"].any() and a["0.bias"].shape == (4,)
    assert (a["1.weight"] == 1).all()

    # reading .data draws a value by the rule; assigning one replaces the rule
    w = emb.weight.data
    assert w.shape == (5, 3) and 0.005 < w.std() < 0.05 and not emb.weight.deferred
    lin.load_state_dict({"weight": np.ones((4, 6)), "bias": np.zeros(4)})
    assert not lin.weight.deferred and lin.weight.graph_init().sum() == 24
    with pytest.raises(TypeError, match="shape="):
        nn.Parameter()


def test_a_module_built_inside_a_forward_names_its_own_parameters():
    """whisper_encoder builds a fresh module inside a traced forward: its names are its own."""
    cfg = whisper.WhisperEncoderConfig.tiny()

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.head = nn.Linear(cfg.d_model, 2)

        def forward(self, x):
            return self.head(mg.ops.mean(whisper.whisper_encoder(x.graph, x, cfg), 1))
    g = mg.Graph()
    Head()(g.input("x", (1, cfg.num_mel_bins, cfg.input_length)))
    assert {"head.weight", "conv1.weight", "layers.1.fc2.bias", "layer_norm.weight"} <= set(g.parameters)
