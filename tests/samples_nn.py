"""Samples for softmax, losses, embedding, normalisations and rotary embedding."""
from dataclasses import dataclass

import numpy as np

from .opinfo import F, I, Sample

S = Sample


@dataclass
class Ints:
    """Fixed integer values (to place repeated ids or ignored labels exactly)."""
    values: tuple
    dtype: str = "i32"

    @property
    def shape(self):
        return np.asarray(self.values).shape

    def make(self, rng):
        return np.asarray(self.values, dtype=np.int32 if self.dtype == "i32" else np.uint32)


def _fn(t):
    return t.nn.functional


# row 1 of each batch fully masked, row 0 partly
_ROW_MASK = np.zeros((2, 3, 4), np.float32)
_ROW_MASK[:, 1, :] = -np.inf
_ROW_MASK[:, 0, 2] = -np.inf


def torch_rope(t, x, base=10000.0, position_offset=0):
    """Llama's rotary embedding (rotate-half), written as transformers computes it."""
    _, _, seq, dim = x.shape
    inv_freq = 1.0 / (base ** (t.arange(0, dim, 2, dtype=t.int64).to(x.dtype) / dim))
    position_ids = t.arange(position_offset, position_offset + seq)[None, :]
    freqs = (inv_freq[None, :, None] @ position_ids[:, None, :].to(x.dtype)).transpose(1, 2)
    emb = t.cat((freqs, freqs), dim=-1)
    cos, sin = emb.cos().unsqueeze(1), emb.sin().unsqueeze(1)

    def rotate_half(v):
        v1, v2 = v[..., : v.shape[-1] // 2], v[..., v.shape[-1] // 2:]
        return t.cat((-v2, v1), dim=-1)
    return x * cos + rotate_half(x) * sin


def _bn_eval(t, x, rm, rv, w, b):
    return _fn(t).batch_norm(x, rm.detach(), rv.detach(), w, b, training=False, eps=1e-3)


def _tiny_lm(o, ids, emb, w, labels):
    h = o.rms_norm(o.embedding(ids, emb), (4,), eps=1e-6)
    return o.cross_entropy(o.reshape(o.linear(h, w), (-1, 5)), o.reshape(labels, (-1,)), ignore_index=0)


def _tiny_lm_torch(t, ids, emb, w, labels):
    f = _fn(t)
    h = f.rms_norm(f.embedding(ids, emb), (4,), eps=1e-6)
    return f.cross_entropy(f.linear(h, w).reshape(-1, 5), labels.reshape(-1), ignore_index=0)


SAMPLES = [
    # softmax / log_softmax
    S("softmax_last", lambda o, x: o.softmax(x), lambda t, x: t.softmax(x, -1), [F((3, 5))]),
    S("softmax_dim0", lambda o, x: o.softmax(x, 0), lambda t, x: t.softmax(x, 0), [F((4, 3, 2))]),
    S("softmax_dim1", lambda o, x: o.softmax(x, dim=1), lambda t, x: t.softmax(x, 1), [F((2, 3, 4))]),
    # without the max shift exp would overflow f32 here
    S("softmax_large_logits", lambda o, x: o.softmax(x), lambda t, x: t.softmax(x, -1),
      [F((2, 4), low=100.0, high=104.0)]),
    S("safe_softmax_masked_rows", lambda o, x: o.safe_softmax(x + x.graph.constant(_ROW_MASK)),
      lambda t, x: t._safe_softmax(x + t.tensor(_ROW_MASK, dtype=x.dtype), -1), [F((2, 3, 4))]),
    S("safe_softmax_long_rows", lambda o, x: o.safe_softmax(x, 0), lambda t, x: t._safe_softmax(x, 0), [F((70, 3))]),
    S("log_softmax_last", lambda o, x: o.log_softmax(x), lambda t, x: t.log_softmax(x, -1), [F((3, 5))]),
    S("log_softmax_dim1", lambda o, x: o.log_softmax(x, 1), lambda t, x: t.log_softmax(x, 1), [F((2, 4, 3))]),
    S("log_softmax_large_logits", lambda o, x: o.log_softmax(x, 0), lambda t, x: t.log_softmax(x, 0),
      [F((4, 2), low=-300.0, high=-296.0)]),
    # cross_entropy
    S("cross_entropy", lambda o, x, y: o.cross_entropy(x, y), lambda t, x, y: _fn(t).cross_entropy(x, y),
      [F((4, 5)), I((4,), 5)]),
    S("cross_entropy_ignore", lambda o, x, y: o.cross_entropy(x, y),
      lambda t, x, y: _fn(t).cross_entropy(x, y), [F((6, 4)), Ints((1, -100, 3, 0, -100, 1))]),
    S("cross_entropy_ignore_in_range", lambda o, x, y: o.cross_entropy(x, y, ignore_index=2),
      lambda t, x, y: _fn(t).cross_entropy(x, y, ignore_index=2), [F((5, 3)), Ints((2, 0, 2, 1, 0))]),
    S("cross_entropy_u32", lambda o, x, y: o.cross_entropy(x, y, reduction="sum"),
      lambda t, x, y: _fn(t).cross_entropy(x, y, reduction="sum"), [F((3, 4)), I((3,), 4, dtype="u32")]),
    S("cross_entropy_none", lambda o, x, y: o.cross_entropy(x, y, reduction="none"),
      lambda t, x, y: _fn(t).cross_entropy(x, y, reduction="none"), [F((5, 3)), Ints((2, -100, 0, 1, 2))]),
    S("cross_entropy_smoothing", lambda o, x, y: o.cross_entropy(x, y, label_smoothing=0.2),
      lambda t, x, y: _fn(t).cross_entropy(x, y, label_smoothing=0.2), [F((5, 4)), Ints((3, -100, 0, 1, 3))]),
    S("cross_entropy_spatial", lambda o, x, y: o.cross_entropy(x, y),
      lambda t, x, y: _fn(t).cross_entropy(x, y), [F((2, 3, 2, 2)), I((2, 2, 2), 3)]),
    S("cross_entropy_spatial_none", lambda o, x, y: o.cross_entropy(x, y, reduction="none"),
      lambda t, x, y: _fn(t).cross_entropy(x, y, reduction="none"), [F((2, 4, 3)), I((2, 3), 4)]),
    S("cross_entropy_unbatched", lambda o, x, y: o.cross_entropy(x, y),
      lambda t, x, y: _fn(t).cross_entropy(x, y), [F((5,)), Ints(3)]),
    # mse_loss
    S("mse_loss", lambda o, a, b: o.mse_loss(a, b), lambda t, a, b: _fn(t).mse_loss(a, b), [F((3, 4)), F((3, 4))]),
    S("mse_loss_sum", lambda o, a, b: o.mse_loss(a, b, reduction="sum"),
      lambda t, a, b: _fn(t).mse_loss(a, b, reduction="sum"), [F((2, 3)), F((2, 3))]),
    S("mse_loss_none", lambda o, a, b: o.mse_loss(a, b, reduction="none"),
      lambda t, a, b: _fn(t).mse_loss(a, b, reduction="none"), [F((2, 3)), F((2, 3))]),
    S("mse_loss_weight", lambda o, a, b, w: o.mse_loss(a, b, weight=w),
      lambda t, a, b, w: _fn(t).mse_loss(a, b, weight=w), [F((2, 3)), F((2, 3)), F((2, 3), positive=True)]),
    # embedding (repeated ids: their gradient rows accumulate)
    S("embedding_repeated", lambda o, ids, w: o.embedding(ids, w), lambda t, ids, w: _fn(t).embedding(ids, w),
      [Ints(((1, 3, 1), (4, 1, 0))), F((5, 4))]),
    S("embedding_u32", lambda o, ids, w: o.embedding(ids, w), lambda t, ids, w: _fn(t).embedding(ids, w),
      [I((4,), 3, dtype="u32"), F((3, 2))]),
    S("embedding_padding_idx", lambda o, ids, w: o.embedding(ids, w, padding_idx=-1),
      lambda t, ids, w: _fn(t).embedding(ids, w, padding_idx=-1), [Ints((2, 3, 3, 0, 2)), F((4, 3))],
      no_grad_inputs=(1,)),  # the padding row's zero gradient is by definition, not by finite differences
    S("embedding_grad", lambda o, ids, ct: o.embedding_grad(ids, ct, 4),
      lambda t, ids, ct: t.zeros(4, 3, dtype=ct.dtype).index_add(0, ids.reshape(-1), ct.reshape(-1, 3)),
      [Ints(((0, 2), (2, 2), (3, 0))), F((3, 2, 3))]),
    S("one_hot", lambda o, y: o.one_hot(y, 4), lambda t, y: _fn(t).one_hot(y, 4).to(t.float64),
      [I((2, 3), 4)], grad=False),
    # rms_norm (eps=None: torch's default, f32's machine epsilon)
    S("rms_norm_weight", lambda o, x, w: o.rms_norm(x, (4,), w), lambda t, x, w: _fn(t).rms_norm(x, (4,), w),
      [F((3, 4)), F((4,))]),
    S("rms_norm_plain", lambda o, x: o.rms_norm(x, 4, eps=1e-5), lambda t, x: _fn(t).rms_norm(x, (4,), eps=1e-5),
      [F((2, 3, 4))]),
    S("rms_norm_2d", lambda o, x, w: o.rms_norm(x, (2, 3), w, eps=1e-3),
      lambda t, x, w: _fn(t).rms_norm(x, (2, 3), w, eps=1e-3), [F((2, 2, 3)), F((2, 3))]),
    # layer_norm
    S("layer_norm_affine", lambda o, x, w, b: o.layer_norm(x, (5,), w, b),
      lambda t, x, w, b: _fn(t).layer_norm(x, (5,), w, b), [F((3, 5)), F((5,)), F((5,))]),
    S("layer_norm_plain", lambda o, x: o.layer_norm(x, (4,)), lambda t, x: _fn(t).layer_norm(x, (4,)),
      [F((2, 3, 4))]),
    S("layer_norm_2d_bias_only", lambda o, x, b: o.layer_norm(x, (3, 2), bias=b, eps=1e-3),
      lambda t, x, b: _fn(t).layer_norm(x, (3, 2), bias=b, eps=1e-3), [F((2, 3, 2)), F((3, 2))]),
    # group_norm
    S("group_norm_affine", lambda o, x, w, b: o.group_norm(x, 3, w, b),
      lambda t, x, w, b: _fn(t).group_norm(x, 3, w, b), [F((2, 6, 3)), F((6,)), F((6,))]),
    S("group_norm_plain", lambda o, x: o.group_norm(x, 2), lambda t, x: _fn(t).group_norm(x, 2),
      [F((2, 4, 2, 2))]),
    S("group_norm_one_group", lambda o, x, w: o.group_norm(x, 1, w, eps=1e-3),
      lambda t, x, w: _fn(t).group_norm(x, 1, w, eps=1e-3), [F((3, 2, 2)), F((2,))]),
    S("group_norm_per_channel", lambda o, x, w, b: o.group_norm(x, 4, w, b),
      lambda t, x, w, b: _fn(t).group_norm(x, 4, w, b), [F((2, 4, 3)), F((4,)), F((4,))]),
    # batch_norm
    S("batch_norm_train_affine", lambda o, x, w, b: o.batch_norm(x, None, None, w, b, training=True),
      lambda t, x, w, b: _fn(t).batch_norm(x, None, None, w, b, training=True), [F((4, 3, 2)), F((3,)), F((3,))]),
    S("batch_norm_train_plain", lambda o, x: o.batch_norm(x, None, None, training=True, eps=1e-3),
      lambda t, x: _fn(t).batch_norm(x, None, None, training=True, eps=1e-3), [F((5, 2))]),
    S("batch_norm_train_4d", lambda o, x, w: o.batch_norm(x, None, None, w, training=True),
      lambda t, x, w: _fn(t).batch_norm(x, None, None, w, training=True), [F((2, 3, 2, 2)), F((3,))]),
    S("batch_norm_eval", lambda o, x, rm, rv, w, b: o.batch_norm(x, rm, rv, w, b, eps=1e-3), _bn_eval,
      [F((3, 2, 2)), F((2,)), F((2,), positive=True), F((2,)), F((2,))], no_grad_inputs=(1, 2)),
    S("batch_norm_stats", lambda o, x: o.batch_norm_stats(x),
      lambda t, x: (x.mean((0, 2)), x.var((0, 2), unbiased=True)), [F((3, 2, 4))]),
    # rope
    S("rope_offset_hd8", lambda o, x: o.rope(x, position_offset=5), lambda t, x: torch_rope(t, x, position_offset=5),
      [F((1, 2, 3, 8))]),
    S("rope_base", lambda o, x: o.rope(x, base=500.0), lambda t, x: torch_rope(t, x, base=500.0),
      [F((2, 1, 4, 4))]),
    S("rotate_half", lambda o, x: o.rotate_half(x), lambda t, x: t.cat([-x[..., 3:], x[..., :3]], -1), [F((2, 5, 6))]),
    S("rotate_half_of_view", lambda o, x, c: o.rotate_half(o.transpose(x, 0, 1)) * c + x[0, 0, 0],
      lambda t, x, c: t.cat([-x.transpose(0, 1)[..., 2:], x.transpose(0, 1)[..., :2]], -1) * c + x[0, 0, 0],
      [F((3, 2, 4)), F((2, 3, 4))]),
    # compositions
    S("softmax_of_layer_norm", lambda o, x, w: o.softmax(o.layer_norm(x, (4,), w), 1),
      lambda t, x, w: t.softmax(_fn(t).layer_norm(x, (4,), w), 1), [F((2, 3, 4)), F((4,))]),
    S("tiny_lm_loss", _tiny_lm, _tiny_lm_torch,
      [Ints(((1, 2, 2), (3, 1, 0))), F((4, 4)), F((5, 4)), Ints(((4, 0, 1), (2, 0, 3)))]),
]
