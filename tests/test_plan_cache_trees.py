"""A plan read from the plan cache brings its kernels' ASTs: a fresh process that loads it
(with the Vulkan kernel caches empty) prints every kernel's GLSL from its tree. An entry of
another layout is ignored and rewritten; a stored tree that does not print its kernel, or
that would build something other than data, is not used (the Vulkan stage refuses that
kernel, naming it) and its entry is deleted, so the next compile builds the plan again."""
import io
import json
import os
import pathlib
import pickle
import shutil
import subprocess
import sys
import textwrap
import zlib

import numpy as np
import pytest

import meganeura as mg
from meganeura import disk, plan_cache
from meganeura.codegen import kernel_ast
from meganeura.compiler import CompileOptions, compile_plan

SRC = pathlib.Path(mg.__file__).parent
ADAPTER = {"name": "test adapter", "description": "driver 1.0", "backend": "Vulkan"}
# the Vulkan backend's caches of compiled kernels (``runtime/vulkan/cache.py``): emptied so
# that the fresh process must make every kernel's GLSL again
KERNEL_CACHES = ("kernels", "kernel_sets", "spirv", "coopmat")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    for switch in ("MEGANEURA_NO_DISK_CACHE", "MEGANEURA_NO_PLAN_CACHE", "MEGANEURA_NO_FUSE"):
        monkeypatch.delenv(switch, raising=False)
    return tmp_path


# the graph (both processes build it from this text): a tiled matmul with its bias and ReLU,
# a GEMV, a softmax row kernel, a reduction and pointwise kernels, all on the kernel AST
GRAPH = textwrap.dedent("""
    import numpy as np
    import meganeura as mg

    def graph():
        g = mg.Graph()
        x, w, b = g.input("x", (24, 40)), g.input("w", (36, 40)), g.input("b", (36,))
        v = g.input("v", (1, 40))
        h = mg.ops.relu(mg.ops.linear(x, w, b))
        outs = [mg.ops.softmax(h * 0.25, -1), mg.ops.sum(h, -1), mg.ops.linear(v, w), mg.ops.exp(-mg.ops.abs(x))]
        rng = np.random.default_rng(7)
        feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
        return g, outs, feeds

    def run(backend="gpu"):
        g, outs, feeds = graph()
        with mg.compile(g, outputs=outs, backend=backend) as s:
            got = s.run(feeds)
            if backend == "numpy":
                return [np.asarray(o) for o in got], {}, None
            plan = s.executor.plans["run"]
            kp, stats = plan.kernel_plan, dict(plan.executable.stats)
        return [np.asarray(o) for o in got], stats, kp
""")

CHILD = GRAPH + textwrap.dedent("""
    import json, sys
    got, stats, kp = run()
    np.savez(sys.argv[1], *got)
    texts = {d.wgsl for d in kp.dispatches}
    print(json.dumps({"cache": kp.stats.get("cache"), "texts": len(texts),
                      "printed": stats["kernels_printed"],
                      "compiled": stats["kernels_compiled"], "hits": stats["kernel_cache_hits"]}))
""")


def _graph_module():
    scope: dict = {}
    exec(compile(GRAPH, "graph", "exec"), scope)
    return scope


def _vulkan():
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.runtime.backends import vulkan_unavailable_reason
    if vulkan_unavailable_reason() is not None:
        pytest.skip(vulkan_unavailable_reason())


def test_a_cached_plan_prints_its_kernels_from_their_trees_in_a_fresh_process(cache):
    _vulkan()
    scope = _graph_module()
    got, stats, kp = scope["run"]()
    assert kp.stats["cache"] == "stored"
    texts = {d.wgsl for d in kp.dispatches}
    archetypes = {d.kernel.archetype for d in kp.dispatches}
    assert {"matmul", "rows", "pointwise"} <= archetypes and {"reduce", "multi"} & archetypes, kp.names
    assert stats["kernels_printed"] == len(texts), stats
    # the NumPy interpreter agrees
    want, _, _ = scope["run"]("numpy")
    for w, o in zip(want, got):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=1e-6)
    for name in KERNEL_CACHES:
        shutil.rmtree(cache / name, ignore_errors=True)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(SRC.parent)] + sys.path))
    r = subprocess.run([sys.executable, "-c", CHILD, str(cache / "out.npz")], env=env, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    child = json.loads(r.stdout.strip().splitlines()[-1])
    n = len(texts)
    assert child == {"cache": "hit", "texts": n, "printed": n, "compiled": n,
                     "hits": 0}, child
    again = np.load(cache / "out.npz")
    for i, o in enumerate(got):
        np.testing.assert_allclose(again[f"arr_{i}"], o, rtol=1e-6, atol=1e-7)


def _mlp():
    g = mg.Graph()
    x = g.input("x", (4, 8))
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("w1", (16, 8)), g.parameter("b1", (16,))))
    return [mg.ops.softmax(mg.ops.linear(h, g.parameter("w2", (3, 16))), -1)]


def _entry(cache):
    (path,) = (cache / "plans").glob("*.plan")
    head, fmt, plan, trees = pickle.loads(disk.load(path))
    assert (head, fmt) == (plan_cache._MAGIC, plan_cache.FORMAT)
    return path, plan, trees


def _tree(packed):
    return plan_cache._PlanUnpickler(io.BytesIO(zlib.decompress(packed))).load()


def test_the_entry_holds_each_printed_kernels_tree_without_the_printers_memos(cache):
    kp = compile_plan(_mlp(), options=CompileOptions(), cache=True, adapter=ADAPTER)
    path, plan, trees = _entry(cache)
    texts = {d.wgsl for d in kp.dispatches}
    assert {t for t, _ in trees} == texts and len(trees) == len(texts)
    for text, packed in trees:
        tree = _tree(packed)
        assert tree == kp.trees[text] and tree is not kp.trees[text]
        assert "_wgsl" not in vars(tree) and all("_wgsl" not in vars(s) for s in tree.body if hasattr(s, "__dict__"))
    # loaded, the plan holds its trees packed; each unpacked prints its kernel's WGSL
    hit = compile_plan(_mlp(), options=CompileOptions(), cache=True, adapter=ADAPTER)
    assert hit.stats["cache"] == "hit" and hit.trees == {} and set(hit.packed_trees) == texts
    for d in hit.dispatches:
        tree = plan_cache.unpacked_tree(d.wgsl, hit.packed_trees[d.wgsl])
        assert kernel_ast.print_wgsl(tree) == d.wgsl


def test_a_tree_that_does_not_print_its_kernel_is_not_used_and_its_entry_goes(cache):
    opts = CompileOptions()
    compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER)
    path, plan, trees = _entry(cache)
    assert len(trees) >= 2
    swapped = [(trees[0][0], trees[1][1]), (trees[1][0], trees[0][1])] + trees[2:]
    assert disk.store(path, pickle.dumps((plan_cache._MAGIC, plan_cache.FORMAT, plan, swapped)))
    hit = compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER)
    assert hit.stats["cache"] == "hit"
    text = trees[0][0]
    assert plan_cache.unpacked_tree(text, hit.packed_trees[text]) is None and not path.exists()  # compiled next time
    assert compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER).stats["cache"] == "stored"
    hit = compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER)
    assert hit.stats["cache"] == "hit"
    assert all(plan_cache.unpacked_tree(t, hit.packed_trees[t]) is not None for t, _ in trees)


@pytest.mark.parametrize("bad", ["plan only", "foreign text", "not bytes", "old format"])
def test_an_entry_of_another_layout_is_ignored_and_rewritten(cache, bad):
    opts = CompileOptions()
    compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER)
    path, plan, trees = _entry(cache)
    entry = {"plan only": plan,            # the layout before kernel ASTs
             "foreign text": (plan_cache._MAGIC, plan_cache.FORMAT, plan, [("another kernel", trees[0][1])]),
             "not bytes": (plan_cache._MAGIC, plan_cache.FORMAT, plan, [(trees[0][0], _tree(trees[0][1]))]),
             "old format": (plan_cache._MAGIC, plan_cache.FORMAT - 1, plan, trees)}[bad]
    assert disk.store(path, pickle.dumps(entry))
    assert compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER).stats["cache"] == "stored"
    assert compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER).stats["cache"] == "hit"


def test_a_tree_that_would_build_a_function_is_refused(cache):
    opts = CompileOptions()
    compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER)
    path, plan, trees = _entry(cache)
    text = trees[0][0]
    evil = zlib.compress(pickle.dumps(kernel_ast.ComputeKernel((), 64, (kernel_ast.ExprStmt(os.getcwd),))))
    with pytest.raises(pickle.UnpicklingError, match="may not build"):
        _tree(evil)
    assert disk.store(path, pickle.dumps((plan_cache._MAGIC, plan_cache.FORMAT, plan, [(text, evil)])))
    hit = compile_plan(_mlp(), options=opts, cache=True, adapter=ADAPTER)
    assert hit.stats["cache"] == "hit"
    assert plan_cache.unpacked_tree(text, hit.packed_trees[text]) is None and not path.exists()


def test_wgpu_runs_a_cached_plan_with_trees_as_it_ran_the_compiled_one(cache):
    """The wgpu backend runs the WGSL itself and reads no tree: a plan stored with them runs
    from the cache with the compiled plan's results."""
    pytest.importorskip("wgpu", reason="the wgpu extra")
    scope = _graph_module()
    g, outs, feeds = scope["graph"]()
    runs = []
    for expect in ("stored", "hit"):
        with mg.compile(g, outputs=outs, backend="wgpu") as s:
            runs.append([np.asarray(o) for o in s.run(feeds)])
            assert s.executor.plans["run"].kernel_plan.stats["cache"] == expect
    for a, b in zip(*runs):
        np.testing.assert_array_equal(a, b)
    assert all(t for _, t in _entry(cache)[2])
