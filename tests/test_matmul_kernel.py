"""The matmul kernel at tile boundaries, with and without bounds checks, every tile size,
split K, transposed operands and broadcast batches, against NumPy in float64."""
import numpy as np
import pytest

import meganeura as mg

SHAPES = [((1, 40), (40, 300)), ((3, 2, 33), (33, 17)), ((4, 64), (64, 9)),
          ((128, 8), (8, 128)), ((130, 9), (9, 131)), ((1, 5), (5, 7)), ((64, 16), (16, 64)),
          ((2, 1, 70, 24), (3, 24, 129)), ((2, 130, 20), (20, 132)), ((256, 64), (64, 128))]


@pytest.mark.parametrize("tile,split", [("32", "1"), ("64", "1"), ("128", "1"), ("32", "3"), ("64", "2")])
@pytest.mark.parametrize("ta,tb", [(False, False), (True, False), (False, True), (True, True)])
@pytest.mark.parametrize("sa,sb", SHAPES, ids=[f"{a}x{b}" for a, b in SHAPES])
def test_matmul_kernel(monkeypatch, tile, split, ta, tb, sa, sb):
    monkeypatch.setenv("MEGANEURA_MATMUL_TILE", tile)
    monkeypatch.setenv("MEGANEURA_MATMUL_SPLIT", split)
    rng = np.random.default_rng(0)
    A, B = rng.standard_normal(sa).astype(np.float32), rng.standard_normal(sb).astype(np.float32)
    if ta:
        A = np.ascontiguousarray(np.swapaxes(A, -1, -2))
    if tb:
        B = np.ascontiguousarray(np.swapaxes(B, -1, -2))
    g = mg.Graph()
    a, b = g.input("a", A.shape), g.input("b", B.shape)
    out = mg.compile(g, outputs=[mg.ops.mm(a, b, ta=ta, tb=tb)], backend="gpu").run({"a": A, "b": B})[0]
    want = np.matmul(np.swapaxes(A, -1, -2) if ta else A, np.swapaxes(B, -1, -2) if tb else B,
                     dtype=np.float64)
    np.testing.assert_allclose(out, want, rtol=1e-4, atol=1e-4 * np.abs(want).max())


def test_merged_matmuls_one_reading_a_buffer_in_its_epilogue_the_other_as_its_operand():
    """Sibling matmuls share a launch and its bindings: a buffer that one part's epilogue
    reads element by element stays scalar when the other part reads it as its B operand
    (declaring it vec4 there made the epilogue's read a type error)."""
    g = mg.Graph()
    x, z = g.input("x", (64, 64)), g.input("z", (64, 64))
    w = g.parameter("w", (64, 64))
    outs = [mg.ops.linear(x, w) + z, mg.ops.linear(x, z)]
    s = mg.compile(g, outputs=outs, backend="gpu")
    assert s.executor.plan("run").names == ["matmul+add|matmul"]
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 64)).astype(np.float32), "z": rng.standard_normal((64, 64)).astype(np.float32)}
    wv = rng.standard_normal((64, 64)).astype(np.float32)
    s.load_state_dict({"w": wv})
    y1, y2 = s.run(feeds)
    np.testing.assert_allclose(y1, feeds["x"] @ wv.T + feeds["z"], rtol=1e-5, atol=1e-4)
    np.testing.assert_allclose(y2, feeds["x"] @ feeds["z"].T, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("name", ["MEGANEURA_MATMUL_MAX_SPLIT", "MEGANEURA_MATMUL_GROUPS"])
def test_bad_matmul_sweep_switches_name_themselves(name):
    """A sweep switch that is not a positive integer stops the import of the matmul code
    generator with its name and value, not with int()'s message."""
    import os
    import subprocess
    import sys
    env = dict(os.environ, **{name: "0x10"})
    r = subprocess.run([sys.executable, "-c", "import meganeura.codegen.matmul"], env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"{name}='0x10': expected a positive integer" in r.stderr, r.stderr


def test_shallow_products_with_a_full_grid_are_not_split():
    """A K split costs a sum of partials: a product at most SHALLOW_K deep on a grid of
    SHALLOW_MIN_GROUPS workgroups runs whole; deeper products, and shallow ones on a smaller
    grid, still split toward the target."""
    from meganeura.codegen.matmul import SHALLOW_K, plan_tiles
    # SmolLM2's weight gradients over 128 tokens: 216 and 81 64-tiles
    assert plan_tiles(1536, 576, SHALLOW_K, 1)[2] == 1
    assert plan_tiles(576, 576, SHALLOW_K, 1)[2] == 1
    assert plan_tiles(1536, 576, 4 * SHALLOW_K, 1)[2] > 1
    assert plan_tiles(128, 128, SHALLOW_K, 1)[2] > 1        # 4 tiles
