"""The Hugging Face folder reader against malformed and hostile files: byte ranges, shard
paths, configs without sizes, weights the config does not use. Every error names the file."""
import json
import struct

import numpy as np
import pytest
from safetensors.numpy import save_file

import meganeura as mg
from meganeura.io import load_hf, read_safetensors
from meganeura.models.llama import LlamaConfig


def _raw(path, header, data=b""):
    h = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(h)) + h + data)
    return path


def _folder(tmp_path, cfg=None, extra_layers=0, config_edit=None):
    """A tiny Llama folder written with the safetensors package (no torch)."""
    cfg = cfg or LlamaConfig.tiny()
    rng = np.random.default_rng(0)
    big = LlamaConfig(**{**cfg.__dict__, "num_hidden_layers": cfg.num_hidden_layers + extra_layers})
    weights = {n: rng.standard_normal(s).astype(np.float32) for n, s in mg.io.expected_weights(big).items()}
    save_file(weights, str(tmp_path / "model.safetensors"))
    d = cfg.to_hf_dict()
    if config_edit:
        config_edit(d)
    (tmp_path / "config.json").write_text(json.dumps(d))
    return weights


def test_valid_folder_round_trips(tmp_path):
    weights = _folder(tmp_path)
    cfg, state = load_hf(tmp_path)
    assert cfg == LlamaConfig.tiny() and set(state) == set(weights)
    for n in weights:
        np.testing.assert_array_equal(state[n], weights[n])


@pytest.mark.parametrize("offsets,match", [
    ([-8, 8], r"data_offsets \[-8, 8\] are not two non-negative integers"),
    ([8, 0], r"byte range \[8, 0\) holds -8 bytes, expected 8"),
    ([0, 12], r"byte range \[0, 12\) holds 12 bytes, expected 8"),
    ([8, 16], r"byte range \[8, 16\) runs past the data section \(8 bytes\)"),
    ([0.0, 8], r"are not two non-negative integers"),
])
def test_bad_byte_ranges_are_refused(tmp_path, offsets, match):
    f = _raw(tmp_path / "w.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": offsets}}, bytes(8))
    with pytest.raises(ValueError, match=rf"w.safetensors: tensor 'a'.*{match}") as e:
        read_safetensors(f)
    assert isinstance(e.value, mg.io.ModelFileError)


def test_overlapping_tensors_and_bad_shapes_are_refused(tmp_path):
    f = _raw(tmp_path / "o.safetensors", {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                                          "b": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]}}, bytes(12))
    with pytest.raises(ValueError, match=r"o.safetensors: tensors 'a' \[0, 8\) and 'b' \[4, 12\) overlap"):
        read_safetensors(f)
    f = _raw(tmp_path / "s.safetensors", {"a": {"dtype": "F32", "shape": [-2], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"s.safetensors: tensor 'a': shape \[-2\] is not a list of non-negative"):
        read_safetensors(f)
    f = _raw(tmp_path / "d.safetensors", {"a": {"dtype": "C64", "shape": [1], "data_offsets": [0, 8]}}, bytes(8))
    with pytest.raises(ValueError, match=r"d.safetensors: tensor 'a' has unsupported dtype 'C64'"):
        read_safetensors(f)


def test_garbage_headers_name_the_file(tmp_path):
    f = tmp_path / "g.safetensors"
    f.write_bytes(struct.pack("<Q", 2 ** 40) + b"{}")
    with pytest.raises(ValueError, match=r"g.safetensors: header length 1099511627776 exceeds the file"):
        read_safetensors(f)
    f.write_bytes(struct.pack("<Q", 5) + b"{nope")
    with pytest.raises(ValueError, match=r"g.safetensors: the header is not valid JSON"):
        read_safetensors(f)
    with pytest.raises(IsADirectoryError, match="is a folder"):
        read_safetensors(tmp_path)


@pytest.mark.parametrize("shard", ["/etc/passwd", "../outside.safetensors", "sub/../../outside.safetensors", ""])
def test_index_paths_must_stay_inside_the_folder(tmp_path, shard):
    model = tmp_path / "model"
    model.mkdir()
    weights = _folder(model)
    (model / "model.safetensors").rename(tmp_path / "outside.safetensors")   # a readable file, outside
    index = {"weight_map": {n: shard for n in weights}}
    (model / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ValueError, match=rf"model.safetensors.index.json: shard {shard!r} "):
        load_hf(model)


def test_index_and_config_that_are_not_json_objects_name_the_file(tmp_path):
    _folder(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{broken")
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: the index is not valid JSON"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": ["a"]}))
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: no 'weight_map' object"):
        load_hf(tmp_path)
    (tmp_path / "model.safetensors.index.json").unlink()
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(ValueError, match=r"config.json: config.json is not a JSON object"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(ValueError, match=r"config.json: config.json is not valid JSON"):
        load_hf(tmp_path)


def test_config_without_size_fields_is_refused(tmp_path):
    _folder(tmp_path, config_edit=lambda d: [d.pop(k) for k in ("hidden_size", "num_hidden_layers")])
    with pytest.raises(ValueError, match=r"config.json: lacks the size field\(s\) \['hidden_size', "
                                         r"'num_hidden_layers'\]"):
        load_hf(tmp_path)
    _folder(tmp_path, config_edit=lambda d: d.update(hidden_size="32"))
    with pytest.raises(ValueError, match=r"config.json: hidden_size must be a positive integer, got '32'"):
        load_hf(tmp_path)


def test_weights_the_config_does_not_use_are_refused_unless_asked(tmp_path):
    _folder(tmp_path, extra_layers=1)           # weights of 3 layers, config of 2
    with pytest.raises(ValueError, match=r"weights do not fit config.json: 9 weight\(s\) the config does not "
                                         r"use, e.g. \['model.layers.2.input_layernorm.weight'"):
        load_hf(tmp_path)
    cfg, state = load_hf(tmp_path, allow_unused=True)
    assert cfg.num_hidden_layers == 2 and "model.layers.2.mlp.up_proj.weight" in state


def test_weights_of_the_wrong_shape_or_missing_are_refused(tmp_path):
    _folder(tmp_path, config_edit=lambda d: d.update(intermediate_size=96))
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.gate_proj.weight' has shape \(64, 32\), the config "
                                         r"implies \(96, 32\)"):
        load_hf(tmp_path)


# ------------------------------------------------------------------ the hub cache layout
def _hub(tmp_path, shards=2, outside=None):
    """A tiny Llama in the Hugging Face hub cache layout: ``models--org--tiny/blobs/<sha>``
    files and ``snapshots/<rev>/`` symlinks into ``../../blobs/``, sharded into ``shards``
    files with an index (1: model.safetensors alone). ``outside``: a shard's link points
    there instead. Returns (the snapshot folder, the weights)."""
    import hashlib
    repo = tmp_path / "hub" / "models--org--tiny"
    blobs, snap = repo / "blobs", repo / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    work = tmp_path / "work"
    work.mkdir()
    weights = _folder(work)
    names = sorted(weights)
    files = {"config.json": (work / "config.json").read_bytes()}
    if shards == 1:
        files["model.safetensors"] = (work / "model.safetensors").read_bytes()
    else:
        weight_map = {}
        for k in range(shards):
            shard = f"model-{k + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: weights[n] for n in names[k::shards]}
            save_file(part, str(work / shard))
            files[shard] = (work / shard).read_bytes()
            weight_map.update(dict.fromkeys(part, shard))
        files["model.safetensors.index.json"] = json.dumps({"weight_map": weight_map}).encode()
    for name, data in files.items():
        sha = hashlib.sha256(data).hexdigest()
        (blobs / sha).write_bytes(data)
        target = f"../../blobs/{sha}"
        if outside is not None and name.startswith("model-00001"):
            target = str(outside)
        (snap / name).symlink_to(target)
    return snap, weights


@pytest.mark.parametrize("shards", [1, 3])
def test_a_hub_cache_snapshot_loads(tmp_path, shards):
    snap, weights = _hub(tmp_path, shards)
    assert all((snap / f).is_symlink() for f in ("config.json",))
    cfg, state = load_hf(snap)
    assert cfg == LlamaConfig.tiny() and sorted(state) == sorted(weights)
    assert all(np.array_equal(state[n], weights[n]) for n in weights)


def test_hub_links_that_escape_the_cache_are_refused(tmp_path):
    stray = tmp_path / "stray.safetensors"
    save_file({"x": np.zeros(2, np.float32)}, str(stray))
    snap, _ = _hub(tmp_path, 2, outside=stray)
    with pytest.raises(ValueError, match=r"model.safetensors.index.json: shard 'model-00001-of-00002.safetensors' "
                                         r"lies outside the model folder"):
        load_hf(snap)
    # the same links in a folder that is not a hub snapshot: blobs are outside it
    plain = tmp_path / "plain"
    snap2, _ = _hub(tmp_path / "b", 2)
    plain.mkdir()
    for p in snap2.iterdir():
        (plain / p.name).symlink_to(p.resolve())
    with pytest.raises(ValueError, match=r"lies outside the model folder"):
        load_hf(plain)


@pytest.mark.parametrize("field,value", [("rms_norm_eps", -1), ("rms_norm_eps", 0), ("rms_norm_eps", "abc"),
                                         ("rms_norm_eps", float("nan")), ("rms_norm_eps", float("inf")),
                                         ("rms_norm_eps", True), ("rope_theta", 0), ("rope_theta", -10000.0),
                                         ("rope_theta", "abc"), ("max_position_embeddings", 0),
                                         ("tie_word_embeddings", "yes")])
def test_config_values_that_would_give_nan_logits_name_the_file_and_field(tmp_path, field, value):
    _folder(tmp_path, config_edit=lambda d: d.update({field: value}))
    with pytest.raises(ValueError, match=rf"config.json: {field} must be "):
        load_hf(tmp_path)


def test_rope_parameters_theta_is_checked_too(tmp_path):
    _folder(tmp_path, config_edit=lambda d: (d.pop("rope_theta"), d.update(rope_parameters={"rope_theta": -1.0})))
    with pytest.raises(ValueError, match=r"config.json: rope_parameters.rope_theta must be a positive finite"):
        load_hf(tmp_path)
    with pytest.raises(ValueError, match=r"LlamaConfig: rms_norm_eps must be a positive finite number, got -1"):
        LlamaConfig(**{**LlamaConfig.tiny().__dict__, "rms_norm_eps": -1})
