"""``mg.jit``: call a Python function or ``mg.nn`` module on NumPy arrays.

Graphs are static: every shape is fixed when a graph is built. ``jit`` traces the function
into a new graph the first time it sees an input signature (shapes, dtypes, the values of
non-array arguments and the train/eval mode of the modules it calls), compiles it, and
keeps one Session per signature. All of them share one copy of the parameters and the
optimizer state, by name (``mg.compile(share_with=)``), so training at batch 32 and then
evaluating a last batch of 7 use the same weights: a new batch size or sequence length is
a cache hit or one more compile, never a rewrite.

    model = nn.Sequential(nn.Linear(64, 32), nn.ReLU(), nn.Linear(32, 10))
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=mg.optim.AdamW(lr=1e-3))
    predict = mg.jit(model, share_with=step)
    loss = step(xb, yb)                # forward, backward and update; returns the loss
    logits = predict(x_test)           # any batch size

With ``optimizer=`` the function must return a scalar loss and each call is a training
step; without, each call is inference and returns arrays in the function's structure.
In training mode, batch norm's running statistics are updated (and its
``num_batches_tracked`` counted) and dropout masks are drawn fresh (on the host, from
``seed``) on every call.

The weights live in the sessions while they train, and the modules read them from there:
after training, ``model.state_dict()``, ``model.save(path)`` and ``p.data`` give the trained
values (read back when first asked for after a step), and assigning or loading values into
the module puts them into the sessions too. ``backend=None`` (the default) is
``mg.api.default_backend()``: ``"gpu"`` where a hardware GPU runs one of the GPU backends,
else the NumPy interpreter.
"""
from __future__ import annotations

import inspect

import numpy as np

from .api import check_array, compile as _compile, default_backend
from .graph import Graph, Tensor, dtype_of
from .nn import module as _nnm
from .optim import Optimizer


def _flatten(out):
    """(list of tensors, rebuild function) for a Tensor or a tuple/list/dict of them."""
    if isinstance(out, Tensor):
        return [out], lambda vals: vals[0]
    if out is None:
        return [], lambda vals: None
    if isinstance(out, (tuple, list)):
        parts = [_flatten(o) for o in out]

        def rebuild(vals):
            res, k = [], 0
            for ts, fn in parts:
                res.append(fn(vals[k:k + len(ts)]))
                k += len(ts)
            return type(out)(res)
        return [t for ts, _ in parts for t in ts], rebuild
    if isinstance(out, dict):
        keys = list(out)
        ts, fn = _flatten([out[k] for k in keys])
        return ts, lambda vals: dict(zip(keys, fn(vals)))
    raise TypeError(f"jit: the function must return Tensors (or tuples, lists, dicts of them), got {type(out).__name__}")


def _modes(mods) -> tuple:
    """What else selects a program: each module's train/eval mode, which of its parameters
    are frozen (a frozen one has no gradient kernels), its own ``trace_variant`` (a merged
    LoRA layer) and whether its activations are checkpointed."""
    return tuple((m.training, tuple(p.requires_grad for p in m._parameters.values() if p is not None),
                  getattr(m, "trace_variant", None), m.activation_checkpointing) for m in mods)


class _Live:
    """The sessions of jit functions sharing weights, as the modules they trace see them:
    ``version`` moves with every call that changes values, so a module reads a value back
    only when asked for it after a step (``Parameter.link``)."""

    def __init__(self):
        self.version, self.sessions = 0, []

    def _keeper(self, name):
        for s in self.sessions:
            if not s.closed and any(t.name == name for t in s.program.kept):
                return s
        return None

    def read(self, name):
        s = self._keeper(name)
        return None if s is None else np.array(s.executor.get_value(name))

    def write(self, name, value):
        s = self._keeper(name)
        if s is not None:          # shared sessions hold one copy: setting it once sets it for all
            t = next(t for t in s.program.kept if t.name == name)
            s.assign({name: check_array("parameter", t, value)})


class Jit:
    """See the module docstring. ``sessions``: {signature: Session}, one compiled program each."""

    def __init__(self, fn, optimizer=None, backend=None, precision="strict", seed=0, share_with=None):
        if not callable(fn):
            raise TypeError(f"jit: expected a function or an mg.nn.Module, got {type(fn).__name__}")
        if optimizer is not None and not isinstance(optimizer, Optimizer):
            raise TypeError(f"jit: optimizer must be an mg.optim optimizer, got {type(optimizer).__name__}")
        if share_with is not None and not isinstance(share_with, Jit):
            raise TypeError(f"jit: share_with must be another mg.jit function, got {type(share_with).__name__}")
        backend = default_backend() if backend is None else backend
        self.fn, self.optimizer, self.backend, self.precision, self.seed = fn, optimizer, backend, precision, seed
        target = fn.forward if isinstance(fn, _nnm.Module) else fn
        try:
            params = list(inspect.signature(target).parameters.values())
        except (TypeError, ValueError):
            params = []
        self.arg_names = [p.name for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        self.sessions: dict = {}
        self._entries: dict = {}                     # signature -> [(modules, their modes, Session, ...)]
        # one anchor session and one step counter for every jit sharing weights
        self._shared = share_with._shared if share_with is not None else \
            {"anchor": None, "steps": 0, "buffers": {}, "live": _Live()}
        if share_with is not None and share_with.backend != backend:
            raise ValueError(f"jit: share_with runs on {share_with.backend!r}, this one on {backend!r}")
        self._rng = np.random.default_rng(seed)

    # ------------------------------------------------------------------ signature
    def _split(self, args, kwargs):
        """(arrays by input name, hashable signature)."""
        arrays, key = {}, []
        for i, a in enumerate(list(args) + list(kwargs.items())):
            name, v = (a if i >= len(args) else
                       (self.arg_names[i] if i < len(self.arg_names) else f"arg{i}", a))
            if isinstance(v, np.ndarray) or hasattr(v, "__array__") and not isinstance(v, (int, float, bool, str)):
                arr = np.asarray(v.detach().cpu().numpy() if hasattr(v, "detach") else v)
                dt = dtype_of(arr.dtype)
                arrays[name] = np.ascontiguousarray(arr, dtype=dt.np)
                key.append((name, "array", arr.shape, dt.name))
            else:
                try:
                    hash(v)
                except TypeError:
                    raise TypeError(f"jit: argument {name!r} is neither an array nor hashable ({type(v).__name__}); "
                                    "pass arrays, or numbers/strings that select a variant") from None
                key.append((name, "static", v))
        return arrays, tuple(key)

    def _lookup(self, key):
        for mods, modes, sess, rebuild in self._entries.get(key, ()):
            if _modes(mods) == modes:
                return sess, rebuild
        return None

    def _trace(self, args, kwargs, arrays, key):
        g = Graph()
        feeds = {n: g.input(n, a.shape, dtype_of(a.dtype)) for n, a in arrays.items()}
        call_args = [feeds.get(self.arg_names[i] if i < len(self.arg_names) else f"arg{i}", a)
                     for i, a in enumerate(args)]
        call_kwargs = {k: feeds.get(k, v) for k, v in kwargs.items()}
        seen: list = []
        _nnm._CALLED.append(seen)
        try:
            out = self.fn(*call_args, **call_kwargs)
        finally:
            _nnm._CALLED.remove(seen)
        mods = list({id(m): m for m in seen}.values())
        live = self._shared["live"]
        for m in mods:          # module buffers by state-dict name: graph state, or (integers) the module's own
            for n, b in m._buffers.items():
                if b is not None and n not in m._non_persistent:
                    self._shared["buffers"][m._prefix + n] = (m, n)
                    m.link_buffer(n, live, m._prefix + n)
            for n, p in m._parameters.items():
                if p is not None:
                    p.link(live, m._prefix + n)
        updates = _nnm.state_updates(g)
        anchor = self._shared["anchor"]
        common = dict(backend=self.backend, precision=self.precision, seed=self.seed, share_with=anchor)
        if self.optimizer is not None:
            if not isinstance(out, Tensor) or out.shape != ():
                raise TypeError("jit: with optimizer=, the function must return the scalar loss Tensor, got "
                                + (f"{out.name!r} of shape {out.shape}" if isinstance(out, Tensor) else type(out).__name__))
            sess = _compile(g, loss=out, optimizer=self.optimizer, **common)    # steps apply `updates` themselves
            rebuild = None
        else:
            outs, rebuild = _flatten(out)
            if not outs:
                raise TypeError("jit: the function returned no Tensor")
            sess = _compile(g, outputs=outs, state_updates=updates or None, **common)
        if anchor is None:
            self._shared["anchor"] = sess
        live.sessions.append(sess)
        self.sessions[key] = sess
        self._entries.setdefault(key, []).append((mods, _modes(mods), sess, rebuild))
        return sess, rebuild

    # ------------------------------------------------------------------------ call
    def __call__(self, *args, **kwargs):
        arrays, key = self._split(args, kwargs)
        found = self._lookup(key) or self._trace(args, kwargs, arrays, key)
        sess, rebuild = found
        feeds = {**arrays, **_nnm.random_feeds(sess.graph, self._rng)}
        feeds = {n: v for n, v in feeds.items() if n in sess.feeds}
        if self.optimizer is None:
            out = rebuild(sess.run(feeds))
            if sess.program.updates.get("run"):
                self._shared["live"].version += 1
        else:
            sess.steps_done = self._shared["steps"]  # Adam's bias correction counts every signature's steps
            try:
                out = sess.step(feeds)
            finally:
                self._shared["live"].version += 1
            self._shared["steps"] = sess.steps_done
        return out

    # ---------------------------------------------------------------------- state
    @property
    def steps_done(self) -> int:
        return self._shared["steps"]

    def state_dict(self, include_optimizer=False) -> dict:
        """Current parameters and module buffers (torch's state-dict names), plus the
        optimizer state when ``include_optimizer``."""
        anchor = self._shared["anchor"]
        if anchor is None:
            if isinstance(self.fn, _nnm.Module):
                return self.fn.state_dict()
            raise RuntimeError("state_dict: call the function once first (nothing is traced yet)")
        buffers = self._shared["buffers"]
        states = {n for s in self._all_sessions() for n in s.graph.states}
        out = {n: anchor.executor.get_value(n).copy()
               for n in dict.fromkeys(n for s in self._all_sessions() for n in s.graph.parameters)}
        for n, (m, attr) in buffers.items():
            b = m._buffers[attr]     # a graph state keeps torch's dtype here (int64 counters)
            out[n] = anchor.executor.get_value(n).astype(b.dtype) if n in states else b.copy()
        if include_optimizer:
            out.update({n: anchor.executor.get_value(n).copy() for n in sorted(states) if n not in out})
        return out

    def _all_sessions(self):
        return [e[2] for es in self._entries.values() for e in es]

    def load_state_dict(self, state: dict, strict=True):
        """Load values by name into the shared store (and the module, if one is wrapped)."""
        _nnm.check_state_mapping("Jit.load_state_dict", state)
        res = None
        if isinstance(self.fn, _nnm.Module):
            res = self.fn.load_state_dict(state, strict)
        vals = {k: _nnm.to_numpy(v) for k, v in state.items()}
        for s in self._all_sessions():
            kept = {t.name for t in s.program.kept}
            sess_res = s.load_state_dict({k: v for k, v in vals.items() if k in kept}, strict=False)
            res = res or sess_res
        self._shared["live"].version += 1
        return res

    def save(self, path, include_optimizer=True):
        """Write the current parameters and buffers (and the optimizer state and step count)
        to a safetensors checkpoint (``meganeura.checkpoint``), as ``Session.save``."""
        from . import checkpoint
        return checkpoint.save(_JitSnapshot(self), path, include_optimizer)

    def load(self, path, strict=True):
        """Load a checkpoint written by ``save`` (or a module's, or any safetensors file of
        parameters by name); optimizer state in it sets the step count too."""
        from . import checkpoint
        state = self.state_dict(include_optimizer=True)
        tensors, meta = checkpoint.read(path)
        params = set(self.state_dict())
        if strict:
            missing = sorted(params - set(tensors))
            unexpected = sorted(set(tensors) - set(state))
            if missing or unexpected:
                from .api import describe_key_mismatch
                raise checkpoint.CheckpointError(f"cannot load {path!r}: " + describe_key_mismatch(missing, unexpected))
        res = self.load_state_dict({k: v for k, v in tensors.items() if k in state}, strict=False)
        if self.optimizer is not None and any(k in state and k not in params for k in tensors):
            self._shared["steps"] = checkpoint._count(path, meta, "step", 0)
        return res

    def write_back(self, module=None):
        """Copy the current values into ``module`` (default: the wrapped one). The modules
        a jit function traces read their trained values by themselves; this is for another
        module of the same names."""
        module = module if module is not None else self.fn
        if not isinstance(module, _nnm.Module):
            raise TypeError("write_back: give the mg.nn.Module to update")
        mine = module.state_dict()
        module.load_state_dict({k: v for k, v in self.state_dict(include_optimizer=True).items() if k in mine},
                               strict=False)
        return module


class _JitSnapshot:
    """What ``checkpoint.save`` reads of a session, for a jit function."""

    def __init__(self, j):
        self.j, self.optimizer, self.steps_done = j, j.optimizer, j.steps_done
        self.parameter_names = list(dict.fromkeys(n for s in j._all_sessions() for n in s.graph.parameters)) \
            if j._shared["anchor"] is not None else list(j.state_dict())

    def state_dict(self, include_optimizer=False):
        return self.j.state_dict(include_optimizer)


def jit(fn=None, *, optimizer=None, backend=None, precision="strict", seed=0, share_with=None):
    """Wrap ``fn`` (a function of Tensors, or an mg.nn.Module) so it runs on arrays, with
    one compiled program per input signature; usable as ``@mg.jit`` or ``@mg.jit(backend=...)``.
    ``backend=None``: ``mg.api.default_backend()``."""
    if fn is None:
        return lambda f: Jit(f, optimizer, backend, precision, seed, share_with)
    return Jit(fn, optimizer, backend, precision, seed, share_with)
