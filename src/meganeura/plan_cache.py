"""The on-disk cache of compiled plans: a process that compiles a graph it (or an earlier
process) compiled before loads the ``KernelPlan`` instead of running the passes again.

An entry is keyed by a SHA-256 of everything the plan depends on: the graph (every node the
targets need: op, inputs, shape, dtype, attributes, constants' values, the names of inputs,
parameters and state), the targets and updates, the compile options (precision, binding and
workgroup-memory limits, switched-off passes), the adapter (name, driver, backend), the
``MEGANEURA_*`` switches the code generators read, and the package: its version and the size
and modification time of its source files, so an edited compiler never reads old plans.

Entries live in ``disk.cache_dir()/plans`` (the user cache folder, ``MEGANEURA_CACHE_DIR``)
as self-checking ``disk`` entries (a digest of the key and the content): a flipped, truncated,
foreign or unreadable entry is ignored, deleted and rewritten, never an error and never a
wrong plan. ``MEGANEURA_NO_DISK_CACHE=1`` (every disk cache) or ``MEGANEURA_NO_PLAN_CACHE=1``
(this one), or ``mg.compile(..., plan_cache=False)``, turn it off.

A plan entry is a pickle of the plan with each kernel reduced to what the runtime reads once
the WGSL is rendered (name, archetype, output view, merged parts); the kernel IR itself is not
kept. Beside it the entry holds the kernel AST of each of its WGSL texts (``KernelPlan.trees``: the
nodes' fields, not the printers' memos), compressed; a plan read back holds them so
(``KernelPlan.packed_trees``), and the Vulkan compile stage unpacks one only for a kernel it
must print (``unpacked_tree``, which checks that the tree prints that very text), so a
cached plan's GLSL is printed from its trees as a compiled one's is. It is read back only inside a checked entry, and only as data:
the unpickler builds the package's own classes (the plan's and the kernel AST's nodes) and
numpy's arrays, nothing callable (``_PlanUnpickler``). A manifest is JSON.

A training session also leaves a manifest (``session_key``, ``load_manifest``, ``note_phase``),
keyed before differentiation: the forward graph (outputs, loss, the graph's own state updates),
the parameters, the optimizer and its hyperparameters, the precision, the adapter and the
package. It names each compiled phase's plan key and what the backward pass and the optimizer
add to the graph (optimizer state, per-step scalars, the kept tensors, the updates). A session
that finds it builds no backward graph and no optimizer update: it loads the phases' plans by
key, and differentiates only if a phase is missing (see ``api.CachedProgram``).
"""
from __future__ import annotations

import contextlib
import copyreg
import hashlib
import io
import json
import pathlib
import pickle
import threading
import time
import weakref
import zlib

import numpy as np

from . import disk, env
from .disk import package_digest  # noqa: F401  (the Vulkan caches key by it too)
from .graph import DTYPES, DType

FORMAT = 5        # bump when the pickled layout changes (3: self-checking entries; 4: with kernel ASTs;
                  # 5: plans carrying their trees)
_MAGIC = "meganeura-plan"
MAX_BYTES = 1 << 30           # the oldest entries go once the folder holds more than this


def enabled(option=None) -> bool:
    """Whether compiled plans are read from and written to disk: ``option`` when given,
    else on unless ``MEGANEURA_NO_DISK_CACHE`` or ``MEGANEURA_NO_PLAN_CACHE`` is set."""
    if option is not None:
        return bool(option)
    return disk.enabled() and not env.flag("MEGANEURA_NO_PLAN_CACHE")


def folder() -> pathlib.Path:
    return disk.cache_dir() / "plans"


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
    return (FORMAT, routing_constants(), precision_constants(),
            (options.precision, options.max_bindings, sorted(options.disabled), options.workgroup_storage,
             sorted(options.f16_weights), options.binding_arrays),
            sorted((str(k), str(v)) for k, v in (adapter or {}).items()), env.plan_keyed(), disk.package_digest())


def plan_key(targets, n_forward, options, updates, adapter=None) -> str | None:
    """The cache key of ``compile_plan(targets, n_forward, options, updates)`` on ``adapter``
    (the device's ``adapter_info``: name, vendor, driver description, backend, ids), or None
    when the graph cannot be keyed."""
    g = graph_digest(targets)
    if g is None:
        return None
    desc = repr((g, n_forward, sorted((updates or {}).items()), _context(options, adapter)))
    return hashlib.sha256(desc.encode()).hexdigest()


def session_key(targets, params, optimizer, options, adapter=None, updated=(), checkpointed=()) -> str | None:
    """The manifest key of a training session: ``targets`` (the fetched outputs, the loss and
    the values of the graph's own state updates, whose states ``updated`` names), ``params``
    (the parameters and the states other than optimizer state), ``optimizer`` (one of
    ``meganeura.optim``'s, its type and hyperparameters; the learning rate and its schedule are
    fed per step and left out), the graph's checkpointed regions (``autodiff.checkpointed_regions``:
    the same forward graph recomputes them in its backward pass, another program), the compile options (``CompileOptions.from_env`` for the
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
    desc = repr(("session", g, entries, list(updated), "".join(hyper), list(checkpointed),
                 _context(options, adapter)))
    return hashlib.sha256(desc.encode()).hexdigest()


def _manifest_path(key: str) -> pathlib.Path:
    return folder() / f"{key}.session"


def _checked_manifest(m) -> dict | None:
    """The manifest ``m`` read from JSON, with its shapes as tuples, or None where it is not
    one ``manifest_of`` would write (a digest collision or another version's)."""
    from .optim import SCALAR_PREFIX

    def names(v):
        return isinstance(v, list) and all(isinstance(n, str) for n in v)
    try:
        states = [(n, tuple(s), d) for n, s, d in m["states"]]
        ok = (isinstance(m["phases"], dict) and m["phases"] and names(list(m["phases"].values()))
              and all(isinstance(n, str) and d in DTYPES and all(type(x) is int for x in s) for n, s, d in states)
              and names(m["scalars"]) and all(n.startswith(SCALAR_PREFIX) for n in m["scalars"])
              and names(m["kept"]) and names(m["grads"])
              and isinstance(m["updates"], dict) and all(map(names, m["updates"].values())))
    except (KeyError, TypeError, ValueError):
        return None
    return {**m, "states": states} if ok else None


def load_manifest(key: str) -> dict | None:
    """The manifest stored under ``key`` (``note_phase``), or None."""
    data = disk.load(_manifest_path(key))
    if data is None:
        return None
    try:
        manifest = _checked_manifest(json.loads(data))
    except (ValueError, UnicodeDecodeError):
        manifest = None
    if manifest is None:
        disk.report(_manifest_path(key), "not a session manifest")
    return manifest


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
    manifest = load_manifest(key) or manifest_of(program)
    if manifest["phases"].get(phase) == plan_key:
        return
    manifest["phases"][phase] = plan_key
    disk.store(_manifest_path(key), json.dumps(manifest).encode())


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


class _PlanUnpickler(pickle.Unpickler):
    """Builds a plan's data only: the package's classes (the plan's, and the kernel AST's
    nodes of ``codegen.kernel_ast`` and the families' ``codegen/*_ast`` modules), numpy's
    arrays and dtypes and the plain containers; no function, so an entry cannot run code as
    it is read."""
    _NUMPY = {("numpy", "dtype"), ("numpy", "ndarray"), ("numpy.core.multiarray", "_reconstruct"),
              ("numpy._core.multiarray", "_reconstruct"), ("numpy.core.multiarray", "scalar"),
              ("numpy._core.multiarray", "scalar"), ("numpy.core.numeric", "_frombuffer"),
              ("numpy._core.numeric", "_frombuffer")}
    _BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range"}
    _PACKAGE = {("meganeura.graph", "dtype_of")}       # a DType by name (``DType.__reduce__``)

    def find_class(self, module, name):
        if (module, name) in self._NUMPY or (module.startswith("numpy.dtypes") and name.endswith("DType")):
            return super().find_class(module, name)
        if module == "builtins" and name in self._BUILTINS:
            return super().find_class(module, name)
        if module == "copyreg" and name == "_reconstructor":
            return super().find_class(module, name)
        if module.startswith("meganeura."):
            found = super().find_class(module, name)
            if isinstance(found, type) or (module, name) in self._PACKAGE:
                return found
        raise pickle.UnpicklingError(f"a plan entry may not build {module}.{name}")


# ----------------------------------------------------------------------------- kernel ASTs
# A plan's entry holds the kernel AST of each of its WGSL texts, each pickled by its nodes'
# fields and compressed. Unpacking is left to the Vulkan compile stage, which asks
# ``unpacked_tree`` only for the kernels it must make GLSL for (a warm process whose kernels
# are in the Vulkan kernel cache, and the wgpu backend, unpack none): unpacking every tree of
# a large plan would cost ten times as much as reading the plan (U-Net's training step: 346
# trees of 117k nodes).


def _node_state(obj):
    """The reduction of a kernel AST node (a ``kernel_ast.node`` dataclass) by its fields:
    the printers' memos on it (``_wgsl``, ``_abstract``) are left out. Always a copy: a
    printer on another thread may add a memo while the pickler walks the fields."""
    state = obj.__dict__.copy()
    state.pop("_wgsl", None)
    state.pop("_abstract", None)
    return copyreg.__newobj__, (type(obj),), state


class _TreePickler(pickle.Pickler):
    """Pickles kernel AST nodes by their fields (``_node_state``), anything else as usual."""
    _nodes: dict = {}        # class -> whether it is a node class of ``kernel_ast.node``

    def reducer_override(self, obj):
        k = type(obj)
        is_node = self._nodes.get(k)
        if is_node is None:
            d = vars(k)
            is_node = self._nodes[k] = "_wgsl" in d and "_abstract" in d and "__dataclass_fields__" in d
        return _node_state(obj) if is_node else NotImplemented


# packed trees by their WGSL text, kept across the plans of a process (a training session's
# phases share most kernels) up to _PACKED_MAX_BYTES, the oldest forgotten first: equal text,
# an equal kernel (``unpacked_tree`` accepts any tree that prints the text)
_PACKED: dict = {}
_PACKED_MAX_BYTES = 64 << 20
_packed_lock = threading.Lock()
_packed_bytes = 0


def _pack(text, tree) -> bytes | None:
    global _packed_bytes
    found = _PACKED.get(text)
    if found is not None:
        return found
    buf = io.BytesIO()
    try:
        _TreePickler(buf, protocol=pickle.HIGHEST_PROTOCOL).dump(tree)
    except Exception:            # noqa: BLE001 (a node holding something unpicklable)
        return None
    packed = zlib.compress(buf.getvalue(), 1)
    with _packed_lock:
        if text not in _PACKED:
            _PACKED[text] = packed
            _packed_bytes += len(packed)
            while _packed_bytes > _PACKED_MAX_BYTES and _PACKED:
                _packed_bytes -= len(_PACKED.pop(next(iter(_PACKED))))
    return packed


def clear_packed():
    """Forget the packed trees kept in this process (``clear_caches`` calls it)."""
    global _packed_bytes
    with _packed_lock:
        _PACKED.clear()
        _packed_bytes = 0


def _packed_trees(trees, texts) -> list:
    """[(WGSL text, compressed pickle of its kernel AST)] of a plan's distinct ``texts`` (each
    text to the one object the entry pickles; ``trees``: the plan's); None where one has no
    tree or its tree cannot be pickled: the Vulkan backend could not print that kernel from
    the entry, so the plan is not stored."""
    out = []
    for text in texts.values():
        tree = trees.get(text)
        packed = None if tree is None else _pack(text, tree)
        if packed is None:
            return None
        out.append((text, packed))
    return out


def _with_packed_trees(plan, trees, path) -> bool:
    """Give ``plan`` the entry's ``trees`` (``_packed_trees``), each with the entry's
    ``path`` (``KernelPlan.packed_trees``); False when they are not pairs of one of the
    plan's texts and bytes."""
    if not isinstance(trees, list):
        return False
    texts = {d.wgsl for d in plan.dispatches}
    if not all(isinstance(p, tuple) and len(p) == 2 and p[0] in texts and type(p[1]) is bytes for p in trees):
        return False
    plan.trees, plan.packed_trees = {}, {text: (packed, path) for text, packed in trees}
    return True


def unpacked_tree(text, packed):
    """The kernel AST whose WGSL is ``text``, from ``packed`` (an entry's, as
    ``KernelPlan.packed_trees`` holds it), or None where it cannot be read or does not print
    ``text``: then the entry is deleted, the Vulkan stage refuses the kernel, and the next
    compile builds the plan again."""
    from .codegen.kernel_ast import ComputeKernel, print_wgsl
    data, path = packed
    try:
        tree = _PlanUnpickler(io.BytesIO(zlib.decompress(data))).load()
        ok = isinstance(tree, ComputeKernel) and print_wgsl(tree) == text
    except Exception:            # noqa: BLE001 (a tree this version's classes or printers cannot take)
        ok = False
    if ok:
        return tree
    disk.report(path, "a kernel AST that does not print its kernel")
    with contextlib.suppress(OSError):
        path.unlink()
    return None


# ----------------------------------------------------------------------------- plan entries
def load(key: str):
    """The cached KernelPlan of ``key``, or None (missing, unreadable, corrupt or not this
    key's: the caller compiles it and ``store`` rewrites it). It holds its kernels' ASTs
    packed (``KernelPlan.packed_trees``)."""
    from .compiler import KernelPlan
    t0 = time.perf_counter()
    path = _path(key)
    data = disk.load(path)
    if data is None:
        return None
    try:
        entry = _PlanUnpickler(io.BytesIO(data)).load()
    except Exception as e:       # noqa: BLE001 (another version's classes: rebuilt and rewritten)
        disk.report(path, f"a plan this version cannot read ({type(e).__name__})")
        return None
    if not (isinstance(entry, tuple) and len(entry) == 4 and entry[:2] == (_MAGIC, FORMAT)
            and isinstance(entry[2], KernelPlan) and _with_packed_trees(entry[2], entry[3], path)):
        disk.report(path, "not a plan")
        return None
    plan = entry[2]
    plan.compile_seconds = time.perf_counter() - t0
    plan.stats = {**plan.stats, "cache": "hit", "key": key, "seconds": {"load": plan.compile_seconds}}
    return plan


def store(key: str, plan) -> None:
    """Write ``plan`` under ``key`` with its kernels' ASTs (atomically; any failure to write
    is ignored)."""
    _write(key, *_snapshot(plan))


def store_beside(key: str, plan) -> threading.Thread:
    """``store`` on a thread of its own, started and returned (the caller joins it): packing
    a plan's trees is the largest part of a cold compile's host work after rendering, and the
    Vulkan stage that follows mostly waits on the compilers' and drivers' threads. The plan
    is read now; only its trees (which no later stage changes) are read on the thread."""
    t = threading.Thread(target=_write, args=(key, *_snapshot(plan)), name="meganeura-plan-store", daemon=True)
    t.start()
    return t


def _snapshot(plan):
    """The entry's plan (each kernel slimmed, timings left out: the same plan, the same
    entry), its distinct WGSL texts and ``plan``'s trees."""
    from dataclasses import replace
    texts: dict = {}       # equal WGSL as one object: pickled once (a plan has few distinct kernels)
    slim = replace(plan, dispatches=[replace(d, kernel=_slim(d.kernel), wgsl=texts.setdefault(d.wgsl, d.wgsl))
                                     for d in plan.dispatches],
                   stats={k: v for k, v in plan.stats.items() if k != "seconds"},
                   compile_seconds=0.0, trees={}, packed_trees={})
    return slim, texts, dict(plan.trees)


def _write(key, slim, texts, trees) -> None:
    packed = _packed_trees(trees, texts)
    if packed is None:           # a kernel without a tree to store: compiled each time
        return
    try:
        data = pickle.dumps((_MAGIC, FORMAT, slim, packed), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:            # noqa: BLE001 (a plan holding something unpicklable is compiled each time)
        return
    if disk.store(_path(key), data):
        prune(folder())


def prune(root: pathlib.Path, max_bytes: int = MAX_BYTES, patterns=("*.plan", "*.session")) -> None:
    """Delete the least recently written entries (files of ``patterns``) while the folder
    holds more than ``max_bytes`` (``disk.prune``)."""
    disk.prune(root, max_bytes, patterns)


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
