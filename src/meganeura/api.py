"""The execution API: ``mg.compile`` builds a Session for one backend.

A Session keeps parameter and state values, checks every feed by name, shape and dtype,
and runs either inference (``run``) or a training step (``step``: forward, backward and the
optimizer update in one go). Backends implement ``Executor``.

Sessions are thread-safe: each call holds the session's lock (shared by sessions made with
``share_with``, which share their values), so one session used from several threads runs
its calls one at a time, and different sessions run side by side. ``close`` (or a ``with``
block) frees the session's device buffers.
"""
from __future__ import annotations

import functools
import threading
import zlib
from collections.abc import MutableMapping

import numpy as np

from .autodiff import grad as _grad
from .graph import Graph, Tensor, cast_exact, fmt_shape, trainable
from .optim import SCALAR_PREFIX, Optimizer

BACKENDS = ("numpy", "gpu", "vulkan", "wgpu")   # "gpu": the Vulkan backend or wgpu, see runtime.backends
# inputs of the "update" phase (``separate_update``): per parameter its gradient, and the scale
GRAD_FEED = SCALAR_PREFIX + "grad."
GRAD_SCALE = "grad_scale"
PRECISIONS = ("strict", "accelerated")


@functools.lru_cache(maxsize=1)
def default_backend() -> str:
    """What ``backend=None`` runs on (``mg.compile``, ``mg.jit``): ``"gpu"`` where one of
    the GPU backends finds a hardware GPU, or ``MEGANEURA_BACKEND`` names one; else
    ``"numpy"``. A software Vulkan device (lavapipe) counts as none: on a CPU the
    interpreter runs small graphs sooner than kernels are compiled for it."""
    import os
    if os.environ.get("MEGANEURA_BACKEND", "").strip():
        return "gpu"
    try:
        from .runtime.backends import gpu_device
        dev = gpu_device()
    except Exception:       # no wgpu, no Vulkan loader or no adapter: nothing to run kernels on
        return "numpy"
    return "numpy" if getattr(dev, "is_software", True) else "gpu"


def default_init(t: Tensor, seed: int) -> np.ndarray:
    """Deterministic per-name initial value: PyTorch's Linear/Conv rule (uniform in
    +-1/sqrt(fan_in)) for rank >= 2, zeros for rank < 2 unless ``init`` says otherwise."""
    init = t.attrs.get("init")
    shape, dt = t.shape, t.dtype.np
    if isinstance(init, np.ndarray):
        return np.asarray(init, dtype=dt, order="C")
    if isinstance(init, (int, float)):
        return np.full(shape, init, dtype=dt)
    rng = np.random.default_rng([seed, zlib.crc32(t.name.encode())])
    if init == "zeros" or (init is None and len(shape) < 2):
        return np.zeros(shape, dt)
    if init == "ones":
        return np.ones(shape, dt)
    if init == "normal":
        return (rng.standard_normal(shape) * 0.02).astype(dt)
    if init is None:
        fan_in = int(np.prod(shape[1:]))
        bound = 1.0 / np.sqrt(max(fan_in, 1))
        return rng.uniform(-bound, bound, shape).astype(dt)
    raise ValueError(f"parameter {t.name!r}: unknown init {init!r}")


def initial_value(t: Tensor, seed: int) -> np.ndarray:
    """A parameter's (``default_init``) or a state's (its ``init``) value before training."""
    if t.op == "parameter":
        return default_init(t, seed)
    init = t.attrs["init"]
    return init.astype(t.dtype.np) if isinstance(init, np.ndarray) else np.full(t.shape, init, t.dtype.np)


def starts_at_zero(t: Tensor) -> bool:
    """``t``'s initial value is all zeros (a fresh device buffer holds it already)."""
    init = t.attrs.get("init")
    if isinstance(init, np.ndarray):
        return False
    if t.op == "parameter":
        return init == "zeros" or (init is None and len(t.shape) < 2) or (isinstance(init, (int, float)) and init == 0)
    return isinstance(init, (int, float)) and init == 0


class _Initial:
    __slots__ = ("tensor", "seed")

    def __init__(self, tensor, seed):
        self.tensor, self.seed = tensor, seed


class Values(MutableMapping):
    """A session's parameter and state values by name. An initial value is made when it is
    first read: weights loaded right after compiling are never drawn at random first, and
    the GPU backend never builds zero-filled optimizer moments on the host (at SmolLM2's
    size those took seconds of every compile)."""

    def __init__(self):
        self._items: dict = {}

    def defer(self, t: Tensor, seed: int):
        """``t``'s initial value, made on first read; nothing changes if a value is set."""
        self._items.setdefault(t.name, _Initial(t, seed))

    def pending(self, name) -> Tensor | None:
        """The tensor whose initial value ``name`` still waits for, else None."""
        v = self._items.get(name)
        return v.tensor if isinstance(v, _Initial) else None

    def spec(self, name):
        """(shape, NumPy dtype) of ``name``'s value without making it, or None."""
        v = self._items.get(name)
        if v is None:
            return None
        return (v.tensor.shape, v.tensor.dtype.np) if isinstance(v, _Initial) else (v.shape, v.dtype)

    def initial(self, name) -> np.ndarray:
        """``name``'s value, made without being kept when it is still the initial one."""
        v = self._items[name]
        return initial_value(v.tensor, v.seed) if isinstance(v, _Initial) else v

    def __getitem__(self, name):
        v = self._items[name]
        if isinstance(v, _Initial):
            v = self._items[name] = initial_value(v.tensor, v.seed)
        return v

    def __setitem__(self, name, value):
        self._items[name] = value

    def __delitem__(self, name):
        del self._items[name]

    def __iter__(self):
        return iter(self._items)

    def __len__(self):
        return len(self._items)

    def __contains__(self, name):
        return name in self._items

    def clear(self):
        self._items.clear()


def check_array(kind, t: Tensor, value) -> np.ndarray:
    """A feed or state value as a contiguous array of ``t``'s dtype, or a clear error."""
    arr = np.asarray(value)
    if arr.shape != t.shape:
        raise ValueError(f"{kind} {t.name!r}: got shape {fmt_shape(arr.shape)}, expected {fmt_shape(t.shape)}")
    if t.dtype.is_float and arr.dtype.kind not in "fiu":
        raise TypeError(f"{kind} {t.name!r}: got dtype {arr.dtype}, expected {t.dtype.name}")
    if not t.dtype.is_float:
        if arr.dtype.kind == "f":
            raise TypeError(f"{kind} {t.name!r}: got float dtype {arr.dtype}, expected integer {t.dtype.name}")
        if arr.dtype.kind not in "iub":
            raise TypeError(f"{kind} {t.name!r}: got dtype {arr.dtype}, expected {t.dtype.name}")
    # int64 ids beyond i32 never wrap, a float64 1e39 never becomes a silent f32 inf
    return cast_exact(arr, t.dtype, f"{kind} {t.name!r}")


def _prefixes(names) -> list:
    """Dotted prefixes (ending in '.') that every name shares, longest first."""
    parts = [n.split(".")[:-1] for n in names]
    common = []
    for seg in zip(*parts) if parts else ():
        if len(set(seg)) != 1:
            break
        common.append(seg[0])
    return [".".join(common[:k]) + "." for k in range(len(common), 0, -1)]


def describe_key_mismatch(missing, unexpected, limit=5) -> str:
    """One message for a state dict whose names do not match: counts, a few names, and
    the prefix to strip or add when the two sides differ only by one."""
    def few(names):
        return ", ".join(repr(n) for n in names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing key(s): {few(missing)}")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected key(s): {few(unexpected)}")
    msg = "; ".join(parts)
    if missing and unexpected:
        for p in _prefixes(unexpected):
            if {n[len(p):] for n in unexpected} >= set(missing):
                return msg + (f". Every unexpected key starts with {p!r}: strip it, e.g. "
                              f"{{k.removeprefix({p!r}): v for k, v in state.items()}}")
        for p in _prefixes(missing):
            if {p + n for n in unexpected} >= set(missing):
                return msg + f". Every expected key starts with {p!r}, the given ones do not: add it"
    return msg


class Program:
    """What a backend compiles: the graph and, per phase, what is fetched and updated.

    Phases: "run" (inference; applies ``state_updates`` such as a KV cache), "grads"
    (forward + backward), "step" (forward + backward + optimizer update), "micro"
    (a gradient-accumulation step that only adds into the accumulators) and "update"
    (the optimizer update alone, from gradients fed as inputs: data-parallel training)."""

    def __init__(self, graph: Graph, fetches: list[Tensor], grads: dict, updates: dict):
        from .reference import needed_nodes
        self.graph = graph
        self.fetches = fetches          # tensors read back, in order
        self.grads = grads              # {parameter name: gradient tensor}
        self.updates = updates          # {phase: {state/parameter tensor: new value tensor}}
        targets = fetches + list(grads.values()) + [v for u in updates.values() for v in u.values()]
        self.used = {t.id for t in needed_nodes(targets)} if targets else set()
        # every parameter and state, except optimizer state that this program does not
        # touch (another compile of the same graph with another optimizer added it)
        updated = {t.id for u in updates.values() for t in u}
        self.kept = list(graph.parameters.values()) + [
            t for t in graph.states.values()
            if not t.attrs.get("optimizer_state") or t.id in self.used or t.id in updated]

    def cached_phase(self, phase):
        """What a phase compiles from without tensors (``CachedProgram``); None: nothing."""
        return None

    def targets(self, phase):
        """(fetches, gradient names, [(kept name, new value)], every tensor to compute in
        that order) for ``phase``."""
        # only "grads" keeps its gradients: a step's die in its own update, so they are
        # intermediates the memory planner may place over dead activations
        grad_names = list(self.grads) if phase == "grads" else []
        fetches = [] if phase == "update" else self.fetches     # no forward pass in an update
        upd = [(t.name, v) for t, v in self.updates.get(phase, {}).items()]
        return fetches, grad_names, upd, fetches + [self.grads[n] for n in grad_names] + [v for _, v in upd]


def _build_program(graph, fetches, loss, optimizer, accumulate, separate_update, updates) -> "Program":
    """The session's Program: gradients of ``loss`` by autodiff, the optimizer's update and
    the graph's own state updates added to ``updates`` ({phase: {tensor: new value}})."""
    updates = {ph: dict(u) for ph, u in updates.items()}
    grads = {}
    if loss is not None:
        # frozen parameters (requires_grad=False) and those the optimizer's params leave
        # out get no gradient kernels and no optimizer state
        params = [p for p in graph.parameters.values()
                  if trainable(p) and (not isinstance(optimizer, Optimizer) or optimizer.trains(p))]
        gs = _grad(loss, params) if params else []
        grads = {p.name: gr for p, gr in zip(params, gs)}
        if optimizer is not None:
            if not isinstance(optimizer, Optimizer):
                raise TypeError(f"optimizer must be an mg.optim optimizer, got {type(optimizer).__name__}")
            if accumulate > 1:
                # accumulators hold the running sum; the k-th micro-step updates with the mean
                accs = [graph.states.get(f"{p.name}.grad_accum") or graph.state(f"{p.name}.grad_accum", p.shape)
                        for p in params]
                for a in accs:
                    a.attrs["optimizer_state"] = True
                updates["micro"] = {a: a + g_ for a, g_ in zip(accs, gs)}
                mean = [(a + g_) * (1.0 / accumulate) for a, g_ in zip(accs, gs)]
                updates["step"] = optimizer.build(params, mean)
                updates["step"].update({a: a * 0.0 for a in accs})
            else:
                updates["step"] = optimizer.build(params, gs)
            if separate_update:
                # the "update" phase: gradients summed elsewhere (other processes) come in
                # as inputs and are scaled by a fed scalar (1 / number of gradients summed)
                scale = optimizer.scalar(graph, GRAD_SCALE)
                fed = [graph.inputs.get(GRAD_FEED + p.name) or graph.input(GRAD_FEED + p.name, p.shape, p.dtype)
                       for p in params]
                updates["update"] = optimizer.build(params, [f * scale for f in fed])
                if accumulate > 1:
                    updates["update"].update({a: a * 0.0 for a in accs})
            # what the training forward maintains (graph.update: batch norm's running
            # statistics) moves with every forward of a step, as in torch's train mode
            for phase in ("micro", "step"):
                if phase in updates:
                    clash = [t.name for t in graph.updates if t in updates[phase]]
                    if clash:
                        raise ValueError(f"graph.update and the optimizer both update {clash}")
                    updates[phase].update(graph.updates)
            if separate_update and graph.updates and "grads" not in updates:
                # a data-parallel step runs its forward and backward as "grads": that
                # forward maintains them as well (each rank from its own batch)
                updates["grads"] = dict(graph.updates)
    return Program(graph, fetches, grads, updates)


class CachedProgram(Program):
    """A training session's Program stood up from its manifest (``plan_cache.note_phase``)
    without differentiating: the optimizer's state and scalar inputs are added to the graph
    under the names the optimizer gives them, and each phase the manifest names is compiled by
    loading its plan by key (``cached_phase``). ``targets``, a phase the manifest does not
    name, or a plan gone from the cache build the real Program (``materialize``), which finds
    that state and those inputs by name and reuses them."""

    def __init__(self, graph: Graph, fetches: list[Tensor], manifest: dict, build):
        from .graph import DTYPES
        from .reference import needed_nodes
        self.graph, self.fetches, self._build, self._real = graph, fetches, build, None
        self.plan_keys = dict(manifest["phases"])
        for name, shape, dtype in manifest["states"]:
            if name not in graph.states:
                graph.state(name, shape, DTYPES[dtype], init=0.0).attrs["optimizer_state"] = True
        for name in manifest["scalars"]:
            if name not in graph.inputs:
                graph.input(name, ())
        self.grads = dict.fromkeys(manifest["grads"])           # names; tensors once materialised
        kept = {**graph.parameters, **graph.states}
        self.kept = [kept[n] for n in manifest["kept"]]
        self.updates = {ph: dict.fromkeys(kept[n] for n in names) for ph, names in manifest["updates"].items()}
        self.used = {t.id for t in needed_nodes(fetches + list(graph.updates.values()))} | \
            {graph.inputs[n].id for n in manifest["scalars"]}

    def cached_phase(self, phase):
        """(fetches, gradient names, [(kept name, None)], plan key) of a phase the manifest
        names (its plan is loaded by key, no tensors needed), or None."""
        if self._real is not None or phase not in self.plan_keys:
            return None
        grad_names = list(self.grads) if phase == "grads" else []
        return self.fetches, grad_names, [(t.name, None) for t in self.updates.get(phase, {})], self.plan_keys[phase]

    def targets(self, phase):
        return self.materialize().targets(phase)

    def materialize(self) -> Program:
        """The real Program (autodiff and the optimizer's update), built once."""
        if self._real is None:
            self._real = self._build()
            self.grads, self.updates, self.used = self._real.grads, self._real.updates, self.used | self._real.used
        return self._real


def _from_manifest(graph, fetches, optimizer, backend, precision, plan_cache, build):
    """(manifest key, ``CachedProgram`` or None) of a training session (``fetches`` end with
    its loss): no key where the plan cache is off, on a checked device or for an optimizer
    the key cannot cover (``plan_cache.session_key``)."""
    from . import plan_cache as pc
    from .compiler import CompileOptions
    from .runtime.backends import get_runtime_device, resolve
    dev = get_runtime_device(resolve(backend))
    if not isinstance(optimizer, Optimizer) or not pc.enabled(plan_cache) or getattr(dev, "checked", False):
        return None, None
    if optimizer._groups is not None:       # which parameters train is not in the key
        return None, None
    # what the session keeps beside optimizer state: every parameter and state
    kept = list(graph.parameters.values()) + [t for t in graph.states.values() if not t.attrs.get("optimizer_state")]
    run_as = precision if precision == "strict" or dev.has_f16 else "strict"     # as the executor runs it
    from .autodiff import checkpointed_regions
    key = pc.session_key(fetches + list(graph.updates.values()), kept, optimizer,
                         CompileOptions.from_env(run_as, dev.limits), dev.adapter_info, [t.name for t in graph.updates],
                         checkpointed_regions(graph))
    manifest = pc.load_manifest(key) if key else None
    if manifest is None:
        return key, None
    try:
        return key, CachedProgram(graph, fetches, manifest, build)
    except KeyError:         # a name the manifest lists is not in this graph
        return key, None


def _locked(method):
    """Run a Session method under the session's lock, refusing a closed session."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            if self.closed:
                raise RuntimeError(f"{method.__name__}: this session is closed")
            return method(self, *args, **kwargs)
    return wrapper


class Session:
    """A compiled graph on one backend. See ``mg.compile``."""

    def __init__(self, graph, outputs, loss, optimizer, backend, precision, seed, accumulate=1, state_updates=None,
                 share_with=None, detect_anomaly=None, separate_update=False, plan_cache=None):
        if backend not in BACKENDS:
            raise ValueError(f"unknown backend {backend!r}; choose one of {BACKENDS}")
        if precision not in PRECISIONS:
            raise ValueError(f"unknown precision {precision!r}; choose one of {PRECISIONS}")
        if int(accumulate) < 1:
            raise ValueError(f"accumulate must be >= 1, got {accumulate}")
        self.graph, self.backend, self.precision, self.seed = graph, backend, precision, seed
        self.outputs = list(outputs or [])
        self.loss, self.optimizer, self.steps_done = loss, optimizer, 0
        self.accumulate, self.micro_done = int(accumulate), 0
        for t in self.outputs + ([loss] if loss is not None else []):
            if not isinstance(t, Tensor) or t.graph is not graph:
                raise ValueError(f"{t!r} is not a tensor of this graph")
        updates = {"run": {}}
        for st, v in (state_updates or {}).items():
            if st.op != "state" or st.graph is not graph:
                raise ValueError(f"state_updates: {st!r} is not a state tensor of this graph (g.state)")
            if v.shape != st.shape or v.dtype is not st.dtype:
                raise ValueError(f"state_updates: new value of {st.name!r} has shape {fmt_shape(v.shape)} "
                                 f"{v.dtype.name}, expected {fmt_shape(st.shape)} {st.dtype.name}")
            updates["run"][st] = v
        fetches = self.outputs + ([loss] if loss is not None else [])

        def build():
            return _build_program(graph, fetches, loss, optimizer, self.accumulate, separate_update, updates)
        # a training session compiled before (this process or an earlier one) stands up from
        # its manifest without differentiating
        self.session_key, program = None, None
        if loss is not None and optimizer is not None and self.accumulate == 1 and not separate_update \
                and not updates["run"] and share_with is None and backend != "numpy":
            self.session_key, program = _from_manifest(graph, fetches, optimizer, backend, precision, plan_cache, build)
        self.program = program or build()
        used = self.program.used
        # the names this session keeps, fixed now: later compiles may add states to the graph
        self.parameter_names = list(graph.parameters)
        self.state_names = [t.name for t in self.program.kept if t.op == "state"]
        # every input the program reads must be fed; inputs it never reads may be omitted
        self.feeds = {n: t for n, t in graph.inputs.items() if not n.startswith(SCALAR_PREFIX)}
        self.required = {n for n, t in self.feeds.items() if t.id in used}
        self.closed = False
        self._lock = share_with._lock if share_with is not None else threading.RLock()
        self._users = share_with._users if share_with is not None else [0]   # open sessions sharing values
        if backend != "numpy":
            # before any host or device memory is allocated for them
            from .runtime.backends import get_runtime_device, resolve
            from .runtime.executor import check_device_limits
            check_device_limits([t for t in graph.nodes if t.id in used] + self.program.kept,
                                get_runtime_device(resolve(backend)))
        shared = None
        if share_with is not None:
            # one copy of parameters and state (by name) serves both sessions
            if share_with.closed:
                raise RuntimeError("share_with: that session is closed")
            if share_with.backend != backend:
                raise ValueError(f"share_with: backends differ ({share_with.backend} vs {backend})")
            for t in self.program.kept:
                other = share_with.values.spec(t.name)
                if other is not None and other != (t.shape, t.dtype.np):
                    raise ValueError(f"share_with: {t.name!r} is {fmt_shape(other[0])} {other[1]} in the "
                                     f"other session, {fmt_shape(t.shape)} {t.dtype.name} here")
            self.values = share_with.values
            shared = share_with.executor
        else:
            self.values = Values()
        for t in self.program.kept:
            self.values.defer(t, seed)
        if backend == "numpy":
            from .reference import NumpyExecutor
            self.executor = NumpyExecutor(self.program, self.values)
        else:
            from .runtime.executor import GpuExecutor
            self.executor = GpuExecutor(self.program, self.values, precision=precision, share_with=shared,
                                        detect_anomaly=detect_anomaly, backend=backend, plan_cache=plan_cache,
                                        session_key=self.session_key)
        self._users[0] += 1

    # ------------------------------------------------------------------- lifetime
    def close(self):
        """Free the device buffers (parameters and state too, once no session made with
        ``share_with`` still uses them). Later calls raise; closing twice is harmless."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self._users[0] -= 1
            last = self._users[0] == 0
            close = getattr(self.executor, "close", None)
            if close is not None:
                close(free_shared=last)
            if last:
                self.values.clear()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ----------------------------------------------------------------- state in/out
    @_locked
    def load_state_dict(self, state: dict, strict: bool = True):
        """Load parameters (and optimizer state) by name; values may be arrays or torch
        tensors. As torch: ``strict`` requires the names to match exactly; with
        ``strict=False`` unknown names are skipped and missing ones keep their values.
        Shapes must match either way. Every problem is reported at once, and a prefix that
        every unknown name carries (or lacks) is named. Returns (missing_keys, unexpected_keys)."""
        from .nn.module import IncompatibleKeys, check_state_mapping, to_numpy
        check_state_mapping("Session.load_state_dict", state)
        kept = {t.name: t for t in self.program.kept}
        problems, arrays = [], {}
        unexpected = [n for n in state if n not in kept]
        missing = [n for n in self.graph.parameters if n not in state]
        for name, value in state.items():
            if name not in kept:
                continue
            try:
                arrays[name] = check_array("state", kept[name], to_numpy(value))
            except (ValueError, TypeError) as e:
                problems.append(str(e))
        if strict and (missing or unexpected):
            problems.append(describe_key_mismatch(missing, unexpected))
        if problems:
            raise ValueError("load_state_dict: " + "; ".join(problems))
        self.assign(arrays)
        return IncompatibleKeys(missing, unexpected)

    @_locked
    def assign(self, arrays: dict):
        """Store already validated arrays, by name, on the host and the device."""
        for name, arr in arrays.items():
            self.values[name] = arr
            self.executor.set_value(name, arr)

    @_locked
    def state_dict(self, include_optimizer: bool = False) -> dict:
        """Parameters (and, with ``include_optimizer``, every state this session keeps)."""
        names = self.parameter_names + (self.state_names if include_optimizer else [])
        return {n: self.executor.get_value(n).copy() for n in names}

    @_locked
    def save(self, path, include_optimizer=True):
        """Write a safetensors checkpoint (atomic). See meganeura.checkpoint."""
        from .checkpoint import save
        return save(self, path, include_optimizer)

    @_locked
    def load(self, path, strict=True):
        """Load a checkpoint written by ``save`` (or any safetensors file of parameters)."""
        from .checkpoint import load
        return load(self, path, strict)

    @_locked
    def export_web(self, out_dir, demo: dict | None = None) -> str:
        """Write this session's inference plan (WGSL kernels, dispatch list, buffer plan as
        plan.json), its weights (safetensors), a dependency-free JavaScript runtime that runs
        them with WebGPU (``meganeura.js``) and a demo page (``index.html``) into ``out_dir``.
        Serve the folder over http(s) and open it. See ``meganeura.export.web``."""
        from .export import export_web
        return export_web(self, out_dir, demo)

    def memory_report(self) -> str:
        """Device bytes of the compiled plans, with and without intermediate aliasing."""
        plans = getattr(self.executor, "plans", {})
        if not plans:
            return "no GPU plan compiled yet (run or step once)"
        from .autodiff import checkpointed_regions
        regions = len(checkpointed_regions(self.graph))
        note = f"; {regions} checkpointed region(s) recomputed in the backward pass" if regions and self.loss is not None \
            else ""
        return "\n".join(f"{key}: {p.memory.report()}, {p.n_dispatches} dispatches{note}" for key, p in plans.items())

    @_locked
    def profile(self, feeds: dict, path=None, phase=None):
        """GPU time per kernel for one run (or training step, without the update) as rows
        (name, total_us, count, mean_us, percent); writes a Chrome/Perfetto trace to ``path``."""
        if self.backend == "numpy":
            raise RuntimeError("profile: only the GPU backends have GPU timestamps")
        phase = phase or ("grads" if self.loss is not None and self.optimizer is not None else "run")
        return self.executor.profile(self._feeds(feeds), phase, path)

    @_locked
    def grads(self) -> dict:
        """Gradients of the loss from the last ``compute_grads``, by parameter name (``step``
        applies its gradients without keeping them)."""
        if self.loss is None:
            raise RuntimeError("grads: this session was compiled without a loss")
        return self.executor.last_grads()

    # --------------------------------------------------------------------- running
    def _feeds(self, feeds: dict, extra=None) -> dict:
        if not isinstance(feeds, dict):
            raise TypeError(f"feeds must be a dict of input name -> array, got {type(feeds).__name__}")
        unknown = [n for n in feeds if n not in self.feeds]
        if unknown:
            raise KeyError(f"unknown input(s) {unknown}; this graph's inputs are {sorted(self.feeds)}")
        missing = [n for n in self.feeds if n not in feeds and n in self.required]
        if missing:
            raise KeyError(f"missing feed(s) {missing}: every input must be fed "
                           + ", ".join(f"{n} {fmt_shape(self.feeds[n].shape)} {self.feeds[n].dtype.name}" for n in missing))
        out = {n: check_array("input", self.feeds[n], v) for n, v in feeds.items()}
        for n, v in (extra or {}).items():
            out[n] = np.asarray(v, dtype=self.graph.inputs[n].dtype.np)
        return out

    @_locked
    def run(self, feeds: dict, fetch: bool = True) -> list[np.ndarray] | None:
        """Inference: evaluate the outputs (and the loss, if any) without updating.
        ``fetch=False`` leaves them on the device (the call returns when they are ready;
        ``read_outputs()`` reads them): a model whose outputs feed the next call, or whose
        caller needs one row of a large output, skips the readback."""
        return self.executor.execute(self._feeds(feeds), "run", fetch=fetch)

    @_locked
    def read_outputs(self) -> list[np.ndarray]:
        """The outputs of the last call, read back from the device."""
        return self.executor.read_outputs()

    @_locked
    def compute_grads(self, feeds: dict) -> float:
        """Forward + backward without an update; returns the loss, keeps the gradients."""
        if self.loss is None:
            raise RuntimeError("compute_grads: this session was compiled without a loss")
        outs = self.executor.execute(self._feeds(feeds), "grads")
        return float(outs[-1])

    @_locked
    def step(self, feeds: dict) -> float:
        """One training step: forward, loss, backward and the optimizer update."""
        if self.loss is None or self.optimizer is None:
            raise RuntimeError("step: compile with loss= and optimizer= to train")
        # counters move only once the step has run: a failed call leaves them as they were
        if self.micro_done + 1 < self.accumulate:
            loss = float(self.executor.execute(self._feeds(feeds), "micro")[-1])
            self.micro_done += 1
            return loss
        scal = self.optimizer.scalars(self.steps_done + 1)
        scal = {k: v for k, v in scal.items() if k in self.graph.inputs}
        outs = self.executor.execute(self._feeds(feeds, scal), "step")
        self.micro_done = 0
        self.steps_done += 1
        return float(outs[-1])


def compile(graph: Graph, outputs=None, loss=None, optimizer=None, backend=None,
            precision="strict", seed=0, accumulate=1, state_updates=None, share_with=None,
            eager=True, detect_anomaly=None, plan_cache=None) -> Session:
    """Compile ``graph`` for inference (``outputs``) or training (``loss`` + ``optimizer``).

    backend: "numpy" (the reference interpreter) or "gpu" (the direct Vulkan backend or wgpu:
    ``MEGANEURA_BACKEND=vulkan|wgpu`` chooses; see ``meganeura.runtime.backends``); "vulkan"
    or "wgpu" ask for one of them; None: ``default_backend()`` ("gpu" on a hardware GPU).
    precision: "strict" (f32 everywhere) or "accelerated" (f16 operands for forward matmuls).
    accumulate: optimizer update every ``accumulate`` calls of ``step`` with the mean gradient.
    state_updates: {state tensor: new value} applied by every ``run`` (e.g. a KV cache).
    The graph's own ``graph.update`` records (batch norm's running statistics in training
    mode) are applied by every ``step``, beside the optimizer's updates; pass
    ``state_updates=graph.updates`` to apply them on ``run`` too.
    share_with: another Session whose parameters and state (same names) this one uses
    instead of its own copy (e.g. prefill and decode programs of one model).
    eager: on the gpu backend, compile the program of the main call (``step`` with an
    optimizer, else ``run``; ``compute_grads`` otherwise) now, pipelines included, so that
    timing ``compile`` times the compilation; other calls compile on first use.
    plan_cache: on the gpu backend, read and write compiled plans in the user cache folder
    (``meganeura.plan_cache``): a graph compiled before, in this process or an earlier one,
    skips the compiler passes. None: on unless ``MEGANEURA_NO_DISK_CACHE=1`` or
    ``MEGANEURA_NO_PLAN_CACHE=1``.
    detect_anomaly: on the gpu backend, check every kernel's output for NaN and Inf after
    it runs and raise FloatingPointError naming the first kernel that produced one (its
    trace name, e.g. ``matmul+add``) and the value it wrote; one submit and one readback
    per dispatch, so slow: for debugging. None reads ``MEGANEURA_DETECT_ANOMALY=1``.
    """
    if outputs is None and loss is None:
        raise ValueError("compile: give outputs= (inference) and/or loss= (training)")
    backend = default_backend() if backend is None else backend
    if isinstance(outputs, Tensor):
        outputs = [outputs]
    from .compiler import gc_paused
    with gc_paused():
        s = Session(graph, outputs, loss, optimizer, backend, precision, seed, accumulate, state_updates, share_with,
                    detect_anomaly, plan_cache=plan_cache)
        if eager and backend != "numpy":
            s.executor.plan("step" if optimizer is not None and loss is not None else "run" if outputs else "grads")
    return s
