"""Bad input gives a clear error naming the op, the tensor, its shape and what was expected."""
import numpy as np
import pytest

import meganeura as mg


def test_shape_mismatch_names_op_tensors_and_shapes():
    g = mg.Graph()
    a, b = g.input("a", (2, 3)), g.input("b", (4, 3))
    with pytest.raises(mg.ShapeError, match=r"add: .*'a' \(2, 3\).*'b' \(4, 3\)"):
        a + b
    with pytest.raises(mg.ShapeError, match=r"matmul: inner dimensions differ: 3 vs 4"):
        a @ b
    w = g.parameter("fc.weight", (5, 4))
    with pytest.raises(mg.ShapeError, match=r"linear: .*in_features 4.*'a' \(2, 3\)"):
        mg.ops.linear(a, w)
    with pytest.raises(mg.ShapeError, match=r"reshape: cannot reshape 6 elements to \(4, 2\)"):
        a.reshape(4, 2)
    with pytest.raises(mg.ShapeError, match=r"sum: dim 2 out of range for rank 2 tensor 'a'"):
        mg.ops.sum(a, 2)


def test_dtype_mismatch_is_type_error():
    g = mg.Graph()
    a, i = g.input("a", (3,)), g.input("i", (3,), mg.i32)
    with pytest.raises(TypeError, match=r"add: dtypes differ: 'a' f32, 'i' i32"):
        a + i
    with pytest.raises(TypeError, match=r"exp: 'i' has dtype i32, expected a float"):
        mg.ops.exp(i)


def test_duplicate_and_unknown_names():
    g = mg.Graph()
    g.input("x", (2,))
    with pytest.raises(ValueError, match="duplicate name 'x'"):
        g.parameter("x", (2,))
    with pytest.raises(KeyError, match="no tensor named 'y'"):
        g["y"]


def test_tensors_of_two_graphs_do_not_mix():
    a, b = mg.Graph().input("a", (2,)), mg.Graph().input("b", (2,))
    with pytest.raises(ValueError, match="different graphs"):
        a + b


def _session():
    g = mg.Graph()
    x = g.input("x", (2, 3))
    w = g.parameter("fc.weight", (4, 3))
    return mg.compile(g, outputs=[mg.ops.linear(x, w)], backend="numpy")


def test_missing_unknown_and_misshaped_feeds():
    s = _session()
    with pytest.raises(KeyError, match=r"missing feed\(s\) \['x'\].*x \(2, 3\) f32"):
        s.run({})
    with pytest.raises(KeyError, match=r"unknown input\(s\) \['z'\]"):
        s.run({"x": np.zeros((2, 3)), "z": 1})
    with pytest.raises(ValueError, match=r"input 'x': got shape \(3, 2\), expected \(2, 3\)"):
        s.run({"x": np.zeros((3, 2))})
    with pytest.raises(ValueError, match=r"got shape \(3,\), expected \(2, 3\)"):
        s.run({"x": np.zeros(3)})  # never silently broadcast


def test_integer_input_refuses_floats():
    g = mg.Graph()
    ids = g.input("ids", (3,), mg.i32)
    s = mg.compile(g, outputs=[ids * 2], backend="numpy")
    with pytest.raises(TypeError, match=r"input 'ids': got float dtype float64, expected integer i32"):
        s.run({"ids": np.zeros(3)})
    np.testing.assert_array_equal(s.run({"ids": np.array([1, 2, 3])})[0], [2, 4, 6])


def test_load_state_dict_reports_every_problem_at_once():
    s = _session()
    with pytest.raises(ValueError) as e:
        s.load_state_dict({"fc.weight": np.zeros((3, 4)), "fc.bias": np.zeros(4)})
    msg = str(e.value)
    assert "'fc.weight': got shape (3, 4), expected (4, 3)" in msg and "1 unexpected key(s): 'fc.bias'" in msg
    with pytest.raises(ValueError, match="1 missing key\\(s\\): 'fc.weight'"):
        s.load_state_dict({})
    before = s.state_dict()["fc.weight"].copy()
    np.testing.assert_array_equal(s.state_dict()["fc.weight"], before)  # nothing changed by failed loads


def test_default_init_is_deterministic_and_seeded():
    a, b = _session().state_dict()["fc.weight"], _session().state_dict()["fc.weight"]
    np.testing.assert_array_equal(a, b)
    assert np.abs(a).max() <= 1 / np.sqrt(3) and a.std() > 0


def test_bad_backend_precision_and_compile_args():
    g = mg.Graph()
    x = g.input("x", (2,))
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        mg.compile(g, outputs=[x], backend="cuda")
    with pytest.raises(ValueError, match="unknown precision"):
        mg.compile(g, outputs=[x], precision="fast")
    with pytest.raises(ValueError, match="give outputs="):
        mg.compile(g)
    with pytest.raises(RuntimeError, match="compile with loss= and optimizer="):
        mg.compile(g, outputs=[x]).step({"x": np.zeros(2)})


def test_grad_rules():
    g = mg.Graph()
    x, i = g.input("x", (3,)), g.input("i", (3,), mg.i32)
    unused = g.input("u", (2,))
    y = mg.ops.sum(x * x)
    gx, gi, gu = mg.grad(y, [x, i, unused])
    assert gi is None
    out = mg.reference.evaluate(g, [gx, gu], {"x": np.array([1.0, 2.0, 3.0], np.float32), "u": np.ones(2, np.float32)})
    np.testing.assert_allclose(out[0], [2, 4, 6])
    np.testing.assert_array_equal(out[1], [0, 0])
    with pytest.raises(ValueError, match="non-scalar loss needs an explicit cotangent"):
        mg.grad(x * 2.0, [x])


def test_shapes_must_be_integers_and_countable():
    g = mg.Graph()
    with pytest.raises(mg.ShapeError, match=r"'x': shape \(4.7, 2\) has a non-integer dimension 4.7 \(float\)"):
        g.input("x", (4.7, 2))
    with pytest.raises(mg.ShapeError, match=r"non-integer dimension 2.0"):
        g.parameter("w", (2.0,))                 # refused, not silently truncated
    with pytest.raises(mg.ShapeError, match=r"non-integer dimension True"):
        g.input("b", (True, 3))
    with pytest.raises(mg.ShapeError, match=r"'big': shape \(4294967296, 4294967296\) has 18446744073709551616 "
                                            r"elements, more than int64 can count"):
        g.input("big", (2 ** 32, 2 ** 32))
    a = g.input("a", (2 ** 31, 2 ** 31))
    with pytest.raises(mg.ShapeError, match="more than int64 can count"):
        mg.ops.reshape(a, (2 ** 31, 1, 2 ** 31)) * g.input("c", (1, 2 ** 31, 1))   # broadcasting overflows
    x = g.input("x2", (6,))
    with pytest.raises(mg.ShapeError, match=r"reshape: shape .* has a non-integer dimension 1.5"):
        x.reshape(4, 1.5)
    with pytest.raises(mg.ShapeError, match=r"broadcast_to: shape .* has a non-integer dimension"):
        mg.ops.broadcast_to(x, (2.0, 6))


def test_constants_out_of_their_dtype_range_are_refused():
    g = mg.Graph()
    with pytest.raises(ValueError, match=r"constant: value 1099511627776 is out of range for i32"):
        g.constant(2 ** 40, mg.i32)
    with pytest.raises(ValueError, match=r"constant 'neg': value -1 is out of range for u32"):
        g.constant(np.array([1, -1]), mg.u32, name="neg")
    with pytest.raises(ValueError, match=r"value 2.5 is not an integer, cannot become i32"):
        g.constant([1.0, 2.5], mg.i32)
    with pytest.raises(ValueError, match=r"value 1e\+20 overflows f16"):
        g.constant(1e20, mg.f16)
    i = g.input("i", (3,), mg.i32)
    with pytest.raises(ValueError, match=r"out of range for i32"):
        i * 2 ** 40                                # a Python int operand becomes a checked constant
    np.testing.assert_array_equal(g.constant(2 ** 31 - 1, mg.i32).attrs["value"], 2 ** 31 - 1)
    assert np.isinf(g.constant(float("inf"), mg.f16).attrs["value"])    # infinity itself is representable


def test_integer_feeds_out_of_range_are_refused():
    g = mg.Graph()
    ids = g.input("ids", (2,), mg.i32)
    s = mg.compile(g, outputs=[ids * 2], backend="numpy")
    with pytest.raises(ValueError, match=r"input 'ids': value 4294967296 is out of range for i32"):
        s.run({"ids": np.array([1, 2 ** 32], np.int64)})


def test_zero_dimensional_tensors_in_dim_ops():
    """Found by the property test: these raised IndexError (or failed in the reference)."""
    g = mg.Graph()
    s = g.input("s", ())
    with pytest.raises(mg.ShapeError, match="concat: zero-dimensional tensors cannot be concatenated"):
        mg.ops.concat([s, s], 0)
    with pytest.raises(mg.ShapeError, match="slice: dim 0: a zero-dimensional tensor has no dimension"):
        mg.ops.slice(s, 0, 0, 1)
    assert mg.ops.squeeze(s, 0) is s                       # torch keeps a 0-d tensor as it is
    outs = [mg.ops.sum(s, 0), mg.ops.mean(s, -1, keepdim=True), mg.ops.amax(s, 0)]   # torch: the scalar itself
    assert all(o.shape == () for o in outs)
    for backend in ("numpy", "gpu"):
        got = mg.compile(g, outputs=outs, backend=backend).run({"s": np.float32(3.5)})
        assert [float(v) for v in got] == [3.5, 3.5, 3.5], backend
