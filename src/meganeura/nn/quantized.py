"""``QuantizedLinear`` and ``QuantizedEmbedding``: layers whose weight stays in GGUF's
packed blocks (Q8_0, Q4_0/1, Q5_0/1, Q2_K .. Q6_K) on the device, dequantized inside the product
(mg.ops.quantized_linear) or the row lookup (mg.ops.quantized_embedding).

The weight is a u32 buffer named ``weight`` (the graph state of that name), so a model
swaps its ``Linear`` / ``Embedding`` layers for these (``quantize_weights``) and keeps its
state-dict names; ``layer.load_blocks(raw)`` takes the uint8 bytes a GGUF reader gives.
Inference only: the weight is not trainable, the gradient reaches the input.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import fmt_shape
from ..ops.quantized import QTYPES, n_words, qtype_name, row_bytes, weight_words
from .layers import _empty
from .module import Module


class _Blocks(Module):
    """A module whose ``weight`` is a (rows, cols) weight of ``qtype`` blocks in u32 words."""

    def _init_blocks(self, qtype, rows, cols, blocks):
        kind = type(self).__name__
        self.qtype = qtype_name(kind, qtype)
        self._rows, self._cols = int(rows), int(cols)
        bs = QTYPES[self.qtype][0]
        if self._cols % bs:
            raise ValueError(f"{kind}: rows of {self._cols} weights are not a multiple of {self.qtype}'s "
                             f"block of {bs}")
        self.register_buffer("weight", np.zeros(n_words(self.qtype, self._rows, self._cols), np.uint32))
        if blocks is not None:
            self.load_blocks(blocks)

    def load_blocks(self, raw):
        """Take the weight's raw block bytes (uint8, any shape: what a GGUF file holds for
        the tensor, its rows one after another)."""
        raw = np.asarray(raw)
        want = self._rows * row_bytes(self.qtype, self._cols)
        if raw.dtype != np.uint8 or raw.size != want:
            raise ValueError(f"{type(self).__name__}.load_blocks: a ({self._rows}, {self._cols}) {self.qtype} "
                             f"weight is {want} bytes (uint8), got {raw.dtype} {fmt_shape(raw.shape)}")
        self._set_buffer("weight", weight_words(raw))
        return self

    def requires_grad_(self, requires_grad=True):
        if requires_grad:
            raise TypeError(f"{type(self).__name__}: the {self.qtype} weight is not trainable (inference only); "
                            "the layers around it train (the gradient passes through it)")
        return super().requires_grad_(False)


class QuantizedLinear(_Blocks):
    """y = x @ W.T + bias, W (out_features, in_features) held as ``qtype`` blocks."""

    def __init__(self, in_features, out_features, qtype, bias=False, blocks=None):
        super().__init__()
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.bias = _empty(self.out_features) if bias else None
        self._init_blocks(qtype, out_features, in_features, blocks)

    def forward(self, x):
        return ops.quantized_linear(x, self.weight, self.qtype, self.out_features, self.in_features, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"bias={self.bias is not None}")


class QuantizedEmbedding(_Blocks):
    """Rows of W (num_embeddings, embedding_dim) held as ``qtype`` blocks, picked by ids;
    ``as_linear(h)`` is ``h @ W.T`` on the same blocks (a head tied to the embedding)."""

    def __init__(self, num_embeddings, embedding_dim, qtype, blocks=None):
        super().__init__()
        self.num_embeddings, self.embedding_dim = int(num_embeddings), int(embedding_dim)
        self._init_blocks(qtype, num_embeddings, embedding_dim, blocks)

    def forward(self, ids):
        return ops.quantized_embedding(ids, self.weight, self.qtype, self.num_embeddings, self.embedding_dim)

    def as_linear(self, h):
        return ops.quantized_linear(h, self.weight, self.qtype, self.num_embeddings, self.embedding_dim)

    def extra_repr(self):
        return f"{self.num_embeddings}, {self.embedding_dim}, qtype={self.qtype}"


def quantize_weights(model: Module, blocks) -> list:
    """Swap each ``nn.Linear`` / ``nn.Embedding`` of ``model`` whose weight's state-dict name
    is a key of ``blocks`` for a ``QuantizedLinear`` / ``QuantizedEmbedding`` holding that
    tensor's GGUF blocks: ``blocks`` maps ``"model.layers.0.mlp.down_proj.weight"`` to (raw
    uint8 bytes, GGUF type name or enum), the weight's rows one after another. A Linear
    keeps its bias; state-dict names stay. A name that is no such layer's weight, or a block
    type without kernels, is refused (named in the error): the caller dequantizes those.
    Returns the swapped weight names."""
    from .layers import Embedding, Linear
    where = {f"{n}.weight" if n else "weight": (n, m) for n, m in model.named_modules()
             if isinstance(m, (Linear, Embedding))}
    swapped = []
    for key, (raw, qtype) in blocks.items():
        if key not in where:
            raise ValueError(f"quantize_weights: {key!r} is not the weight of an nn.Linear or nn.Embedding "
                             f"of {type(model).__name__}")
        path, old = where[key]
        if isinstance(old, Linear):
            has_bias = old._parameters.get("bias") is not None
            # made with its bias slot (a registered parameter), then given the old one: a bias
            # set on a layer made without one stays a plain None attribute and is never read
            new = QuantizedLinear(old.in_features, old.out_features, qtype, bias=has_bias, blocks=raw)
            if has_bias:
                new.bias = old._parameters["bias"]
        else:
            if old.padding_idx is not None:
                raise ValueError(f"quantize_weights: {key!r} has a padding_idx, which QuantizedEmbedding has not")
            new = QuantizedEmbedding(old.num_embeddings, old.embedding_dim, qtype, blocks=raw)
        parent, _, child = path.rpartition(".")
        # in place: a Sequential runs its children in their order of registration
        (model.get_submodule(parent) if parent else model)._modules[child] = new
        swapped.append(key)
    return swapped
