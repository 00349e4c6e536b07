"""``QuantizedLinear``: a linear layer whose weight stays in GGUF's packed blocks
(Q8_0, Q4_0, Q4_K) on the device, dequantized inside the product (mg.ops.quantized_linear).

The weight is a u32 buffer named ``weight`` (the graph state of that name), so a model
swaps its ``Linear`` layers for these and loads the raw block bytes of each tensor under
the same state-dict names: ``layer.load_blocks(raw)`` takes the uint8 bytes a GGUF reader
gives. Inference only: the weight is not trainable, the gradient reaches the input.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import fmt_shape
from ..ops.quantized import QTYPES, n_words, qtype_name, row_bytes, weight_words
from .layers import _empty
from .module import Module


class QuantizedLinear(Module):
    """y = x @ W.T + bias, W (out_features, in_features) held as ``qtype`` blocks."""

    def __init__(self, in_features, out_features, qtype, bias=False, blocks=None):
        super().__init__()
        self.qtype = qtype_name("QuantizedLinear", qtype)
        self.in_features, self.out_features = int(in_features), int(out_features)
        bs = QTYPES[self.qtype][0]
        if self.in_features % bs:
            raise ValueError(f"QuantizedLinear: in_features {self.in_features} is not a multiple of "
                             f"{self.qtype}'s block of {bs} weights")
        self.register_buffer("weight", np.zeros(n_words(self.qtype, self.out_features, self.in_features), np.uint32))
        self.bias = _empty(self.out_features) if bias else None
        if blocks is not None:
            self.load_blocks(blocks)

    def load_blocks(self, raw):
        """Take the weight's raw block bytes (uint8, any shape: what a GGUF file holds for
        the tensor, rows of in_features weights)."""
        raw = np.asarray(raw)
        want = self.out_features * row_bytes(self.qtype, self.in_features)
        if raw.dtype != np.uint8 or raw.size != want:
            raise ValueError(f"QuantizedLinear.load_blocks: a ({self.out_features}, {self.in_features}) "
                             f"{self.qtype} weight is {want} bytes (uint8), got {raw.dtype} {fmt_shape(raw.shape)}")
        self._set_buffer("weight", weight_words(raw))
        return self

    def requires_grad_(self, requires_grad=True):
        if requires_grad:
            raise TypeError(f"QuantizedLinear: the {self.qtype} weight is not trainable (inference only); "
                            "train a float Linear, or an adapter beside this layer")
        return super().requires_grad_(False)

    def forward(self, x):
        return ops.quantized_linear(x, self.weight, self.qtype, self.out_features, self.in_features, self.bias)

    def extra_repr(self):
        return (f"in_features={self.in_features}, out_features={self.out_features}, qtype={self.qtype}, "
                f"bias={self.bias is not None}")
