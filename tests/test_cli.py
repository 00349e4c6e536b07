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


@pytest.mark.parametrize("args", [[], ["info"], ["train-demo"], ["generate"], ["quantize"], ["serve"], ["bench"], ["bench", "run"],
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


def test_train_demo_batch_larger_than_the_training_set_fails_before_training(tmp_path):
    out = tmp_path / "m.safetensors"
    line = _one_line_error(_cli(["train-demo", "--batch", "2000", "--out", str(out), "--backend", "numpy"]),
                           "--batch 2000", "training set")
    assert re.search(r"\(\d+ digits\)", line), line
    assert not out.exists(), "no checkpoint may be written when nothing was trained"
    _one_line_error(_cli(["train-demo", "--out", str(tmp_path)]), repr(str(tmp_path)), "is a folder")
    _one_line_error(_cli(["train-demo", "--lr", "0"]), "--lr")


def test_export_names_a_checkpoint_that_is_not_safetensors(tmp_path):
    bad = tmp_path / "not-a-checkpoint.py"
    bad.write_text("print('hello')\n")
    _one_line_error(_cli(["export", "--web", str(tmp_path / "web"), "--checkpoint", str(bad)]),
                    repr(str(bad)), "not a safetensors checkpoint")
    assert not (tmp_path / "web").exists()
    _one_line_error(_cli(["export", "--web", str(tmp_path / "web"), "--epochs", "0"]), "--epochs")


def test_bench_report_names_a_file_it_cannot_merge(tmp_path):
    broken, foreign = tmp_path / "broken.json", tmp_path / "foreign.json"
    broken.write_text("{not json")
    foreign.write_text(json.dumps({"a": 1}))
    _one_line_error(_cli(["bench", "report", str(broken), "--out", str(tmp_path)]), repr(str(broken)), "not a JSON")
    _one_line_error(_cli(["bench", "report", str(foreign), "--out", str(tmp_path)]), repr(str(foreign)),
                    "'options'")


def test_backend_help_says_what_each_choice_runs():
    for cmd in ("train-demo", "generate"):
        text = " ".join(_cli([cmd, "--help"]).stdout.split())
        assert "gpu: the direct Vulkan backend where the 'vulkan' extra and a Vulkan driver are present" in text
        assert "else wgpu" in text and "vulkan: the direct Vulkan backend only" in text
        assert "wgpu: WGSL through wgpu" in text and "numpy: the reference interpreter" in text
        assert "WGSL through wgpu; lavapipe" not in text     # the old, wrong description of gpu
    text = " ".join(_cli(["train-demo", "--help"]).stdout.split())
    for shown in ("(default: 64)", "(default: 20)", "(default: 0)", "(default: digits_mlp.safetensors)"):
        assert shown in text, shown


def test_bench_help_names_the_command_without_markup():
    for args in (["bench", "--help"], ["bench", "run", "--help"], ["bench", "gates", "--help"]):
        out = _cli(args).stdout
        assert out.startswith("usage: meganeura bench"), out[:200]
        assert "``" not in out and "python -m meganeura.bench" not in out, out
    text = " ".join(_cli(["bench", "run", "--help"]).stdout.split())
    # the committed tables' protocol is said where the defaults are
    assert "--warmup" in text and "--samples" in text and "used 3" in text and "used 10" in text
    assert "(default: tiny)" in text


def test_info_leads_with_the_backend_that_runs_and_its_device():
    from meganeura.runtime.backends import get_runtime_device, resolve
    r = _cli(["info"])
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    kind = resolve("gpu")
    runtime = "the direct Vulkan backend" if kind == "vulkan" else "wgpu"
    assert lines[0].startswith(f"backend='gpu' runs on: {runtime}, device {get_runtime_device(kind).name}"), lines[0]
    cache = next(ln for ln in lines if "disk pipeline cache:" in ln)
    features = next(ln for ln in lines if ln.strip().startswith("features:"))
    if "off" in cache:      # a feature wgpu cannot use is not listed as one that is in use
        assert "pipeline-cache" not in features, features
