"""A kernel's structure without the identity of its buffers: kernels of repeated layers render
the same program text and differ only in the buffers they bind, so the compiler renders one
and binds the others' buffers in its places (``RenderCache``).

The fingerprint walks everything a kernel holds. Buffers, graph tensors and expression
nodes become the index of their first appearance: a renderer names bindings in order of
first use and computes a subexpression shared by identity once, so equal indices mean equal
text. Numbers keep their type (1, 1.0 and True render differently; -0.0 and 0.0 too). An
object of a kind it does not know (and a large array) keeps its identity, so it is never
shared: the cache can miss, never mix two kernels up."""
from __future__ import annotations

import dataclasses

import numpy as np

from ..graph import DType, Tensor
from ..schedule import Buf, Kernel, View
from .expr import Node

# arrays (constants' values) compared by content up to this many elements
SMALL_ARRAY = 64
# types that stand for themselves in a key (bool is not one: True == 1)
_PLAIN = frozenset({int, str, type(None)})


class _Walk:
    __slots__ = ("bufs", "ids")

    def __init__(self):
        self.bufs = []          # the Bufs, in order of first appearance
        self.ids = {}           # id(Buf / Tensor / Node) -> its key ("B" | "N", index, ...)

    def buf(self, b):
        found = self.ids.get(id(b))
        if found is None:
            found = self.ids[id(b)] = ("B", len(self.bufs), b.kind, b.nbytes, self.fp(b.dtype), self.fp(b.value))
            self.bufs.append(b)
        return found

    def node(self, x, fields):
        found = self.ids.get(id(x))
        if found is None:
            # the index is taken before the fields are walked, which may meet other nodes
            index = len(self.ids)
            self.ids[id(x)] = ("N", index)
            found = self.ids[id(x)] = ("N", index, fields())
        return found

    def fp(self, x):
        t = type(x)
        if t in _PLAIN:
            return x
        if t is tuple or t is list:
            # most items are plain (shapes, leaf indices, op names): no call for them
            fp = self.fp
            return (t is list, *[y if type(y) in _PLAIN else fp(y) for y in x])
        if t is View:
            return ("V", self.buf(x.buf), x.shape, x.strides, x.offset, x.dtype.name)
        if t is dict:
            fp = self.fp
            return ("d", *[(k if type(k) in _PLAIN else fp(k), v if type(v) in _PLAIN else fp(v))
                           for k, v in x.items()])
        if t is DType:
            return ("D", x.name)
        if t is Node:
            return self.node(x, lambda: (x.op, self.fp(x.dtype), self.fp(x.attrs), self.fp(x.shape)))
        if t is Tensor:
            return self.node(x, lambda: ("T", x.op, self.fp(x.attrs), x.shape, x.dtype.name,
                                         tuple((i.shape, i.dtype.name) for i in x.inputs)))
        if t is Kernel:
            return ("K", x.name, x.archetype, self.fp(x.spec), self.fp(x.out), self.fp(x.reads),
                    self.fp(x.epilogue), self.fp(x.epi_reads), self.fp(x.outs))
        if t is float:
            return ("f", x.hex())
        if t is bool:
            return ("b", x)
        if t is Buf:
            return self.buf(x)
        if t is np.ndarray:
            if x.size <= SMALL_ARRAY:
                return ("A", x.dtype.str, x.shape, x.tobytes())
            return ("id", id(x))
        if isinstance(x, np.generic):
            return ("n", x.dtype.str, x.tobytes())
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            return (t.__qualname__,) + tuple(self.fp(getattr(x, f.name)) for f in dataclasses.fields(x))
        return ("id", id(x))


def fingerprint(kernel) -> tuple:
    """(a hashable key equal for kernels that render the same text, their Bufs in order of
    first appearance)."""
    w = _Walk()
    return w.fp(kernel), w.bufs


class RenderCache:
    """``render(kernel)`` once per kernel structure within one compile (the renderers read
    per-compile settings, so a cache lives as long as one ``compile_plan``). ``hits`` counts
    the kernels bound to an earlier kernel's text."""

    def __init__(self, render):
        self.render, self.seen, self.hits = render, {}, 0

    def __call__(self, kernel):
        key, bufs = fingerprint(kernel)
        found = self.seen.get(key)
        if found is not None:
            text, places, groups = found
            self.hits += 1
            return text, [bufs[i] for i in places], groups
        text, bound, groups = self.render(kernel)
        where = {id(b): i for i, b in enumerate(bufs)}
        if all(id(b) in where for b in bound):      # a buffer the walk did not see: not shared
            self.seen[key] = (text, [where[id(b)] for b in bound], groups)
        return text, bound, groups
