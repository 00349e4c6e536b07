"""torch's edge cases for convolution, pooling, resampling, normalisation, rotary and the
remaining ops: empty batches (and other zero-size axes), unbatched inputs, 0-d tensors and
negative dims, wherever torch accepts them (what it refuses, we refuse with an error naming
the argument: tests/test_op_errors.py)."""
import numpy as np

from .opinfo import F, I, Sample
from .samples_nn import torch_rope

S = Sample


def _fn(t):
    return t.nn.functional


# a fully masked row (dim -2 of a (3, 2) slice) and a partly masked one, for safe_softmax
_COL_MASK = np.zeros((2, 3, 2), np.float32)
_COL_MASK[:, :, 1] = -np.inf
_COL_MASK[0, 1, 0] = -np.inf


def _bn_eval(t, x, rm, rv):
    return _fn(t).batch_norm(x, rm.detach(), rv.detach(), training=False)


SAMPLES = [
    # conv1d / conv2d: empty batch, zero output channels, unbatched
    S("edge_conv2d_empty_batch", lambda o, x, w, b: o.conv2d(x, w, b, padding=1),
      lambda t, x, w, b: _fn(t).conv2d(x, w, b, padding=1), [F((0, 2, 4, 4)), F((3, 2, 3, 3)), F((3,))]),
    S("edge_conv2d_unbatched_groups", lambda o, x, w: o.conv2d(x, w, stride=2, groups=2),
      lambda t, x, w: _fn(t).conv2d(x, w, stride=2, groups=2), [F((4, 5, 5)), F((2, 2, 3, 3))]),
    S("edge_conv1d_empty_batch", lambda o, x, w, b: o.conv1d(x, w, b, padding=1),
      lambda t, x, w, b: _fn(t).conv1d(x, w, b, padding=1), [F((0, 2, 5)), F((3, 2, 3)), F((3,))]),
    S("edge_conv1d_unbatched_strided", lambda o, x, w: o.conv1d(x, w, stride=2, padding=1, dilation=2),
      lambda t, x, w: _fn(t).conv1d(x, w, stride=2, padding=1, dilation=2), [F((2, 7)), F((3, 2, 2))]),
    # pools, ceil_mode among them
    S("edge_max_pool2d_empty_batch", lambda o, x: o.max_pool2d(x, 2, ceil_mode=True) * 2.0,
      lambda t, x: _fn(t).max_pool2d(x, 2, ceil_mode=True) * 2.0, [F((0, 2, 5, 5))]),
    S("edge_max_pool2d_unbatched_ceil", lambda o, x: o.max_pool2d(x, 3, 2, 1, ceil_mode=True),
      lambda t, x: _fn(t).max_pool2d(x, 3, 2, 1, ceil_mode=True), [F((2, 6, 5))]),
    S("edge_avg_pool2d_empty_batch", lambda o, x: o.avg_pool2d(x, 2, ceil_mode=True) * 2.0,
      lambda t, x: _fn(t).avg_pool2d(x, 2, ceil_mode=True) * 2.0, [F((0, 2, 5, 5))]),
    S("edge_avg_pool2d_unbatched_ceil", lambda o, x: o.avg_pool2d(x, 2, 2, 1, ceil_mode=True, count_include_pad=False),
      lambda t, x: _fn(t).avg_pool2d(x, 2, 2, 1, ceil_mode=True, count_include_pad=False), [F((2, 5, 4))]),
    S("edge_adaptive_avg_pool2d_empty_batch", lambda o, x: o.adaptive_avg_pool2d(x, 2) * 2.0,
      lambda t, x: _fn(t).adaptive_avg_pool2d(x, 2) * 2.0, [F((0, 2, 4, 4))]),
    S("edge_adaptive_avg_pool2d_unbatched", lambda o, x: o.adaptive_avg_pool2d(x, (1, 3)),
      lambda t, x: _fn(t).adaptive_avg_pool2d(x, (1, 3)), [F((2, 4, 6))]),
    # upsampling (torch's interpolate reads a 3-D input as (N, C, L), so unbatched goes through [None])
    S("edge_upsample_nearest2d_empty_batch", lambda o, x: o.upsample_nearest2d(x, 2) * 2.0,
      lambda t, x: _fn(t).interpolate(x, scale_factor=2, mode="nearest") * 2.0, [F((0, 2, 2, 3))]),
    S("edge_upsample_nearest2d_unbatched", lambda o, x: o.upsample_nearest2d(x, (1, 2)),
      lambda t, x: _fn(t).interpolate(x[None], scale_factor=(1, 2), mode="nearest")[0], [F((2, 3, 2))]),
    # unfold / fold
    S("edge_unfold_empty_batch", lambda o, x: o.unfold(x, 2, padding=1) * 2.0,
      lambda t, x: _fn(t).unfold(x, 2, padding=1) * 2.0, [F((0, 2, 3, 3))]),
    S("edge_unfold_unbatched", lambda o, x: o.unfold(x, (2, 1), stride=(1, 2)),
      lambda t, x: _fn(t).unfold(x, (2, 1), stride=(1, 2)), [F((2, 3, 4))]),
    S("edge_fold_empty_batch", lambda o, c: o.fold(c, (3, 3), 2) * 2.0,
      lambda t, c: _fn(t).fold(c, (3, 3), 2) * 2.0, [F((0, 8, 4))]),
    S("edge_fold_unbatched", lambda o, c: o.fold(c, (3, 4), 2, stride=(1, 2)),
      lambda t, c: _fn(t).fold(c, (3, 4), 2, stride=(1, 2)), [F((4, 4))]),
    # group_norm / batch_norm / batch_norm_stats
    S("edge_group_norm_empty_batch", lambda o, x, w, b: o.group_norm(x, 2, w, b) * 2.0,
      lambda t, x, w, b: _fn(t).group_norm(x, 2, w, b) * 2.0, [F((0, 4, 3)), F((4,)), F((4,))]),
    S("edge_group_norm_2d", lambda o, x, w: o.group_norm(x, 2, w), lambda t, x, w: _fn(t).group_norm(x, 2, w),
      [F((3, 6)), F((6,))]),
    S("edge_batch_norm_eval_empty_batch", lambda o, x, rm, rv: o.batch_norm(x, rm, rv) * 2.0,
      lambda t, x, rm, rv: _bn_eval(t, x, rm, rv) * 2.0, [F((0, 2, 3)), F((2,)), F((2,), positive=True)],
      no_grad_inputs=(1, 2)),
    S("edge_batch_norm_train_5d", lambda o, x, b: o.batch_norm(x, None, None, None, b, training=True),
      lambda t, x, b: _fn(t).batch_norm(x, None, None, None, b, training=True), [F((2, 2, 2, 1, 2)), F((2,))]),
    S("edge_batch_norm_stats_2d", lambda o, x: o.batch_norm_stats(x),
      lambda t, x: (x.mean(0), x.var(0, unbiased=True)), [F((4, 3))]),
    # rope / rotate_half
    S("edge_rope_empty_seq", lambda o, x: o.rope(x) * 2.0, lambda t, x: torch_rope(t, x) * 2.0, [F((1, 2, 0, 4))]),
    S("edge_rope_empty_batch", lambda o, x: o.rope(x, position_offset=3) * 2.0,
      lambda t, x: torch_rope(t, x, position_offset=3) * 2.0, [F((0, 2, 3, 4))]),
    S("edge_rope_2d", lambda o, x: o.rope(x, position_offset=2), lambda t, x: torch_rope(t, x[None, None], position_offset=2)[0, 0], [F((3, 6))]),
    S("edge_rotate_half_1d", lambda o, x: o.rotate_half(x), lambda t, x: t.cat([-x[2:], x[:2]]), [F((4,))]),
    # safe_softmax
    S("edge_safe_softmax_0d", lambda o, x: o.safe_softmax(x, -1), lambda t, x: t._safe_softmax(x, -1), [F(())]),
    S("edge_safe_softmax_empty", lambda o, x: o.safe_softmax(x, -1) * 2.0,
      lambda t, x: t._safe_softmax(x, -1) * 2.0, [F((0, 3))]),
    S("edge_safe_softmax_neg_masked", lambda o, x: o.safe_softmax(x + x.graph.constant(_COL_MASK), -2),
      lambda t, x: t._safe_softmax(x + t.tensor(_COL_MASK, dtype=x.dtype), -2), [F((2, 3, 2))]),
    # cast, clip, detach / stop_gradient
    S("edge_cast_0d", lambda o, a: o.cast(o.cast(a, "i32"), "f32") * 1.0,
      lambda t, a: a.to(t.int32).to(a.dtype) * 1.0, [F((), low=-3, high=3)], grad=False),
    S("edge_cast_empty", lambda o, a: o.cast(o.cast(a, "i32"), "f32") * 1.0,
      lambda t, a: a.to(t.int32).to(a.dtype) * 1.0, [F((2, 0), low=-3, high=3)], grad=False),
    S("edge_clip_0d_bounds", lambda o, x, lo: o.clip(x, lo, lo + 0.5), lambda t, x, lo: t.clip(x, lo, lo + 0.5),
      [F((2, 3)), F(())]),
    S("edge_clip_empty", lambda o, x: o.clip(x, max=0.1) * 2.0, lambda t, x: t.clip(x, max=0.1) * 2.0, [F((0, 3))]),
    S("edge_detach_0d", lambda o, a: a * o.detach(a), lambda t, a: a * a.detach(), [F(())], fd=False),
    S("edge_stop_gradient_empty", lambda o, a: a * o.stop_gradient(a), lambda t, a: a * a.detach(), [F((0, 2))],
      fd=False),
    # embedding_grad: 0-d and empty ids
    S("edge_embedding_grad_0d_ids", lambda o, ids, ct: o.embedding_grad(o.sum(ids), ct, 4),
      lambda t, ids, ct: t.zeros(4, 3, dtype=ct.dtype).index_add(0, ids.sum().reshape(1), ct.reshape(1, 3)),
      [I((1,), 4), F((3,))]),
    S("edge_embedding_grad_empty_ids", lambda o, ids, ct: o.embedding_grad(ids, ct, 4),
      lambda t, ids, ct: t.zeros(4, 3, dtype=ct.dtype).index_add(0, ids.reshape(-1), ct.reshape(-1, 3)),
      [I((0, 2), 4), F((0, 2, 3))]),
    # attention: key and value head counts differ, each dividing the query heads (torch's enable_gqa)
    S("edge_sdpa_gqa_kv_heads_differ", lambda o, q, k, v: o.scaled_dot_product_attention(q, k, v, enable_gqa=True),
      lambda t, q, k, v: _fn(t).scaled_dot_product_attention(q, k, v, enable_gqa=True),
      [F((2, 6, 3, 4)), F((2, 2, 5, 4)), F((2, 3, 5, 3))]),
    S("edge_sdpa_gqa_kv_heads_differ_causal",
      lambda o, q, k, v: o.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
      lambda t, q, k, v: _fn(t).scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True),
      [F((4, 3, 4)), F((1, 3, 4)), F((2, 3, 2))]),
    # the rest of the table: zero-size and 0-d cases not covered elsewhere
    S("edge_one_hot_empty", lambda o, y, x: o.one_hot(y, 3) * x, lambda t, y, x: _fn(t).one_hot(y, 3).to(x.dtype) * x,
      [I((0,), 3), F((3,))]),
    S("edge_cross_entropy_empty_sum", lambda o, x, y: o.cross_entropy(x, y, reduction="sum"),
      lambda t, x, y: _fn(t).cross_entropy(x, y, reduction="sum"), [F((0, 4)), I((0,), 4)]),
    S("edge_mm_empty", lambda o, a, b: o.mm(a, b) * 2.0, lambda t, a, b: t.mm(a, b) * 2.0, [F((0, 3)), F((3, 2))]),
    S("edge_matmul_empty_batch", lambda o, a, b: o.matmul(a, b) * 2.0, lambda t, a, b: t.matmul(a, b) * 2.0,
      [F((0, 2, 3)), F((3, 4))]),
    S("edge_linear_no_out_features", lambda o, x, w: o.linear(x, w) * 2.0,
      lambda t, x, w: _fn(t).linear(x, w) * 2.0, [F((2, 4)), F((0, 4))]),
    S("edge_max_neg_dim_keep", lambda o, x: o.max(x, -2, keepdim=True), lambda t, x: x.max(-2, keepdim=True),
      [F((2, 3, 4))]),
    S("edge_var_0d", lambda o, x: o.var(x, correction=0), lambda t, x: x.var(correction=0), [F(())]),
    S("edge_squeeze_empty", lambda o, x: o.squeeze(x) * 2.0, lambda t, x: x.squeeze() * 2.0, [F((0, 1, 3))]),
    S("edge_index_select_0d_index", lambda o, x, i: o.index_select(x, -1, o.sum(i)),
      lambda t, x, i: t.index_select(x, -1, i.sum()), [F((2, 4)), I((1,), 4)]),
    S("edge_split_zero_section", lambda o, x: list(o.split(x, [0, 3, 1], -2)),
      lambda t, x: list(t.split(x, [0, 3, 1], -2)), [F((4, 2))]),
    S("edge_broadcast_to_empty", lambda o, x: o.broadcast_to(x, (0, 3)) * 2.0,
      lambda t, x: t.broadcast_to(x, (0, 3)) * 2.0, [F((1, 3))]),
    S("edge_expand_minus_one", lambda o, x: o.expand(x, (2, -1, 3)), lambda t, x: x.expand(2, -1, 3), [F((4, 1))]),
    S("edge_where_empty", lambda o, c, a: o.where(c, a, 0.5), lambda t, c, a: t.where(c.bool(), a, 0.5),
      [I((0, 3), 2), F((0, 3))]),
    S("edge_mse_none_0d", lambda o, a, b: o.mse_loss(a, b, reduction="none"),
      lambda t, a, b: _fn(t).mse_loss(a, b, reduction="none"), [F(()), F(())]),
]
