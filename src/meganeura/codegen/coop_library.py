"""The module part of the cooperative-matrix kernels (``coopmat``, ``flash_coop``,
``flash_grad_coop``), whose ``main`` is written in GLSL directly: the storage buffers of a
``common.Bindings`` and module items of the typed kernel AST (the output stores,
``expr.OutputStore.module_items``, with the helper functions their epilogues call), printed
by the AST's GLSL printer as the WGSL-to-GLSL translator printed their WGSL before."""
from __future__ import annotations

from . import kernel_ast as K
from .kernel_ast_print import GlslPrinter


def glsl_library(bind, items) -> str:
    """GLSL of the buffers of ``bind`` and the module ``items`` (functions, workgroup
    arrays): declarations, prototypes and function bodies, without a header or an entry
    point (the kernel that includes it writes those; its header enables 16-bit types)."""
    tree = K.ComputeKernel(K.buffers(bind), 1, (), module=tuple(items), builtins=(), enable_f16=bind.enable_f16)
    lines = GlslPrinter(unroll=False, preserve_ieee=False).kernel(tree).splitlines()
    assert lines[-2:] == ["void main() {", "}"], lines[-2:]
    code = [ln for ln in lines[:-2] if not ln.startswith(("#version", "#extension", "layout(local_size"))]
    return "\n".join(code) + "\n"
