"""mg.from_pretrained: Hugging Face folders written by transformers' own save_pretrained
(tiny, random-initialised, seeded), found by path or by model id in a local Hugging Face cache
laid out as huggingface_hub lays it out; outputs match the transformers model; clear errors
for an id not in the cache, a folder without config.json and an unknown architecture."""
import json
import os

import pytest
import torch

transformers = pytest.importorskip("transformers")

import meganeura as mg  # noqa: E402
from meganeura.bench.gates import rel_l2  # noqa: E402
from meganeura.importers import ModelImportError  # noqa: E402

SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=64,
             max_position_embeddings=32)


def _save(folder, config_cls, model_cls, **kw):
    torch.manual_seed(0)
    model = model_cls(config_cls(**kw)).eval()
    model.save_pretrained(folder)
    return model


def _reference(model, ids):
    model.config.use_cache = False
    with torch.no_grad():
        out = model(ids)
    return (out.logits if hasattr(out, "logits") else out.last_hidden_state).numpy()


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_a_qwen2_folder_imports_and_matches_transformers(tmp_path, backend):
    model = _save(tmp_path / "qwen2", transformers.Qwen2Config, transformers.Qwen2ForCausalLM,
                  num_key_value_heads=2, **SMALL)
    ids = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(1))
    imported = mg.from_pretrained(tmp_path / "qwen2", (ids,))
    assert imported.config.model_type == "qwen2"
    assert "model.layers.0.self_attn.q_proj.bias" in imported.state_dict()
    out = imported.compile(backend=backend).run(imported.feeds(ids))[0]
    assert rel_l2(out, _reference(model, ids)) < 1e-4


def _cache_entry(cache, repo_id, commit="0123456789abcdef0123456789abcdef01234567"):
    """The layout huggingface_hub keeps: models--org--name/{refs/main, snapshots/<commit>/}."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(commit)
    return root / "snapshots" / commit


def test_a_model_id_is_found_in_the_local_cache_with_its_default_inputs(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    snapshot = _cache_entry(cache, "acme/tiny-bert")
    model = _save(snapshot, transformers.BertConfig, transformers.BertModel, **SMALL)
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    imported = mg.from_pretrained("acme/tiny-bert", seq_len=6)
    assert tuple(imported.inputs["input_ids"].shape) == (1, 6)
    ids = torch.zeros(1, 6, dtype=torch.long)
    out = imported.compile(backend="numpy").run(imported.feeds(ids))[0]
    assert rel_l2(out, _reference(model, ids)) < 1e-4


def test_an_id_not_in_the_cache_names_the_id_and_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))
    with pytest.raises(ModelImportError, match=r"'acme/absent'.*neither a folder nor a model in .*empty"):
        mg.from_pretrained("acme/absent")


def test_a_folder_without_config_and_an_unknown_architecture_are_named(tmp_path):
    (tmp_path / "bare").mkdir()
    with pytest.raises(ModelImportError, match=r"bare has no config.json"):
        mg.from_pretrained(tmp_path / "bare")
    odd = tmp_path / "odd"
    odd.mkdir()
    (odd / "config.json").write_text(json.dumps({"architectures": ["NoSuchModelForAnything"], "model_type": "x"}))
    with pytest.raises(ModelImportError, match=r"NoSuchModelForAnything.*does not have"):
        mg.from_pretrained(odd)
    assert sorted(os.listdir(odd)) == ["config.json"]      # nothing written
