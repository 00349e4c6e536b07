"""The meganeura command: user mistakes end with one error line and a non-zero exit, no
traceback; every option of every subcommand has help text."""
import json
import re
import subprocess
import sys

import pytest


def _cli(args, block=(), env=None):
    """Run the CLI in a fresh interpreter; ``block`` makes those packages unimportable, as
    on a core-only install."""
    code = ("import sys\n"
            + "".join(f"sys.modules[{m!r}] = None\n" for m in block)
            + f"from meganeura.cli import main\nsys.exit(main({list(args)!r}))\n")
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def _one_line_error(r, *needles):
    assert r.returncode != 0, r
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("meganeura"), r.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


def test_generate_missing_or_empty_or_incomplete_model_folder(tmp_path):
    _one_line_error(_cli(["generate", "--model", "/nonexistent/model", "--prompt", "hi"]), "does not exist")
    _one_line_error(_cli(["generate", "--model", str(tmp_path), "--prompt", "hi"]), "config.json")
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    (tmp_path / "tokenizer.json").write_text("{}")
    _one_line_error(_cli(["generate", "--model", str(tmp_path), "--prompt", "hi"]), "model.safetensors")
    f = tmp_path / "config.json"
    _one_line_error(_cli(["generate", "--model", str(f), "--prompt", "hi"]), "is a file")


def test_generate_bad_values_and_broken_files_are_one_line(tmp_path):
    for name in ("config.json", "tokenizer.json", "model.safetensors"):
        (tmp_path / name).write_text("not what it should be")
    _one_line_error(_cli(["generate", "--model", str(tmp_path), "--prompt", "hi", "--top-p", "2"]), "--top-p")
    # a corrupt folder fails inside the loader: still one line, naming the error
    _one_line_error(_cli(["generate", "--model", str(tmp_path), "--prompt", "hi", "--backend", "numpy"]), "error:")


def test_core_only_install_gets_the_install_line():
    _one_line_error(_cli(["train-demo"], block=["sklearn"]), "pip install 'meganeura[examples]'")
    _one_line_error(_cli(["bench", "--size", "tiny", "--quick"], block=["torch"]), "pip install 'meganeura[bench]'")
    _one_line_error(_cli(["bench", "gates"], block=["transformers"]), "pip install 'meganeura[bench]'")


def test_missing_files_and_folders(tmp_path):
    _one_line_error(_cli(["train-demo", "--out", str(tmp_path / "no" / "dir" / "m.safetensors")]), "does not exist")
    _one_line_error(_cli(["bench", "report", str(tmp_path / "missing.json"), "--out", str(tmp_path)]),
                    "does not exist")
    _one_line_error(_cli(["train-demo", "--epochs", "0"]), "--epochs")


def test_argument_mistakes_exit_2_without_traceback():
    for args in (["nosuchcommand"], ["generate"], ["train-demo", "--epochs", "many"], []):
        r = _cli(args)
        assert r.returncode == 2 and "Traceback" not in r.stderr and "usage:" in r.stderr, (args, r.stderr)


@pytest.mark.parametrize("args", [[], ["info"], ["train-demo"], ["generate"], ["bench"], ["bench", "run"],
                                  ["bench", "gates"], ["bench", "train"], ["bench", "report"]])
def test_help_everywhere(args):
    r = _cli(args + ["--help"])
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    # every option line carries help text: "  --name VALUE   text"
    for line in r.stdout.splitlines():
        m = re.match(r"^  (-{1,2}[\w-]+)", line)
        if m and m.group(1) not in ("-h",):
            opt_line = line.strip()
            idx = r.stdout.splitlines().index(line)
            nxt = r.stdout.splitlines()[idx + 1] if idx + 1 < len(r.stdout.splitlines()) else ""
            has_text = re.search(r"\S\s{2,}\S", opt_line) or nxt.startswith(" " * 10)
            assert has_text, f"{args}: option without help: {line!r}"
