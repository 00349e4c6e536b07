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


def quantize_linears(model: Module, blocks) -> list:
    """Swap every ``nn.Linear`` of ``model`` whose weight's state-dict name is a key of
    ``blocks`` for a ``QuantizedLinear`` holding that tensor's GGUF blocks: ``blocks`` maps
    ``"model.layers.0.mlp.down_proj.weight"`` to (raw uint8 bytes, GGUF type name or enum),
    rows of the layer's in_features weights. A layer keeps its bias; state-dict names stay.
    Entries of other block types, or naming no Linear, are refused (name them in the error)
    so a loader dequantizes those itself. Returns the swapped weight names."""
    from .layers import Linear
    swapped, where = [], {f"{n}.weight" if n else "weight": n for n, m in model.named_modules() if isinstance(m, Linear)}
    for key, (raw, qtype) in blocks.items():
        if key not in where:
            raise ValueError(f"quantize_linears: {key!r} is not the weight of an nn.Linear of {type(model).__name__}")
        path = where[key]
        parent, _, child = path.rpartition(".")
        owner = model.get_submodule(parent)
        lin = owner._modules[child] if path else model
        q = QuantizedLinear(lin.in_features, lin.out_features, qtype, blocks=raw)
        if "bias" in lin._parameters:
            q.bias = lin._parameters["bias"]
        setattr(owner, child, q)
        swapped.append(key)
    return swapped
