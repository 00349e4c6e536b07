"""The ``gpu`` backend: binds the compile stage's executables (``compilation.executable``,
asked for per call kind on the device's ``Target``) to device buffers, pipelines and bind
groups, and runs each step as one command buffer and one submit. It compiles nothing: the
kernels come final, and stream in while they are finished (``KernelStream``) so pipelines
are created meanwhile. The device is used through ``runtime.protocol.RuntimeDevice``.

A plan exists per kind of call (inference; forward+backward; training step); they share
the persistent buffers of inputs, parameters and optimizer state by name.
"""
from __future__ import annotations

import itertools
import os
import time

import numpy as np

from ..api import starts_at_zero
from .. import plan_cache
from ..compilation.executable import KernelStream
from ..compiler import F16_COPY, f16_weights
from ..graph import DeviceLimitError, fmt_shape
from .backends import env_flag, get_runtime_device, gpu_device, make_recorder, resolve
from .protocol import RuntimeDevice
from .profiler import trace_writer, write_chrome_trace


def _round4(n):
    return max(4, (int(n) + 3) // 4 * 4)


class Plan:
    """An ``Executable`` bound to device buffers, pipelines and bind groups."""

    def __init__(self, ex, exe, n_fetch, grad_names, updates, slot_pool=None, made=None):
        """``exe``: the compile stage's executable for this call. ``slot_pool``: slot buffers
        shared with the session's other plans that take it (``_pooled_slots``). ``made``: the
        runtime's pipelines of kernels streamed while ``exe`` compiled, to wait for first."""
        dev = ex.dev
        kp = exe.plan
        self.executable, self.kernel_plan, self.memory = exe, kp, kp.memory
        # persistent f16 copies of weights (accelerated precision): those this plan reads,
        # and those it writes beside their master weights (targets after the given ones)
        self.copies_read = {b.name[:-len(F16_COPY)] for b in kp.bufs if b.kind == "state" and b.name.endswith(F16_COPY)}
        updates = list(updates) + [(name, None) for name in kp.copy_updates]
        for name in self.copies_read | {n[:-len(F16_COPY)] for n in kp.copy_updates}:
            ex.track_copy(name)
        self.shares_slots = slot_pool is not None
        # checked mode: kernels that index with data (embedding ids, labels) report bad
        # indices into one error buffer, read after each step (see check_indices)
        self.checks, self.error_buf, err = exe.checks, None, exe.error_buf
        if err is not None:
            self.error_zeros = np.zeros(err.nbytes // 4, np.uint32)
        phys = {}

        def allocate():
            self.slots = slots = _pooled_slots(dev, self.memory.slot_sizes, slot_pool)
            for b in kp.bufs:
                if b.kind in ("input", "parameter", "state"):
                    phys[b] = ex.named_buffer(b.name, b.nbytes)
                elif b.kind == "constant":
                    phys[b] = dev.create_buffer(b.nbytes, label=b.name)
                    dev.upload(phys[b], b.value)
                elif b in self.memory.slot_of:      # intermediates and targets
                    phys[b] = slots[self.memory.slot_of[b]]
            if err is not None:
                phys[err] = self.error_buf = dev.create_buffer(err.nbytes, label="index_errors")
        if made is not None:
            made.result()
        # every pipeline now (identical kernels once), so that compiling compiles and the
        # first call only runs; where the runtime allows it, while this thread allocates
        pipes = _pipelines_while(dev, exe.kernels, allocate)
        dispatches, self.writes = [], []
        for pipe, step in zip(pipes, exe.steps):
            bound = [phys[b] for b in step.bufs]
            # buffers each dispatch may write: a value is final after the last one that does
            self.writes.append([buf for buf, acc in zip(bound, pipe.access) if acc in ("rw", "write")])
            dispatches.append((pipe, dev.bind_group(pipe, bound), step.groups))
        self.names = kp.names
        self.n_dispatches = kp.n_dispatches
        self.step = ex.recorder.prepare(dispatches, self.names)
        self.dispatches = dispatches
        # anomaly mode: per dispatch, the float values it writes (buffer, view)
        self.written = [[(phys[v.buf], v) for p in d.kernel.spec.get("parts", [d.kernel]) for v in [p.out, *p.outs]
                         if v.dtype.is_float and v.buf in phys] for d in kp.dispatches]
        # where each target's value lives: (buffer, byte offset, nbytes, dtype, shape)
        locs = [(phys[b], off, nb, dt, shape) for b, off, nb, dt, shape in kp.target_locs]
        self.fetch_locs = locs[:n_fetch]
        self.grad_locs = dict(zip(grad_names, locs[n_fetch:n_fetch + len(grad_names)]))
        self.update_locs = {name: loc for (name, _), loc in zip(updates, locs[n_fetch + len(grad_names):])}
        self.copies_after = []
        for (name, _), (buf, off, n, _, _) in zip(updates, locs[n_fetch + len(grad_names):]):
            dst = ex.named_buffer(name, n)
            if dst is not buf:
                self.copies_after.append((buf, off, dst, 0, _round4(n)))
        self.staging = [dev.create_buffer(_round4(n), "staging", label="fetch") for _, _, n, _, _ in self.fetch_locs]
        self.update_copies = list(self.copies_after)
        self.copies_after += [(buf, off, st, 0, _round4(n)) for (buf, off, n, _, _), st in zip(self.fetch_locs, self.staging)]
        self.compile_seconds = 0.0      # set by the executor: compiling and binding

    def run_detecting_anomaly(self, ex, copies):
        """Anomaly mode: one submit per dispatch, and each dispatch's output read back
        before the next runs (slow: for debugging). Raises FloatingPointError naming the
        first kernel, its position and the graph value it wrote, if that holds NaN or Inf."""
        dev = ex.dev
        for i, (disp, outs) in enumerate(zip(self.dispatches, self.written)):
            ex.recorder.run([disp], copies_after=copies if i == len(self.dispatches) - 1 else (), wait=True)
            for buf, v in outs:
                vals = _read_view(dev, buf, v)
                bad = ~np.isfinite(vals)
                if bad.any():
                    first = vals[bad].flat[0]
                    raise FloatingPointError(
                        f"anomaly: kernel {i} {self.names[i]!r} wrote {int(bad.sum())} non-finite value(s) "
                        f"({'NaN' if np.isnan(first) else first}, ...) into {v.buf.name!r} "
                        f"{fmt_shape(v.shape)}: the first kernel of the step to produce NaN or Inf")
        if not self.dispatches and copies:
            ex.recorder.run([], copies_after=copies, wait=True)

    def check_indices(self, dev):
        """Raise IndexError naming the op and tensor of the first check that saw a bad
        index in the last step (checked mode only)."""
        if self.error_buf is None:
            return
        flags = dev.readback(self.error_buf, self.error_zeros.nbytes, np.uint32)
        dev.upload(self.error_buf, self.error_zeros)     # cleared for the next step
        for k, (c, kname) in enumerate(self.checks):
            if flags[2 * k]:
                bad = int(flags[2 * k + 1].astype(np.int32))
                raise IndexError(f"{c['op']}: {c['what']} {bad} in {c['tensor']!r} is out of range for "
                                 f"{c['bound']} {'classes' if c['what'] == 'label' else 'rows'} "
                                 f"(found by kernel {kname!r} in checked mode)")


def _read_view(dev, buf, v):
    """The elements of view ``v`` of device buffer ``buf``, as a NumPy array of its shape."""
    item = v.dtype.np.itemsize
    span = 1 + sum((n - 1) * st for n, st in zip(v.shape, v.strides)) if v.size else 0
    start = v.offset * item
    lo = start & ~3                          # copies start on 4-byte boundaries
    raw = dev.readback(buf, _round4(start - lo + span * item), np.uint8, offset=lo)
    flat = raw[start - lo:start - lo + span * item].view(v.dtype.np)
    return np.lib.stride_tricks.as_strided(flat, v.shape, [st * item for st in v.strides])


def anomaly_from_env() -> bool:
    return env_flag("MEGANEURA_DETECT_ANOMALY")


_trace_ids = itertools.count()

# the tile sizes the matmul kernel template is written for (threads x register blocks)
MATMUL_TILES = (32, 64, 128)


def check_environment():
    """Refuse bad values of the switches the code generators read, before anything is
    compiled: MEGANEURA_MATMUL_TILE=4096 would otherwise make a kernel that never ends."""
    tile = os.environ.get("MEGANEURA_MATMUL_TILE", "").strip()
    if tile and tile not in {str(t) for t in MATMUL_TILES}:
        raise ValueError(f"MEGANEURA_MATMUL_TILE={tile!r}: must be one of {list(MATMUL_TILES)} (or unset)")
    split = os.environ.get("MEGANEURA_MATMUL_SPLIT", "").strip()
    if split and not split.isdigit():
        raise ValueError(f"MEGANEURA_MATMUL_SPLIT={split!r}: must be a non-negative integer (0 or unset: automatic)")
    block = os.environ.get("MEGANEURA_MATMUL_BLOCK", "").strip()
    if block:
        from ..codegen.matmul import parse_block
        try:
            parse_block(block)
        except ValueError as e:
            raise ValueError(f"MEGANEURA_MATMUL_BLOCK: {e}") from None


def check_device_limits(tensors, dev=None):
    """Raise DeviceLimitError, naming each tensor, if any is larger than one storage
    binding (or one buffer) of the device may be: found at compile time, not as a wgpu
    validation error at the first run. ``dev``: the device the session runs on (default: the
    ``backend="gpu"`` one)."""
    dev = dev or gpu_device()
    lims = dev.limits
    limit, which = min((int(lims[k]), k) for k in ("max-storage-buffer-binding-size", "max-buffer-size") if k in lims)
    over = [t for t in tensors if t.size * t.dtype.np.itemsize > limit]
    if over:
        desc = "; ".join(f"{t.name!r} ({t.op}) {fmt_shape(t.shape)} {t.dtype.name}: {t.size * t.dtype.np.itemsize} bytes"
                         for t in over[:5])
        more = f" and {len(over) - 5} more" if len(over) > 5 else ""
        raise DeviceLimitError(f"{len(over)} tensor(s) exceed the {limit} bytes one buffer binding may hold on "
                               f"{dev.name!r} ({which}): {desc}{more}")


# Phases of one session that share their intermediates' slot buffers: they run one after
# another (each call waits for its step), never pass values to each other through slots
# (parameters, state and gradients' accumulators are named buffers), and what a caller may
# read afterwards is the last call's outputs or the gradients of a ``grads`` call that no
# other call followed (a step makes them stale). A session that compiles both
# compute_grads and step held two copies of nearly the same slots (SmolLM2: 2 x 801 MiB).
SHARED_SLOT_PHASES = frozenset({"grads", "step", "micro"})


def _pipelines_while(dev: RuntimeDevice, kernels, work):
    """``dev.pipelines(kernels)``, running ``work()`` meanwhile on this thread where the
    runtime creates pipelines and allocates memory concurrently (``concurrent_pipelines``:
    the Vulkan backend, whose driver calls release the GIL); else one after the other.
    ``work``'s error wins over the pipelines', and both have ended when this returns."""
    if not dev.concurrent_pipelines:
        work()
        return dev.pipelines(kernels)
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(1, thread_name_prefix="pipelines") as pool:
        made = pool.submit(dev.pipelines, kernels)
        try:
            work()
        except BaseException:
            made.exception()        # wait for it, then report the allocation's error
            raise
        return made.result()


def _pooled_slots(dev, sizes, pool):
    """Buffers for slots of ``sizes`` bytes: new ones, or with ``pool`` (a list kept by the
    session) the pool's, largest to largest, where big enough; a slot the pool cannot hold
    gets a new buffer that joins it (a plan made earlier keeps the smaller one it holds)."""
    if pool is None:
        return [dev.create_buffer(n, label=f"slot{i}") for i, n in enumerate(sizes)]
    pool.sort(key=lambda b: -b.size)
    slots = [None] * len(sizes)
    for rank, i in enumerate(sorted(range(len(sizes)), key=lambda i: -sizes[i])):
        if rank < len(pool) and pool[rank].size >= sizes[i]:
            slots[i] = pool[rank]
        else:
            slots[i] = dev.create_buffer(sizes[i], label=f"slot{i}")
            if rank < len(pool):
                pool[rank] = slots[i]
            else:
                pool.append(slots[i])
    return slots


class GpuExecutor:
    """Runs a Program on the GPU. Not thread-safe by itself: the Session serialises calls."""

    def __init__(self, program, values: dict, precision="strict", share_with=None, detect_anomaly=None,
                 backend="gpu", plan_cache=None, session_key=None):
        check_environment()
        self.plan_cache = plan_cache             # None: on unless MEGANEURA_NO_DISK_CACHE / _NO_PLAN_CACHE
        self.detect_anomaly = detect_anomaly     # None: $MEGANEURA_DETECT_ANOMALY at each call
        self.runtime = resolve(backend)          # "wgpu" or "vulkan"
        self.dev = get_runtime_device(self.runtime)
        self.closed = False
        self.trace_id = next(_trace_ids)     # this session's track in a MEGANEURA_TRACE file
        self.recorder = make_recorder(self.dev)
        self.program, self.values, self.precision = program, values, precision
        self.session_key = session_key     # a training session's manifest key: compiled phases are noted there
        if precision == "accelerated" and not self.dev.has_f16:
            import warnings
            warnings.warn(f"{self.dev.name} has no shader-f16: accelerated precision runs as strict")
            self.precision = "strict"
        # parameters read by accelerated forward matmuls get persistent f16 copies
        self.f16_weights = f16_weights(program.fetches) if self.precision == "accelerated" and program.fetches \
            else frozenset()
        self.plans: dict = {}
        self.slot_pool: list = []        # the SHARED_SLOT_PHASES plans' slot buffers
        self.last_plan = self.last_fetch_plan = None    # whose gradients / outputs may be read back
        self._dtypes = {t.name: t for t in program.graph.nodes if t.op in ("input", "parameter", "state")}
        self.input_buffers: dict = {}    # inputs are never shared: shapes differ per program
        if share_with is not None:       # parameters and state shared with another session
            self.buffers = share_with.buffers
            self.unsent = share_with.unsent
            self.copies, self.stale = share_with.copies, share_with.stale
            kept = {n: t for n, t in self._dtypes.items() if t.op != "input"}
            self._dtypes = {**{n: t for n, t in share_with._dtypes.items() if t.op != "input"}, **self._dtypes}
            share_with._dtypes.update(kept)
        else:
            self.buffers = {}
            self.unsent = set()          # initial values not made yet: uploaded before the first call
            self.copies = {}             # parameter name -> its f16 copy's name (accelerated plans' weights)
            self.stale = set()           # parameters whose f16 copy is older than the weight
        pending = getattr(values, "pending", lambda name: None)
        for name in values:
            if name in self.buffers:
                continue
            t = pending(name)
            if t is None:
                self.set_value(name, values[name])
            elif starts_at_zero(t):
                self.named_buffer(name, t.size * t.dtype.np.itemsize)    # new buffers hold zeros
            else:
                self.unsent.add(name)

    # --------------------------------------------------------------- buffers
    def named_buffer(self, name, nbytes):
        t = self._dtypes.get(name)
        pool = self.input_buffers if t is not None and t.op == "input" else self.buffers
        b = pool.get(name)
        if b is None:
            b = self.dev.create_buffer(nbytes, "input" if pool is self.input_buffers else "storage", label=name)
            pool[name] = b
        return b

    def set_value(self, name, arr, put=None):
        """``put``: how the bytes go to the device (default ``dev.upload``, at once)."""
        arr = np.asarray(arr, dtype=self._dtypes[name].dtype.np, order="C")
        (put or self.dev.upload)(self.named_buffer(name, arr.nbytes), arr)
        self.unsent.discard(name)
        if name in self.copies:
            self._write_copy(name, arr)

    # ------------------------------------------------------- f16 copies of weights
    def track_copy(self, name):
        """Parameter ``name`` has an f16 copy from now on (a plan reads or writes it); it is
        filled from the weight before any call reads it."""
        if name in self.copies:
            return
        self.copies[name] = name + F16_COPY
        if name not in self.unsent:      # the weight is on the device already: copy it there
            self.stale.add(name)

    def _write_copy(self, name, arr):
        arr16 = arr.astype(np.float16)
        self.dev.upload(self.named_buffer(self.copies[name], max(4, arr16.nbytes)), arr16)
        self.stale.discard(name)

    def refresh_copies(self, plan):
        """Bring the f16 copies that ``plan`` reads up to date with their weights (updated by
        a session that shares them without keeping copies, e.g. a strict training session)."""
        for name in sorted(plan.copies_read & self.stale):
            self._write_copy(name, self.get_value(name))

    def mark_stale_copies(self, plan):
        """After ``plan`` ran: copies of the weights it updated without writing their copy."""
        for name in plan.update_locs:
            if name in self.copies and self.copies[name] not in plan.update_locs:
                self.stale.add(name)

    def send_initial_values(self):
        """Upload the initial values that nothing has set since compiling (made for the
        upload only: no host copy stays behind)."""
        for name in list(self.unsent):
            self.set_value(name, self.values.initial(name))

    def upload(self, feeds: dict):
        """A call's inputs (the Vulkan backend defers small ones into the step's command buffer)."""
        for name, arr in feeds.items():
            self.set_value(name, arr, self.dev.upload_input if self._dtypes[name].op == "input" else None)

    def get_value(self, name):
        if name in self.unsent:
            self.set_value(name, self.values.initial(name))
        t = self._dtypes[name]
        n = t.size * t.dtype.np.itemsize
        return self.dev.readback(self.named_buffer(name, n), n, t.dtype.np, t.shape)

    def read_outputs(self):
        """The outputs of the last call, read from the device."""
        plan = self.last_fetch_plan
        if plan is None:
            raise RuntimeError("read_outputs: no call's outputs are on the device (nothing has run yet, or a "
                               "later call that shares their memory, or a failed one, overwrote them)")
        return [self.dev.readback(buf, nb, dt, shape, offset=off) for buf, off, nb, dt, shape in plan.fetch_locs]

    def last_grads(self):
        if self.last_plan is None or not self.last_plan.grad_locs:
            raise RuntimeError("grads: call compute_grads() first (step() applies its gradients without "
                               "keeping them, and a later step, or a failed call, overwrites them)")
        return {n: self.dev.readback(buf, nb, dt, shape, offset=off)
                for n, (buf, off, nb, dt, shape) in self.last_plan.grad_locs.items()}

    # ------------------------------------------------------------------ plans
    def plan(self, phase: str) -> Plan:
        if phase not in self.plans:
            from ..compiler import gc_paused
            check_environment()
            t0 = time.perf_counter()
            p = self.program
            # a phase compiled on first use (compute_grads after step) allocates as much as
            # mg.compile does: the collector is held off as there (its scans of a process
            # full of graphs took 0.15 s of a 0.34 s SmolLM2 training compile)
            pool = self.slot_pool if phase in SHARED_SLOT_PHASES else None
            with gc_paused():
                plan = None
                cached = p.cached_phase(phase)
                if cached is not None:        # a session stood up from its manifest (api.CachedProgram)
                    fetches, grad_names, upd, key = cached
                    # None where it was evicted from the cache: differentiate after all
                    plan = self._bind(len(fetches), grad_names, upd, pool, key=key)
                if plan is None:
                    fetches, grad_names, upd, targets = p.targets(phase)
                    plan = self._bind(len(fetches), grad_names, upd, pool, targets=targets)
                    key = plan.kernel_plan.stats.get("key")
                    if self.session_key and key:
                        plan_cache.note_phase(self.session_key, p, phase, key)
                plan.compile_seconds = time.perf_counter() - t0
                self.plans[phase] = plan
        return self.plans[phase]

    def _bind(self, n_fetch, grad_names, upd, pool, targets=None, key=None):
        """The Plan of one call: its executable from the compile stage (compiled from
        ``targets``, or read from the plan cache by ``key``: None when it is not there), its
        kernels' pipelines created as the compile stage streams them where the runtime can."""
        from ..compilation import build
        dev = self.dev
        target = dev.target()
        opts = build.options_for(target, self.precision, self.f16_weights, dev.checked)
        base = n_fetch + len(grad_names)
        stream = KernelStream() if dev.concurrent_pipelines else None
        made = dev.pipelines_from(stream) if stream is not None else None
        try:
            if targets is None:
                exe = build.cached_executable(key, target, opts, self.plan_cache, stream)
                if exe is None or len(exe.target_locs) != base + len(upd) + len(exe.copy_updates):
                    return None      # gone, or not the plan of these targets
            else:
                exe = build.compile_executable(targets, n_fetch, {base + j: name for j, (name, _) in enumerate(upd)},
                                               target, opts, self.plan_cache, stream)
        except BaseException:
            if made is not None:
                made.exception()     # its pipelines end before the compile's error is raised
            raise
        return Plan(self, exe, n_fetch, grad_names, upd, slot_pool=pool, made=made)

    def profile(self, feeds: dict, phase: str, path=None):
        """Run ``phase`` once with GPU timestamps around every dispatch; returns the
        per-kernel table and writes a Chrome/Perfetto trace to ``path`` if given."""
        from .profiler import kernel_table
        plan = self.plan(phase)
        self.send_initial_values()
        self.refresh_copies(plan)
        self.upload(feeds)
        self.overwriting(plan)
        ts = self.recorder.run(plan.step, timestamps=True)
        if path:
            write_chrome_trace(path, plan.names, ts)
        return kernel_table(plan.names, ts)

    def overwriting(self, plan):
        """Before ``plan`` runs: forget the outputs and gradients it is about to overwrite (its
        own last call's, and with shared slots every sharing plan's), so that ``read_outputs``
        and ``grads`` raise instead of returning what the run (or a run that failed) left."""
        def hit(p):
            return p is not None and (p is plan or (p.shares_slots and plan.shares_slots))
        if hit(self.last_plan):
            self.last_plan = None
        if hit(self.last_fetch_plan):
            self.last_fetch_plan = None

    def close(self, free_shared=True):
        """Free this session's device buffers; parameters and state too when
        ``free_shared`` (no other session made with share_with uses them)."""
        if self.closed:
            return
        self.closed = True
        owned = [p.staging for p in self.plans.values()]
        owned.append(list(self.input_buffers.values()))
        if free_shared:
            owned.append(list(self.buffers.values()))
            self.buffers.clear()
        for p in self.plans.values():
            self.recorder.release(p.step)      # the Vulkan backend's recorded command buffers
        # slots, constants and targets live only in the plans' bind groups and copies
        self.plans.clear()
        self.slot_pool.clear()
        self.input_buffers.clear()
        self.last_plan = self.last_fetch_plan = None
        self.recorder = None
        for bufs in owned:
            for b in bufs:
                b.destroy()

    def execute(self, feeds: dict, phase: str, fetch: bool = True, copies_before=()):
        """Run ``phase``; with ``fetch`` False the outputs stay on the device (the call
        still waits for the GPU) and ``read_outputs`` reads them later. ``copies_before``:
        buffer copies, (src, src_offset, dst, dst_offset, nbytes), recorded in the same
        submit before the step (data-parallel training fills the update's gradient inputs
        from staging memory that way; keep the same buffers from call to call, so that the
        Vulkan backend records its command buffer once)."""
        plan = self.plan(phase)
        trace = os.environ.get("MEGANEURA_TRACE")
        writer = trace_writer(trace) if trace else None    # an unwritable path fails before the step
        self.send_initial_values()
        self.refresh_copies(plan)
        self.upload(feeds)
        copies = plan.copies_after if fetch else plan.update_copies
        anomaly = anomaly_from_env() if self.detect_anomaly is None else self.detect_anomaly
        self.overwriting(plan)
        if anomaly:
            if copies_before:
                self.recorder.run([], copies_after=copies_before, wait=True)
            plan.run_detecting_anomaly(self, copies)
        elif writer is not None:
            ts = self.recorder.run(plan.step, copies_before=copies_before, copies_after=copies, timestamps=True)
            writer.add(plan.names, ts, session=self.trace_id, label=phase)
        else:
            self.recorder.run(plan.step, copies_before=copies_before, copies_after=copies)
        self.mark_stale_copies(plan)
        plan.check_indices(self.dev)
        if plan.grad_locs or phase in ("step", "micro"):     # a step leaves older gradients stale
            self.last_plan = plan
        self.last_fetch_plan = plan
        if not fetch:
            self.dev.sync()
            return None
        return [self.dev.read_staging(st, nb, dt, shape)
                for st, (_, _, nb, dt, shape) in zip(plan.staging, plan.fetch_locs)]


class ExecutableRunner:
    """Runs one ``Executable`` (saved by another process, or built device-free) on this
    process's device of its target's API: its kernels are final, so nothing is compiled,
    only pipelines created and buffers bound. ``values``: the parameters' and states'
    values by name; every target is fetched (an inference executable)."""

    def __init__(self, exe, values: dict):
        self.dev = get_runtime_device(exe.target.api)
        self.recorder = make_recorder(self.dev)
        self.buffers: dict = {}
        self.plan = Plan(self, exe, len(exe.target_locs) - len(exe.copy_updates), [], [])
        for b in exe.bufs:
            if b.kind in ("parameter", "state"):
                if b.name not in values:
                    raise KeyError(f"executable: no value for {b.kind} {b.name!r}")
                self.dev.upload(self.named_buffer(b.name, b.nbytes), np.ascontiguousarray(values[b.name]))

    def named_buffer(self, name, nbytes):
        b = self.buffers.get(name)
        if b is None:
            b = self.buffers[name] = self.dev.create_buffer(nbytes, label=name)
        return b

    def track_copy(self, name):
        raise NotImplementedError(f"executable: {name!r} is read through an f16 copy, which a standalone run "
                                  "does not keep (compile it in strict precision)")

    def run(self, feeds: dict) -> list:
        plan = self.plan
        for name, arr in feeds.items():
            self.dev.upload(self.buffers[name] if name in self.buffers else self.named_buffer(name, np.asarray(arr).nbytes),
                            np.ascontiguousarray(arr))
        self.recorder.run(plan.step, copies_after=plan.copies_after)
        plan.check_indices(self.dev)
        return [self.dev.read_staging(st, nb, dt, shape) for st, (_, _, nb, dt, shape) in zip(plan.staging, plan.fetch_locs)]
