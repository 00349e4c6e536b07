"""Hand-written GLSL compute kernels that exercise the Vulkan runtime: the tests run them on
lavapipe against numpy and ``bench/vulkan_dispatch.py`` times them. They also show the shape
the GLSL renderer of the kernel archetypes will take: ``#define``-parameterised templates,
storage buffers in set 0 (``readonly`` / ``writeonly`` where true, so the runtime knows
each binding's access), sizes in push constants.

Loops over the input are bounded by a constant (``MAX_ITERS``): lavapipe stops a shader loop
after 65535 iterations, and the launch helpers check a shape fits before dispatching.
"""
from __future__ import annotations

MAX_ITERS = 65535

# y = a * x + y over n elements
SAXPY = """#version 450
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) buffer Y { float y[]; };
layout(push_constant) uniform PC { uint n; float a; } pc;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < pc.n) y[i] = pc.a * x[i] + y[i];
}
"""

# out[r] = sum_j x[r * cols + j]: one workgroup per row, a strided loop then a tree in shared memory
ROW_SUM = """#version 450
#extension GL_EXT_control_flow_attributes : require
layout(local_size_x = WG) in;
layout(std430, binding = 0) readonly buffer X { float x[]; };
layout(std430, binding = 1) writeonly buffer O { float o[]; };
layout(push_constant) uniform PC { uint rows; uint cols; } pc;
shared float part[WG];
void main() {
    uint r = gl_WorkGroupID.x, t = gl_LocalInvocationID.x;
    float s = 0.0;
    uint steps = min((pc.cols + WG - 1u) / WG, MAX_ITERS);
    for (uint i = 0u; i < steps; ++i) {
        uint j = i * WG + t;
        if (j < pc.cols) s += x[r * pc.cols + j];
    }
    part[t] = s;
    barrier();
    [[unroll]] for (uint w = WG / 2u; w > 0u; w >>= 1u) {
        if (t < w) part[t] += part[t + w];
        barrier();
    }
    if (t == 0u) o[r] = part[0];
}
"""

# C[M, N] = A[M, K] @ B[K, N], f32, row-major. A workgroup computes a BM x BN tile, each
# invocation TM x TN of it, rows and columns interleaved (row ty + i * BM/TM) so that stores
# and shared reads of neighbouring invocations are neighbours. K advances in chunks of BK
# staged through shared memory (A transposed there). Any M, N, K: loads outside read 0.
SGEMM = """#version 450
#extension GL_EXT_control_flow_attributes : require
const uint RX = BN / TN, RY = BM / TM, NT = RX * RY;
layout(local_size_x = NT) in;
layout(std430, binding = 0) readonly buffer A { float a[]; };
layout(std430, binding = 1) readonly buffer B { float b[]; };
layout(std430, binding = 2) writeonly buffer C { float c[]; };
layout(push_constant) uniform PC { uint M; uint N; uint K; } pc;
shared float As[BK][BM + 1u];
shared float Bs[BK][BN];
void main() {
    uint t = gl_LocalInvocationIndex, tx = t % RX, ty = t / RX;
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    float acc[TM][TN];
    [[unroll]] for (uint i = 0u; i < TM; ++i)
        [[unroll]] for (uint j = 0u; j < TN; ++j) acc[i][j] = 0.0;
    uint chunks = min((pc.K + BK - 1u) / BK, MAX_ITERS);
    for (uint kc = 0u; kc < chunks; ++kc) {
        uint k0 = kc * BK;
        [[unroll]] for (uint l = 0u; l < (BM * BK + NT - 1u) / NT; ++l) {
            uint idx = t + l * NT;
            if (idx < BM * BK) {
                uint r = idx / BK, kk = idx % BK, gm = m0 + r, gk = k0 + kk;
                As[kk][r] = (gm < pc.M && gk < pc.K) ? a[gm * pc.K + gk] : 0.0;
            }
        }
        [[unroll]] for (uint l = 0u; l < (BK * BN + NT - 1u) / NT; ++l) {
            uint idx = t + l * NT;
            if (idx < BK * BN) {
                uint kk = idx / BN, col = idx % BN, gk = k0 + kk, gn = n0 + col;
                Bs[kk][col] = (gk < pc.K && gn < pc.N) ? b[gk * pc.N + gn] : 0.0;
            }
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK; ++kk) {
            float ar[TM], br[TN];
            [[unroll]] for (uint i = 0u; i < TM; ++i) ar[i] = As[kk][ty + i * RY];
            [[unroll]] for (uint j = 0u; j < TN; ++j) br[j] = Bs[kk][tx + j * RX];
            [[unroll]] for (uint i = 0u; i < TM; ++i)
                [[unroll]] for (uint j = 0u; j < TN; ++j) acc[i][j] = fma(ar[i], br[j], acc[i][j]);
        }
        barrier();
    }
    [[unroll]] for (uint i = 0u; i < TM; ++i) {
        uint gm = m0 + ty + i * RY;
        [[unroll]] for (uint j = 0u; j < TN; ++j) {
            uint gn = n0 + tx + j * RX;
            if (gm < pc.M && gn < pc.N) c[gm * pc.N + gn] = acc[i][j];
        }
    }
}
"""
SGEMM_SMALL = dict(BM=32, BN=32, BK=8, TM=4, TN=4)     # 64 invocations: for lavapipe
SGEMM_LARGE = dict(BM=128, BN=128, BK=8, TM=8, TN=8)   # 256 invocations: for GPUs

# y[i] = f32(x[i] * s + b[i]) with x, b stored as f16 and f16 arithmetic
F16_AXPB = """#version 450
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_shader_16bit_storage : require
layout(local_size_x = 64) in;
layout(std430, binding = 0) readonly buffer X { float16_t x[]; };
layout(std430, binding = 1) readonly buffer Bv { float16_t bv[]; };
layout(std430, binding = 2) writeonly buffer Y { float y[]; };
layout(push_constant) uniform PC { uint n; float s; } pc;
void main() {
    uint i = gl_GlobalInvocationID.x;
    if (i < pc.n) y[i] = float(x[i] * float16_t(pc.s) + bv[i]);
}
"""

# C[M, N] (f32) = A[M, K] (f16) @ B[K, N] (f16) on KHR cooperative matrices 16x16x16 with f32
# accumulation. A workgroup of SG_M x SG_N subgroups of 32 computes a BM x BN tile; each
# subgroup owns WM x WN accumulator fragments. A (BM x BK) and B (BK x BN) chunks are staged in
# shared memory as uvec4 (8 halves), rows padded by one uvec4 against bank conflicts.
# Requires M % BM == N % BN == K % BK == 0 (the launcher checks), subgroup size 32.
HGEMM_COOP = """#version 450
#extension GL_KHR_cooperative_matrix : require
#extension GL_KHR_memory_scope_semantics : require
#extension GL_KHR_shader_subgroup_basic : require
#extension GL_EXT_shader_explicit_arithmetic_types_float16 : require
#extension GL_EXT_control_flow_attributes : require
const uint NT = 32u * SG_M * SG_N;
const uint WM = BM / (16u * SG_M), WN = BN / (16u * SG_N);
const uint AQ = BK / 8u, BQ = BN / 8u;             // uvec4 per row of the A and B chunks
const uint SA = AQ + 1u, SB = BQ + 1u;             // padded shared row strides
layout(local_size_x = NT) in;
layout(std430, binding = 0) readonly buffer A { uvec4 a[]; };
layout(std430, binding = 1) readonly buffer B { uvec4 b[]; };
layout(std430, binding = 2) writeonly buffer C { float c[]; };
layout(push_constant) uniform PC { uint M; uint N; uint K; } pc;
shared uvec4 As[BM * SA];
shared uvec4 Bs[BK * SB];
void main() {
    uint t = gl_LocalInvocationIndex;
    uint sg = gl_SubgroupID, sy = sg / SG_N, sx = sg % SG_N;
    uint m0 = gl_WorkGroupID.y * BM, n0 = gl_WorkGroupID.x * BN;
    uint K8 = pc.K / 8u, N8 = pc.N / 8u;
    coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator> acc[WM][WN];
    [[unroll]] for (uint i = 0u; i < WM; ++i)
        [[unroll]] for (uint j = 0u; j < WN; ++j)
            acc[i][j] = coopmat<float, gl_ScopeSubgroup, 16, 16, gl_MatrixUseAccumulator>(0.0);
    uint chunks = min(pc.K / BK, MAX_ITERS);
    for (uint kc = 0u; kc < chunks; ++kc) {
        uint k8 = kc * AQ;
        [[unroll]] for (uint l = 0u; l < BM * AQ / NT; ++l) {
            uint idx = t + l * NT, r = idx / AQ, q = idx % AQ;
            As[r * SA + q] = a[(m0 + r) * K8 + k8 + q];
        }
        [[unroll]] for (uint l = 0u; l < BK * BQ / NT; ++l) {
            uint idx = t + l * NT, r = idx / BQ, q = idx % BQ;
            Bs[r * SB + q] = b[(kc * BK + r) * N8 + n0 / 8u + q];
        }
        barrier();
        [[unroll]] for (uint kk = 0u; kk < BK / 16u; ++kk) {
            coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseA> fa[WM];
            [[unroll]] for (uint i = 0u; i < WM; ++i)
                coopMatLoad(fa[i], As, (sy * WM + i) * 16u * SA + kk * 2u, SA, gl_CooperativeMatrixLayoutRowMajor);
            [[unroll]] for (uint j = 0u; j < WN; ++j) {
                coopmat<float16_t, gl_ScopeSubgroup, 16, 16, gl_MatrixUseB> fb;
                coopMatLoad(fb, Bs, kk * 16u * SB + (sx * WN + j) * 2u, SB, gl_CooperativeMatrixLayoutRowMajor);
                [[unroll]] for (uint i = 0u; i < WM; ++i) acc[i][j] = coopMatMulAdd(fa[i], fb, acc[i][j]);
            }
        }
        barrier();
    }
    [[unroll]] for (uint i = 0u; i < WM; ++i)
        [[unroll]] for (uint j = 0u; j < WN; ++j)
            coopMatStore(acc[i][j], c, (m0 + (sy * WM + i) * 16u) * pc.N + n0 + (sx * WN + j) * 16u, pc.N,
                         gl_CooperativeMatrixLayoutRowMajor);
}
"""
HGEMM_COOP_DEFAULT = dict(BM=128, BN=128, BK=32, SG_M=2, SG_N=4)


def defines(params):
    """``params`` as GLSL defines (unsigned literals) plus ``MAX_ITERS``."""
    return {**{k: f"{int(v)}u" for k, v in params.items()}, "MAX_ITERS": f"{MAX_ITERS}u"}


def sgemm_groups(M, N, K, p):
    """Workgroup counts for ``SGEMM`` with tiling ``p``; checks the K loop bound."""
    if -(-K // p["BK"]) > MAX_ITERS:
        raise ValueError(f"sgemm: K={K} needs {-(-K // p['BK'])} chunks of {p['BK']}; the kernel loops at most "
                         f"{MAX_ITERS} times")
    return (-(-N // p["BN"]), -(-M // p["BM"]), 1)


def hgemm_coop_groups(M, N, K, p):
    """Workgroup counts for ``HGEMM_COOP`` with tiling ``p``; checks the shape fits the tiling."""
    nt = 32 * p["SG_M"] * p["SG_N"]
    if p["BM"] % (16 * p["SG_M"]) or p["BN"] % (16 * p["SG_N"]) or p["BK"] % 16 \
            or (p["BM"] * p["BK"] // 8) % nt or (p["BK"] * p["BN"] // 8) % nt:
        raise ValueError(f"hgemm_coop: tiling {p} does not split evenly over {nt} invocations")
    bad = [f"{n}={v} % {t}" for n, v, t in (("M", M, p["BM"]), ("N", N, p["BN"]), ("K", K, p["BK"])) if v % t]
    if bad:
        raise ValueError(f"hgemm_coop: shape not a multiple of the tile ({', '.join(bad)} != 0)")
    if K // p["BK"] > MAX_ITERS:
        raise ValueError(f"hgemm_coop: K={K} needs more than {MAX_ITERS} chunks")
    return (N // p["BN"], M // p["BM"], 1)
