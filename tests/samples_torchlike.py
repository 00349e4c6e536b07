"""Samples for the ops a PyTorch user reaches for first, on torch's own edge cases: 0-d
and empty tensors, negative dims, dim tuples, keepdim, squeeze variants, elementwise
max/min, tensor powers, clamp, stack, gather, var/std, weighted and soft-target
cross-entropy, ceil-mode pooling, zero-size matmuls."""
from .opinfo import F, I, Sample

S = Sample
SAMPLES = [
    # squeeze: no dim, a dim that is not 1 (no-op), a tuple, negative dims
    S("squeeze_all", lambda o, x: o.squeeze(x), lambda t, x: x.squeeze(), [F((1, 3, 1, 2))]),
    S("squeeze_not_one", lambda o, x: o.squeeze(x, 1) * 2.0, lambda t, x: x.squeeze(1) * 2.0, [F((2, 3))]),
    S("squeeze_tuple_neg", lambda o, x: o.squeeze(x, (0, -1, 1)), lambda t, x: x.squeeze((0, -1, 1)),
      [F((1, 3, 1))]),
    S("squeeze_0d", lambda o, x: o.squeeze(o.sum(x), 0), lambda t, x: x.sum().squeeze(0), [F((2, 2))]),
    # elementwise max / min through max(a, b)
    S("max_elementwise", lambda o, a, b: o.max(a, b), lambda t, a, b: t.max(a, b), [F((3, 4)), F((4,))]),
    S("min_elementwise", lambda o, a, b: o.min(a, b), lambda t, a, b: t.min(a, b), [F((2, 3)), F((2, 1))]),
    S("min_dim_keep", lambda o, x: o.min(x, -1, keepdim=True), lambda t, x: t.min(x, -1, keepdim=True),
      [F((3, 5))]),
    S("amin_dims", lambda o, x: o.amin(x, (0, 2)), lambda t, x: x.amin((0, 2)), [F((2, 3, 4))]),
    # powers with tensor exponents
    S("pow_tensor", lambda o, a, b: o.pow(a, b), lambda t, a, b: t.pow(a, b), [F((3, 4), positive=True), F((4,))]),
    S("pow_scalar_base", lambda o, b: o.pow(2.0, b), lambda t, b: t.pow(2.0, b), [F((5,))]),
    S("rpow_tensor", lambda o, a, b: a ** b, lambda t, a, b: a ** b, [F((2, 3), positive=True), F((2, 3))]),
    # 0-d inputs to reductions, softmax, flatten, transpose
    S("sum_0d", lambda o, x: o.sum(o.sum(x), 0), lambda t, x: x.sum().sum(0), [F((2, 3))]),
    S("max_0d_dim", lambda o, x: o.max(o.sum(x), 0), lambda t, x: t.max(x.sum(), 0), [F((2, 3))]),
    S("mean_0d_neg", lambda o, x: o.mean(o.sum(x), -1, keepdim=True), lambda t, x: x.sum().mean(-1, keepdim=True),
      [F((3,))]),
    S("softmax_0d", lambda o, x: o.softmax(o.sum(x), 0) * o.sum(x), lambda t, x: t.softmax(x.sum(), 0) * x.sum(),
      [F((3,))]),
    S("log_softmax_0d", lambda o, x: o.log_softmax(o.sum(x) * 1.0, -1) + o.sum(x),
      lambda t, x: t.log_softmax(x.sum(), -1) + x.sum(), [F((3,))]),
    S("flatten_0d", lambda o, x: o.flatten(o.sum(x)), lambda t, x: t.flatten(x.sum()), [F((2, 2))]),
    S("transpose_0d", lambda o, x: o.transpose(o.sum(x), 0, -1), lambda t, x: x.sum().transpose(0, -1),
      [F((2, 2))]),
    # empty tensors
    S("sum_empty", lambda o, x: o.sum(x, 0), lambda t, x: x.sum(0), [F((0, 3))]),
    S("matmul_zero_k", lambda o, a, b: a @ b, lambda t, a, b: a @ b, [F((3, 0)), F((0, 4))]),
    S("matmul_zero_m", lambda o, a, b: a @ b, lambda t, a, b: a @ b, [F((0, 3)), F((3, 4))]),
    S("linear_zero_batch", lambda o, x, w, b: o.linear(x, w, b), lambda t, x, w, b: t.nn.functional.linear(x, w, b),
      [F((0, 4)), F((3, 4)), F((3,))]),
    # clamp
    S("clamp_scalars", lambda o, x: o.clamp(x, -0.5, 0.7), lambda t, x: x.clamp(-0.5, 0.7), [F((3, 4))]),
    S("clamp_min_only", lambda o, x: o.clamp(x, min=0.1), lambda t, x: x.clamp(min=0.1), [F((6,))]),
    S("clamp_tensors", lambda o, x, lo, hi: o.clamp(x, lo, hi), lambda t, x, lo, hi: t.clamp(x, lo, hi),
      [F((3, 4)), F((4,), low=-1.0, high=-0.2), F((3, 1), low=0.2, high=1.0)]),
    # stack, gather, index_select
    S("stack_neg_dim", lambda o, a, b: o.stack([a, b, a], -1), lambda t, a, b: t.stack([a, b, a], -1),
      [F((2, 3)), F((2, 3))]),
    S("stack_0d", lambda o, a, b: o.stack([o.sum(a), o.sum(b)]), lambda t, a, b: t.stack([a.sum(), b.sum()]),
      [F((2,)), F((3,))]),
    S("gather_dim1", lambda o, x, i: o.gather(x, 1, i), lambda t, x, i: t.gather(x, 1, i), [F((3, 5)), I((3, 4), 5)]),
    S("gather_dim0_smaller", lambda o, x, i: o.gather(x, 0, i), lambda t, x, i: t.gather(x, 0, i),
      [F((4, 3, 2)), I((2, 2, 2), 4)]),
    S("gather_neg_dim", lambda o, x, i: o.gather(x, -1, i), lambda t, x, i: t.gather(x, -1, i),
      [F((2, 3, 4)), I((2, 3, 6), 4)]),
    S("index_select", lambda o, x, i: o.index_select(x, 1, i), lambda t, x, i: t.index_select(x, 1, i),
      [F((3, 5)), I((7,), 5)]),
    # var / std
    S("var_all", lambda o, x: o.var(x), lambda t, x: x.var(), [F((3, 4))]),
    S("var_dims_keep", lambda o, x: o.var(x, (0, 2), keepdim=True), lambda t, x: x.var((0, 2), keepdim=True),
      [F((2, 3, 4))]),
    S("var_biased", lambda o, x: o.var(x, -1, correction=0), lambda t, x: x.var(-1, correction=0), [F((3, 5))]),
    S("std_unbiased_flag", lambda o, x: o.std(x, 1, unbiased=False), lambda t, x: x.std(1, unbiased=False),
      [F((4, 6))]),
    S("std_dim", lambda o, x: o.std(x, 0), lambda t, x: x.std(0), [F((5, 3))]),
    # cross-entropy with class weights and probability targets
    S("ce_weight", lambda o, x, w, y: o.cross_entropy(x, y, weight=w),
      lambda t, x, w, y: t.nn.functional.cross_entropy(x, y, weight=w.detach()),
      [F((6, 4)), F((4,), positive=True), I((6,), 4)], no_grad_inputs=(1,)),
    S("ce_weight_ignore_smooth", lambda o, x, w, y: o.cross_entropy(x, o.where(o.eq(y, 0), -100, y), weight=w,
                                                                    ignore_index=-100, label_smoothing=0.2),
      lambda t, x, w, y: t.nn.functional.cross_entropy(x, t.where(y == 0, -100, y), weight=w.detach(), ignore_index=-100,
                                                       label_smoothing=0.2),
      [F((8, 3)), F((3,), positive=True), I((8,), 3)], no_grad_inputs=(1,)),
    S("ce_weight_none_nd", lambda o, x, w, y: o.cross_entropy(x, y, weight=w, reduction="none"),
      lambda t, x, w, y: t.nn.functional.cross_entropy(x, y, weight=w.detach(), reduction="none"),
      [F((2, 3, 4)), F((3,), positive=True), I((2, 4), 3)], no_grad_inputs=(1,)),
    S("ce_probs", lambda o, x, p: o.cross_entropy(x, o.softmax(p, 1)),
      lambda t, x, p: t.nn.functional.cross_entropy(x, t.softmax(p, 1)), [F((5, 4)), F((5, 4))]),
    S("ce_probs_weight_smooth_sum", lambda o, x, p, w: o.cross_entropy(x, o.softmax(p, 1), weight=w,
                                                                       label_smoothing=0.1, reduction="sum"),
      lambda t, x, p, w: t.nn.functional.cross_entropy(x, t.softmax(p, 1), weight=w.detach(), label_smoothing=0.1,
                                                       reduction="sum"),
      [F((2, 3, 2, 2)), F((2, 3, 2, 2)), F((3,), positive=True)], no_grad_inputs=(2,)),
    # max_pool2d with ceil_mode
    S("max_pool_ceil", lambda o, x: o.max_pool2d(x, 2, 2, ceil_mode=True),
      lambda t, x: t.nn.functional.max_pool2d(x, 2, 2, ceil_mode=True), [F((1, 2, 5, 7))]),
    S("max_pool_ceil_pad", lambda o, x: o.max_pool2d(x, 3, 2, 1, ceil_mode=True),
      lambda t, x: t.nn.functional.max_pool2d(x, 3, 2, 1, ceil_mode=True), [F((2, 1, 6, 5))]),
    # avg_pool2d with ceil_mode: the overhang counts in no divisor (count_include_pad or not)
    S("avg_pool_ceil", lambda o, x: o.avg_pool2d(x, 2, 2, ceil_mode=True),
      lambda t, x: t.nn.functional.avg_pool2d(x, 2, 2, ceil_mode=True), [F((1, 2, 5, 7))]),
    S("avg_pool_ceil_pad_incl", lambda o, x: o.avg_pool2d(x, 3, 2, 1, ceil_mode=True),
      lambda t, x: t.nn.functional.avg_pool2d(x, 3, 2, 1, ceil_mode=True), [F((2, 1, 6, 5))]),
    S("avg_pool_ceil_pad_excl", lambda o, x: o.avg_pool2d(x, (3, 2), (2, 3), (1, 0), ceil_mode=True,
                                                          count_include_pad=False),
      lambda t, x: t.nn.functional.avg_pool2d(x, (3, 2), (2, 3), (1, 0), ceil_mode=True, count_include_pad=False),
      [F((1, 2, 6, 7))]),
    S("avg_pool_ceil_divisor_3d", lambda o, x: o.avg_pool2d(x, 2, 2, ceil_mode=True, divisor_override=3),
      lambda t, x: t.nn.functional.avg_pool2d(x, 2, 2, ceil_mode=True, divisor_override=3), [F((2, 3, 5))]),
    # conv1d
    S("conv1d", lambda o, x, w, b: o.conv1d(x, w, b, stride=2, padding=1),
      lambda t, x, w, b: t.nn.functional.conv1d(x, w, b, stride=2, padding=1), [F((2, 3, 9)), F((4, 3, 3)), F((4,))]),
    S("conv1d_same_groups", lambda o, x, w: o.conv1d(x, w, padding="same", groups=2, dilation=2),
      lambda t, x, w: t.nn.functional.conv1d(x, w, padding="same", groups=2, dilation=2),
      [F((1, 4, 7)), F((6, 2, 3))]),
]
