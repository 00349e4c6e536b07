"""The Vulkan compile stage's translation fallback (``compilation.vulkan``): the kernels of
the families on the kernel AST are printed, none translated, and only the families named in
``TRANSLATED_FAMILIES`` still go the fallback, each counted in ``stats["kernels_translated"]``,
over the tiny workloads' plans (inference and training step, strict and accelerated). Once
every family is printed the list is empty and the fallback (with the translator) goes."""
from meganeura.bench import compile_time
from meganeura.codegen.kernel_ast import tree_of
from meganeura.compilation import vulkan
from meganeura.compilation.executable import FinalKernel


def _plans_kernels(names, phases=("inference", "train_step")):
    """{WGSL text: kernel} of the distinct kernels of the workloads' tiny plans."""
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    from meganeura.compiler import CompileOptions, compile_plan, f16_weights
    texts = {}
    for name in names:
        w = make(name, size="tiny")
        for phase in phases:
            targets, n, upd = phase_targets(w, phase)
            for precision in ("strict", "accelerated"):
                copies = f16_weights(targets[:n]) if precision == "accelerated" else frozenset()
                opts = CompileOptions(max_bindings=BINDINGS, precision=precision, f16_weights=copies)
                for d in compile_plan(targets, n_forward=n, options=opts, updates=upd).dispatches:
                    texts.setdefault(d.wgsl, d.kernel)
    return texts


def _still_translated(kernel) -> bool:
    """Whether ``kernel`` is of the families ``TRANSLATED_FAMILIES`` names."""
    if kernel.archetype == "matmul":       # only those with an im2col in their operand loads
        return any(p.spec.get("gathers") for p in kernel.spec.get("parts", [kernel]))
    return kernel.archetype in vulkan.TRANSLATED_FAMILIES


def _stage(monkeypatch, texts, translate=True):
    """The stage's stats finishing ``texts`` for the H200 (glslang not run: the GLSL is the
    kernel); ``translate`` False: the translator fails the test if called."""
    from meganeura.codegen import glsl

    def compiled(self, glsl_text, label, key, text):
        self._add("kernels_compiled", 1)
        return FinalKernel(label, key, glsl_text)

    def refuse(wgsl, name="kernel", *a, **k):
        raise AssertionError(f"{name}: translated, not printed from its kernel AST")
    with monkeypatch.context() as m:
        m.setattr(vulkan.VulkanKernels, "_compile", compiled)
        m.setenv("MEGANEURA_TRANSLATE_WORKERS", "0")
        if not translate:
            m.setattr(glsl, "to_glsl", refuse)
        done, stats = compile_time.stage_kernels(texts)
    assert set(done) == set(texts) and all(done[t].text.startswith("#version") for t in texts)
    return stats


def _check(monkeypatch, names):
    """The families of the kernels that went the fallback."""
    texts = _plans_kernels(names)
    printed = {t: k for t, k in texts.items() if tree_of(t) is not None}
    rest = {t: k for t, k in texts.items() if t not in printed}
    wrong = sorted({k.name for k in rest.values() if not _still_translated(k)})
    assert not wrong, f"kernels of families on the kernel AST without a tree: {wrong[:8]}"
    assert printed
    stats = _stage(monkeypatch, printed, translate=False)
    assert stats["kernels_translated"] == 0 and stats["kernels_printed"] == len(printed), stats
    if rest:
        stats = _stage(monkeypatch, rest)
        assert stats["kernels_translated"] == len(rest) and stats["kernels_printed"] == 0, stats
    assert {k.archetype for k in rest.values()} <= set(vulkan.TRANSLATED_FAMILIES)
    return {k.archetype for k in rest.values()}


def test_the_tiny_workloads_families_on_the_ast_compile_with_no_translation(monkeypatch):
    from meganeura.bench.workloads import WORKLOADS
    assert _check(monkeypatch, list(WORKLOADS)) == set(vulkan.TRANSLATED_FAMILIES)
