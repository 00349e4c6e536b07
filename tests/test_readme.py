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
