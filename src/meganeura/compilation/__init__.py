"""The compile stage's parts around ``compiler.compile_plan``: the ``Target`` a plan is
compiled for (``target``), the ``Executable`` it becomes (``executable``), accelerated
precision's policy (``precision``), the in-place passes (``inplace``), and the finishing of
kernels for Vulkan (``vulkan``: cooperative-matrix variants, GLSL printed from the kernel
AST, SPIR-V through ``glslang``). Nothing here needs a device."""
