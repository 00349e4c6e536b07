"""The GLSL renderer (codegen.glsl): typing rules checked on small modules, every kernel
of the five workloads translated and accepted by glslang, and results compared with wgpu
on lavapipe (the OpInfo table and the training tests run on both backends elsewhere)."""
import numpy as np
import pytest

from meganeura.codegen.glsl import GlslTranslationError, to_glsl

vulkan = pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")

HEAD = "@group(0) @binding(0) var<storage, read_write> b0: array<f32>;\n" \
       "@group(0) @binding(1) var<storage, read> b1: array<u32>;\n"


def main(body, extra=""):
    return HEAD + extra + "@compute @workgroup_size(64)\nfn main(@builtin(local_invocation_index) lid: u32) {\n" + \
        body + "\n}\n"


def test_abstract_literals_take_the_other_operand_type():
    g = to_glsl(main("    let i = lid + 1;\n    let x = b0[i] * 2;\n    b0[lid] = x + f32(b1[i] % 3);"))
    assert "uint i = (lid + 1u);" in g
    assert "float x = (b0[i] * 2.0);" in g
    assert "(b1[i] % 3u)" in g
    assert "readonly buffer" in g and g.count("buffer B") == 2


def test_declarations_are_typed_and_zero_initialised():
    g = to_glsl(main("    var acc: array<vec4<f32>, 4>;\n    var s: f32;\n    var k = 0u;\n"
                     "    acc[k] = vec4<f32>(s);\n    b0[lid] = acc[0u].x;"))
    assert "vec4 acc[4];" in g and "acc[z1_] = vec4(0);" in g
    assert "float s = float(0);" in g and "uint k = 0u;" in g


def test_spellings_select_bitcast_remainder_barrier_round():
    g = to_glsl(main("    let m = bitcast<f32>(0xff800000u);\n    let y = select(m, 1.0, lid < 3u);\n"
                     "    workgroupBarrier();\n    b0[lid] = round(y % 2.5) + f32(bitcast<u32>(m) & 1u);"))
    assert "uintBitsToFloat(0xff800000u)" in g
    assert "((lid < 3u) ? 1.0 : m)" in g
    assert "barrier();" in g and "workgroupBarrier" not in g
    assert "roundEven((y - 2.5 * trunc(y / 2.5)))" in g
    assert "floatBitsToUint(m)" in g


def test_functions_get_prototypes_and_module_variables_are_hoisted():
    src = HEAD + ("fn later(x: f32) -> f32 { return helper(x) + part[0]; }\n"
                  "var<workgroup> part: array<f32, 64>;\n"
                  "fn helper(x: f32) -> f32 { return x * 0.5; }\n"
                  "@compute @workgroup_size(64)\nfn main(@builtin(local_invocation_index) lid: u32) {\n"
                  "    part[lid] = 1.0;\n    b0[lid] = later(b0[lid]);\n}\n")
    g = to_glsl(src)
    assert g.index("shared float part[64];") < g.index("float later(float x) {")
    assert g.index("float helper(float x);") < g.index("float later(float x) {")


def test_outside_the_subset_names_the_construct_and_line():
    with pytest.raises(GlslTranslationError, match=r"k: line 5: unknown identifier .loop."):
        to_glsl(main("    loop { break; }"), "k")
    with pytest.raises(GlslTranslationError, match="unknown identifier 'nope'"):
        to_glsl(main("    b0[lid] = nope;"))
    # ">>" closing two templates is split into two tokens, in signatures read before the
    # bodies and in the bodies: the line of an error still counts the source's tokens
    body = "\n".join(f"    var v{i}: array<vec2<vec4<f32>>, 2>;" for i in range(13))
    src = ("@group(0) @binding(0) var<storage, read_write> o: array<f32>;\n"
           f"fn a() {{\n{body}\n    let z = 1.0\n}}\nfn b(p: array<vec4<f32>>) {{\n}}\n"
           "@compute @workgroup_size(1)\nfn main() {\n}\n")
    with pytest.raises(GlslTranslationError, match=r"k: line 17: expected ;"):
        to_glsl(src, "k")
    with pytest.raises(GlslTranslationError, match=r"line 2: unexpected character '\$'"):
        to_glsl("fn f() {\n  $\n}\n")


def test_every_workload_kernel_compiles_to_spirv():
    """Every distinct kernel of the five workloads (tiny size, every phase) is translated
    and accepted by glslang: the archetypes as the fusion passes combine them."""
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import WORKLOADS, make
    from meganeura.compiler import CompileOptions, compile_plan
    from meganeura.compilation.glslang import compile_glsl
    seen, shared = {}, 0
    for name in WORKLOADS:
        w = make(name, size="tiny")
        for phase in ("inference", "train_step"):
            targets, n, upd = phase_targets(w, phase)
            kp = compile_plan(targets, n_forward=n, options=CompileOptions(max_bindings=BINDINGS), updates=upd)
            for d in kp.dispatches:
                seen.setdefault(d.wgsl, d.kernel.name)
            # merged launches whose parts share bodies through arrays of buffers (Vulkan)
            kp = compile_plan(targets, n_forward=n, updates=upd,
                              options=CompileOptions(max_bindings=BINDINGS, binding_arrays=True))
            for d in kp.dispatches:
                if "binding_array" in d.wgsl:
                    shared += 1
                    seen.setdefault(d.wgsl, d.kernel.name)
    assert len(seen) > 300 and shared > 5, (len(seen), shared)
    from meganeura.codegen.glsl import _tokenize_text, tokenize
    for text, kname in seen.items():
        # tokens from the cache of lines are the whole text's
        assert [(t.kind, t.text) for t in tokenize(text)] == [(t.kind, t.text) for t in _tokenize_text(text)], kname
        # as hardware drivers get them: with [[unroll]] hints (lavapipe runs them without)
        spirv = compile_glsl(to_glsl(text, kname, unroll=True), name=kname, disk_cache=False)
        assert spirv[:4] == b"\x03\x02\x23\x07"      # the SPIR-V magic number


@pytest.mark.parametrize("backend", ["vulkan", "wgpu"])
def test_backends_agree_bit_for_bit_on_a_training_step(backend):
    """The same plan through both runtimes: the same kernels, so the same bits but for the
    folds that the Vulkan kernels' SignedZeroInfNanPreserve forbids the driver (an ulp)."""
    from .harness import mlp_training_losses
    ref = mlp_training_losses("numpy")
    got = mlp_training_losses(backend)
    np.testing.assert_allclose(got, ref, rtol=1e-5)
    if backend == "vulkan":
        np.testing.assert_allclose(got, mlp_training_losses("wgpu"), rtol=3e-7, atol=0)


def test_arrays_of_buffers_are_blocks_indexed_by_a_uniform_value():
    """``binding_array<array<T>, N>`` (a merged launch's parts sharing one body) is an array of
    buffer blocks; indexing it picks a block, whose member is then indexed."""
    src = ("@group(0) @binding(0) var<storage, read> b0: binding_array<array<f32>, 3>;\n"
           "@group(0) @binding(1) var<storage, read_write> b1: binding_array<array<vec4<f32>>, 2>;\n"
           "@compute @workgroup_size(64)\n"
           "fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lid: u32) {\n"
           "    let p = wid.x % 2u;\n"
           "    b1[p][lid] = vec4<f32>(b0[p + 1u][lid] * 2.0);\n}\n")
    out = to_glsl(src, "arrays")
    assert "readonly buffer B0_ { float d[]; } b0[3];" in out and "buffer B1_ { vec4 d[]; } b1[2];" in out
    assert "b1[p].d[lid] = vec4((b0[(p + 1u)].d[lid] * 2.0));" in out, out
    with pytest.raises(GlslTranslationError, match="binding_array of"):
        to_glsl(src.replace("array<f32>, 3>", "array<f32, 4>, 3>"))


def test_signed_remainder_folded_constants_and_saturate_keep_wgsl_meaning():
    src = ("@group(0) @binding(0) var<storage, read_write> b0: array<f32>;\n"
           "@group(0) @binding(1) var<storage, read_write> b1: array<i32>;\n"
           "@compute @workgroup_size(64)\nfn main(@builtin(local_invocation_index) lid: u32) {\n"
           "    let i = lid + 4 * 2;\n    b1[i] = b1[i] % 3i;\n    b0[i] = b0[i] * (3 / 2) + saturate(b0[i]);\n}\n")
    g = to_glsl(src)
    assert "uint i = (lid + uint((4 * 2)));" in g                 # a folded constant is wrapped, not suffixed
    assert "(b1[i] - 3 * (b1[i] / 3))" in g                        # truncated, as WGSL's signed %
    assert "float(((3 / 2)))" in g                                 # integer division first, as WGSL
    assert "clamp(b0[i], 0.0, 1.0)" in g
    from meganeura.compilation.glslang import compile_glsl
    assert compile_glsl(g, disk_cache=False)[:4] == b"\x03\x02\x23\x07"


def test_unroll_hints_only_where_asked(monkeypatch):
    """Short constant loops get [[unroll]] for hardware drivers; the software rasterizer
    (lavapipe) gets none, since its compile time explodes on unrolled kernels."""
    src = main("    var s = 0.0;\n    for (var k = 0u; k < 8u; k = k + 1u) { s = s + b0[k]; }\n"
               "    for (var k = 0u; k < 64u; k = k + 1u) { s = s + b0[k]; }\n    b0[lid] = s;")
    on, off = to_glsl(src, unroll=True), to_glsl(src, unroll=False)
    assert on.count("[[unroll]]") == 1 and "GL_EXT_control_flow_attributes" in on      # 8 trips, not 64
    assert "[[unroll]]" not in off and "control_flow_attributes" not in off
    monkeypatch.delenv("MEGANEURA_GLSL_UNROLL", raising=False)
    from meganeura.runtime.vulkan.backend import get_vulkan_runtime
    rt = get_vulkan_runtime()
    assert rt.unroll_loops is not rt.is_software
