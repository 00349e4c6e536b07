"""The WGSL expression of each pointwise op, over its operands ``{0}``, ``{1}``...: the op
records say only that an op is pointwise (``pointwise=True``); how a kernel computes it is the
code generator's (``expr_ast.op_node`` parses these into kernel AST nodes, printed as WGSL and
GLSL). A dict picks by the node's ``approximate`` attribute; ``cast`` and ``rotate_half`` are
written by ``expr_ast`` itself, and a few ops get other helpers there (tanh, erf, integer sign)."""

SCALAR = {
    'neg': '(-{0})',
    'exp': 'exp({0})',
    'log': 'log({0})',
    'sqrt': 'sqrt({0})',
    'rsqrt': 'inverseSqrt({0})',
    'sign': 'sign({0})',
    'abs': 'abs({0})',
    'tanh': 'tanh({0})',
    'sigmoid': '(1.0 / (1.0 + exp(-{0})))',
    'relu': 'max({0}, 0.0)',
    'erf': 'erf({0})',
    'silu': '({0} / (1.0 + exp(-{0})))',
    'gelu': {'none': 'gelu_erf({0})', 'tanh': 'gelu_tanh({0})'},
    'gelu_grad': {'none': 'gelu_erf_grad({0})', 'tanh': 'gelu_tanh_grad({0})'},
    'sin': 'sin({0})',
    'cos': 'cos({0})',
    'reciprocal': '(1.0 / {0})',
    # log(1 + x) and exp(x) - 1 lose the digits of a small x to the rounding of 1 + x: below
    # |x| = 0.01 a Taylor polynomial (4 terms: error under 1e-9 relative) stands in
    'log1p': 'select(log(1.0 + {0}), {0} * (1.0 - {0} * (0.5 - {0} * (0.33333334 - {0} * 0.25))), abs({0}) < 0.01)',
    'expm1':
        'select(exp({0}) - 1.0, {0} * (1.0 + {0} * (0.5 + {0} * (0.16666667 + {0} * 0.041666668))), abs({0}) < 0.01)',
    'floor': 'floor({0})',
    'ceil': 'ceil({0})',
    'trunc': 'trunc({0})',
    'round': 'round({0})',
    'pow': 'pow_c({0})',
    'add': '({0} + {1})',
    'sub': '({0} - {1})',
    'mul': '({0} * {1})',
    'div': '({0} / {1})',
    'maximum': 'max({0}, {1})',
    'minimum': 'min({0}, {1})',
    'lt': 'u32({0} < {1})',
    'le': 'u32({0} <= {1})',
    'gt': 'u32({0} > {1})',
    'ge': 'u32({0} >= {1})',
    'eq': 'u32({0} == {1})',
    'ne': 'u32({0} != {1})',
    'where': 'select({2}, {1}, {0} != 0u)',
    'cast': 'cast',
    'stop_gradient': '{0}',
    'recompute': '{0}',
    'ema': '({0} * {2} + {1} * {3})',
    'ema_sq': '({0} * {2} + {1} * {1} * {3})',
    'adam_step': '({0} - {3} * {1} / (sqrt({2}) * {4} + {5}))',
    'rotate_half': 'rotate_half',
}
