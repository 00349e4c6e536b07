"""bench/resnet_numerics.py (sides against float64, causes) and bench/matmul_shapes.py (the
workloads' GEMM shapes from the compiled plans, timed beside torch) at tiny size."""
import importlib.util
import json
import pathlib

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_resnet_numerics_tiny(tmp_path):
    out = tmp_path / "n.json"
    r = _load("resnet_numerics").main(["--size", "tiny", "--steps", "2", "--out", str(out)])
    assert json.loads(out.read_text())["size"] == "tiny"
    far = r["vs_float64"]
    # our graph in float64 is torch's float64 model: same maths, only rounding differs
    assert far["ours_numpy64"]["all_grads_rel_l2"] < 1e-9 and far["ours_numpy64"]["loss_rel_err"] < 1e-12
    # at this depth f32 on either side is near float64, and ours is no further than a few times torch's
    for side in ("torch32", "ours_gpu", "ours_numpy32"):
        assert far[side]["all_grads_rel_l2"] < 1e-5, side
    assert far["ours_gpu"]["all_grads_rel_l2"] < 5 * far["torch32"]["all_grads_rel_l2"]
    assert set(r["ablation"]) >= {"conv2d", "batch_norm", "conv2d_input_grad", "all_ops_f32"}
    assert r["ablation"]["conv2d"]["forward"] > 0 and r["depth_sensitivity"]["stem_conv_f32"] > 0
    assert r["conditioning"]["convs"] == 12 and r["maxpool_near_ties"]["windows"] == 4 * 8 * 8 * 8
    assert len(r["curve"]["losses"]["ours_gpu"]) == 2 and r["curve"]["max_rel_diff"]["ours_gpu_vs_torch64"] < 1e-5


def test_matmul_shapes_collects_and_times(tmp_path):
    ms = _load("matmul_shapes")
    out = tmp_path / "m.json"
    r = ms.main(["--size", "tiny", "--workloads", "resnet50,whisper", "--phases", "inference,flb",
                 "--time-shapes", "64x48x40", "--time-max", "2", "--samples", "3", "--warmup", "1",
                 "--out", str(out)])
    saved = json.loads(out.read_text())
    assert saved["shapes"] and len(saved["timed"]) == 2
    shapes = r["shapes"]
    # every use is counted once per (workload, phase), and the stem convolution is there:
    # 3 -> 8 channels, 7x7 kernel (K = 147) over a 16x16 output of batch 4, as implicit GEMM
    assert sum(s["count"] for s in shapes) == sum(n for s in shapes for n in s["uses"].values())
    stem = [s for s in shapes if (s["m"], s["k"], s["n"]) == (8, 147, 256)]
    assert stem and stem[0]["sources"] == ["conv"] and stem[0]["uses"]["resnet50/inference"] == 1
    assert any(u.startswith("whisper/flb") for s in shapes for u in s["uses"])
    first = r["timed"][0]
    assert (first["m"], first["n"], first["k"]) == (64, 48, 40)
    for t in r["timed"]:
        assert t["max_rel_err"] < 1e-5 and t["ours_tflops"] > 0 and t["torch_tflops"] > 0


def test_attention_bench_reports_each_kernels_gpu_time(tmp_path):
    """bench/attention.py at tiny size: our flash and decomposed forwards checked against
    float64, with each dispatch's GPU time (lavapipe has timestamps) in the JSON."""
    out = tmp_path / "a.json"
    _load("attention").main(["--size", "tiny", "--samples", "1", "--warmup", "0", "--phases", "forward",
                             "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {(r["case"], r["variant"]) for r in rows} == {(c, v) for c in ("whisper", "causal_gqa")
                                                          for v in ("flash", "decomposed")}
    for r in rows:
        assert r["max_rel_err"] < 1e-5
        assert [n for n, _ in r["kernel_gpu_s"]] == r["kernels"] and all(s > 0 for _, s in r["kernel_gpu_s"])


def test_attention_bench_accelerated_runs_flash_on_cooperative_matrices(tmp_path, monkeypatch):
    """bench/attention.py --precision accelerated at tiny size with the U-Net case, the
    tensor-core kernels emulated: every flash forward ran as the cooperative-matrix variant
    (f16 operands: error against float64 of the f32 inputs near f16's rounding)."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setenv("MEGANEURA_COOPMAT", "emulate")
    monkeypatch.setenv("MEGANEURA_BACKEND", "vulkan")
    out = tmp_path / "a.json"
    _load("attention").main(["--size", "tiny", "--samples", "1", "--warmup", "0", "--phases", "forward",
                             "--precision", "accelerated", "--unet", "--out", str(out)])
    data = json.loads(out.read_text())
    assert data["precision"] == "accelerated" and data["coopmat"] == "emulate"
    rows = [r for r in data["rows"] if r["variant"] == "flash"]
    assert {r["case"] for r in rows} == {"whisper", "causal_gqa", "unet"}
    for r in rows:
        assert r["coop_dispatches"] == 1 and 1e-5 < r["max_rel_err"] < 2e-3, r
