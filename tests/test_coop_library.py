"""The cooperative-matrix kernels (codegen.coopmat, flash_coop, flash_grad_coop) print their
bindings, output stores and epilogue helpers from the typed kernel AST (codegen.coop_library):
the same GLSL as the WGSL-to-GLSL translator made of the WGSL those parts had (so the SPIR-V
is unchanged), over every such matmul of the five tiny workloads (inference and training) and
flash forward and backward kernels of many shapes, on tensor cores and emulated."""
import pytest

import meganeura as mg
from meganeura.bench.dispatches import BINDINGS, phase_targets
from meganeura.bench.workloads import WORKLOADS, make
from meganeura.codegen import attention as attn, coop_library, coopmat, flash_coop, flash_grad_coop
from meganeura.codegen.common import Bindings
from meganeura.compiler import CompileOptions, compile_plan

from .glsl_reference import GOLDEN
from .samples_attention import head_split_block, sdpa_graph
from .test_flash_attention import CASES as FLASH_CASES, _case

OPTS = CompileOptions(precision="accelerated", max_bindings=BINDINGS, workgroup_storage=49152)


def _check(monkeypatch, render, case):
    """``render()``'s GLSL printed from the AST has its golden digest (recorded while it was
    what the translated library gave); returns it."""
    printed = render()[0]
    GOLDEN.check(printed, case, unroll=False, ieee=True)
    return printed


def _workload_matmuls():
    out = {}
    for name in WORKLOADS:
        w = make(name, size="tiny", device="cpu")
        for phase in ("inference", "train"):
            targets, n, upd = phase_targets(w, phase)
            for d in compile_plan(targets, n_forward=n, options=OPTS, updates=upd).dispatches:
                if d.kernel.archetype == "matmul" and not coopmat.select(d.kernel):
                    out.setdefault(d.wgsl, d)
    return list(out.values())


def test_workload_matmuls_print_the_translated_library(monkeypatch):
    ds = _workload_matmuls()
    assert len(ds) > 80
    features = set()
    for d in ds:
        for p in d.kernel.spec.get("parts", [d.kernel]):
            features |= {f for f, on in (("store_map", p.spec.get("store_map")), ("stores", p.spec.get("stores")),
                                         ("epilogue", p.epilogue is not None), ("f16 out", p.out.dtype.name == "f16"))
                         if on}
        for emulate in (False, True):
            printed = _check(monkeypatch, lambda: coopmat.render(d.kernel, 49152, emulate, d.bufs),
                             f"{d.kernel.name}:emulate={int(emulate)}")
            features |= {f for f, on in (("helper", "isnan_f(" in printed), ("merged", "store_out1(" in printed)) if on}
    assert features == {"store_map", "stores", "epilogue", "f16 out", "helper", "merged"}, features


def _flash_dispatches():
    graphs = []
    for name, c in FLASH_CASES.items():
        feeds = _case(name)
        g, ins, out = sdpa_graph(feeds, c[4], c[5])
        do = g.input("do", out.shape)
        graphs.append(([out], mg.grad(mg.ops.sum(out * do), [ins[x] for x in "qkv"])))
    g, out, _, _, _ = head_split_block(2, 75, 3, 16, seed=3, causal=True)       # strided views, an epilogue
    graphs.append(([out], mg.grad(mg.ops.sum(out * out), [g.nodes[0]])))
    seen = {}
    for fwd, grads in graphs:
        for targets in (fwd, fwd + list(grads)):
            kp = compile_plan(targets, n_forward=len(fwd), options=OPTS)
            for d in kp.dispatches:
                if d.kernel.archetype == "attention":
                    seen.setdefault(d.wgsl, d)
    return list(seen.values())


def test_flash_kernels_print_the_translated_library(monkeypatch):
    monkeypatch.setattr(attn, "MAX_ROW_WORK", 0)
    monkeypatch.setattr(attn, "ACCELERATED_MAX_ROW_WORK", 0)
    kinds, n = set(), 0
    for d in _flash_dispatches():
        k = d.kernel
        module = flash_grad_coop if k.spec.get("grad") else flash_coop
        for emulate in (False, True):
            for storage in (16384, 32768, 49152):
                if module.select(k, storage, emulate=emulate):
                    continue
                _check(monkeypatch, lambda: module.render(k, storage, emulate=emulate),
                       f"{k.name}:emulate={int(emulate)},storage={storage}")
                kinds.add(k.spec.get("grad") or ("forward+epilogue" if k.epilogue is not None else "forward"))
                n += 1
    assert n > 100, n
    assert kinds == {"forward", "forward+epilogue", "dq", "dkv"}, kinds


def test_no_operand_functions_on_cooperative_matrices():
    """Of the operands computed in the loads only im2col reaches the tensor-core matmul (its
    columns are fetched there); any other would need a function, which it refuses."""
    g = mg.Graph()
    x, w = g.input("x", (40, 24)), g.input("w", (52, 24))
    (d,) = [d for d in compile_plan([mg.ops.mm(x, w, tb=True)], n_forward=1, options=OPTS).dispatches
            if d.kernel.archetype == "matmul"]
    k = d.kernel
    assert coopmat.select(k) == ""
    gathers = {0: {"expr": ("leaf", 0), "shape": (40, 24), "size": 960, "offset": 0, "first": 2, "n": 1}}
    import dataclasses
    assert "function" in coopmat.select(dataclasses.replace(k, spec={**k.spec, "gathers": gathers}))


def test_library_of_an_array_binding_and_unused_position():
    """Buffers as declared: read-only or written, a position no use claimed (words), an array
    of buffers (a merged launch's binding), f16 elements."""
    from meganeura.graph import f16, f32
    from meganeura.schedule import Buf
    a, b, c, e = (Buf(64, "temp", n) for n in "abce")
    bind = Bindings([a, b])
    bind.index(a, f16, write=True)
    bind.array((c, e), "f32")
    bind.index(c, f32)
    lib = coop_library.glsl_library(bind, [])
    GOLDEN.check(lib, "library", unroll=False, ieee=False)
    assert "B2_ { float d[]; } b2[2];" in coop_library.glsl_library(bind, [])


def test_printed_kernel_compiles():
    """glslang accepts an emulated kernel whose library is printed (with an epilogue helper)."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.compilation.glslang import compile_glsl
    g = mg.Graph()
    x, w = g.input("x", (40, 24)), g.input("w", (52, 24))
    y = mg.ops.gelu(mg.ops.mm(x, w, tb=True))
    (d,) = [d for d in compile_plan([y], n_forward=1, options=OPTS).dispatches if d.kernel.archetype == "matmul"]
    src = coopmat.render(d.kernel, 49152, emulate=True, bufs=d.bufs)[0]
    assert "erf_f(" in src
    assert compile_glsl(src, name="coop_gelu", target="vulkan1.3", disk_cache=False)
