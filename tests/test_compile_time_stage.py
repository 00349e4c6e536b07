"""bench/compile_time.py takes its kernels' GLSL and SPIR-V from the Vulkan compile stage
(``stage_kernels``: printed from each kernel's AST, as the plan holds it) for the H200's target, and compares plan digests of one size only."""
import json

import pytest

from meganeura.bench import compile_time
from meganeura.compilation.target import Target
from meganeura.compiler import compile_plan
from tests.glsl_reference import GOLDEN


def test_stage_kernels_print_ast_kernels_and_compile_every_text():
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.bench.workloads import make
    from meganeura.compilation.glslang import compile_glsl
    w = make("whisper", size="tiny", device="cpu")
    b = w.build("inference")
    kp = compile_plan(b.outputs, n_forward=len(b.outputs), options=compile_time._h200_options())
    texts = {}
    for d in kp.dispatches:
        texts.setdefault(d.wgsl, d.kernel)
    done, stats = compile_time.stage_kernels(texts, kp.trees)
    assert set(done) == set(texts) and stats["kernels_compiled"] == len(texts)
    on_ast = [t for t in texts if t in kp.trees]
    assert stats["kernels_printed"] == len(on_ast) == len(texts)
    target = Target.h200()
    for text, fk in done.items():
        # the golden GLSL (recorded while it was what the translator wrote for the H200)
        GOLDEN.check(fk.text, texts[text].name, unroll=True, ieee=True)
        assert fk.spirv == compile_glsl(fk.text, name="k", target=target.spirv_env, disk_cache=False)


def test_host_reference_names_its_job(monkeypatch):
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    monkeypatch.setattr(compile_time, "REFERENCE_COMPILES", 2)
    host = compile_time.host_reference(threads=1)
    assert host["job"] == "glslang" and host["compiles"] == 2 and host["one_thread_s"] > 0


def test_digests_refuse_a_reference_of_another_size(tmp_path):
    ref = tmp_path / "ref.json"
    ref.write_text(json.dumps({"size": "real", "plans": {}}))
    with pytest.raises(SystemExit, match="size 'real'"):
        compile_time.main(["--digests", "--size", "tiny", "--workloads", "whisper", "--out", str(tmp_path / "d.json"),
                           "--against", str(ref)])
