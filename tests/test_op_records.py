"""Every op record is whole: its shape rule and NumPy reference, a VJP or
``differentiable=False``, and a way onto the GPU (a lowering registered by the code generator,
``pointwise``, a layout op, a shape-dependent kernel, or a decomposition into other ops). The
records carry no WGSL: how a kernel computes an op is the code generator's."""
import pathlib

import pytest

import meganeura as mg
from meganeura import codegen
from meganeura.ops.registry import OPS, register_lowering

SRC = pathlib.Path(mg.__file__).parent


@pytest.mark.parametrize("name", sorted(OPS))
def test_every_record_has_its_rules(name):
    od = OPS[name]
    assert callable(od.infer) and callable(od.ref), name
    assert callable(od.vjp) or not od.differentiable, name
    on_gpu = (od.lower is not None, od.extra.get("pointwise", False), od.extra.get("layout", False),
              name in codegen.KERNEL_WHEN, callable(od.extra.get("decompose")))
    assert any(on_gpu), f"{name}: no lowering, pointwise code, layout rule or decomposition"


def test_pointwise_ops_have_their_scalar_code_in_the_code_generator():
    from meganeura.codegen.scalar_ops import SCALAR
    pointwise = {n for n, od in OPS.items() if od.extra.get("pointwise")}
    assert pointwise == set(SCALAR)


def test_the_op_modules_and_the_graph_hold_no_wgsl():
    for path in [SRC / "graph.py", *sorted((SRC / "ops").glob("*.py"))]:
        text = path.read_text().lower()
        assert "wgsl" not in text, f"{path.name} mentions WGSL"


def test_a_lowering_is_registered_once():
    with pytest.raises(ValueError, match="already has a lowering"):
        register_lowering("matmul", lambda *a: None)
    with pytest.raises(KeyError, match="no op 'no_such_op'"):
        register_lowering("no_such_op", lambda *a: None)
