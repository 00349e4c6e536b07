"""The docs: the op table lists every public op and is current; the API reference builds."""
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_op_table_is_current_and_complete():
    sys.path.insert(0, str(ROOT / "docs"))
    try:
        import ops_table
    finally:
        sys.path.pop(0)
    missing = [n for n in ops_table.public_ops() if n not in ops_table.TORCH]
    assert not missing, f"ops without a PyTorch equivalent in docs/ops_table.py: {missing}"
    assert (ROOT / "docs" / "ops.md").read_text() == ops_table.render(), "run python docs/ops_table.py"


def test_api_reference_builds(tmp_path):
    r = subprocess.run([sys.executable, "-m", "pdoc", "--docformat", "restructuredtext", "-o", str(tmp_path),
                        "meganeura.nn", "meganeura.jit", "meganeura.optim", "meganeura.api"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    html = (tmp_path / "meganeura" / "jit.html").read_text()
    assert "one compiled program per input signature" in html
