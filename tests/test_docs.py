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


def test_switch_table_names_every_switch_the_sources_read():
    import re
    read = set()
    for f in (ROOT / "src" / "meganeura").rglob("*.py"):
        read |= set(re.findall(r"MEGANEURA_[A-Z0-9_]*[A-Z0-9]", f.read_text()))
    table = (ROOT / "docs" / "switches.md").read_text()
    rows = set(re.findall(r"^\| `(MEGANEURA_[A-Z0-9_]+)` \|", table, flags=re.M))
    assert not read - rows, f"switches missing from docs/switches.md: {sorted(read - rows)}"
    assert not rows - read, f"docs/switches.md lists switches no source reads: {sorted(rows - read)}"
    for name in rows:   # the file it names is a real one and reads it
        row = next(ln for ln in table.splitlines() if ln.startswith(f"| `{name}` |"))
        files = re.findall(r"`([\w/]+\.py)`", row.rsplit("|", 2)[-2])
        assert files and all(name in (ROOT / "src" / "meganeura" / f).read_text() for f in files), row


def _markdown_files():
    return [ROOT / "README.md", ROOT / "bench" / "results" / "HISTORY.md", *sorted((ROOT / "docs").glob("*.md"))]


def test_relative_links_of_the_docs_lead_to_files():
    import re
    broken = []
    for md in _markdown_files():
        for target in re.findall(r"\]\(([^)\s]+)\)", md.read_text()):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (md.parent / target.split("#", 1)[0]).resolve()
            if not path.exists():
                broken.append(f"{md.relative_to(ROOT)}: {target}")
    assert not broken, "links to nothing:\n" + "\n".join(broken)


def test_no_doc_calls_vulkan_the_default_without_its_extra():
    """backend='gpu' takes the direct Vulkan backend only where the vulkan extra is installed too."""
    for md in _markdown_files()[:1] + _markdown_files()[2:]:
        text = " ".join(md.read_text().split())
        assert "default where a Vulkan driver is present" not in text, md
