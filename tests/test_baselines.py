"""The strongest-PyTorch bookkeeping of the benchmark: which baseline a cell is judged
against, and how the tables say it (no GPU needed; the CUDA-graph variants themselves run
only where torch has CUDA)."""
from meganeura.bench import baselines as B
from meganeura.bench import report


def _cell(ours, **variants):
    c = {"workload": "w", "mode": "accelerated", "phase": "inference", "valid": True,
         "ours": {"median_ms": ours}}
    c.update(variants)
    name, ms = B.best(c)
    c["best_baseline"], c["ratio_best"] = name, (ours / ms if ms else None)
    return c


def test_best_is_the_fastest_valid_baseline():
    c = _cell(2.0, torch_eager={"median_ms": 5.0}, torch_compile={"median_ms": 4.0, "valid": True},
              torch_graph={"median_ms": 3.0, "valid": True},
              torch_compile_graphs={"error": "capture failed"},
              torch_bf16_graph={"median_ms": 1.0, "valid": False})     # faster, but failed its check
    assert c["best_baseline"] == "torch_graph"
    assert abs(c["ratio_best"] - 2.0 / 3.0) < 1e-12


def test_skipped_and_failed_variants_never_win():
    c = _cell(1.0, torch_eager={"median_ms": 5.0}, torch_compile={"skipped": "no CUDA"},
              torch_graph={"skipped": "no CUDA"})
    assert c["best_baseline"] == "torch_eager"
    assert B.best({"ours": {"median_ms": 1.0}, "torch_eager": {"error": "x"}}) == (None, None)


def test_graph_variants_per_mode():
    assert B.BF16_GRAPH not in B.graph_variants("strict")
    assert B.graph_variants("accelerated")[-1] == B.BF16_GRAPH


def test_tables_name_the_winner_and_mark_losses():
    cells = [_cell(2.0, torch_eager={"median_ms": 4.0}),
             dict(_cell(3.0, torch_eager={"median_ms": 4.0}, torch_bf16_graph={"median_ms": 1.5, "valid": True}),
                  phase="train_step")]
    result = {"options": {"modes": ["accelerated"], "workloads": ["w"], "phases": ["inference", "train_step"]},
              "cells": cells}
    lines = report.best_section(result, report._cells(result), ["inference", "train_step"])
    text = "\n".join(lines)
    assert "strongest PyTorch" in text
    assert "2.000 / 4.000 (0.50x, eager)" in text
    assert "**3.000 / 1.500 (2.00x, bf16 graph)**" in text          # slower than PyTorch: bold
    assert "| median | 0.50x | 2.00x |" in text


def test_old_results_without_variants_render_as_before():
    result = {"options": {"modes": ["strict"], "workloads": ["w"], "phases": ["inference"]},
              "cells": [{"workload": "w", "mode": "strict", "phase": "inference", "ours": {"median_ms": 1.0}}]}
    assert report.best_section(result, report._cells(result), ["inference"]) == []
