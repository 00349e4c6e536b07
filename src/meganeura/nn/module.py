"""``mg.nn.Module``: layers that build into a graph with PyTorch's parameter names.

A module holds its parameters and buffers as NumPy arrays (their initial or loaded
values). Calling it on graph Tensors adds its parameters to that graph under their
hierarchical names (``features.0.weight``: attribute path then parameter name, exactly
as torch's ``state_dict``), so state dicts move between torch and meganeura unchanged.
Inside ``forward``, ``self.weight`` is the graph tensor of that parameter, so a custom
module reads like its torch twin.

Buffers (batch norm's running statistics and its integer batch counter) become graph
*state*: kept by the session, never trained, saved under their torch names. In training
mode a module records how the step changes them (``record_update``, i.e. ``Graph.update``:
every training step applies these itself) and may add random feeds (dropout masks), which
``mg.jit`` feeds and ``random_feeds(g, rng)`` gives to a hand-made session.
"""
from __future__ import annotations

import weakref
from collections import OrderedDict, namedtuple
from collections.abc import Mapping

import numpy as np

from ..graph import Graph, Tensor, cast_exact, dtype_of, fmt_shape

IncompatibleKeys = namedtuple("IncompatibleKeys", ["missing_keys", "unexpected_keys"])

# per graph: {input name: (shape, keep probability)} of the dropout masks fed every call
_RANDOM: "weakref.WeakKeyDictionary[Graph, dict]" = weakref.WeakKeyDictionary()
_TRACE: list = []          # graphs of the module calls in progress, innermost last
_CALLED: list = []         # while mg.jit traces: lists that collect every module called


class Parameter:
    """A trainable array (float32 unless ``data`` says f16).

    ``Parameter(shape=..., init=rule)`` (or any layer built inside ``nn.init.deferred()``)
    holds no array yet: a graph built from the module draws it with ``Graph.parameter``'s
    rule (None: torch's fan-in uniform for rank >= 2, zeros below; 'normal': N(0, 0.02);
    'ones'; 'zeros'), seeded by the session and the parameter's full name, so two builds
    agree and a large model is not held twice before its weights are loaded. Assigning or
    loading ``data`` replaces the rule; reading it first draws a value by the same rule
    from ``nn.init``'s generator."""

    def __init__(self, data=None, requires_grad=True, *, shape=None, init=None):
        self.requires_grad = bool(requires_grad)
        self.graph_names = set()       # the names modules gave it in graphs (optimizer groups find it so)
        self._data, self.init = None, init
        if data is None:
            if shape is None:
                raise TypeError("Parameter: give data, or shape= (and init=) for a deferred value")
            self._shape = tuple(int(s) for s in shape)
        else:
            self.data = data

    @property
    def deferred(self) -> bool:
        return self._data is None

    @property
    def data(self) -> np.ndarray:
        live = self.__dict__.get("_live")
        if live is not None and live.version != self._live_seen:
            value = live.read(self._live_name)        # trained since last read: the session's value
            if value is not None:
                self._data, self._shape, self.init = value, value.shape, None
            self._live_seen = live.version
        if self._data is None:
            from .init import draw
            self._data = draw(self._shape, self.init)
        return self._data

    @data.setter
    def data(self, value):
        arr = np.asarray(value)
        self._data = np.array(arr, dtype=arr.dtype if arr.dtype == np.float16 else np.float32)
        self._shape, self.init = self._data.shape, None
        live = self.__dict__.get("_live")
        if live is not None:                        # the sessions training it take it too
            live.write(self._live_name, self._data)
            self._live_seen = live.version

    def link(self, live, name):
        """Values now live in ``live``'s sessions under ``name`` (``mg.jit`` training): read
        through it after each step, and written to it on assignment."""
        self._live, self._live_name, self._live_seen = live, name, live.version

    def __getstate__(self):
        if "_live" in self.__dict__:
            self.data                   # pulled from a session first; the link is not copied
        return {k: v for k, v in self.__dict__.items() if not k.startswith("_live")}

    @property
    def shape(self):
        return self._shape

    @property
    def dtype(self):
        return np.dtype(np.float32) if self._data is None else self._data.dtype

    def requires_grad_(self, requires_grad=True):
        """Freeze (False) or unfreeze it for training, as torch; returns it."""
        self.requires_grad = bool(requires_grad)
        return self

    def graph_init(self):
        """What ``Graph.parameter`` takes as ``init``: the rule while deferred, else a copy."""
        if "_live" in self.__dict__:
            self.data                   # a value another session trained
        return self.init if self._data is None else self._data.copy()

    def __repr__(self):
        return f"Parameter(shape={fmt_shape(self._shape)}{', deferred' if self.deferred else ''})"


def to_numpy(v) -> np.ndarray:
    """A NumPy copy of an array, a Parameter, or a torch tensor (no torch import needed)."""
    if isinstance(v, Parameter):
        v = v.data
    if hasattr(v, "detach") and hasattr(v, "cpu"):
        v = v.detach().cpu().numpy()
    return np.array(v)


def check_state_mapping(owner, state):
    """Refuse a state dict that is not a mapping (a list of arrays, a file name), naming it."""
    if not isinstance(state, Mapping):
        raise TypeError(f"{owner}: expected a dict of name -> array (as state_dict() gives), "
                        f"got {type(state).__name__}" + (" (load a file with .load(path))" if isinstance(state, str) else ""))


def state_updates(graph: Graph) -> dict:
    """{state tensor: new value} that modules in training mode recorded on ``graph``
    (``graph.updates``): every training step applies them; give them to
    ``mg.compile(state_updates=)`` to have ``run`` apply them too."""
    return dict(graph.updates)


def random_feeds(graph: Graph, rng: np.random.Generator) -> dict:
    """Fresh dropout masks (already scaled by 1/keep) for every Dropout input of ``graph``:
    feed them to every call."""
    return {name: (rng.random(shape) < keep).astype(np.float32) / np.float32(keep)
            for name, (shape, keep) in _RANDOM.get(graph, {}).items()}


def random_input(x: Tensor, name: str, keep: float) -> Tensor:
    """A graph input fed with a fresh random keep-mask of ``x``'s shape every call."""
    g = x.graph
    key, k = name, 0
    while key in g.inputs:               # a module called twice in one graph
        k += 1
        key = f"{name}.{k}"
    _RANDOM.setdefault(g, {})[key] = (x.shape, float(keep))
    return g.input(key, x.shape, x.dtype)


def current_graph():
    return _TRACE[-1] if _TRACE else None


def _find_graph(obj):
    if isinstance(obj, Tensor):
        return obj.graph
    if isinstance(obj, (list, tuple)):
        for o in obj:
            g = _find_graph(o)
            if g is not None:
                return g
    if isinstance(obj, dict):
        return _find_graph(list(obj.values()))
    return None


class Module:
    """Base class of every layer, as torch.nn.Module: assign Parameters and Modules as
    attributes, write ``forward``, call the module on Tensors. ``activation_checkpointing =
    True``: its activations are recomputed in the backward pass (``mg.nn.checkpoint``)."""
    activation_checkpointing = False

    def __init__(self):
        object.__setattr__(self, "_parameters", OrderedDict())
        object.__setattr__(self, "_buffers", OrderedDict())
        object.__setattr__(self, "_non_persistent", set())
        object.__setattr__(self, "_modules", OrderedDict())
        object.__setattr__(self, "training", True)
        object.__setattr__(self, "_prefix", None)      # its state-dict path, set when first called

    # ------------------------------------------------------------------ attributes
    def __setattr__(self, name, value):
        if "_parameters" not in self.__dict__:
            raise AttributeError(f"call super().__init__() in {type(self).__name__}.__init__ before assigning {name!r}")
        for d in (self._parameters, self._buffers, self._modules):
            d.pop(name, None)
        if isinstance(value, Parameter):
            self._parameters[name] = value
        elif isinstance(value, Module):
            self._modules[name] = value
        else:
            object.__setattr__(self, name, value)

    def __getattr__(self, name):
        d = self.__dict__
        if name in d.get("_parameters", ()):
            return self._tensor(name, "parameter") if _TRACE else d["_parameters"][name]
        if name in d.get("_buffers", ()):
            return self._tensor(name, "buffer") if _TRACE else self._buffer(name)
        if name in d.get("_modules", ()):
            return d["_modules"][name]
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def __delattr__(self, name):
        for d in (self._parameters, self._buffers, self._modules):
            if name in d:
                del d[name]
                return
        object.__delattr__(self, name)

    def _buffer(self, name):
        """A buffer's array, read from the session training it (``link_buffer``) when a step
        ran since it was last read."""
        links = self.__dict__.get("_live_buffers")
        if links and name in links:
            live, full, seen = links[name]
            if live.version != seen:
                value = live.read(full)
                if value is not None:
                    self._buffers[name] = value.astype(self._buffers[name].dtype)
                links[name] = (live, full, live.version)
        return self._buffers[name]

    def link_buffer(self, name, live, full):
        """The buffer ``name`` lives in ``live``'s sessions as ``full`` (see Parameter.link)."""
        self.__dict__.setdefault("_live_buffers", {})[name] = (live, full, live.version)

    def _set_buffer(self, name, value):
        self._buffers[name] = value
        links = self.__dict__.get("_live_buffers")
        if links and name in links:
            live, full, _ = links[name]
            live.write(full, value)
            links[name] = (live, full, live.version)

    def __getstate__(self):
        for n in self._buffers:
            if self._buffers[n] is not None:
                self._buffer(n)
        return {k: v for k, v in self.__dict__.items() if k != "_live_buffers"}

    def register_buffer(self, name, value, persistent=True):
        """A non-trained array saved in the state dict (float ones are graph state)."""
        self._buffers[name] = None if value is None else np.array(value)
        if not persistent:
            self._non_persistent.add(name)

    def register_parameter(self, name, param):
        if param is None:
            self._parameters.pop(name, None)
            object.__setattr__(self, name, None)
        else:
            self._parameters[name] = param

    def add_module(self, name, module):
        self._modules[str(name)] = module

    def _tensor(self, name, kind) -> Tensor:
        """The graph tensor of one of this module's parameters or buffers."""
        g = current_graph()
        full = self._prefix + name
        if kind == "parameter":
            value = self._parameters[name]
            value.graph_names.add(full)
            t = g.parameters.get(full)
            if t is None:
                return g.parameter(full, value.shape, value.dtype, init=value.graph_init(),
                                   requires_grad=value.requires_grad)
        else:
            value = self._buffers[name]
            if value is None or value.dtype.kind not in "fiu":
                raise TypeError(f"{type(self).__name__}: buffer {full!r} is not a numeric array and has no graph tensor")
            t = g.states.get(full)
            if t is None:
                # an integer buffer (torch's int64 counters) is an i32 state, values kept exact
                dt = dtype_of(value.dtype)
                return g.state(full, value.shape, dt, init=cast_exact(value, dt, f"buffer {full!r}").copy())
        if t.shape != value.shape:
            raise ValueError(f"{full!r} is already in the graph with shape {fmt_shape(t.shape)}, "
                             f"this module's is {fmt_shape(value.shape)}")
        return t

    # ---------------------------------------------------------------------- calling
    def forward(self, *args, **kwargs):
        raise NotImplementedError(f"{type(self).__name__} has no forward()")

    def __call__(self, *args, **kwargs):
        if _TRACE:
            g = _TRACE[-1]
        else:
            g = _find_graph((args, kwargs))
            if g is None:
                raise TypeError(f"{type(self).__name__}: call it on mg Tensors (graph inputs), or wrap it in "
                                "mg.jit to call it on NumPy arrays")
        if not _TRACE or self._prefix is None:           # a root, or a module made inside a forward
            for prefix, m in self.named_modules():      # names as in this module's state_dict
                object.__setattr__(m, "_prefix", prefix + "." if prefix else "")
        _TRACE.append(g)
        for seen in _CALLED:
            seen.append(self)
        try:
            if self.activation_checkpointing:
                from ..autodiff import checkpoint
                return checkpoint(self.forward, *args, **kwargs)
            return self.forward(*args, **kwargs)
        finally:
            _TRACE.pop()

    def record_update(self, state: Tensor, value: Tensor):
        """In training mode: ``state`` takes ``value`` after each training step (running
        statistics, counters): ``Graph.update``. Build ``value`` on ``pending(state)`` so a
        module called twice in one graph updates twice, as in torch."""
        state.graph.update(state, value)

    @staticmethod
    def pending(state: Tensor) -> Tensor:
        """``state`` as updates recorded so far in this graph leave it."""
        return state.graph.pending(state)

    # ------------------------------------------------------------------------- tree
    def named_modules(self, prefix="", memo=None):
        memo = set() if memo is None else memo
        if id(self) in memo:
            return
        memo.add(id(self))
        yield prefix, self
        for n, m in self._modules.items():
            if m is not None:
                yield from m.named_modules(f"{prefix}.{n}" if prefix else n, memo)

    def modules(self):
        return [m for _, m in self.named_modules()]

    def requires_grad_(self, requires_grad=True):
        """Freeze (False) or unfreeze every parameter of this module, as torch; returns it."""
        for p in self.parameters():
            p.requires_grad_(requires_grad)
        return self

    def get_submodule(self, target: str) -> "Module":
        """The module at dotted path ``target`` ("" is this one), as torch."""
        m = self
        for part in target.split(".") if target else ():
            if part not in m._modules or m._modules[part] is None:
                raise AttributeError(f"{type(m).__name__} has no submodule {part!r} (looking up {target!r})")
            m = m._modules[part]
        return m

    def children(self):
        return [m for m in self._modules.values() if m is not None]

    def named_children(self):
        return [(n, m) for n, m in self._modules.items() if m is not None]

    def named_parameters(self, prefix=""):
        seen = set()
        for mp, m in self.named_modules(prefix):
            for n, p in m._parameters.items():
                if p is not None and id(p) not in seen:
                    seen.add(id(p))
                    yield (f"{mp}.{n}" if mp else n), p

    def parameters(self):
        return [p for _, p in self.named_parameters()]

    def named_buffers(self, prefix=""):
        for mp, m in self.named_modules(prefix):
            for n, b in m._buffers.items():
                if b is not None:
                    yield (f"{mp}.{n}" if mp else n), m._buffer(n)

    def _entries(self):
        """{state-dict name: (owner module, attribute, is_parameter)}."""
        out = {}
        for mp, m in self.named_modules():
            pre = mp + "." if mp else ""
            for n, p in m._parameters.items():
                if p is not None:
                    out[pre + n] = (m, n, True)
            for n, b in m._buffers.items():
                if b is not None and n not in m._non_persistent:
                    out[pre + n] = (m, n, False)
        return out

    def state_dict(self) -> dict:
        """{name: NumPy copy} of parameters and persistent buffers, torch's names and order."""
        return {k: (m._parameters[n].data if isp else m._buffer(n)).copy()
                for k, (m, n, isp) in self._entries().items()}

    def load_state_dict(self, state: dict, strict: bool = True) -> IncompatibleKeys:
        """Copy values in by name (torch tensors or arrays). Shapes must match; with
        ``strict`` every name must match too. Returns (missing_keys, unexpected_keys)."""
        from ..api import describe_key_mismatch
        check_state_mapping(f"{type(self).__name__}.load_state_dict", state)
        entries = self._entries()
        missing = [k for k in entries if k not in state]
        unexpected = [k for k in state if k not in entries]
        problems = []
        values = {}
        for k, v in state.items():
            if k not in entries:
                continue
            m, n, isp = entries[k]
            arr = to_numpy(v)
            want = m._parameters[n] if isp else m._buffers[n]
            if arr.shape != tuple(want.shape):
                problems.append(f"{k!r}: got shape {fmt_shape(arr.shape)}, expected {fmt_shape(want.shape)}")
            else:
                values[k] = arr.astype(want.dtype)
        if strict and (missing or unexpected):
            problems.append(describe_key_mismatch(missing, unexpected))
        if problems:
            raise ValueError(f"{type(self).__name__}.load_state_dict: " + "; ".join(problems))
        for k, arr in values.items():
            m, n, isp = entries[k]
            if isp:
                m._parameters[n].data = arr
            else:
                m._set_buffer(n, arr)
        return IncompatibleKeys(missing, unexpected)

    def save(self, path):
        """Write the parameters and persistent buffers (their trained values, if ``mg.jit``
        trained them) to a safetensors file by state-dict name (``meganeura.checkpoint``)."""
        from .. import checkpoint
        return checkpoint.save(_Snapshot(self), path, include_optimizer=False)

    def load(self, path, strict=True):
        """Load a safetensors file (``save``'s, a session's or torch's ``save_file``) by name;
        optimizer state a session saved beside the parameters is skipped."""
        from .. import checkpoint
        tensors, meta = checkpoint.read(path)
        mine = self._entries()
        listed = checkpoint._parameter_names(path, meta)
        extra = [k for k in tensors if k not in mine and (listed is None or k in listed)]
        if strict and extra:
            raise checkpoint.CheckpointError(f"cannot load {path!r}: unexpected key(s) {extra[:5]} "
                                             f"(not in this {type(self).__name__})")
        return self.load_state_dict({k: v for k, v in tensors.items() if k in mine}, strict)

    # ------------------------------------------------------------------------ modes
    def train(self, mode: bool = True):
        for m in self.modules():
            object.__setattr__(m, "training", bool(mode))
        return self

    def eval(self):
        return self.train(False)

    def apply(self, fn):
        for m in self.children():
            m.apply(fn)
        fn(self)
        return self

    def extra_repr(self) -> str:
        return ""

    def __repr__(self):
        lines = [f"({n}): " + repr(m).replace("\n", "\n  ") for n, m in self._modules.items()]
        head = f"{type(self).__name__}({self.extra_repr()}"
        return head + ("\n  " + "\n  ".join(lines) + "\n)" if lines else ")")


class _Snapshot:
    """What ``checkpoint.save`` reads of a session, for a module."""
    optimizer, steps_done = None, 0

    def __init__(self, module):
        self.module = module
        self.parameter_names = [n for n, _ in module.named_parameters()]

    def state_dict(self, include_optimizer=False):
        return self.module.state_dict()


class Sequential(Module):
    """Modules applied in order, named ``0``, ``1``, ... (or by the keys of an OrderedDict)."""

    def __init__(self, *mods):
        super().__init__()
        if len(mods) == 1 and isinstance(mods[0], OrderedDict):
            for n, m in mods[0].items():
                self.add_module(n, m)
        else:
            for i, m in enumerate(mods):
                self.add_module(str(i), m)

    def __getitem__(self, i):
        items = list(self._modules.values())
        return Sequential(*items[i]) if isinstance(i, slice) else items[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())

    def append(self, m):
        self.add_module(str(len(self)), m)
        return self

    def forward(self, x):
        for m in self._modules.values():
            x = m(x)
        return x


class ModuleList(Module):
    """A list of modules named ``0``, ``1``, ..."""

    def __init__(self, mods=()):
        super().__init__()
        for m in mods:
            self.append(m)

    def append(self, m):
        self.add_module(str(len(self._modules)), m)
        return self

    def extend(self, mods):
        for m in mods:
            self.append(m)
        return self

    def __getitem__(self, i):
        items = list(self._modules.values())
        return ModuleList(items[i]) if isinstance(i, slice) else items[i]

    def __len__(self):
        return len(self._modules)

    def __iter__(self):
        return iter(self._modules.values())


class ModuleDict(Module):
    """Modules by name."""

    def __init__(self, mods=None):
        super().__init__()
        for n, m in (mods or {}).items():
            self.add_module(n, m)

    def __getitem__(self, k):
        return self._modules[k]

    def __setitem__(self, k, m):
        self.add_module(k, m)

    def __contains__(self, k):
        return k in self._modules

    def __len__(self):
        return len(self._modules)

    def keys(self):
        return self._modules.keys()

    def items(self):
        return self._modules.items()

    def values(self):
        return self._modules.values()
