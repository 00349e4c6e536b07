"""The on-disk cache of compiled plans: a process that compiles a graph it (or an earlier
process) compiled before loads the ``KernelPlan`` instead of running the passes again.

An entry is keyed by a SHA-256 of everything the plan depends on: the graph (every node the
targets need: op, inputs, shape, dtype, attributes, constants' values, the names of inputs,
parameters and state), the targets and updates, the compile options (precision, binding and
workgroup-memory limits, switched-off passes), the adapter (name, driver, backend), the
``MEGANEURA_*`` switches the code generators read, and the package: its version and the size
and modification time of its source files, so an edited compiler never reads old plans.

Entries live in ``cache_dir()/plans`` (the user cache folder, ``MEGANEURA_CACHE_DIR``), are
written atomically, and hold their key: a corrupt, truncated or foreign entry is ignored and
rewritten, never an error. ``MEGANEURA_NO_DISK_CACHE=1`` (every disk cache) or
``MEGANEURA_NO_PLAN_CACHE=1`` (this one), or ``mg.compile(..., plan_cache=False)``, turn it off.

An entry is a pickle of the plan with each kernel reduced to what the runtime reads once the
WGSL is rendered (name, archetype, output view, merged parts); the kernel IR itself is not
kept. Like any pickle it is trusted: it is read only from the user's own cache folder.

A training session also leaves a manifest (``session_key``, ``load_manifest``, ``note_phase``),
keyed before differentiation: the forward graph (outputs, loss, the graph's own state updates),
the parameters, the optimizer and its hyperparameters, the precision, the adapter and the
package. It names each compiled phase's plan key and what the backward pass and the optimizer
add to the graph (optimizer state, per-step scalars, the kept tensors, the updates). A session
that finds it builds no backward graph and no optimizer update: it loads the phases' plans by
key, and differentiates only if a phase is missing (see ``api.CachedProgram``).
"""
from __future__ import annotations

import hashlib
import os
import pathlib
import pickle
import time
import weakref

import numpy as np

from .graph import DType

FORMAT = 2                    # bump when the pickled layout changes
MAX_BYTES = 1 << 30           # the oldest entries go once the folder holds more than this
# switches that never change a plan (they are not part of the key)
_NOT_PLAN_SWITCHES = {"MEGANEURA_CACHE_DIR", "MEGANEURA_NO_DISK_CACHE", "MEGANEURA_NO_PLAN_CACHE", "MEGANEURA_COMPILE_THREADS",
                      "MEGANEURA_TRACE", "MEGANEURA_DETECT_ANOMALY", "MEGANEURA_ADAPTER", "MEGANEURA_SPIN_MS"}

_source_digest = None


def enabled(option=None) -> bool:
    """Whether compiled plans are read from and written to disk: ``option`` when given,
    else on unless ``MEGANEURA_NO_DISK_CACHE`` or ``MEGANEURA_NO_PLAN_CACHE`` is set."""
    if option is not None:
        return bool(option)
    from .runtime.backends import env_flag
    from .runtime.vulkan.cache import disk_cache_enabled
    return disk_cache_enabled() and not env_flag("MEGANEURA_NO_PLAN_CACHE")


def folder() -> pathlib.Path:
    from .runtime.vulkan.cache import cache_dir
    return cache_dir() / "plans"


def package_digest() -> str:
    """The package version and its source files' sizes and modification times (once per process)."""
    global _source_digest
    if _source_digest is None:
        from . import __version__
        root = pathlib.Path(__file__).parent
        h = hashlib.sha256(f"{__version__} {FORMAT}".encode())
        for p in sorted(root.rglob("*.py")):
            st = p.stat()
            h.update(f"{p.relative_to(root)} {st.st_size} {st.st_mtime_ns}\n".encode())
        _source_digest = h.hexdigest()
    return _source_digest


_PLAIN = (type(None), bool, int, float, str)


def _attr_text(x, out: list) -> bool:
    """Append a canonical text of an attribute value to ``out``; False when it has none."""
    if type(x) in _PLAIN:
        out.append(repr(x))
    elif isinstance(x, (list, tuple)):
        if x and all(type(v) is int for v in x):      # shapes, dims, strides: the common case
            out.append("(" + ",".join(map(repr, x)) + ",)")
            return True
        out.append("(")
        for v in x:
            if not _attr_text(v, out):
                return False
            out.append(",")
        out.append(")")
    elif isinstance(x, dict):
        out.append("{")
        for k in sorted(x, key=repr):
            out.append(repr(k) + ":")
            if not _attr_text(x[k], out):
                return False
            out.append(",")
        out.append("}")
    elif isinstance(x, np.ndarray):
        out.append(f"array({x.dtype.str},{x.shape},{hashlib.sha256(np.ascontiguousarray(x).tobytes()).hexdigest()})")
    elif isinstance(x, np.generic):
        out.append(f"{x.dtype.str}:{x.item()!r}")
    elif isinstance(x, DType):
        out.append(f"dtype:{x.name}")
    else:
        return False
    return True


# per graph, each node's canonical text (op, dtype, shape, attributes; None when it has
# none): graphs are append-only, so compiling several phases of one graph keys each node once
_node_texts: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _node_text(t):
    head = f"{t.op}|{t.dtype.name}|{t.shape}|"
    if t.op in ("input", "parameter", "state"):
        return head + t.name         # bound by name; their initial values never reach a plan
    if type(t.attrs) is dict and not t.attrs:
        return head + "{}"
    parts = [head]
    return "".join(parts) if _attr_text(t.attrs, parts) else None


def graph_digest(targets) -> str | None:
    """SHA-256 of the part of the graph ``targets`` need, or None when some attribute has
    no canonical text (such a graph is compiled every time)."""
    from .reference import needed_nodes
    nodes = needed_nodes(targets)
    texts = _node_texts.setdefault(targets[0].graph, {})
    pos = {t.id: i for i, t in enumerate(nodes)}
    backward = targets[0].graph.backward_ids      # accelerated precision treats these apart
    h = hashlib.sha256()
    parts: list = []
    for t in nodes:
        text = texts.get(t.id, False)
        if text is False:
            text = texts[t.id] = _node_text(t)
        if text is None:
            return None
        parts.append(text)
        parts.append(("|b|" if t.id in backward else "|") + ",".join([str(pos[i.id]) for i in t.inputs]) + "\n")
        if len(parts) > 4096:
            h.update("".join(parts).encode())
            parts.clear()
    h.update("".join(parts).encode())
    h.update(repr([pos[t.id] for t in targets]).encode())
    return h.hexdigest()


def _context(options, adapter) -> tuple:
    """What every key holds besides the graph: the code generators' routing and precision
    constants, the compile options, the adapter, the ``MEGANEURA_*`` switches, the package."""
    from .codegen import routing_constants
    from .compiler import precision_constants
    switches = sorted((k, v) for k, v in os.environ.items()
                      if k.startswith("MEGANEURA_") and k not in _NOT_PLAN_SWITCHES)
    return (routing_constants(), precision_constants(),
            (options.precision, options.max_bindings, sorted(options.disabled), options.workgroup_storage,
             sorted(options.f16_weights), options.binding_arrays),
            sorted((str(k), str(v)) for k, v in (adapter or {}).items()), switches, package_digest())


def plan_key(targets, n_forward, options, updates, adapter=None) -> str | None:
    """The cache key of ``compile_plan(targets, n_forward, options, updates)`` on ``adapter``
    (the device's ``adapter_info``: name, vendor, driver description, backend, ids), or None
    when the graph cannot be keyed."""
    g = graph_digest(targets)
    if g is None:
        return None
    desc = repr((g, n_forward, sorted((updates or {}).items()), _context(options, adapter)))
    return hashlib.sha256(desc.encode()).hexdigest()


def session_key(targets, params, optimizer, options, adapter=None, updated=()) -> str | None:
    """The manifest key of a training session: ``targets`` (the fetched outputs, the loss and
    the values of the graph's own state updates, whose states ``updated`` names), ``params``
    (the parameters and the states other than optimizer state), ``optimizer`` (one of
    ``meganeura.optim``'s, its type and hyperparameters; the learning rate and its schedule are
    fed per step and left out), the compile options (``CompileOptions.from_env`` for the
    device) and what every plan key holds (``_context``). None when the graph or the optimizer
    cannot be keyed: a user's optimizer class may build its update from anything."""
    if type(optimizer).__module__ != "meganeura.optim":
        return None
    g = graph_digest(targets)
    if g is None:
        return None
    hyper = [type(optimizer).__qualname__]
    state = {k: v for k, v in vars(optimizer).items() if k not in ("lr", "schedule") and not k.startswith("_")}
    if not _attr_text(state, hyper):
        return None
    entries = [(p.name, p.shape, p.dtype.name) + (("frozen",) if p.attrs.get("requires_grad") is False else ())
               for p in params]         # a frozen parameter (no gradient, no update) is marked
    desc = repr(("session", g, entries, list(updated), "".join(hyper),
                 _context(options, adapter)))
    return hashlib.sha256(desc.encode()).hexdigest()


def _manifest_path(key: str) -> pathlib.Path:
    return folder() / f"{key}.session"


def load_manifest(key: str) -> dict | None:
    """The manifest stored under ``key`` (``note_phase``), or None."""
    try:
        stored_key, manifest = pickle.loads(_manifest_path(key).read_bytes())
    except Exception:            # missing, corrupt or truncated: the session differentiates
        return None
    return manifest if stored_key == key and isinstance(manifest, dict) and manifest.get("phases") else None


def manifest_of(program) -> dict:
    """What a session with ``program`` (an ``api.Program`` built by differentiating) needs
    to stand up again without differentiating: see ``api.CachedProgram``."""
    from .optim import SCALAR_PREFIX
    g = program.graph
    return {"phases": {},
            "states": [(t.name, t.shape, t.dtype.name) for t in program.kept
                       if t.op == "state" and t.attrs.get("optimizer_state")],
            "scalars": sorted(n for n, t in g.inputs.items() if n.startswith(SCALAR_PREFIX) and t.id in program.used),
            "kept": [t.name for t in program.kept],
            "grads": list(program.grads),
            "updates": {ph: [t.name for t in u] for ph, u in program.updates.items()}}


def note_phase(key: str, program, phase: str, plan_key: str) -> None:
    """Record that ``phase`` of the session ``key`` compiles to the plan ``plan_key``
    (written atomically; any failure to write is ignored; a phase another process noted
    meanwhile may be lost, which costs that phase a differentiation later)."""
    from .runtime.vulkan.cache import write_atomic
    manifest = load_manifest(key) or manifest_of(program)
    if manifest["phases"].get(phase) == plan_key:
        return
    manifest["phases"][phase] = plan_key
    try:
        write_atomic(_manifest_path(key), pickle.dumps((key, manifest), protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:
        pass


# ----------------------------------------------------------------------------- entries
def _slim(kernel):
    """What the runtime reads of a kernel once its WGSL is rendered (traces, anomaly checks,
    memory planning): name, archetype, output views and merged parts."""
    from .schedule import Kernel
    parts = kernel.spec.get("parts")
    return Kernel(kernel.name, kernel.archetype, {"parts": [_slim(p) for p in parts]} if parts else {}, kernel.out,
                  outs=list(kernel.outs))


def _path(key: str) -> pathlib.Path:
    return folder() / f"{key}.plan"


def load(key: str):
    """The cached KernelPlan of ``key``, or None (missing, unreadable or not this key's)."""
    from .compiler import KernelPlan
    t0 = time.perf_counter()
    try:
        data = _path(key).read_bytes()
    except OSError:
        return None
    try:
        stored_key, plan = pickle.loads(data)
    except Exception:            # corrupt or truncated: rebuilt and rewritten by the caller
        return None
    if stored_key != key or not isinstance(plan, KernelPlan):
        return None
    plan.compile_seconds = time.perf_counter() - t0
    plan.stats = {**plan.stats, "cache": "hit", "key": key, "seconds": {"load": plan.compile_seconds}}
    return plan


def store(key: str, plan) -> None:
    """Write ``plan`` under ``key`` (atomically; any failure to write is ignored)."""
    from dataclasses import replace

    from .runtime.vulkan.cache import write_atomic
    texts: dict = {}       # equal WGSL as one object: pickled once (a plan has few distinct kernels)
    slim = replace(plan, dispatches=[replace(d, kernel=_slim(d.kernel), wgsl=texts.setdefault(d.wgsl, d.wgsl))
                                     for d in plan.dispatches],
                   stats={k: v for k, v in plan.stats.items() if k != "seconds"})
    try:
        data = pickle.dumps((key, slim), protocol=pickle.HIGHEST_PROTOCOL)
        write_atomic(_path(key), data)
        prune(folder())
    except Exception:            # a full disk or a read-only cache folder costs a recompile, nothing more
        pass


def prune(root: pathlib.Path, max_bytes: int = MAX_BYTES, patterns=("*.plan", "*.session")) -> None:
    """Delete the least recently written entries (files of ``patterns``) while the folder
    holds more than ``max_bytes``."""
    entries = []
    for p in [p for pattern in patterns for p in root.glob(pattern)]:
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(e[1] for e in entries)
    for _, size, p in sorted(entries):
        if total <= max_bytes:
            break
        try:
            p.unlink()
            total -= size
        except OSError:
            pass


def clear() -> int:
    """Delete every cached plan and session manifest; returns how many plans there were."""
    n = 0
    for p in [*folder().glob("*.session"), *folder().glob("*.plan")]:
        try:
            p.unlink()
            n += p.suffix == ".plan"
        except OSError:
            pass
    return n
