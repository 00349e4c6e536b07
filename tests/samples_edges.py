"""torch's edge cases across the exposed ops: 0-d inputs, empty tensors and negative
dims, wherever torch accepts them (what it refuses, we refuse with an error naming the
argument: tests/test_errors.py)."""
from .opinfo import F, I, Sample

S = Sample

_UNARY = {   # name: (ours, theirs, positive inputs only)
    "neg": (lambda o, x: -x, lambda t, x: -x, False),
    "exp": (lambda o, x: o.exp(x), lambda t, x: t.exp(x), False),
    "log": (lambda o, x: o.log(x), lambda t, x: t.log(x), True),
    "sqrt": (lambda o, x: o.sqrt(x), lambda t, x: t.sqrt(x), True),
    "rsqrt": (lambda o, x: o.rsqrt(x), lambda t, x: t.rsqrt(x), True),
    "abs": (lambda o, x: o.abs(x), lambda t, x: t.abs(x), False),
    "tanh": (lambda o, x: o.tanh(x), lambda t, x: t.tanh(x), False),
    "sigmoid": (lambda o, x: o.sigmoid(x), lambda t, x: t.sigmoid(x), False),
    "relu": (lambda o, x: o.relu(x), lambda t, x: t.relu(x), False),
    "gelu": (lambda o, x: o.gelu(x), lambda t, x: t.nn.functional.gelu(x), False),
    "silu": (lambda o, x: o.silu(x), lambda t, x: t.nn.functional.silu(x), False),
    "erf": (lambda o, x: o.erf(x), lambda t, x: t.erf(x), False),
    "square": (lambda o, x: o.square(x), lambda t, x: t.square(x), False),
    "sign": (lambda o, x: o.sign(x) * x, lambda t, x: t.sign(x) * x, False),
    "pow_scalar": (lambda o, x: o.pow(x, 1.5), lambda t, x: t.pow(x, 1.5), True),
    "clamp": (lambda o, x: o.clamp(x, -0.3, 0.4), lambda t, x: t.clamp(x, -0.3, 0.4), False),
}

_BINARY = {
    "add": (lambda o, a, b: o.add(a, b), lambda t, a, b: t.add(a, b)),
    "sub": (lambda o, a, b: o.sub(a, b), lambda t, a, b: t.sub(a, b)),
    "mul": (lambda o, a, b: o.mul(a, b), lambda t, a, b: t.mul(a, b)),
    "div": (lambda o, a, b: o.div(a, o.exp(b)), lambda t, a, b: t.div(a, t.exp(b))),
    "maximum": (lambda o, a, b: o.maximum(a, b), lambda t, a, b: t.maximum(a, b)),
    "minimum": (lambda o, a, b: o.minimum(a, b), lambda t, a, b: t.minimum(a, b)),
    "pow": (lambda o, a, b: o.pow(o.exp(a), b), lambda t, a, b: t.pow(t.exp(a), b)),
    "where": (lambda o, a, b: o.where(o.gt(a, b), a, b * 2.0), lambda t, a, b: t.where(a > b, a, b * 2.0)),
}


_CMP = ["eq", "ne", "lt", "le", "gt", "ge"]


def _cmp(name):
    return (lambda o, a, b: o.cast(getattr(o, name)(a, b), "f32") + a * 0.0,
            lambda t, a, b: getattr(t, name)(a, b).to(a.dtype) + a * 0.0)


SAMPLES = []
for _n, (_o, _t, _pos) in _UNARY.items():
    SAMPLES += [S(f"edge_{_n}_0d", _o, _t, [F((), positive=_pos)]),
                S(f"edge_{_n}_empty", _o, _t, [F((0, 3), positive=_pos)])]
for _n, (_o, _t) in _BINARY.items():
    SAMPLES += [S(f"edge_{_n}_0d_0d", _o, _t, [F(()), F(())]),
                S(f"edge_{_n}_0d_bcast", _o, _t, [F(()), F((2, 3))]),
                S(f"edge_{_n}_empty_bcast", _o, _t, [F((2, 0, 3)), F((1, 3))])]
for _n in _CMP:
    SAMPLES += [S(f"edge_{_n}_0d", *_cmp(_n), [F(()), F((3,))], grad=False),
                S(f"edge_{_n}_empty", *_cmp(_n), [F((0, 2)), F((2,))], grad=False)]

SAMPLES += [
    # layout: negative dims, 0-d, empty
    S("edge_permute_neg", lambda o, x: o.permute(x, (-1, 0, -2)), lambda t, x: x.permute(-1, 0, -2), [F((2, 3, 4))]),
    S("edge_permute_0d", lambda o, x: o.permute(x, ()) * 2.0, lambda t, x: x.permute(()) * 2.0, [F(())]),
    S("edge_transpose_neg", lambda o, x: o.transpose(x, -1, -3), lambda t, x: x.transpose(-1, -3), [F((2, 3, 4))]),
    S("edge_reshape_0d", lambda o, x: o.reshape(x, (1, 1)), lambda t, x: x.reshape(1, 1), [F(())]),
    S("edge_reshape_to_0d", lambda o, x: o.reshape(x, ()), lambda t, x: x.reshape(()), [F((1, 1))]),
    S("edge_reshape_empty", lambda o, x: o.reshape(x, (3, -1, 2)) * 2.0, lambda t, x: x.reshape(3, -1, 2) * 2.0,
      [F((0, 6))]),
    S("edge_unsqueeze_0d", lambda o, x: o.unsqueeze(x, -1), lambda t, x: x.unsqueeze(-1), [F(())]),
    S("edge_unsqueeze_neg", lambda o, x: o.unsqueeze(x, -2), lambda t, x: x.unsqueeze(-2), [F((2, 3))]),
    S("edge_squeeze_neg", lambda o, x: o.squeeze(x, -2), lambda t, x: x.squeeze(-2), [F((2, 1, 3))]),
    S("edge_flatten_neg", lambda o, x: o.flatten(x, -3, -2), lambda t, x: x.flatten(-3, -2), [F((2, 3, 4, 2))]),
    S("edge_flatten_empty", lambda o, x: o.flatten(x, 1) * 2.0, lambda t, x: x.flatten(1) * 2.0, [F((2, 0, 3))]),
    S("edge_slice_empty", lambda o, x: o.slice(x, 0, 2, 2) * 2.0, lambda t, x: x[2:2] * 2.0, [F((4, 3))]),
    S("edge_concat_empty", lambda o, a, b: o.concat([a, b], -1), lambda t, a, b: t.cat([a, b], -1),
      [F((2, 3)), F((2, 0))]),
    S("edge_sdpa_empty_batch", lambda o, q, k, v: o.scaled_dot_product_attention(q, k, v),
      lambda t, q, k, v: t.nn.functional.scaled_dot_product_attention(q, k, v),
      [F((0, 2, 3, 4)), F((0, 2, 5, 4)), F((0, 2, 5, 3))]),
    S("edge_sdpa_no_queries", lambda o, q, k, v: o.scaled_dot_product_attention(q, k, v),
      lambda t, q, k, v: t.nn.functional.scaled_dot_product_attention(q, k, v),
      [F((2, 1, 0, 4)), F((2, 1, 5, 4)), F((2, 1, 5, 3))]),
    S("edge_slice_neg_dim", lambda o, x: o.slice(x, -1, 1, 3), lambda t, x: x[..., 1:3], [F((2, 3, 4))]),
    S("edge_getitem_0d", lambda o, x: x[None] * 2.0, lambda t, x: x[None] * 2.0, [F(())]),
    S("edge_getitem_neg", lambda o, x: x[-1, ..., -2], lambda t, x: x[-1, ..., -2], [F((2, 3, 4))]),
    S("edge_concat_neg", lambda o, a, b: o.concat([a, b], -1), lambda t, a, b: t.cat([a, b], -1),
      [F((2, 3)), F((2, 1))]),
    S("edge_cat_neg", lambda o, a, b: o.cat([a, b], -2), lambda t, a, b: t.cat([a, b], -2), [F((2, 1, 3)), F((2, 2, 3))]),
    S("edge_stack_empty", lambda o, a, b: o.stack([a, b], -1) * 2.0, lambda t, a, b: t.stack([a, b], -1) * 2.0,
      [F((0, 3)), F((0, 3))]),
    S("edge_split_neg", lambda o, x: list(o.split(x, 2, -1)), lambda t, x: list(t.split(x, 2, -1)), [F((3, 5))]),
    S("edge_chunk_neg", lambda o, x: list(o.chunk(x, 2, -2)), lambda t, x: list(t.chunk(x, 2, -2)), [F((5, 2))]),
    S("edge_expand_0d", lambda o, x: o.expand(x, (2, 3)), lambda t, x: x.expand(2, 3), [F(())]),
    S("edge_broadcast_to_0d", lambda o, x: o.broadcast_to(x, (3,)), lambda t, x: t.broadcast_to(x, (3,)), [F(())]),
    S("edge_broadcast_tensors", lambda o, a, b: list(o.broadcast_tensors(a, b)),
      lambda t, a, b: list(t.broadcast_tensors(a, b)), [F(()), F((2, 3))]),
    S("edge_index_select_neg", lambda o, x, i: o.index_select(x, -1, i), lambda t, x, i: t.index_select(x, -1, i),
      [F((2, 4)), I((3,), 4)]),
    S("edge_index_select_empty", lambda o, x, i: o.index_select(x, 0, i) * 2.0,
      lambda t, x, i: t.index_select(x, 0, i) * 2.0, [F((3, 2)), I((0,), 3)]),
    S("edge_gather_0d", lambda o, x, i: o.gather(o.sum(x), 0, o.sum(i)), lambda t, x, i: t.gather(x.sum(), 0, i.sum()),
      [F((2,)), I((2,), 1)]),
    S("edge_rotate_half_empty", lambda o, x: o.rotate_half(x) * 2.0,
      lambda t, x: t.cat([-x[..., 2:], x[..., :2]], -1) * 2.0, [F((0, 3, 4))]),
    # reductions and softmax: negative dims, empty, 0-d
    S("edge_sum_neg_dims", lambda o, x: o.sum(x, (-1, -3)), lambda t, x: x.sum((-1, -3)), [F((2, 3, 4))]),
    S("edge_reduce_sum_empty_all", lambda o, x: o.sum(x), lambda t, x: x.sum(), [F((0, 3))]),
    S("edge_amax_neg", lambda o, x: o.amax(x, -2), lambda t, x: x.amax(-2), [F((2, 3, 4))]),
    S("edge_amin_0d", lambda o, x: o.amin(x, -1), lambda t, x: x.amin(-1), [F(())]),
    S("edge_min_0d", lambda o, x: o.min(x), lambda t, x: x.min(), [F(())]),
    S("edge_mean_empty_dim", lambda o, x: o.mean(x, 0), lambda t, x: x.mean(0), [F((2, 0))]),
    S("edge_var_neg", lambda o, x: o.var(x, -1), lambda t, x: x.var(-1), [F((3, 4))]),
    S("edge_std_0d_dims", lambda o, x: o.std(x, (-2, -1), correction=0), lambda t, x: x.std((-2, -1), correction=0),
      [F((2, 3, 4))]),
    S("edge_softmax_neg", lambda o, x: o.softmax(x, -2), lambda t, x: t.softmax(x, -2), [F((2, 3, 4))]),
    S("edge_softmax_empty", lambda o, x: o.softmax(x, -1) * 2.0, lambda t, x: t.softmax(x, -1) * 2.0, [F((0, 4))]),
    S("edge_log_softmax_neg", lambda o, x: o.log_softmax(x, -3), lambda t, x: t.log_softmax(x, -3), [F((2, 3, 4))]),
    # matmul family, norms, losses
    S("edge_matmul_vec_vec", lambda o, a, b: o.matmul(a, b), lambda t, a, b: t.matmul(a, b), [F((4,)), F((4,))]),
    S("edge_matmul_vec_mat", lambda o, a, b: o.matmul(a, b), lambda t, a, b: t.matmul(a, b), [F((3,)), F((2, 3, 4))]),
    S("edge_linear_vec", lambda o, x, w, b: o.linear(x, w, b), lambda t, x, w, b: t.nn.functional.linear(x, w, b),
      [F((4,)), F((3, 4)), F((3,))]),
    S("edge_layer_norm_empty", lambda o, x, w, b: o.layer_norm(x, (4,), w, b) * 2.0,
      lambda t, x, w, b: t.nn.functional.layer_norm(x, (4,), w, b) * 2.0, [F((0, 4)), F((4,)), F((4,))]),
    S("edge_rms_norm_empty", lambda o, x, w: o.rms_norm(x, (4,), w, 1e-6) * 2.0,
      lambda t, x, w: t.nn.functional.rms_norm(x, (4,), w, 1e-6) * 2.0, [F((2, 0, 4)), F((4,))]),
    S("edge_mse_0d", lambda o, a, b: o.mse_loss(a, b), lambda t, a, b: t.nn.functional.mse_loss(a, b), [F(()), F(())]),
    S("edge_mse_sum_empty", lambda o, a, b: o.mse_loss(a, b, reduction="sum"),
      lambda t, a, b: t.nn.functional.mse_loss(a, b, reduction="sum"), [F((0, 3)), F((0, 3))]),
    S("edge_cross_entropy_0d_target", lambda o, x, y: o.cross_entropy(x, o.sum(y)),
      lambda t, x, y: t.nn.functional.cross_entropy(x, y.sum().long()), [F((4,)), I((1,), 4)]),
    S("edge_embedding_0d", lambda o, i, w: o.embedding(o.sum(i), w), lambda t, i, w: t.nn.functional.embedding(i.sum(), w),
      [I((1,), 5), F((5, 3))]),
    S("edge_embedding_empty", lambda o, i, w: o.embedding(i, w) * 2.0,
      lambda t, i, w: t.nn.functional.embedding(i, w) * 2.0, [I((0, 2), 5), F((5, 3))]),
    S("edge_one_hot_0d", lambda o, i, x: o.cast(o.one_hot(o.sum(i), 4), "f32") * x,
      lambda t, i, x: t.nn.functional.one_hot(i.sum().long(), 4).to(x.dtype) * x, [I((1,), 4), F((4,))]),
]
