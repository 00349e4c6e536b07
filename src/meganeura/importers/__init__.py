"""Importers of models made elsewhere: ``from_torch`` (torch.export), ``from_onnx`` and
``from_pretrained`` (a Hugging Face folder or cached model id, through transformers and torch.export).

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


def from_pretrained(name_or_path, example_inputs=None, *, revision=None, training=False, batch=1,
                    seq_len=8) -> ImportedModel:
    """Import a Hugging Face model: a folder, or a model id found in the local Hugging Face
    cache (nothing is downloaded). transformers builds the model named by its config.json,
    with its weights, and ``from_torch`` imports it called on ``example_inputs`` (default: zero
    token ids of ``(batch, seq_len)``, or an image / spectrogram for vision and audio models).
    ``.config`` of the result is the transformers config (see ``pretrained``)."""
    from .pretrained import from_pretrained as run
    return run(name_or_path, example_inputs, revision=revision, training=training, batch=batch, seq_len=seq_len)
