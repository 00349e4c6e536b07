"""The fragment operations of the cooperative-matrix kernels (``coopmat``, ``flash_coop``,
``flash_grad_coop``): ``CoopOps`` prints them as ``GL_KHR_cooperative_matrix`` calls on
16x16 fragments of a subgroup of 32 lanes, ``EmulatedOps`` as plain loops over workgroup
memory with the same layout (any device: tests run the kernels on lavapipe)."""
from __future__ import annotations


FRAG = 16          # the fragment shape: 16x16x16
SUBGROUP = 32      # lanes per subgroup the kernel is written for

HEADER = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
#extension GL_EXT_control_flow_attributes : require"""
ROW, COL = "gl_CooperativeMatrixLayoutRowMajor", "gl_CooperativeMatrixLayoutColumnMajor"


class CoopOps:
    """The fragment operations on cooperative matrices (one subgroup of 32 owns a fragment)."""
    header = HEADER
    helpers = ""
    ids = "uint sg = gl_SubgroupID, lane = gl_SubgroupInvocationID;"
    sync = ["subgroupMemoryBarrierShared();", "subgroupBarrier();"]
    acc_t = "coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>"

    def acc_decl(self, wm, wn):
        return [f"{self.acc_t} acc[{wm}][{wn}];",
                f"[[unroll]] for (uint i = 0u; i < {wm}u; ++i)",
                f"    [[unroll]] for (uint jn = 0u; jn < {wn}u; ++jn) acc[i][jn] = {self.acc_t}(0.0);"]

    def frag_decl(self, use, name):
        return f"coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUse{use}> {name};"

    def load(self, frag, shared, at, stride, row_major):
        return f"coopMatLoad({frag}, {shared}, {at}, {stride}u, {ROW if row_major else COL});"

    def mma(self, fa, a_layout, fb, b_layout, acc):
        return f"{acc} = coopMatMulAdd({fa}, {fb}, {acc});"

    def store(self, acc, buf, at, stride):
        return f"coopMatStore({acc}, {buf}, {at}, {stride}u, {ROW});"

    def scale(self, acc, factor):
        return f"{acc} = {acc} * {factor};"

    def workgroup_max(self, var, nt):
        """GLSL taking ``var`` to its largest value over the workgroup (all ``nt`` threads
        run it) through ``Pk``: a subgroup max, then one slot per subgroup."""
        return [f"{var} = subgroupMax({var});", f"if (lane == 0u) Pk[sg] = {var};", "barrier();",
                f"for (uint h = 0u; h < {nt // SUBGROUP}u; ++h) {var} = max({var}, Pk[h]);", "barrier();"]


class EmulatedOps(CoopOps):
    """The same fragment operations as plain loops over workgroup memory: a "fragment" is
    its offset there, and lane ``l`` of a group of 32 invocations holds elements ``l + 32 q``
    (row-major) of each accumulator. No cooperative matrices and any subgroup size: the
    kernel with every index, guard, staging layout and the epilogue exactly as on tensor
    cores, for devices without them (the tests run it on lavapipe against NumPy)."""
    header = "\n".join(ln for ln in HEADER.splitlines() if "cooperative_matrix" not in ln
                       and "memory_scope" not in ln and "subgroup" not in ln)
    helpers = """// element (row, col) of a 16x16 f16 fragment staged at uvec4 offset ``at`` of As / Bs
float frag_elem(uvec4 v, uint h) {
    vec2 p = unpackHalf2x16(v[h >> 1u]);
    return (h & 1u) == 0u ? p.x : p.y;
}
float frag_a(uint at, uint stride, bool row_major, uint r, uint c) {
    return row_major ? frag_elem(As[at + r * stride + c / 8u], c % 8u) : frag_elem(As[at + c * stride + r / 8u], r % 8u);
}
float frag_b(uint at, uint stride, bool row_major, uint r, uint c) {
    return row_major ? frag_elem(Bs[at + r * stride + c / 8u], c % 8u) : frag_elem(Bs[at + c * stride + r / 8u], r % 8u);
}
"""
    ids = "uint sg = t / 32u, lane = t % 32u;"
    sync = ["barrier();"]
    frag_fns = ("frag_a", "frag_b")    # the helpers reading an A and a B fragment's element

    def acc_decl(self, wm, wn):
        return [f"float acc[{wm}][{wn}][8];",
                f"[[unroll]] for (uint i = 0u; i < {wm}u; ++i)",
                f"    [[unroll]] for (uint jn = 0u; jn < {wn}u; ++jn)",
                "        [[unroll]] for (uint q = 0u; q < 8u; ++q) acc[i][jn][q] = 0.0;"]

    def frag_decl(self, use, name):
        return f"uint {name};"

    def load(self, frag, shared, at, stride, row_major):
        return f"{frag} = {at};"

    def mma(self, fa, a_layout, fb, b_layout, acc):
        (sa, ra), (sb, rb), (get_a, get_b) = a_layout, b_layout, self.frag_fns
        return (f"for (uint q = 0u; q < 8u; ++q) {{ uint e = lane + q * 32u; float s = {acc}[q]; "
                f"for (uint k = 0u; k < 16u; ++k) s += {get_a}({fa}, {sa}u, {str(ra).lower()}, e / 16u, k) * "
                f"{get_b}({fb}, {sb}u, {str(rb).lower()}, k, e % 16u); {acc}[q] = s; }}")

    def store(self, acc, buf, at, stride):
        return (f"for (uint q = 0u; q < 8u; ++q) {{ uint e = lane + q * 32u; "
                f"{buf}[{at} + (e / 16u) * {stride}u + e % 16u] = {acc}[q]; }}")

    def scale(self, acc, factor):
        return f"for (uint q = 0u; q < 8u; ++q) {acc}[q] *= {factor};"

    def workgroup_max(self, var, nt):
        return [f"Pk[t] = {var};", "barrier();", f"for (uint h = {nt // 2}u; h > 0u; h >>= 1u) {{",
                "    if (t < h) Pk[t] = max(Pk[t], Pk[t + h]);", "    barrier();", "}", f"{var} = Pk[0];", "barrier();"]
