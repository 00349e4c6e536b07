"""The benchmark package: accuracy gates for the five workloads at tiny size, the timing
harness end to end in quick mode (CPU torch, our gpu backend) and its report outputs."""
import json
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("diffusers")

from meganeura.bench import gates, report  # noqa: E402
from meganeura.bench.__main__ import main  # noqa: E402
from meganeura.bench.compile_time import cold_and_warm  # noqa: E402
from meganeura.bench.workloads import WORKLOADS, make  # noqa: E402


def test_importing_meganeura_does_not_import_torch():
    code = "import sys, meganeura, meganeura.bench; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_gate_metrics():
    ref = np.linspace(1.0, 2.0, 1000)
    idx = gates.sample_index(ref.size)
    assert idx.size == 256 and idx[0] == 0 and idx[-1] == 999
    assert gates.sample_index(10).tolist() == list(range(10))
    assert gates.forward_check(ref * 1.001, ref)["pass"]
    bad = gates.forward_check(ref * 1.02, ref)
    assert not bad["pass"] and abs(bad["rel_l2_sampled"] - 0.02) < 1e-9
    g = {"a": np.ones(3), "b": np.full(2, 2.0)}
    ok = gates.backward_check({"a": np.ones(3) * 1.01, "b": g["b"]}, g)
    assert ok["pass"] and ok["total_norm_err"] < 0.01 and ok["worst_param"] == "a"
    assert not gates.backward_check({"a": g["a"]}, g)["pass"]      # a missing gradient fails
    assert not gates.loss_check(1.02, 1.0)["pass"]


def test_gates_all_workloads_tiny_strict(tmp_path):
    """Every workload's forward, minimal and backward gates at tiny size (numpy backend)."""
    rc = main(["gates", "--size", "tiny", "--modes", "strict", "--backend", "numpy", "--out", str(tmp_path)])
    res = json.loads((tmp_path / "gates.json").read_text())
    assert (tmp_path / "gates.md").exists()
    assert sorted(res["workloads"]) == sorted(WORKLOADS)
    for name, modes in res["workloads"].items():
        r = modes["strict"]
        print(f"{name}: forward {r['inference']['rel_l2_sampled']:.1e}, minimal {r['minimal']['rel_l2_sampled']:.1e}, "
              f"loss {r['train']['loss']['rel_err']:.1e}, grad total {r['train']['backward']['total_norm_err']:.1e}, "
              f"grad norms {r['train']['backward']['norms_rel_l2']:.1e}")
        assert r["pass"], (name, r)
        # strict mode is far inside the paper's thresholds
        assert r["inference"]["rel_l2_sampled"] < 1e-4 and r["minimal"]["rel_l2_sampled"] < 1e-4
        assert r["train"]["loss"]["rel_err"] < 1e-4 and r["train"]["backward"]["norms_rel_l2"] < 1e-3
    assert rc == 0


def test_train_compare_short_numpy():
    w = make("smolvla", "tiny", device="cpu")
    r = gates.train_compare(w, "strict", steps=4, lr=1e-3, backend="numpy")
    print(f"smolvla losses ours {r['ours']} torch {r['torch']}, max rel diff {r['max_rel_diff']:.1e}")
    assert len(r["ours"]) == len(r["torch"]) == 4
    assert r["decreased_ours"] and r["decreased_torch"] and r["within_tol"]


def test_harness_quick_end_to_end(tmp_path):
    out = tmp_path / "run"
    rc = main(["--size", "tiny", "--quick", "--workloads", "whisper,smollm2", "--phases", "inference,minimal,flb,compile",
               "--modes", "strict", "--warmup", "1", "--samples", "2", "--no-progress", "--no-fresh-process",
               "--out", str(out)])
    assert rc == 0
    res = json.loads((out / "bench.json").read_text())
    md = (out / "bench.md").read_text()
    assert (out / "ratios.png").exists() or (out / "ratios.svg").exists()
    assert res["environment"]["adapter"]["name"] and res["environment"]["versions"]["torch"]
    cells = {(c["workload"], c["phase"]): c for c in res["cells"]}
    assert len(cells) == 8
    for (name, phase), c in cells.items():
        assert c["valid"], (name, phase, c)
        if phase == "compile":
            for g in ("inference", "train"):
                o = c["ours"][g]
                assert o["in_process_first_s"] > 0 and o["in_process_again_s"] > 0, o
            assert "skipped" in c["torch_compile"]        # no CUDA here
            continue
        assert c["gate"]["pass"]
        assert c["ours"]["n"] == 2 and len(c["ours"]["samples_ms"]) == 2 and c["ours"]["dispatches"] > 0
        assert c["ours"]["memory"]["peak_with_aliasing"] <= c["ours"]["memory"]["peak_without_aliasing"]
        assert c["torch_eager"]["median_ms"] > 0 and c["ratio_eager"] > 0
        assert "skipped" in c["torch_compile"]
    for name in ("whisper", "smollm2"):
        assert res["workloads"][name]["gates"]["strict"]["train"]["pass"]
        assert len(res["workloads"][name]["kernels"]["strict"]["inference"]) <= 10
    assert "| whisper |" in md and "Accuracy gates" in md and "Top-10 kernels" in md
    # merging runs re-renders one table
    assert main(["report", str(out / "bench.json"), "--out", str(tmp_path / "merged")]) == 0
    merged = report.merge([out / "bench.json", out / "bench.json"])
    assert len(merged["cells"]) == 16 and (tmp_path / "merged" / "bench.md").exists()


def test_compile_time_cold_and_warm_processes():
    """The compile table's fresh processes: the cold one fills the caches (plan and driver
    shader caches in one folder), the warm one reads its plan back."""
    r = cold_and_warm("whisper", "tiny", "inference", warm_processes=2)
    assert "error" not in r, r
    cold, warm = r["cold"], r["warm"]
    assert r["cold_s"] > 0 and r["warm_s"] > 0 and r["again_s"] > 0
    assert 0 < r["cold_eager_s"] <= r["cold_s"]          # mg.compile's main call, within every plan
    assert len(r["warm_all_s"]) == 2 and r["warm_s"] == max(r["warm_all_s"])     # the upper median of two
    assert cold["plan_cache"] == {"run": "stored"} and warm["plan_cache"] == {"run": "hit"}
    assert warm["dispatches"] == cold["dispatches"] and cold["unique_pipelines"] > 0
    assert cold["pipelines_created"] == cold["unique_pipelines"] and cold["pipeline_s"] > 0 < cold["pipeline_wall_s"]
    assert r["again"]["pipelines_created"] == 0          # the same process keeps its pipelines
    slow = cold["slowest_kernels"]                       # where a cold compile's driver time went
    assert 0 < len(slow) <= min(5, cold["unique_pipelines"]) and all(k["spirv_bytes"] > 0 for k in slow)
    assert sum(k["spirv_bytes"] for k in slow) <= cold["spirv_bytes"]
    assert [k["create_s"] for k in slow] == sorted((k["create_s"] for k in slow), reverse=True)
    md = report.bench_markdown({"options": {"size": "tiny", "workloads": ["whisper"], "modes": ["strict"],
                                            "phases": ["compile"], "warmup": 1, "samples": 2},
                                "environment": {"adapter": {}, "versions": {}}, "workloads": {},
                        "cells": [{"workload": "whisper", "mode": "strict", "phase": "compile", "valid": True,
                                   "torch_compile": {"skipped": "no CUDA"},
                                   "ours": {"inference": {"in_process_first_s": 0.5, "in_process_again_s": 0.1,
                                                          "cold_s": r["cold_s"], "warm_s": r["warm_s"],
                                                          "pipelines": cold["unique_pipelines"],
                                                          "cold_pipeline_s": cold["pipeline_wall_s"]}}}]})
    assert f"{r['cold_s']:.2f} / {r['warm_s']:.2f} / 0.50 first, 0.10 again" in md


def test_compile_time_records_the_hosts_speed_at_a_fixed_job(monkeypatch):
    """The GPU compile table's host reference: the same kernel compiled on one thread, then
    on every thread at once (runs on hosts of other speeds are compared through it)."""
    from meganeura.bench import compile_time
    monkeypatch.setattr(compile_time, "REFERENCE_COMPILES", 3)
    host = compile_time.host_reference(threads=2)
    assert host["compiles"] == 3 and host["threads"] == 2 and host["one_thread_s"] > 0 < host["all_threads_s"]


def test_cached_decoder_keeps_the_cache_on_device():
    """The minimal SmolLM2 graph reads and writes its cache as state: only small position
    inputs are fed per token."""
    w = make("smollm2", "tiny", device="cpu")
    b = w.build("minimal")
    assert set(b.graph.inputs) == {"input_ids", "rope_cos", "rope_sin", "attn_mask", "cache_write"}
    assert len(b.state_updates) == 2 * w.cfg.num_hidden_layers


def test_compile_time_kernel_code_table(tmp_path):
    """``--spirv``: each graph's distinct kernels compiled to SPIR-V as for a hardware driver,
    counted by archetype, with the driver's seconds estimated from their size."""
    from meganeura.bench.compile_time import DRIVER_MS_PER_KIB, main as compile_main
    out = tmp_path / "code.json"
    compile_main(["--spirv", "--size", "tiny", "--workloads", "whisper", "--graphs", "inference", "--out", str(out)])
    (row,) = json.loads(out.read_text())["rows"]
    fams = row["families"].values()
    assert row["kernels"] == sum(f["kernels"] for f in fams) > 1
    assert row["spirv_kib"] == pytest.approx(sum(f["spirv_kib"] for f in fams))
    assert 0 < row["largest"]["spirv_kib"] < row["spirv_kib"]
    assert row["driver_s"] == pytest.approx(row["spirv_kib"] * DRIVER_MS_PER_KIB / 1e3)


def test_compile_time_device_free_table(tmp_path):
    """The device-free compile table builds every graph kind (ResNet-50 trains with its
    batch-norm state updates) and writes its JSON."""
    from meganeura.bench.compile_time import main as compile_main
    out = tmp_path / "compile.json"
    compile_main(["--size", "tiny", "--workloads", "resnet50", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert {r["graph"] for r in rows} == {"inference", "train"}
    assert all(r["plans_s"] > 0 for r in rows)
