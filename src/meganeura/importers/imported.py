"""What an importer returns: a graph with the model's inputs, outputs and weights by the
names the source model gives them."""
from __future__ import annotations

import numpy as np

from ..graph import Graph, Tensor


class ImportedModel:
    """An imported model. ``graph`` is an ordinary meganeura graph: compile it for inference
    (``mg.compile(m.graph, outputs=m.outputs)``) or add a loss on ``m.outputs`` and compile
    it with an optimizer to train. Parameters and buffers carry their source names (torch's
    ``state_dict`` keys, ONNX initializer names), so ``Session.load_state_dict`` takes the
    source model's weights and ``Session.state_dict`` gives them back. The imported values
    are the parameters' initial values, so a fresh session already holds them."""

    def __init__(self, graph: Graph, inputs: dict, outputs: list, output_names: list, source: str):
        self.graph, self.inputs, self.outputs = graph, dict(inputs), list(outputs)
        self.output_names, self.source = list(output_names), source

    @property
    def output(self) -> Tensor:
        """The first output (the only one of most models)."""
        return self.outputs[0]

    def state_dict(self) -> dict:
        """The imported weights by name (parameters and buffers), as NumPy arrays."""
        out = {}
        for name, t in self.graph.parameters.items():
            out[name] = np.asarray(t.attrs["init"])
        for name, t in self.graph.states.items():
            out[name] = np.asarray(t.attrs["init"])
        return out

    def feeds(self, *args, **kwargs) -> dict:
        """The feed dict of a call with the source model's positional (and keyword) inputs."""
        names = list(self.inputs)
        if len(args) > len(names):
            raise TypeError(f"{self.source}: {len(args)} inputs given, the model takes {len(names)} ({names})")
        feeds = dict(zip(names, args))
        feeds.update(kwargs)
        return {n: _array(v) for n, v in feeds.items()}

    def compile(self, loss=None, optimizer=None, **options):
        """``mg.compile`` of this model's graph: its outputs (and ``loss`` where given)."""
        from ..api import compile as mg_compile
        return mg_compile(self.graph, outputs=self.outputs, loss=loss, optimizer=optimizer, **options)

    def __repr__(self):
        return (f"ImportedModel({self.source}: {len(self.inputs)} inputs, {len(self.outputs)} outputs, "
                f"{len(self.graph.parameters)} parameters, {len(self.graph.nodes)} nodes)")


def _array(v):
    if hasattr(v, "detach"):        # a torch tensor, without importing torch
        v = v.detach().cpu().numpy()
    return np.asarray(v)
