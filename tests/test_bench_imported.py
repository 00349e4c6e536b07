"""bench/imported.py at the tiny size on the NumPy interpreter with CPU torch: the imported
BERT's cells carry ours and eager's timings, the gate against eager f32, ratio_best and
its baseline; a model whose package is missing is recorded as skipped; a wrong weight
fails the gate and the run."""
import importlib.util
import json
import os

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")


def _bench():
    spec = importlib.util.spec_from_file_location(
        "imported_bench", os.path.join(os.path.dirname(__file__), "..", "bench", "imported.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


ARGS = ["--size", "tiny", "--backend", "numpy", "--device", "cpu", "--modes", "strict", "--warmup", "1",
        "--samples", "3"]


def test_imported_bert_tiny_numpy(tmp_path, monkeypatch):
    bench = _bench()
    real = bench.missing_dependency
    monkeypatch.setattr(bench, "missing_dependency",
                        lambda m: "torchvision is not installed: resnet18 skipped" if m == "resnet18" else real(m))
    rc = bench.main(ARGS + ["--models", "resnet18,bert", "--batches", "2", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "imported.json").read_text())
    assert result["kind"] == "imported" and result["options"]["backend"] == "numpy"
    assert result["skipped_models"] == {"resnet18": "torchvision is not installed: resnet18 skipped"}
    cells = {(c["model"], c.get("batch")): c for c in result["cells"]}
    assert set(cells) == {("resnet18", None), ("bert", 2)}
    for b in (2,):
        c = cells[("bert", b)]
        assert c["mode"] == "strict" and c["phase"] == "inference" and c["valid"]
        assert c["gate"]["pass"] and c["gate"]["rel_l2_sampled"] < 1e-4 and c["gate"]["finite"]
        assert c["ours"]["median_ms"] > 0 and c["ours"]["n"] == 3
        assert c["torch_eager"]["median_ms"] > 0
        assert "skipped" in c["torch_compile"] and "skipped" in c["torch_graph"]
        assert c["best_baseline"] == "torch_eager"
        assert c["ratio_best"] == pytest.approx(c["ours"]["median_ms"] / c["torch_eager"]["median_ms"])
        assert c["compile"]["compile_s"] >= 0 and c["compile"]["nodes"] > 10
        assert c["config"]["input_shapes"] == {"input_ids": [b, 8]}
    md = (tmp_path / "imported.md").read_text()
    assert "| bert | 2 | strict |" in md and "skipped: torchvision is not installed" in md


def test_imported_gate_fails_on_a_wrong_weight(tmp_path, monkeypatch):
    bench = _bench()
    session = bench.Bert.session

    def perturbed(self, *a, **k):
        s, feeds = session(self, *a, **k)
        name = "encoder.layer.1.output.LayerNorm.weight"     # the last layer: scales the output
        s.load_state_dict({name: s.state_dict()[name] * np.float32(1.5)}, strict=False)
        return s, feeds
    monkeypatch.setattr(bench.Bert, "session", perturbed)
    rc = bench.main(ARGS + ["--models", "bert", "--batches", "1", "--out", str(tmp_path)])
    assert rc == 1
    (c,) = json.loads((tmp_path / "imported.json").read_text())["cells"]
    assert not c["gate"]["pass"] and c["gate"]["rel_l2_sampled"] > 1e-2 and not c["valid"]
