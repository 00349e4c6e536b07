"""``mg.nn``: PyTorch-style layers that build into meganeura graphs.

    import meganeura as mg
    from meganeura import nn

    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    model.load_state_dict(torch_model.state_dict())        # same names as torch
    predict = mg.jit(model, backend="gpu")                 # one compiled plan per input shape
    logits = predict(x_numpy)

Calling a module on graph Tensors adds its parameters (named as torch's ``state_dict``)
and ops to the tensors' graph; ``mg.compile`` or ``mg.jit`` turn that into a program.
"""
from . import functional, init  # noqa: F401
from .layers import (AdaptiveAvgPool2d, AvgPool2d, BatchNorm1d, BatchNorm2d, Conv1d, Conv2d, Dropout,  # noqa: F401
                     Embedding, Flatten, GELU, GroupNorm, Identity, LayerNorm, Linear, MaxPool2d,
                     MultiheadAttention, ReLU, RMSNorm, SiLU, Sigmoid, Softmax, Tanh, Upsample)
from .module import (IncompatibleKeys, Module, ModuleDict, ModuleList, Parameter, Sequential,  # noqa: F401
                     random_feeds, state_updates)
from . import lora  # noqa: F401,E402
from .quantized import QuantizedEmbedding, QuantizedLinear, quantize_weights  # noqa: F401,E402
from ..autodiff import checkpoint  # noqa: F401,E402
