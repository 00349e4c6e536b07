"""The ONNX operator table, case by case: small graphs built with onnx.helper, imported,
and run on the interpreter and both GPU backends against onnx's own reference evaluator
(``onnx.reference``), to 1e-4 relative. Each case packs several operators (and their
attribute variants: negative steps, asymmetric and automatic padding, transposed Gemm
operands) into one graph, so a backend compiles a few programs, not dozens."""
import re
from pathlib import Path

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")

import meganeura as mg  # noqa: E402
from meganeura.bench.gates import rel_l2  # noqa: E402
from onnx import TensorProto as TP, helper  # noqa: E402
from onnx.reference import ReferenceEvaluator  # noqa: E402

BACKENDS = ["numpy", "gpu", "wgpu"]
F, I64 = TP.FLOAT, TP.INT64


def node(op, ins, outs, **attrs):
    return helper.make_node(op, ins, outs, name=f"{op.lower()}_{outs[0]}", **attrs)


def const(name, value):
    arr = np.asarray(value)
    return helper.make_tensor(name, I64 if arr.dtype.kind == "i" else F, arr.shape, arr.ravel().tolist())


def case(nodes, inputs, outputs, inits=(), opset=18):
    """(model, feeds): ``inputs`` {name: (shape, elem type)}, ``outputs`` names; feeds seeded."""
    rng = np.random.default_rng(0)
    vis = [helper.make_tensor_value_info(n, t, s) for n, (s, t) in inputs.items()]
    feeds = {n: (rng.standard_normal(s).astype(np.float32) if t == F else rng.integers(0, 4, s).astype(np.int64))
             for n, (s, t) in inputs.items()}
    untyped = helper.make_model(helper.make_graph(nodes, "case", vis, [helper.make_empty_tensor_value_info(n)
                                                                       for n in outputs], list(inits)),
                                opset_imports=[helper.make_opsetid("", opset)])
    values = ReferenceEvaluator(untyped).run(None, feeds)        # the outputs' types and shapes, as declared
    outs = [helper.make_tensor_value_info(n, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
            for n, v in zip(outputs, values)]
    g = helper.make_graph(nodes, "case", vis, outs, list(inits))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)]), feeds


def elementwise():
    nodes = [node("Sub", ["x", "y"], ["d"]), node("Abs", ["d"], ["a"]), node("Sqrt", ["a"], ["s"]),
             node("Sigmoid", ["x"], ["sg"]), node("Clip", ["y", "lo", "hi"], ["c"]),
             node("Equal", ["k", "two"], ["eq"]), node("Where", ["eq", "s", "c"], ["w"]),
             node("Exp", ["c"], ["e"]), node("Neg", ["e"], ["n"]), node("Reciprocal", ["e"], ["r"]),
             node("Max", ["x", "y", "sg"], ["mx"]), node("Min", ["x", "y"], ["mn"]), node("Identity", ["mx"], ["id"]),
             node("Dropout", ["id"], ["dr"], seed=0), node("Div", ["n", "r"], ["q"]),
             node("Pow", ["a", "three"], ["p"]), node("Tanh", ["mn"], ["t"]), node("Relu", ["d"], ["rl"]),
             node("Erf", ["x"], ["er"]), node("Log", ["e"], ["lg"]), node("Gelu", ["x"], ["ge"], approximate="tanh"),
             node("Mul", ["x", "three"], ["x3"]), node("HardSwish", ["x3"], ["hw"]),
             node("HardSigmoid", ["x3"], ["hs"], alpha=0.3, beta=0.4)]
    inits = [const("lo", np.float32(-0.5)), const("hi", np.float32(0.5)), const("two", np.int64(2)),
             const("three", np.float32(3.0))]
    return case(nodes, {"x": ((3, 5), F), "y": ((1, 5), F), "k": ((3, 5), I64)},
                ["w", "sg", "q", "dr", "p", "t", "rl", "er", "lg", "ge", "hw", "hs"], inits, opset=20)


def shapes():
    nodes = [node("Flatten", ["x"], ["f"], axis=2), node("Unsqueeze", ["f", "ax0"], ["u"]),
             node("Squeeze", ["u", "ax0"], ["sq"]), node("Concat", ["x", "x2"], ["cat"], axis=1),
             node("Slice", ["cat", "st", "en", "axs", "sp"], ["sl"]), node("Expand", ["y", "shp"], ["ex"]),
             node("Transpose", ["ex"], ["tr"], perm=[2, 0, 1]),
             node("Split", ["x"], ["s0", "s1"], axis=3, num_outputs=2),
             node("Shape", ["x"], ["sh"], start=1), node("Reshape", ["sl", "rs"], ["r"]),
             node("Add", ["s0", "s1"], ["ss"])]
    inits = [const("ax0", np.array([0])), const("st", np.array([5, -1])), const("en", np.array([0, -100])),
             const("axs", np.array([1, 3])), const("sp", np.array([-2, -2])), const("shp", np.array([2, 4, 1])),
             const("rs", np.array([2, 0, -1]))]
    return case(nodes, {"x": ((2, 3, 2, 4), F), "x2": ((2, 4, 2, 4), F), "y": ((4, 3), F)},
                ["sq", "sl", "tr", "ss", "r"], inits)


def reductions():
    nodes = [node("ReduceMean", ["x", "a1"], ["m"], keepdims=1), node("ReduceSum", ["x", "a02"], ["s"], keepdims=0),
             node("ReduceMax", ["x"], ["mx"], keepdims=0), node("ReduceMin", ["x", "a1"], ["mn"]),
             node("Softmax", ["x"], ["sm"], axis=1), node("LogSoftmax", ["x"], ["ls"]),
             node("Sub", ["x", "m"], ["c"])]
    inits = [const("a1", np.array([1])), const("a02", np.array([0, -1]))]
    return case(nodes, {"x": ((2, 3, 4), F)}, ["c", "s", "mx", "mn", "sm", "ls"], inits)


def vision():
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3
    w1 = rng.standard_normal((4, 3, 3)).astype(np.float32) * 0.3
    inits = [const("w", w), const("w1", w1), const("b", np.arange(4, dtype=np.float32) / 4),
             const("scale", np.linspace(0.5, 1.5, 4, dtype=np.float32)), const("bias", np.zeros(4, np.float32) + 0.1),
             const("mean", np.linspace(-0.2, 0.2, 4, dtype=np.float32)), const("var", np.linspace(0.5, 2, 4, dtype=np.float32))]
    nodes = [node("Conv", ["x", "w", "b"], ["same"], auto_pad="SAME_UPPER", strides=[2, 2], kernel_shape=[3, 3]),
             node("Conv", ["x", "w"], ["asym"], pads=[0, 1, 2, 1], dilations=[1, 2]),
             node("BatchNormalization", ["asym", "scale", "bias", "mean", "var"], ["bn"], epsilon=1e-3),
             node("MaxPool", ["bn"], ["mp"], kernel_shape=[2, 3], pads=[0, 0, 1, 1], strides=[2, 1]),
             node("AveragePool", ["x"], ["ap"], kernel_shape=[3, 3], pads=[1, 1, 1, 1], count_include_pad=1),
             node("AveragePool", ["x"], ["ap0"], kernel_shape=[2, 2], strides=[2, 2], ceil_mode=1),
             node("GlobalAveragePool", ["same"], ["gap"]), node("GlobalMaxPool", ["same"], ["gmp"]),
             node("Conv", ["x1", "w1"], ["c1"], pads=[1, 1], strides=[2])]
    return case(nodes, {"x": ((2, 3, 7, 7), F), "x1": ((2, 3, 9), F)},
                ["same", "mp", "ap", "ap0", "gap", "gmp", "c1"], inits)


def linear_algebra():
    rng = np.random.default_rng(2)
    inits = [const("wt", rng.standard_normal((4, 6)).astype(np.float32)),
             const("w", rng.standard_normal((6, 5)).astype(np.float32)),
             const("c", rng.standard_normal((1, 5)).astype(np.float32)),
             const("bias", rng.standard_normal(6).astype(np.float32))]
    nodes = [node("Gemm", ["a", "w", "c"], ["g1"], transA=1, alpha=0.5, beta=2.0),
             node("Gemm", ["b", "wt", "bias"], ["g2"], transB=1),
             node("Gemm", ["b", "wt"], ["g3"], transB=1, alpha=2.0),
             node("MatMul", ["p", "q"], ["mm"]), node("MatMul", ["v", "w"], ["mv"])]
    inits[0] = const("wt", rng.standard_normal((6, 4)).astype(np.float32))
    return case(nodes, {"a": ((6, 3), F), "b": ((3, 4), F), "p": ((2, 1, 3, 4), F), "q": ((3, 4, 2), F),
                 "v": ((6,), F)},
                ["g1", "g2", "g3", "mm", "mv"], inits)


def gathers():
    rng = np.random.default_rng(3)
    inits = [const("table", rng.standard_normal((5, 3)).astype(np.float32)), const("neg", np.array([[-1, 0], [2, -2]])),
             const("one", np.int64(1))]
    nodes = [node("Gather", ["table", "ids"], ["emb"]), node("Gather", ["x", "neg"], ["gx"], axis=1),
             node("Gather", ["x", "one"], ["g1"], axis=0), node("Gather", ["x", "ids"], ["gi"], axis=2),
             node("GatherND", ["x", "nd"], ["gnd"]), node("Cast", ["ids"], ["fi"], to=F),
             node("CastLike", ["fi", "ids"], ["back"]), node("Add", ["back", "ids"], ["twice"]),
             node("Less", ["ids", "one"], ["lt"]), node("Not", ["lt"], ["nl"]), node("Cast", ["nl"], ["nlf"], to=F),
             node("Greater", ["x", "zero"], ["pos"]), node("Cast", ["pos"], ["posf"], to=F),
             node("CastLike", ["three_i", "x"], ["three_f"]), node("Mul", ["x", "three_f"], ["x3"])]
    inits += [const("zero", np.float32(0.0)), const("three_i", np.int64(3))]     # a known value cast like x
    # ScatterND with constant indices: whole rows from an input, slices from a constant (a
    # negative index, a repeated one: the last wins), every row, and reduction add
    inits += [const("rows", np.array([[1], [3]])), const("cells", np.array([[0, 1], [2, 3], [-1, 0], [0, 1]])),
              const("fill", rng.standard_normal((4, 5)).astype(np.float32)),
              const("all", np.array([[3], [2], [1], [0]])), const("two_cells", np.array([[1, 1], [2, 0]]))]
    nodes += [node("ScatterND", ["x", "rows", "upd"], ["sr"]), node("ScatterND", ["x", "cells", "fill"], ["sc"]),
              node("ScatterND", ["x", "all", "x3"], ["sa"]),
              node("ScatterND", ["x", "two_cells", "upd2"], ["sd"], reduction="add")]
    return case(nodes, {"x": ((4, 4, 5), F), "ids": ((2, 3), I64), "nd": ((2, 2), I64), "upd": ((2, 4, 5), F),
                        "upd2": ((2, 5), F)},
                ["emb", "gx", "g1", "gi", "gnd", "twice", "nlf", "posf", "x3", "sr", "sc", "sa", "sd"], inits)


def resizing():
    """Pad (constant with a value, reflect, edge over chosen axes) and Resize (linear to sizes
    and by scales, align_corners; nearest at an integer scale, as torch exports it)."""
    f = np.float32
    inits = [const("p1", np.array([0, 0, 1, 2, 0, 0, 2, 1])), const("cv", f(0.5)), const("p2", np.array([1, 2, 2, 1])),
             const("ax", np.array([2, 3])), const("p3", np.array([0, 1, 1, 0])), const("ax3", np.array([-1, 1])),
             const("size", np.array([2, 3, 7, 5])), const("sc", np.array([1, 1, 1.5, 2.5], f)),
             const("sc2", np.array([1, 1, 2, 3], f)), const("noroi", np.zeros(0, f))]
    nodes = [node("Pad", ["x", "p1", "cv"], ["pc"]), node("Pad", ["x", "p2", "", "ax"], ["pr"], mode="reflect"),
             node("Pad", ["x", "p3", "", "ax3"], ["pe"], mode="edge"),
             node("Resize", ["x", "", "", "size"], ["rl"], mode="linear"),
             node("Resize", ["x", "noroi", "sc"], ["rs"], mode="linear"),
             node("Resize", ["x", "", "", "size"], ["ra"], mode="linear", coordinate_transformation_mode="align_corners"),
             node("Resize", ["x", "", "sc2"], ["rn"], mode="nearest", coordinate_transformation_mode="asymmetric",
                  nearest_mode="floor")]
    return case(nodes, {"x": ((2, 3, 4, 3), F)}, ["pc", "pr", "pe", "rl", "rs", "ra", "rn"], inits)


CASES = {"elementwise": elementwise, "shapes": shapes, "reductions": reductions, "vision": vision,
         "linear_algebra": linear_algebra, "gathers": gathers, "resizing": resizing}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(CASES))
def test_operators_match_onnx_reference(name, backend):
    model, feeds = CASES[name]()
    onnx.checker.check_model(model)
    want = ReferenceEvaluator(model).run(None, feeds)
    imported = mg.from_onnx(model)
    got = imported.compile(backend=backend).run(imported.feeds(**feeds))
    assert imported.output_names == [o.name for o in model.graph.output]
    for out, ours, ref in zip(imported.output_names, got, want):
        assert ours.shape == ref.shape, (out, ours.shape, ref.shape)
        err = rel_l2(ours.astype(np.float64), ref.astype(np.float64)) if np.any(ref) else np.abs(ours).max()
        assert err < 1e-4, (out, err)


def test_the_docs_list_every_operator_of_the_table():
    from meganeura.importers.onnx_ops import TABLE
    text = (Path(__file__).parents[1] / "docs" / "importing.md").read_text()
    listed = text[text.index("- **Operators**"):text.index("- **Unsupported")]
    assert sorted(set(TABLE) - set(re.findall(r"\b[A-Z][A-Za-z]+\b", listed))) == []
