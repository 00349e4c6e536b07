"""bench/decode.py end to end at the tiny size on lavapipe: every format's cells carry
tokens/s, the weight bytes of their format, and a passing gate against PyTorch eager on
the same (dequantized) weights."""
import importlib.util
import json
import os

import pytest

pytest.importorskip("torch")
pytest.importorskip("gguf")


@pytest.mark.slow
def test_decode_bench_tiny(tmp_path):
    spec = importlib.util.spec_from_file_location("decode_bench", os.path.join(os.path.dirname(__file__), "..",
                                                                              "bench", "decode.py"))
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    rc = bench.main(["--size", "tiny", "--batches", "1,2", "--formats", "f32,q8_0", "--prompt", "8", "--steps", "2",
                     "--torch", "--backend", "gpu", "--bandwidth-gbs", "100", "--out", str(tmp_path)])
    assert rc == 0
    result = json.loads((tmp_path / "decode.json").read_text())
    cells = {(c["format"], c["batch"]): c for c in result["cells"]}
    assert set(cells) == {("f32", 1), ("f32", 2), ("q8_0", 1), ("q8_0", 2)}
    for c in cells.values():
        assert c["gate_pass"] and c["gate_rel_l2"] < 1e-4
        assert c["decode_tok_s"] > 0 and c["prefill_tok_s"] > 0 and c["torch_best"].startswith("torch_")
        assert c["bound_tok_s"] > 0
    assert cells[("q8_0", 1)]["weight_bytes"] < cells[("f32", 1)]["weight_bytes"] / 2
    assert cells[("q8_0", 1)]["types"] == ["Q8_0"]
    assert "| q8_0 | 2 |" in (tmp_path / "decode.md").read_text()
