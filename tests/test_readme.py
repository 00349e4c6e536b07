"""The README's quick start runs exactly as written (every Python block of that section,
each in a fresh interpreter, in an empty folder)."""
import pathlib
import re
import subprocess
import sys

import pytest

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def _quick_start_blocks():
    text = README.read_text()
    section = text.split("## Quick start", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


def test_quick_start_has_blocks():
    assert len(_quick_start_blocks()) >= 2


@pytest.mark.parametrize("k", range(len(_quick_start_blocks())))
def test_quick_start_runs_as_written(k, tmp_path):
    code = _quick_start_blocks()[k]
    r = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "Traceback" not in r.stderr
    if "tr.save" in code:
        assert (tmp_path / "model.safetensors").exists()


def _setup_commands():
    text = README.read_text()
    section = text.split("## Set-up (two commands)", 1)[1].split("\n## ", 1)[0]
    block = re.search(r"```bash\n(.*?)```", section, flags=re.S).group(1)
    return [ln for ln in block.splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def test_two_commands_main_job_and_tests_and_ci_runs_the_test_command():
    main_job, tests = _setup_commands()            # exactly two
    assert main_job == "bash scripts/setup.sh && .venv/bin/meganeura train-demo"
    assert tests == "bash scripts/setup.sh --dev && .venv/bin/python -m pytest"
    ci = [ln for ln in (README.parent / ".ci" / "run").read_text().splitlines()
          if ln.strip() and not ln.startswith("#")]
    assert tests in ci and ".venv/bin/python -m pytest -m slow" in ci


def test_setup_installs_the_lean_main_job_and_the_dev_extras_only_with_dev():
    import tomllib
    setup = (README.parent / "scripts" / "setup.sh").read_text()
    extras = tomllib.loads((README.parent / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert 'mode=main; extras="vulkan,examples"' in setup and 'mode=dev; extras="dev"' in setup
    main_pins = " ".join(extras["vulkan"] + extras["examples"])
    assert "torch" not in main_pins and "playwright" not in main_pins
    # chromium only for the tests
    assert re.search(r'if \[ "\$mode" = dev \] && ! command -v chromium', setup)
    for pin in ("torch==2.14.1", "torchvision==0.29.1", "timm==1.0.31", "peft==0.18.0", "onnx==1.23.2", "onnxscript==0.7.2"):
        assert pin in extras["dev"], pin
    assert extras["torch"] == ["torch==2.14.1"] and set(extras["vision"]) <= set(extras["dev"]) and extras["onnx"] == ["onnx==1.23.2", "onnxscript==0.7.2"]


def test_results_state_the_baseline_and_point_to_the_history():
    text = " ".join(README.read_text().split("## Results", 1)[1].split("\n## ", 1)[0].split())
    assert "reduce-overhead" in text and "CUDA graph" in text and "bf16 autocast" in text
    assert "bench/results/HISTORY.md" in text
    assert "2.11" not in text.replace("torch 2.11.0", "")   # the old version only where it applies
