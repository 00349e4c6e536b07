"""What every GLSL kernel of the direct Vulkan backend shares, whoever writes it (the kernel
AST's printer, ``kernel_ast_print``; the WGSL-to-GLSL translator, ``glsl``, while it
remains): the spelling of our identifiers that GLSL reserves, the header lines that keep IEEE
Inf, NaN and signed zeros, and the ``MEGANEURA_GLSL_UNROLL`` switch. Standard library only
(the translation workers load it beside the translator, without the package)."""
from __future__ import annotations

import functools
import os

# IEEE semantics as torch has them: Vulkan lets a driver assume no Inf/NaN and ignore the
# sign of zero (Mesa folds ``x - x`` to 0 for an inf x) unless a shader asks to preserve
# them. SignedZeroInfNanPreserve (execution mode 4461, capability 4466, core in SPIR-V 1.4,
# which the Vulkan 1.2 target is past) for 32-bit floats, through GL_EXT_spirv_intrinsics;
# devices report it as VkPhysicalDeviceVulkan12Properties.shaderSignedZeroInfNanPreserveFloat32
# (lavapipe, NVIDIA, AMD and Intel do). The WGSL path cannot ask for it (naga writes no
# float controls): there ``expr.ieee_guard`` keeps the folds we know of exact instead.
IEEE_PRESERVE = ["#extension GL_EXT_spirv_intrinsics : require",
                 'spirv_execution_mode(extensions = ["SPV_KHR_float_controls"], capabilities = [4466], 4461, 32);']

# GLSL keywords and reserved words an identifier of ours could collide with
RESERVED = frozenset("""attribute const uniform varying buffer shared coherent volatile restrict readonly writeonly
atomic_uint layout centroid flat smooth noperspective patch sample break continue do for while switch case default
if else subroutine in out inout float double int void bool true false invariant precise discard return mat2 mat3
mat4 vec2 vec3 vec4 ivec2 ivec3 ivec4 bvec2 bvec3 bvec4 uint uvec2 uvec3 uvec4 lowp mediump highp precision
sampler1D sampler2D sampler3D image1D image2D struct common partition active asm class union enum typedef template
this resource goto inline noinline public static extern external interface long short half fixed unsigned superp
input output hvec2 hvec3 hvec4 fvec2 fvec3 fvec4 sampler3DRect filter sizeof cast namespace using demote
float16_t texture""".split())


@functools.lru_cache(maxsize=8192)
def glsl_name(name: str) -> str:
    """``name`` (a WGSL identifier of ours) as GLSL may spell it: reserved words, ``gl_``
    prefixes and double underscores are GLSL's, so those get an ``m_`` prefix."""
    if name in RESERVED or name.startswith("gl_") or "__" in name:
        return "m_" + name.replace("__", "_u_")
    return name


def clear_caches():
    """Forget the memo of spelt names (bounded)."""
    glsl_name.cache_clear()


# Loops of a few constant trips can be marked [[unroll]]: NVIDIA's compiler left the tiled
# matmul's inner K loop rolled, and unrolled it ran 31.3 -> 37.8 TFLOP/s at 4096^3 on an
# H200. A software rasterizer's LLVM compiles unrolled kernels far more slowly (lavapipe: a
# masked flash attention kernel with 130-wide heads, 1 s -> 48 s), so the runtime asks for it
# on hardware drivers only; MEGANEURA_GLSL_UNROLL=1 or 0 forces it.
def unroll_switch() -> bool | None:
    """MEGANEURA_GLSL_UNROLL as True / False, or None when unset (the runtime decides)."""
    raw = os.environ.get("MEGANEURA_GLSL_UNROLL", "").strip().lower()
    if not raw:
        return None
    return raw not in ("0", "false", "off", "no")
