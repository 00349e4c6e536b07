"""meganeura: portable GPU training and inference through Vulkan, Metal and DX12 (wgpu)."""
from .graph import DeviceLimitError, DType, Graph, ShapeError, Tensor, f16, f32, i32, u32  # noqa: F401
from . import ops  # noqa: F401
from .autodiff import grad  # noqa: F401
from . import io, optim  # noqa: F401
from .api import compile, Session  # noqa: F401
from . import nn  # noqa: F401
from .jit import Jit, jit  # noqa: F401
from . import export  # noqa: F401
from . import distributed  # noqa: F401  (torch is imported only when it is used)
from .importers import from_onnx, from_pretrained, from_torch  # noqa: F401  (torch and onnx only when called)

__version__ = "0.1.0"
