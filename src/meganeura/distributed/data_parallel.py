"""The data-parallel session (``DataParallel``, made by ``compile``): a step submitted in
segments that end where a bucket is final, buckets all-reduced while later ones are still
computed, and the optimizer update on the mean; ``plan_signature`` checks that every rank
compiled the same plan."""
from __future__ import annotations

import hashlib
import os
import time
import zlib

import numpy as np

from ..api import GRAD_FEED, GRAD_SCALE, Session
from ..graph import Graph, Tensor
from ..optim import SCALAR_PREFIX
from .buckets import DEFAULT_BUCKET_MB, _Bucket, _chunks
from . import ranks
from .ranks import DistributedError, _collective, _torch_dist, barrier, check_streams, init
from .transports import _runtime_maps_staging, _transport_setting, open_shm_allreduce, split_pieces


TIMING_KEYS = ("compute", "readback", "allreduce", "upload", "update", "total")


# ---------------------------------------------------------------------------- plan signature
def _canon(v):
    """A stable text for an attribute value (arrays by shape, dtype and checksum)."""
    if isinstance(v, np.ndarray):
        return f"array{v.shape}{v.dtype}:{zlib.crc32(np.ascontiguousarray(v).tobytes()):08x}"
    if isinstance(v, Tensor):
        return f"tensor#{v.id}"
    if isinstance(v, (list, tuple)):
        return "(" + ",".join(_canon(x) for x in v) + ")"
    if isinstance(v, dict):
        return "{" + ",".join(f"{k}:{_canon(v[k])}" for k in sorted(v, key=str)) + "}"
    if v is None or isinstance(v, (bool, int, float, str, np.generic)):
        return repr(v)
    return type(v).__name__


def plan_signature(session: Session) -> str:
    """A device-independent hash of what ``session`` trains: every node of its program
    (op, shape, dtype, name of parameters, inputs and states, attributes, inputs), its
    accumulation and its optimizer's settings. Equal on ranks that train the same model."""
    from ..reference import needed_nodes
    prog = session.program
    targets = [t for _, v in prog.updates.items() for t in v.values()] + prog.fetches + list(prog.grads.values())
    h = hashlib.sha256()
    index = {}
    for t in needed_nodes(targets):
        index[t.id] = len(index)
        named = t.op in ("input", "parameter", "state")
        attrs = {k: v for k, v in t.attrs.items() if k != "init"}
        h.update(f"{t.op}|{t.shape}|{t.dtype.name}|{t.name if named else ''}|{_canon(attrs)}|"
                 f"{[index[i.id] for i in t.inputs]};".encode())
    opt = session.optimizer
    settings = {k: v for k, v in vars(opt).items() if isinstance(v, (int, float, bool, str, type(None)))}
    h.update(f"accumulate={session.accumulate}|{type(opt).__name__}|{_canon(settings)}".encode())
    return h.hexdigest()


class DataParallel:
    """A training session replicated on every rank; see ``mg.distributed.compile``.

    ``step(feeds)`` takes this rank's share of the batch and returns this rank's loss;
    ``mean_loss`` is the mean over ranks (and micro-steps) of the last update's losses.
    ``runtime`` names the GPU runtime it runs on (``vulkan`` or ``wgpu``).
    ``grad_path`` says how gradients reach the collective and come back: ``mapped`` (Gloo
    reduces the mapped staging memory the device copied them into, and the update copies
    the sums from there: no host copy) or ``host`` (copied into a host array, reduced there
    and uploaded as the update's inputs).
    ``timings`` holds the host seconds of the last update by stage (``TIMING_KEYS``:
    compute = waiting for the GPU, readback = copying gradients out of mapped memory into
    host arrays (the host path), allreduce = waiting for collectives, upload (the host
    path), update, total); ``timing_totals`` sums
    them over every update and ``reset_timings`` clears them."""

    def __init__(self, graph: Graph, loss: Tensor, optimizer, accumulate=1, precision="strict", seed=0,
                 bucket_mb=DEFAULT_BUCKET_MB, ctx=None, backend=None, mapped=None, streams=None, transport=None):
        if streams is not None:
            check_streams(streams)
        transport = _transport_setting(transport)
        self.ctx = ctx = ctx or ranks._context or init(backend=backend or "gpu")
        if bucket_mb <= 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        self.streams = ctx.streams if streams is None else int(streams)
        if loss is None or optimizer is None:
            raise ValueError("mg.distributed.compile: give loss= and optimizer= (data-parallel training)")
        self.runtime = _session_runtime(ctx, backend)
        if mapped and not _runtime_maps_staging(self.runtime):
            raise ValueError(f"mg.distributed.compile: mapped=True, but the {self.runtime} runtime keeps no "
                             f"staging memory mapped (wgpu maps a buffer only to read it): use mapped=None")
        self.session = Session(graph, None, loss, optimizer, self.runtime, precision, seed, accumulate,
                               separate_update=True)
        self.accumulate = self.session.accumulate
        self.torch, self.tdist = _torch_dist() if ctx.world_size > 1 else (_torch_or_none(), None)
        self.check_same_program()
        self.groups = ctx.stream_groups(self.streams)
        self.broadcast_values()
        ex = self.session.executor
        self.phase = "micro" if self.accumulate > 1 else "grads"
        plan = ex.plan(self.phase)
        ex.plan("update")
        self._build_buckets(plan, bucket_mb, mapped)
        self.shm = open_shm_allreduce(ctx, self.tdist, [b.size for b in self.buckets], transport)
        self.transport = "shm" if self.shm is not None else "gloo"
        self.mean_loss = None
        self._loss_sum = 0.0
        self.reset_timings()

    # ---------------------------------------------------------------- start-up checks
    def check_same_program(self):
        """Raise DistributedError on every rank unless all ranks compiled the same program."""
        ctx = self.ctx
        if ctx.world_size == 1:
            return
        params = [(n, self.session.graph.parameters[n].shape) for n in self.session.parameter_names]
        mine = (plan_signature(self.session), len(params), sum(int(np.prod(s)) for _, s in params), params,
                self.streams)
        every = [None] * ctx.world_size
        _collective(ctx, "comparing the program hash", lambda: self.tdist.all_gather_object(every, mine))
        if len({e[4] for e in every}) > 1:
            raise DistributedError("ranks disagree on the number of all-reduce streams (compile(streams=...)): "
                                   + ", ".join(f"rank {r}: {e[4]}" for r, e in enumerate(every)))
        if all(e[0] == every[0][0] for e in every):
            return
        lines = [f"rank {r}: {e[1]} parameters ({e[2]} values), hash {e[0][:12]}" for r, e in enumerate(every)]
        diff = ""
        for r, e in enumerate(every):
            first = next(((a, b) for a, b in zip(every[0][3], e[3]) if a != b), None)
            if first is not None:
                diff = f"; first differing parameter: rank 0 {first[0][0]!r} {first[0][1]}, " \
                       f"rank {r} {first[1][0]!r} {first[1][1]}"
                break
        raise DistributedError("ranks disagree on the graph they train (every rank must build the same "
                               "model, loss, optimizer and accumulate): " + "; ".join(lines) + diff)

    def broadcast_values(self):
        """Give every rank rank 0's parameters and optimizer state (in buckets)."""
        ctx = self.ctx
        if ctx.world_size == 1:
            return
        torch = self.torch
        state = self.session.state_dict(include_optimizer=True)
        names = sorted(state)
        out = {}
        for group in _chunks(names, lambda n: state[n].nbytes, DEFAULT_BUCKET_MB * 2 ** 20):
            by_dtype = {}
            for n in group:
                by_dtype.setdefault(state[n].dtype, []).append(n)
            for dt, ns in by_dtype.items():
                flat = np.concatenate([state[n].reshape(-1) for n in ns]) if ctx.rank == 0 else \
                    np.empty(sum(state[n].size for n in ns), dt)
                t = torch.from_numpy(flat)
                _collective(ctx, "broadcasting the initial weights from rank 0",
                            lambda: self.tdist.broadcast(t, src=0))
                off = 0
                for n in ns:
                    out[n] = flat[off:off + state[n].size].reshape(state[n].shape).copy()
                    off += state[n].size
        if ctx.rank != 0:
            self.session.assign(out)

    def _build_buckets(self, plan, bucket_mb, mapped=None):
        """Group the gradients (or, when accumulating, the accumulated sums) into buckets
        in the order the step finishes them; rank 0's grouping is used by all. ``mapped``:
        None all-reduces in the staging memory where the runtime maps it for good (Vulkan),
        True insists, False copies through host arrays (the path wgpu takes)."""
        ex, torch = self.session.executor, self.torch
        if self.accumulate > 1:
            locs = {n: plan.update_locs[f"{n}.grad_accum"] for n in self.session.program.grads}
        else:
            locs = dict(plan.grad_locs)
        for n, loc in locs.items():
            if loc[3] != np.float32:
                raise NotImplementedError(f"mg.distributed: gradient of {n!r} is {loc[3]}, only float32 is "
                                          f"all-reduced")
        last = {}
        for i, bufs in enumerate(plan.writes):
            for b in bufs:
                last[id(b)] = i
        ready = {n: last.get(id(loc[0]), -1) for n, loc in locs.items()}
        order = sorted(locs, key=lambda n: (ready[n], n))
        groups = _chunks(order, lambda n: locs[n][2], bucket_mb * 2 ** 20)
        if self.ctx.world_size > 1:
            box = [groups]
            _collective(self.ctx, "sharing the bucket layout", lambda: self.tdist.broadcast_object_list(box, src=0))
            groups = box[0]
        self.buckets = [_Bucket(ex.dev, torch, [(n, locs[n], ready[n]) for n in g],
                                extra=1 if k == len(groups) - 1 else 0, mapped=mapped is not False)
                        for k, g in enumerate(groups)]
        self.grad_path = "mapped" if self.buckets and all(b.mapped for b in self.buckets) else "host"
        if len(self.groups) > 1:
            split = split_pieces([b.size for b in self.buckets], len(self.groups))
            for b, pieces in zip(self.buckets, split):
                b.set_pieces([(a, z, self.groups[i]) for a, z, i in pieces])
        for b in self.buckets:
            if b.mapped:
                # the update's gradient inputs are filled from the staging memory inside the
                # update's own command buffer (recorded once: the ranges never change)
                b.upload_copies = [(b.staging, 4 * o, ex.named_buffer(GRAD_FEED + n, nb), 0, nb)
                                   for n, o, (_, _, nb, _, _) in zip(b.names, b.offsets, b.locs)]
        self.update_copies = [c for b in self.buckets for c in b.upload_copies]
        # the step is submitted in segments, each ending where a bucket's gradients are final
        # and followed by that bucket's copies (buckets final at the same point share one);
        # the outputs' copies follow the last. No segment is copies alone: on lavapipe such a
        # submit blocks until the work before it is done.
        n = len(plan.dispatches)
        subs, early, early_k = [], [], []       # [start, end, copies, bucket indices]
        for k, b in enumerate(self.buckets):
            cut = max(b.ready_after + 1, subs[-1][1] if subs else 0)
            if subs and subs[-1][1] == cut:
                subs[-1][2].extend(b.copies)
                subs[-1][3].append(k)
            elif cut > 0:
                subs.append([subs[-1][1] if subs else 0, cut, early + list(b.copies), early_k + [k]])
                early, early_k = [], []
            else:                      # final before any dispatch: rides with the first segment
                early.extend(b.copies)
                early_k.append(k)
        end = subs[-1][1] if subs else 0
        if end < n or not subs:
            subs.append([end, n, early + list(plan.copies_after), early_k])
        else:
            subs[-1][2].extend(early + list(plan.copies_after))
            subs[-1][3].extend(early_k)
        self.bucket_submission = {k: i for i, sub in enumerate(subs) for k in sub[3]}
        self.submissions = [(ex.recorder.prepare(plan.dispatches[a:b], plan.names[a:b]), copies)
                            for a, b, copies, _ in subs]

    # ---------------------------------------------------------------------------- stepping
    def reset_timings(self):
        self.timings = dict.fromkeys(TIMING_KEYS, 0.0)      # the last finished update's
        self._current = dict.fromkeys(TIMING_KEYS, 0.0)     # the update under way
        self.timing_totals = dict.fromkeys(TIMING_KEYS, 0.0)
        self.updates_timed = 0

    @property
    def steps_done(self) -> int:
        return self.session.steps_done

    def step(self, feeds: dict) -> float:
        """One micro-step on this rank's share of the batch; every ``accumulate``-th call
        all-reduces the gradients and updates. Returns this rank's loss."""
        s = self.session
        with s._lock:
            if s.closed:
                raise RuntimeError("step: this session is closed")
            feeds = s._feeds(feeds)
            t0 = time.perf_counter()
            if s.micro_done == 0:
                self._current = dict.fromkeys(TIMING_KEYS, 0.0)
            if s.micro_done + 1 < self.accumulate:
                loss = float(s.executor.execute(feeds, "micro")[-1])
                s.micro_done += 1
                self._loss_sum += loss
                self._current["compute"] += time.perf_counter() - t0
                self._current["total"] += time.perf_counter() - t0
                return loss
            loss = self._reduce_step(feeds)
            self._update()
            s.micro_done = 0
            s.steps_done += 1
            self._current["total"] += time.perf_counter() - t0
            self.timings = self._current
            for k in TIMING_KEYS:
                self.timing_totals[k] += self.timings[k]
            self.updates_timed += 1
            return loss

    def _reduce_step(self, feeds) -> float:
        """The last micro-step: its segments are submitted ahead of the host; each bucket is
        all-reduced asynchronously once its segment has run, while later segments run: in
        place in its mapped staging memory (``grad_path`` "mapped"), or copied out of it into
        a host array first, and the sums then uploaded as the update's inputs ("host")."""
        ex, dev, tm = self.session.executor, self.session.executor.dev, self._current
        rec = ex.recorder
        plan = ex.plan(self.phase)
        subs, done = self.submissions, []
        # wgpu on a software driver runs a submit only once the one before it has finished,
        # so there one segment is queued ahead of the host; elsewhere they go all at once
        ahead = 1 if dev.is_software and self.runtime == "wgpu" else len(subs)

        def submit_until(i):
            while len(done) <= min(i, len(subs) - 1):
                done.append(rec.submit(*subs[len(done)]))

        try:
            t = time.perf_counter()
            # as GpuExecutor.execute: values never set go up first (alone and with
            # accumulate=1, this is the first thing that runs)
            ex.send_initial_values()
            ex.refresh_copies(plan)
            ex.upload(feeds)
            ex.overwriting(plan)
            submit_until(ahead - 1)
            tm["compute"] += time.perf_counter() - t
            loss = None
            for k, b in enumerate(self.buckets):
                t = time.perf_counter()
                j = self.bucket_submission[k]
                submit_until(j + ahead)
                if b.mapped:          # its segment alone; the collective reduces the staging memory
                    rec.wait(done[j])
                    t1 = time.perf_counter()
                else:
                    with rec.mapped_after(done[j], b.staging, 4 * max(b.n, 1)) as raw:
                        t1 = time.perf_counter()
                        b.host_np[:b.n] = raw.view(np.float32)[:b.n]
                t2 = time.perf_counter()
                tm["compute"] += t1 - t
                tm["readback"] += t2 - t1
                if k == len(self.buckets) - 1:     # the loss rides with the last bucket
                    submit_until(len(subs) - 1)
                    st, (_, _, nb, dt, _) = plan.staging[-1], plan.fetch_locs[-1]
                    with rec.mapped_after(done[-1], st, nb) as raw:
                        loss = float(raw.view(dt)[0])
                    self._loss_sum += loss
                    b.host_np[b.n] = self._loss_sum
                    tm["compute"] += time.perf_counter() - t2
                if self.tdist is not None:      # on its streams, while later segments run
                    _collective(self.ctx, f"starting the all-reduce of gradient bucket {k + 1}/"
                                f"{len(self.buckets)}", lambda: b.start_allreduce(self.tdist, self.shm, k))
        finally:
            for d in done:          # a submission left unwaited could not be submitted again
                rec.wait(d)
        plan.check_indices(dev)
        ex.last_plan = ex.last_fetch_plan = plan
        for k, b in enumerate(self.buckets):
            t = time.perf_counter()
            for w in b.works:
                _collective(self.ctx, f"the all-reduce of gradient bucket {k + 1}/{len(self.buckets)} at update "
                            f"{self.session.steps_done + 1}", w.wait)
            b.works = []
            t1 = time.perf_counter()
            # inputs of the update phase: mapped buckets are copied from their staging memory
            # inside the update's command buffer (self.update_copies); otherwise uploaded (on
            # the Vulkan backend with staged memory the small ones are copied inside it too)
            if not b.mapped:
                ex.upload({GRAD_FEED + name: b.host_np[o:o + nb // 4]
                           for name, o, (_, _, nb, _, _) in zip(b.names, b.offsets, b.locs)})
            tm["allreduce"] += t1 - t
            tm["upload"] += time.perf_counter() - t1
        last = self.buckets[-1]
        self.mean_loss = float(last.host_np[last.n]) / (self.accumulate * self.ctx.world_size)
        self._loss_sum = 0.0
        return loss

    def _update(self):
        s = self.session
        t = time.perf_counter()
        scal = s.optimizer.scalars(s.steps_done + 1)
        scal[SCALAR_PREFIX + GRAD_SCALE] = 1.0 / (self.accumulate * self.ctx.world_size)
        feeds = {k: np.asarray(v, np.float32) for k, v in scal.items() if k in s.graph.inputs}
        s.executor.execute(feeds, "update", copies_before=self.update_copies)
        s.executor.dev.sync()
        self._current["update"] += time.perf_counter() - t

    # ------------------------------------------------------------------ checkpoints, state
    def save(self, path, include_optimizer=True):
        """Rank 0 writes the checkpoint (atomically: see meganeura.checkpoint); every rank
        waits until it is written, so any rank may load it next. Returns the path."""
        if self.session.micro_done:
            raise RuntimeError(f"save: {self.session.micro_done} of {self.accumulate} micro-steps are "
                               f"accumulated; save after an update")
        if self.ctx.rank == 0:
            self.session.save(path, include_optimizer)
        barrier(self.ctx)
        return os.fspath(path)

    def load(self, path, strict=True):
        """Every rank loads the same checkpoint (parameters, optimizer state and step)."""
        return self.session.load(path, strict)

    def state_dict(self, include_optimizer=False):
        return self.session.state_dict(include_optimizer)

    def close(self):
        for step, _ in getattr(self, "submissions", ()):
            close = getattr(step, "close", None)      # the Vulkan backend's recorded command buffers
            if close is not None:
                close()
        if getattr(self, "shm", None) is not None:
            self.shm.close()
            self.shm = None
        self.session.close()
        for b in getattr(self, "buckets", ()):
            if b.host_np is not None:
                b.release()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _torch_or_none():
    """torch alone (a world of one process still keeps gradients in torch tensors when
    torch is installed, so the code path is the same); None without it."""
    try:
        import torch
        return torch
    except ImportError:
        return None


def _session_runtime(ctx, backend) -> str:
    """The runtime a session runs on: ``backend`` resolved, else the one ``init`` chose the
    device for; they must agree (the other runtime would open its own default device)."""
    from ..runtime.backends import resolve
    runtime = resolve(backend) if backend is not None else (ctx.runtime or resolve("gpu"))
    if ctx.runtime is not None and runtime != ctx.runtime:
        raise ValueError(f"mg.distributed.compile: backend {backend!r} runs on {runtime}, but init() chose this "
                         f"rank's device on {ctx.runtime}: pass the same backend to init()")
    return runtime


def compile(graph: Graph, loss: Tensor, optimizer, accumulate=1, precision="strict", seed=0,
            bucket_mb=DEFAULT_BUCKET_MB, ctx=None, backend=None, mapped=None, streams=None,
            transport=None) -> DataParallel:
    """A data-parallel training session on this rank's GPU (``init`` is called if it was
    not). Every rank must build the same graph: their program hashes are compared first
    (DistributedError otherwise). Rank 0's initial values are broadcast to all.
    accumulate: all-reduce and update once per ``accumulate`` calls of ``step``.
    bucket_mb: gradient megabytes per all-reduce. backend: None runs on the runtime that
    ``init`` chose (``init(backend=...)``: the direct Vulkan backend by default, wgpu where
    it does not run or when asked). mapped: None all-reduces the gradients in the staging
    memory the device copies them into and updates from there, where the runtime keeps it
    mapped (Vulkan), else through host copies (wgpu); False always copies (for comparison);
    True refuses a runtime that cannot. streams: concurrent all-reduce streams (None: what
    ``init`` set up, by default 4; another count uses the first of the context's stream
    groups, creating more where needed, on every rank alike). transport: how the buckets are
    all-reduced (``$MEGANEURA_DP_TRANSPORT``): "gloo" (default); "auto": through shared memory
    where every rank runs on this host and /dev/shm has room, else Gloo; "shm" insists."""
    return DataParallel(graph, loss, optimizer, accumulate, precision, seed, bucket_mb, ctx, backend, mapped,
                        streams, transport)
