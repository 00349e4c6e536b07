"""The Vulkan compile stage prints every kernel's GLSL from its kernel AST
(``compilation.vulkan``): every distinct kernel of the tiny workloads' plans (inference and
training step, strict and accelerated) has a tree and is printed; a WGSL text with no tree
is refused, naming the kernel (nothing parses WGSL back)."""
from collections import OrderedDict

import pytest

from meganeura.bench import compile_time
from meganeura.compilation import vulkan
from meganeura.compilation.executable import FinalKernel


def _plans_kernels(names, phases=("inference", "train_step")):
    """({WGSL text: kernel}, {WGSL text: kernel AST}) of the distinct kernels of the workloads'
    tiny plans (the trees as the plans hold them)."""
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    from meganeura.compiler import CompileOptions, compile_plan, f16_weights
    texts, trees = {}, {}
    for name in names:
        w = make(name, size="tiny")
        for phase in phases:
            targets, n, upd = phase_targets(w, phase)
            for precision in ("strict", "accelerated"):
                copies = f16_weights(targets[:n]) if precision == "accelerated" else frozenset()
                opts = CompileOptions(max_bindings=BINDINGS, precision=precision, f16_weights=copies)
                kp = compile_plan(targets, n_forward=n, options=opts, updates=upd)
                trees.update(kp.trees)
                for d in kp.dispatches:
                    texts.setdefault(d.wgsl, d.kernel)
    return texts, trees


def _stage(monkeypatch, texts, trees):
    """The stage's stats finishing ``texts`` for the H200 (glslang not run: the GLSL is the
    kernel), with none of them recalled from the kernels an earlier test finished in this
    process (each is printed here)."""
    def compiled(self, glsl_text, label, key, text):
        self._add("kernels_compiled", 1)
        return FinalKernel(label, key, glsl_text)
    with monkeypatch.context() as m:
        m.setattr(vulkan.VulkanKernels, "_compile", compiled)
        m.setattr(vulkan, "_finished", OrderedDict())
        done, stats = compile_time.stage_kernels(texts, trees)
    assert set(done) == set(texts) and all(done[t].text.startswith("#version") for t in texts)
    return stats


def test_every_kernel_of_the_tiny_workloads_is_printed_from_its_tree(monkeypatch):
    from meganeura.bench.workloads import WORKLOADS
    texts, trees = _plans_kernels(list(WORKLOADS))
    without = sorted({k.name for t, k in texts.items() if t not in trees})
    assert not without, f"kernels without a kernel AST: {without[:8]}"
    assert {k.archetype for k in texts.values()} >= {"pointwise", "multi", "reduce", "rows", "matmul", "gather",
                                                      "attention"}
    stats = _stage(monkeypatch, texts, trees)
    assert stats["kernels_printed"] == len(texts), stats


def test_a_wgsl_text_without_a_tree_is_refused_naming_the_kernel():
    stage = vulkan.VulkanKernels(_h200(), disk=False)
    try:
        with pytest.raises(vulkan.KernelSourceError, match="'hand_written'.*backend='wgpu'"):
            stage.finish([("@compute @workgroup_size(1)\nfn main() {\n}\n", "hand_written")])
    finally:
        stage.close()


def _h200():
    from meganeura.compilation.target import Target
    return Target.h200()
