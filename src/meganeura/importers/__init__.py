"""Importers of models made elsewhere: ``from_torch`` (torch.export) and ``from_onnx``.

Neither torch nor onnx is imported until one of these is called: they are optional
extras (``meganeura[torch]``, ``meganeura[onnx]``), and ``import meganeura`` stays light.
"""
from __future__ import annotations

from .errors import ModelImportError, UnsupportedOpsError  # noqa: F401
from .imported import ImportedModel  # noqa: F401


def from_torch(module, example_inputs, example_kwargs=None, *, training=False, strict=False) -> ImportedModel:
    """Import a ``torch.nn.Module`` through ``torch.export`` (see ``torch_export``)."""
    from .torch_export import from_torch as run
    return run(module, example_inputs, example_kwargs, training=training, strict=strict)


def from_onnx(path_or_model, *, load_external=True, input_shapes=None) -> ImportedModel:
    """Import an ONNX model (a file path or an ``onnx.ModelProto``; see ``onnx_import``)."""
    from .onnx_import import from_onnx as run
    return run(path_or_model, load_external=load_external, input_shapes=input_shapes)


def load_saved(folder):
    """A model ``meganeura import --out DIR`` saved, run from its executable (see ``saved``)."""
    from .saved import load_saved as run
    return run(folder)
