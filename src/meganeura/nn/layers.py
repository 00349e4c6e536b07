"""The common layers, with torch.nn's constructor arguments, parameter names, shapes and
default initialisations. Their maths is mg.ops; see module.py for how they build."""
from __future__ import annotations

import math

import numpy as np

from .. import ops
from ..graph import Tensor, f32, fmt_shape
from . import init
from .functional import dropout
from .module import Module, Parameter


def _empty(*shape):
    """A parameter to initialise: deferred to the graph inside ``init.deferred()``."""
    return Parameter(shape=shape) if init.deferring() else Parameter(np.zeros(shape, np.float32))


def _filled(shape, one: bool):
    """Ones (scales) or zeros (shifts), as a deferred rule inside ``init.deferred()``."""
    if init.deferring():
        return Parameter(shape=shape, init="ones" if one else None)
    return Parameter(np.ones(shape) if one else np.zeros(shape))


class Identity(Module):
    def __init__(self, *args, **kwargs):
        super().__init__()

    def forward(self, x):
        return x


class Linear(Module):
    """y = x @ weight.T + bias; weight (out_features, in_features)."""

    def __init__(self, in_features, out_features, bias=True):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.weight = _empty(out_features, in_features)
        self.bias = _empty(out_features) if bias else None
        init.default_weight_and_bias(self._parameters["weight"], self._parameters.get("bias"))

    def forward(self, x):
        return ops.linear(x, self.weight, self.bias)

    def extra_repr(self):
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class _ConvNd(Module):
    def __init__(self, nd, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                 padding_mode):
        super().__init__()
        if padding_mode != "zeros":
            raise NotImplementedError(f"Conv{nd}d: padding_mode={padding_mode!r} is not supported (only 'zeros')")
        if in_channels % groups or out_channels % groups:
            raise ValueError(f"Conv{nd}d: in_channels {in_channels} and out_channels {out_channels} must be "
                             f"divisible by groups {groups}")
        k = (kernel_size,) * nd if isinstance(kernel_size, int) else tuple(kernel_size)
        self.in_channels, self.out_channels, self.kernel_size = in_channels, out_channels, k
        self.stride, self.padding, self.dilation, self.groups = stride, padding, dilation, groups
        self.weight = _empty(out_channels, in_channels // groups, *k)
        self.bias = _empty(out_channels) if bias else None
        init.default_weight_and_bias(self._parameters["weight"], self._parameters.get("bias"))

    def extra_repr(self):
        return (f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, stride={self.stride}, "
                f"padding={self.padding}")


class Conv1d(_ConvNd):
    """1-D convolution over (N, C_in, L); weight (C_out, C_in / groups, k)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros"):
        super().__init__(1, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode)

    def forward(self, x):
        return ops.conv1d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Conv2d(_ConvNd):
    """2-D convolution over (N, C_in, H, W); weight (C_out, C_in / groups, kH, kW)."""

    def __init__(self, in_channels, out_channels, kernel_size, stride=1, padding=0, dilation=1, groups=1,
                 bias=True, padding_mode="zeros"):
        super().__init__(2, in_channels, out_channels, kernel_size, stride, padding, dilation, groups, bias,
                         padding_mode)

    def forward(self, x):
        return ops.conv2d(x, self.weight, self.bias, self.stride, self.padding, self.dilation, self.groups)


class Embedding(Module):
    """Rows of weight (num_embeddings, embedding_dim), initialised N(0, 1) with the
    ``padding_idx`` row zero, as torch."""

    def __init__(self, num_embeddings, embedding_dim, padding_idx=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = num_embeddings, embedding_dim
        if padding_idx is not None:
            if not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(f"Embedding: padding_idx {padding_idx} out of range for {num_embeddings} rows")
            padding_idx %= num_embeddings
        self.padding_idx = padding_idx
        self.weight = init.normal_(_empty(num_embeddings, embedding_dim))
        if padding_idx is not None:
            self._parameters["weight"].data[padding_idx] = 0.0

    def forward(self, ids):
        return ops.embedding(ids, self.weight, self.padding_idx)


def _shape(normalized_shape):
    return (int(normalized_shape),) if isinstance(normalized_shape, (int, np.integer)) else tuple(normalized_shape)


class LayerNorm(Module):
    def __init__(self, normalized_shape, eps=1e-5, elementwise_affine=True, bias=True):
        super().__init__()
        self.normalized_shape, self.eps = _shape(normalized_shape), eps
        self.weight = _filled(self.normalized_shape, True) if elementwise_affine else None
        self.bias = _filled(self.normalized_shape, False) if elementwise_affine and bias else None

    def forward(self, x):
        return ops.layer_norm(x, self.normalized_shape, self.weight, self.bias, self.eps)


class RMSNorm(Module):
    def __init__(self, normalized_shape, eps=None, elementwise_affine=True):
        super().__init__()
        self.normalized_shape, self.eps = _shape(normalized_shape), eps
        self.weight = _filled(self.normalized_shape, True) if elementwise_affine else None

    def forward(self, x):
        return ops.rms_norm(x, self.normalized_shape, self.weight, self.eps)


class GroupNorm(Module):
    def __init__(self, num_groups, num_channels, eps=1e-5, affine=True):
        super().__init__()
        if num_channels % num_groups:
            raise ValueError(f"GroupNorm: num_channels {num_channels} must be divisible by num_groups {num_groups}")
        self.num_groups, self.num_channels, self.eps = num_groups, num_channels, eps
        self.weight = _filled((num_channels,), True) if affine else None
        self.bias = _filled((num_channels,), False) if affine else None

    def forward(self, x):
        return ops.group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


class _BatchNorm(Module):
    """Training mode normalises with the batch's statistics and (tracking) updates the
    running ones and the batch counter as torch does, in the training step itself
    (``Graph.update``); eval mode uses the running statistics. All three buffers are graph
    state under torch's names (the counter as i32), so torch's state dict loads as it is."""
    ranks = ()

    def __init__(self, num_features, eps=1e-5, momentum=0.1, affine=True, track_running_stats=True):
        super().__init__()
        self.num_features, self.eps, self.momentum = num_features, eps, momentum
        self.affine, self.track_running_stats = affine, track_running_stats
        self.weight = _filled((num_features,), True) if affine else None
        self.bias = _filled((num_features,), False) if affine else None
        if track_running_stats:
            self.register_buffer("running_mean", np.zeros(num_features, np.float32))
            self.register_buffer("running_var", np.ones(num_features, np.float32))
            # torch's counter (int64): training calls so far (momentum=None averages by it)
            self.register_buffer("num_batches_tracked", np.zeros((), np.int64))

    def forward(self, x):
        if x.ndim not in self.ranks:
            raise ValueError(f"{type(self).__name__}: expected a rank {' or '.join(map(str, self.ranks))} input, "
                             f"got {x.name!r} {fmt_shape(x.shape)}")
        if self.training or not self.track_running_stats:
            y = ops.batch_norm(x, None, None, self.weight, self.bias, training=True, eps=self.eps)
            if self.training and self.track_running_stats:
                self._update_running_stats(x)
            return y
        self.num_batches_tracked      # noqa: B018 (declared, so torch's state dict loads strictly)
        return ops.batch_norm(x, self.running_mean, self.running_var, self.weight, self.bias, training=False,
                              eps=self.eps)

    def _update_running_stats(self, x):
        """torch's train-mode update, built on the pending values so a second call in one
        graph updates again: counter + 1, stats <- stats * (1 - m) + batch * m (unbiased
        batch variance), with m = 1 / counter (a cumulative average) when momentum is None."""
        mean, var = ops.batch_norm_stats(x)
        rm, rv = self.pending(self.running_mean), self.pending(self.running_var)
        count = self.pending(self.num_batches_tracked) + 1
        m = self.momentum if self.momentum is not None else 1.0 / ops.cast(count, f32)
        self.record_update(self.running_mean, rm * (1.0 - m) + mean * m)
        self.record_update(self.running_var, rv * (1.0 - m) + var * m)
        self.record_update(self.num_batches_tracked, count)


class BatchNorm1d(_BatchNorm):
    ranks = (2, 3)


class BatchNorm2d(_BatchNorm):
    ranks = (4,)


class Dropout(Module):
    """Zeroes elements with probability p in training mode (a fresh mask every call,
    fed from the host) and scales the rest by 1/(1-p); identity in eval mode."""

    def __init__(self, p=0.5, inplace=False):
        super().__init__()
        if not 0.0 <= p <= 1.0:
            raise ValueError(f"Dropout: p must be in [0, 1], got {p}")
        self.p = p

    def forward(self, x):
        return dropout(x, self.p, self.training, name=self._prefix + "mask" if self._prefix else "dropout.mask")


class MultiheadAttention(Module):
    """torch.nn.MultiheadAttention (``in_proj_weight``/``in_proj_bias`` packed q, k, v and
    ``out_proj``); ``kdim``/``vdim`` different from embed_dim use separate projections.

    forward(query, key, value, key_padding_mask, need_weights, attn_mask,
    average_attn_weights, is_causal) -> (output, weights or None). Masks follow torch:
    a boolean / integer mask marks positions NOT allowed to attend (non-zero = masked), a
    float mask is added to the scores. They may be NumPy arrays or graph tensors."""

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False):
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise NotImplementedError("MultiheadAttention: add_bias_kv and add_zero_attn are not supported")
        if embed_dim % num_heads:
            raise ValueError(f"MultiheadAttention: embed_dim {embed_dim} must be divisible by num_heads {num_heads}")
        self.embed_dim, self.num_heads, self.dropout, self.batch_first = embed_dim, num_heads, dropout, batch_first
        self.kdim, self.vdim = kdim or embed_dim, vdim or embed_dim
        self.head_dim = embed_dim // num_heads
        self.same_dims = self.kdim == embed_dim and self.vdim == embed_dim
        e = embed_dim
        if self.same_dims:
            self.in_proj_weight = init.xavier_uniform_(_empty(3 * e, e))
        else:
            self.q_proj_weight = init.xavier_uniform_(_empty(e, e))
            self.k_proj_weight = init.xavier_uniform_(_empty(e, self.kdim))
            self.v_proj_weight = init.xavier_uniform_(_empty(e, self.vdim))
        self.in_proj_bias = _empty(3 * e) if bias else None
        self.out_proj = Linear(e, e, bias=bias)
        if bias:
            init.zeros_(self.out_proj._parameters["bias"])

    def _project(self, q, k, v):
        e, b = self.embed_dim, self.in_proj_bias
        bs = [None] * 3 if b is None else [ops.slice(b, 0, i * e, (i + 1) * e) for i in range(3)]
        if self.same_dims:
            ws = [ops.slice(self.in_proj_weight, 0, i * e, (i + 1) * e) for i in range(3)]
        else:
            ws = [self.q_proj_weight, self.k_proj_weight, self.v_proj_weight]
        return [ops.linear(x, w, bb) for x, w, bb in zip((q, k, v), ws, bs)]

    def _mask(self, mask, like, shape, what):
        """A float additive mask broadcastable to ``shape`` (torch: non-zero / True = masked)."""
        if mask is None:
            return None
        if not isinstance(mask, Tensor):
            arr = np.asarray(mask)
            if arr.dtype.kind == "f":
                return like.graph.constant(arr.astype(np.float32))
            return like.graph.constant(np.where(arr != 0, np.finfo(np.float32).min, 0.0).astype(np.float32))
        if mask.dtype.is_float:
            return mask
        return ops.cast(ops.ne(mask, 0), like.dtype) * float(np.finfo(np.float32).min)

    def forward(self, query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False):
        unbatched = query.ndim == 2
        if unbatched:
            query, key, value = (ops.unsqueeze(t, 1) for t in (query, key, value))
        elif self.batch_first:
            query, key, value = (ops.transpose(t, 0, 1) for t in (query, key, value))
        if query.ndim != 3 or query.shape[-1] != self.embed_dim:
            raise ValueError(f"MultiheadAttention: query must be (L, N, {self.embed_dim}) "
                             f"({'batch first' if self.batch_first else 'sequence first'}), got {query.name!r} "
                             f"{fmt_shape(query.shape)}")
        tgt, n, e = query.shape
        src = key.shape[0]
        h, d = self.num_heads, self.head_dim
        q, k, v = self._project(query, key, value)

        def heads(t, length):                         # (L, N, E) -> (N, H, L, D)
            return ops.permute(ops.reshape(t, (length, n, h, d)), (1, 2, 0, 3))
        q, k, v = heads(q, tgt), heads(k, src), heads(v, src)
        mask = self._mask(attn_mask, q, (tgt, src), "attn_mask")
        if mask is not None and mask.ndim == 3:       # (N * H, L, S) as torch
            mask = ops.reshape(mask, (n, h, tgt, src))
        kpm = self._mask(key_padding_mask, q, (n, src), "key_padding_mask")
        if kpm is not None:
            kpm = ops.reshape(kpm, (n, 1, 1, src))
            mask = kpm if mask is None else mask + kpm
        drop = self.dropout if self.training else 0.0
        if need_weights or drop:
            scores = ops.matmul(q * (1.0 / math.sqrt(d)), ops.transpose(k, -1, -2))
            if mask is not None:
                scores = scores + mask
            if is_causal and attn_mask is None:
                causal = np.triu(np.full((tgt, src), np.finfo(np.float32).min, np.float32), 1)
                scores = scores + q.graph.constant(causal)
            probs = ops.softmax(scores, -1)
            out = ops.matmul(dropout(probs, drop, True, name=self._prefix + "attn_mask") if drop else probs, v)
        else:
            out = ops.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal and attn_mask is None)
            probs = None
        out = ops.reshape(ops.permute(out, (2, 0, 1, 3)), (tgt, n, e))
        out = self.out_proj(out)
        if unbatched:
            out = ops.reshape(out, (tgt, e))
        elif self.batch_first:
            out = ops.transpose(out, 0, 1)
        weights = None
        if need_weights:
            weights = ops.mean(probs, 1) if average_attn_weights else probs
            if unbatched:
                weights = ops.reshape(weights, weights.shape[1:])
        return out, weights


# --------------------------------------------------------------- parameter-free layers
def _simple(name, fn, doc):
    def forward(self, x):
        return fn(self, x)
    return type(name, (Module,), {"forward": forward, "__doc__": doc})


ReLU = _simple("ReLU", lambda self, x: ops.relu(x), "torch.nn.ReLU")
SiLU = _simple("SiLU", lambda self, x: ops.silu(x), "torch.nn.SiLU")
Tanh = _simple("Tanh", lambda self, x: ops.tanh(x), "torch.nn.Tanh")
Sigmoid = _simple("Sigmoid", lambda self, x: ops.sigmoid(x), "torch.nn.Sigmoid")


class GELU(Module):
    def __init__(self, approximate="none"):
        super().__init__()
        self.approximate = approximate

    def forward(self, x):
        return ops.gelu(x, self.approximate)


class Softmax(Module):
    def __init__(self, dim=None):
        super().__init__()
        self.dim = dim

    def forward(self, x):
        return ops.softmax(x, self.dim)


class Flatten(Module):
    def __init__(self, start_dim=1, end_dim=-1):
        super().__init__()
        self.start_dim, self.end_dim = start_dim, end_dim

    def forward(self, x):
        return ops.flatten(x, self.start_dim, self.end_dim)


class MaxPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, dilation=1, return_indices=False, ceil_mode=False):
        super().__init__()
        self.args = (kernel_size, stride, padding, dilation, ceil_mode, return_indices)

    def forward(self, x):
        return ops.max_pool2d(x, *self.args)


class AvgPool2d(Module):
    def __init__(self, kernel_size, stride=None, padding=0, ceil_mode=False, count_include_pad=True,
                 divisor_override=None):
        super().__init__()
        self.args = (kernel_size, stride, padding, ceil_mode, count_include_pad, divisor_override)

    def forward(self, x):
        return ops.avg_pool2d(x, *self.args)


class AdaptiveAvgPool2d(Module):
    def __init__(self, output_size):
        super().__init__()
        self.output_size = output_size

    def forward(self, x):
        return ops.adaptive_avg_pool2d(x, self.output_size)


class Upsample(Module):
    """Nearest-neighbour upsampling by an integer scale factor."""

    def __init__(self, size=None, scale_factor=None, mode="nearest"):
        super().__init__()
        if size is not None or mode != "nearest":
            raise NotImplementedError("Upsample: only mode='nearest' with an integer scale_factor is supported")
        self.scale_factor = scale_factor

    def forward(self, x):
        return ops.upsample_nearest2d(x, self.scale_factor)
