"""LoRA on a tiny Llama against peft + torch: the same adapters (A copied across, B zeros)
fine-tuned 20 steps give the same loss curve, and adapter files move both ways."""
import json

import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura import nn
from meganeura.nn import lora
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 8
TARGETS = ["q_proj", "v_proj", "down_proj"]


def hf_model(cfg, seed=0):
    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    hc = transformers.LlamaConfig(**d, initializer_range=0.1, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hc)


def ours_from(hf, cfg):
    model = LlamaForCausalLM(cfg)
    mine = model.state_dict()
    model.load_state_dict({k: v.detach().numpy() for k, v in hf.state_dict().items() if k in mine})
    return model


def data(seed):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, 64, (BATCH, SEQ)).astype(np.int32)
    labels = rng.integers(0, 64, (BATCH, SEQ)).astype(np.int32)
    labels[0, 2] = -100
    # transformers scores position t against labels[t + 1]; ours is fed the shifted labels
    shifted = np.concatenate([labels[:, 1:], np.full((BATCH, 1), -100, np.int32)], 1)
    return ids, labels, shifted


def loss_fn(model, vocab):
    return lambda ids, target: mg.ops.cross_entropy(mg.ops.reshape(model(ids), (BATCH * SEQ, vocab)),
                                                     mg.ops.reshape(target, (BATCH * SEQ,)), ignore_index=-100)


def peft_twin(hf, ours, r, alpha):
    pm = peft.get_peft_model(hf, peft.LoraConfig(r=r, lora_alpha=alpha, target_modules=TARGETS, lora_dropout=0.0))
    sd = {}
    for name, m in lora.adapters(ours).items():         # the same A; B is zeros on both sides
        sd[f"base_model.model.{name}.lora_A.default.weight"] = torch.tensor(m.lora_A.weight.data)
        sd[f"base_model.model.{name}.lora_B.default.weight"] = torch.tensor(m.lora_B.weight.data)
    res = pm.load_state_dict(sd, strict=False)
    assert not res.unexpected_keys
    return pm


def logits_of(model, ids, backend):
    model.eval()
    return mg.jit(model, backend=backend)(ids)


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_lora_finetune_matches_peft_and_adapter_moves_both_ways(backend, tmp_path):
    cfg = LlamaConfig.tiny()
    hf = hf_model(cfg)
    nn.init.manual_seed(0)
    ours = lora.apply(ours_from(hf, cfg), r=4, alpha=8, target_modules=TARGETS)
    assert len(lora.adapters(ours)) == 3 * cfg.num_hidden_layers
    trainable = [n for n, p in ours.named_parameters() if p.requires_grad]
    assert trainable and all(".lora_" in n for n in trainable)
    base_before = ours.model.layers[0].self_attn.q_proj.weight.data.copy()
    pm = peft_twin(hf, ours, 4, 8)
    opt_t = torch.optim.AdamW([p for p in pm.parameters() if p.requires_grad], lr=5e-3)
    step = mg.jit(loss_fn(ours, cfg.vocab_size), optimizer=mg.optim.AdamW(lr=5e-3), backend=backend)
    ours_curve, torch_curve = [], []
    for i in range(20):
        ids, labels, shifted = data(i % 4)
        ours_curve.append(step(ids, shifted))
        opt_t.zero_grad()
        lt = pm(input_ids=torch.tensor(ids, dtype=torch.long), labels=torch.tensor(labels, dtype=torch.long)).loss
        lt.backward()
        opt_t.step()
        torch_curve.append(lt.item())
    ours_curve, torch_curve = np.array(ours_curve), np.array(torch_curve)
    err = np.max(np.abs(ours_curve - torch_curve) / np.abs(torch_curve))
    print(f"[{backend}] loss {ours_curve[0]:.5f} -> {ours_curve[-1]:.5f}, max relative difference to peft {err:.2e}")
    assert ours_curve[-1] < ours_curve[0] - 0.05 and err < 1e-4
    # the base stayed frozen; the adapters in the module are the trained ones
    np.testing.assert_array_equal(ours.model.layers[0].self_attn.q_proj.weight.data, base_before)
    ref_b = pm.base_model.model.model.layers[0].self_attn.q_proj.lora_B.default.weight.detach().numpy()
    np.testing.assert_allclose(ours.model.layers[0].self_attn.q_proj.lora_B.weight.data, ref_b, rtol=1e-3, atol=1e-6)

    # our adapter files load into peft (over a fresh base) with the same outputs
    ids = data(7)[0]
    ours_logits = logits_of(ours, ids, backend)
    lora.save(ours, tmp_path / "ours")
    cfg_json = json.loads((tmp_path / "ours" / "adapter_config.json").read_text())
    assert cfg_json["r"] == 4 and cfg_json["peft_type"] == "LORA"
    loaded = peft.PeftModel.from_pretrained(hf_model(cfg), str(tmp_path / "ours")).eval()
    with torch.no_grad():
        peft_logits = loaded(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(ours_logits, peft_logits, rtol=1e-4, atol=1e-5)

    # and peft's files load into ours (LoRA applied from adapter_config.json)
    pm.save_pretrained(str(tmp_path / "theirs"))
    theirs = lora.load(ours_from(hf_model(cfg), cfg), tmp_path / "theirs")
    with torch.no_grad():
        pm_logits = pm.eval()(input_ids=torch.tensor(ids, dtype=torch.long)).logits.numpy()
    np.testing.assert_allclose(logits_of(theirs, ids, backend), pm_logits, rtol=1e-4, atol=1e-5)


def test_merge_unmerge_and_unload_keep_outputs():
    cfg = LlamaConfig.tiny()
    model = ours_from(hf_model(cfg), cfg)
    nn.init.manual_seed(1)
    lora.apply(model, r=2, alpha=4, target_modules=["o_proj", "up_proj"])
    rng = np.random.default_rng(0)
    for m in lora.adapters(model).values():                 # adapters that change the output
        m.lora_B.weight.data = rng.standard_normal(m.lora_B.weight.shape).astype(np.float32) * 0.1
    ids = data(0)[0]
    model.eval()
    predict = mg.jit(model, backend="numpy")
    before = predict(ids)
    w0 = model.model.layers[1].mlp.up_proj.weight.data.copy()
    lora.merge(model)
    assert not np.array_equal(model.model.layers[1].mlp.up_proj.weight.data, w0)
    np.testing.assert_allclose(predict(ids), before, rtol=1e-4, atol=1e-5)      # retraced without the branch
    assert sum(len(v) for v in predict._entries.values()) == 2
    lora.unmerge(model)
    np.testing.assert_allclose(model.model.layers[1].mlp.up_proj.weight.data, w0, atol=1e-6)
    lora.merge_and_unload(model)
    assert not lora.adapters(model) and not any("lora" in k for k in model.state_dict())
    np.testing.assert_allclose(mg.jit(model, backend="numpy")(ids), before, rtol=1e-4, atol=1e-5)


def test_lora_errors_name_the_problem(tmp_path):
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    with pytest.raises(ValueError, match="names no Linear.*'0', '2'"):
        lora.apply(model, r=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="r must be a positive int"):
        lora.apply(model, r=0, target_modules=["0"])
    with pytest.raises(ValueError, match="no LoRA layers"):
        lora.merge(model)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        lora.load(model, tmp_path)
    lora.apply(model, r=2, alpha=2, target_modules=r"\d")       # a regex, as peft takes it
    assert set(lora.adapters(model)) == {"0", "2"}


def test_example_trains_adapters_and_saves_only_them(tmp_path, monkeypatch):
    import pathlib
    import sys
    monkeypatch.syspath_prepend(str(pathlib.Path(__file__).resolve().parents[1] / "examples"))
    import lora_finetune
    first, last = lora_finetune.main(["--steps", "30", "--out", str(tmp_path / "ad"), "--backend", "numpy"])
    assert last < first - 0.1, (first, last)
    assert {p.name for p in (tmp_path / "ad").iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    from safetensors.numpy import load_file
    keys = load_file(str(tmp_path / "ad" / "adapter_model.safetensors"))
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    sys.modules.pop("lora_finetune", None)
