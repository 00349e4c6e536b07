"""Errors of the importers: every problem of one model reported at once, naming the op,
its target (ATen overload or ONNX op type), the node and where it was made."""
from __future__ import annotations


class ModelImportError(ValueError):
    """A model could not be imported. ``problems`` lists one line per cause."""

    def __init__(self, what: str, problems: list[str] = ()):
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"{what}:\n{lines}" if self.problems else what)


class UnsupportedOpsError(ModelImportError):
    """Ops of the model that meganeura has no mapping for (all of them, not the first)."""


class Unavailable:
    """A value an op produces that meganeura does not compute (batch norm's saved
    statistics, max pooling's indices): any use of it is reported as the node's problem."""

    def __init__(self, why: str):
        self.why = why


def rule_table():
    """An importer's op table and the decorator that fills it: ``@rule("aten.add.Tensor")``
    maps each name given to the function."""
    table: dict = {}

    def rule(*names):
        def add(fn):
            for n in names:
                table[n] = fn
            return fn
        return add
    return table, rule
