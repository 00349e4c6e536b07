"""The kernel families built on the typed kernel AST (pointwise, merged launches, reductions,
rows, norms, fused rows): over the plans of small graphs in many shapes and fusion options
(``kernel_ast_cases``), their WGSL is the text the templates printed before the move (a
digest per case, taken at the branch point), their GLSL printed from the tree is what the
WGSL-to-GLSL translator writes for that WGSL (so their SPIR-V is unchanged), and they run
right on both Vulkan runtimes and the NumPy interpreter."""
import hashlib

import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen.kernel_ast import print_glsl
from tests.printed_trees import tree_of
from tests.glsl_reference import check_glsl
from tests.kernel_ast_cases import CASES, plans

# archetypes whose kernels are printed from the kernel AST
ON_AST = {"pointwise", "multi", "reduce", "rows", "norm", "rowfuse"}
# sha256 of each case's plans' "archetype\nWGSL" texts as the templates printed them
WGSL_DIGESTS = {"pointwise": "aabaebfac49c8b66", "pointwise_f16": "946e5ad579fe15bd", "reductions": "acce67fc90e3d88c",
                "merged": "75866d85e6eaafe6", "rows": "f31e13c1b024010e", "norms": "4bcc181fa82d0011",
                "norm_training": "94a1019e6155c673", "rowfuse": "4cf1a4c2622b7c1b"}


@pytest.fixture(scope="module")
def case_plans():
    return {case: plans(case) for case in CASES}


@pytest.mark.parametrize("case", sorted(CASES))
def test_wgsl_is_the_templates(case, case_plans):
    texts = [f"{d.kernel.archetype}\n{d.wgsl}" for kp in case_plans[case] for d in kp.dispatches]
    assert hashlib.sha256("\n".join(texts).encode()).hexdigest()[:16] == WGSL_DIGESTS[case]


@pytest.mark.parametrize("case", sorted(CASES))
def test_glsl_from_the_tree_is_the_translation(case, case_plans):
    """Each kernel of the families on the AST has its tree (the Vulkan stage prints it), and
    its GLSL is the translator's under the unroll and IEEE switches the stage passes."""
    seen, trees = {}, {}
    for kp in case_plans[case]:
        trees.update(kp.trees)          # (the plans are the module's: their trees are read there)
        for d in kp.dispatches:
            if d.kernel.archetype in ON_AST:
                seen.setdefault(d.wgsl, d.kernel.name)
    assert seen, f"no kernel of {sorted(ON_AST)} in {case}"
    for text, name in seen.items():
        tree = trees.get(text)
        assert tree is not None, name
        for unroll, ieee in ((False, True), (True, False)):
            check_glsl(print_glsl(tree, unroll=unroll, preserve_ieee=ieee), text, name, unroll, ieee)


def _run_case(case, backend, feeds_seed=0, **kw):
    g = mg.Graph()
    spec = CASES[case](g)
    rng = np.random.default_rng(feeds_seed)
    feeds = {n: (rng.standard_normal(t.shape) * 2).astype(np.float32) for n, t in g.inputs.items()}
    with mg.compile(g, outputs=spec["outputs"], backend=backend, **kw) as s:
        got = s.run(feeds)
        plan = s.executor.plans["run"] if backend != "numpy" else None
        stats = plan.executable.stats if backend == "vulkan" else {}
        kp = plan.kernel_plan if plan is not None else None
    return [np.asarray(o, dtype=np.float64) for o in got], stats, kp


@pytest.mark.parametrize("backend", ["vulkan", "wgpu"])
@pytest.mark.parametrize("case", ["pointwise", "reductions", "merged", "rows", "norms", "rowfuse"])
def test_families_run_right_on_both_runtimes(case, backend, monkeypatch):
    """The cases' outputs on each runtime equal the NumPy interpreter's (IEEE specials
    included); on Vulkan the kernels on the AST are printed, not translated."""
    if backend == "vulkan":
        pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    else:
        pytest.importorskip("wgpu", reason="the wgpu extra")
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    want, _, _ = _run_case(case, "numpy")
    got, stats, kp = _run_case(case, backend)
    for k, (w, o) in enumerate(zip(want, got)):
        np.testing.assert_allclose(o, w, rtol=2e-4, atol=2e-5, equal_nan=True, err_msg=f"{case} output {k}")
    if backend == "vulkan":
        on_ast = {d.wgsl for d in kp.dispatches if d.kernel.archetype in ON_AST}
        assert stats["kernels_printed"] >= len(on_ast), (stats, kp.names)


@pytest.mark.slow
def test_every_workload_kernel_of_the_families_prints_its_translation():
    """Every distinct kernel of the families on the AST in the five workloads (tiny size,
    inference and training step, strict and accelerated, with and without arrays of
    buffers): printed from its tree, GLSL equal to the translation of its WGSL."""
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import WORKLOADS, make
    from meganeura.compiler import CompileOptions, compile_plan, f16_weights
    seen = {}
    for name in WORKLOADS:
        w = make(name, size="tiny")
        for phase in ("inference", "train_step"):
            targets, n, upd = phase_targets(w, phase)
            for precision in ("strict", "accelerated"):
                copies = f16_weights(targets[:n]) if precision == "accelerated" else frozenset()
                for arrays in (False, True):
                    opts = CompileOptions(max_bindings=BINDINGS, binding_arrays=arrays, precision=precision,
                                          f16_weights=copies)
                    for d in compile_plan(targets, n_forward=n, options=opts, updates=upd).dispatches:
                        if d.kernel.archetype in ON_AST:
                            seen.setdefault(d.wgsl, d.kernel.name)
    assert len(seen) > 300, len(seen)
    for text, name in seen.items():
        tree = tree_of(text)
        assert tree is not None, name
        check_glsl(print_glsl(tree, unroll=True), text, name, unroll=True)
