"""Record a whole step as one command encoder, one compute pass, one submit.

The dispatch list of a compiled plan is fixed, so `prepare` turns it once into
raw wgpu-native handles; each step is then a tight loop of cffi calls
(SetPipeline only when the pipeline changes, SetBindGroup only when the bind
group or pipeline changes, DispatchWorkgroups). wgpu inserts the barriers
between dispatches of a pass itself.
"""

from __future__ import annotations

import contextlib

import numpy as np
from wgpu.backends.wgpu_native._ffi import ffi, lib

# wgpu-core caps a query set at 4096 queries.
_MAX_QUERIES = 4096


def _norm_copy(c):
    """(src, dst, nbytes) or (src, src_offset, dst, dst_offset, nbytes); the size is
    rounded up to 4 bytes as copies require (runtime buffers are rounded alike)."""
    if len(c) == 3:
        src, dst, n = c
        so = do = 0
    else:
        src, so, dst, do, n = c
    return src, int(so), dst, int(do), (int(n) + 3) & ~3


def encode_copies(enc, copies):
    """Record buffer copies (``_norm_copy`` forms) into command encoder ``enc``."""
    for c in copies:
        src, so, dst, do, n = _norm_copy(c)
        enc.copy_buffer_to_buffer(src, so, dst, do, n)


class PreparedStep:
    """A dispatch list turned into raw handles, built once per plan.

    ops: tuples (pipeline_handle_or_None, bind_group_handle_or_None, x, y, z,
    immediates_or_None); None means 'unchanged since the previous dispatch'."""

    def __init__(self, dispatches, names=None):
        self.keep = []  # owners of the raw handles (pipelines, bind groups, cffi data)
        self.ops = []
        self.names = list(names) if names is not None else None
        self.pipelines = []
        last_p = last_bg = None
        for d in dispatches:
            pipe, bg, wg = d[0], d[1], d[2]
            imm = d[3] if len(d) > 3 else None
            x, y, z = (tuple(wg) + (1, 1))[:3] if not isinstance(wg, int) else (wg, 1, 1)
            ph = pipe.handle
            bh = bg._internal
            set_p = ph if ph != last_p else None
            set_bg = bh if (set_p is not None or bh != last_bg) else None
            if imm is not None:
                data = bytes(np.ascontiguousarray(imm).view(np.uint8).reshape(-1))
                cdata = ffi.new("char[]", data)
                self.keep.append(cdata)
                imm = (cdata, len(data))
            self.ops.append((set_p, set_bg, int(x), int(y), int(z), imm))
            self.keep.append(pipe)
            self.keep.append(bg)
            self.pipelines.append(pipe)
            last_p, last_bg = ph, bh
        if self.names is not None and len(self.names) != len(self.ops):
            raise ValueError(f"{len(self.names)} names for {len(self.ops)} dispatches")
        self._queries = None  # lazily built timestamp resources

    def __len__(self):
        return len(self.ops)

    @property
    def num_set_pipeline(self):
        return sum(1 for o in self.ops if o[0] is not None)


class StepRecorder:
    """Records dispatch lists on `device` (a meganeura Device)."""

    def __init__(self, device):
        self.device = device
        self.last_timestamps_ns = None

    @staticmethod
    def release(step):
        """Nothing to free: wgpu's command buffers are recorded per run."""

    def prepare(self, dispatches, names=None) -> PreparedStep:
        """dispatches: (Pipeline, bind_group, (x, y, z)) or with a 4th item, the
        immediate data (a NumPy array / bytes) for pipelines with immediate_size."""
        return PreparedStep(dispatches, names)

    # ----------------------------------------------------------------- run
    def run(self, dispatches, copies_before=(), copies_after=(), timestamps=False, wait=False):
        """Record every dispatch into one pass of one encoder and submit once.

        dispatches: a PreparedStep (preferred: build it once) or a raw list.
        copies_before / copies_after: buffer copies recorded in the same encoder
        before / after the pass, each (src, dst, nbytes) or
        (src, src_offset, dst, dst_offset, nbytes).
        timestamps: also time each dispatch; waits and returns an (n, 2) int64 array
        of [start, end] in ns (also kept as .last_timestamps_ns).
        wait: block until the GPU has finished."""
        step = dispatches if isinstance(dispatches, PreparedStep) else self.prepare(dispatches)
        dev = self.device
        if timestamps:
            if not dev.has_timestamps:
                raise RuntimeError("adapter has no timestamp-query feature")
            return self._run_timed(step, copies_before, copies_after)
        enc = dev.raw.create_command_encoder()
        encode_copies(enc, copies_before)
        cpass = enc.begin_compute_pass()
        self._record(cpass._internal, step.ops)
        cpass.end()
        encode_copies(enc, copies_after)
        dev.submit([enc.finish()])
        if wait:
            dev.sync()
        return None

    @staticmethod
    def _record(p, ops):
        set_pipeline = lib.wgpuComputePassEncoderSetPipeline
        set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
        dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
        set_imm = lib.wgpuComputePassEncoderSetImmediates
        null = ffi.NULL
        for ph, bh, x, y, z, imm in ops:
            if ph is not None:
                set_pipeline(p, ph)
            if bh is not None:
                set_bind_group(p, 0, bh, 0, null)
            if imm is not None:
                set_imm(p, 0, imm[0], imm[1])
            dispatch(p, x, y, z)

    # ------------------------------------------------ submissions waited for one by one
    def submit(self, step: PreparedStep, copies_after=()) -> int:
        """Record ``step`` and the copies after it into one encoder and submit it without
        waiting; returns its submission index (``wait`` and ``mapped_after`` wait for it
        alone, while later submissions run)."""
        dev = self.device
        enc = dev.raw.create_command_encoder()
        if step.ops:
            cpass = enc.begin_compute_pass()
            self._record(cpass._internal, step.ops)
            cpass.end()
        encode_copies(enc, copies_after)
        # keep the command buffer's wrapper alive until it is submitted: wgpu-py releases a
        # dropped wrapper's handle (from its poll thread), and a released handle makes the
        # submit panic ("CommandBuffer ... does not exist")
        cmd = enc.finish()
        handles = ffi.new("WGPUCommandBuffer[]", [cmd._internal])
        with dev.queue_lock:
            index = int(lib.wgpuQueueSubmitForIndex(dev.queue._internal, 1, handles))
        del cmd
        return index

    def wait(self, index: int):
        lib.wgpuDevicePoll(self.device.handle, True, ffi.new("WGPUSubmissionIndex *", index))

    @contextlib.contextmanager
    def mapped_after(self, index: int, staging, nbytes):
        """The first ``nbytes`` of MAP_READ buffer ``staging`` as a uint8 array, once
        submission ``index`` (which fills it) has run; unmapped after the block.

        ``map_sync`` would wait for every submission, later ones included (wgpu-py's poll
        thread polls for all of them), and first submits an empty command buffer, which a
        software driver runs only after the work before it. So the map is requested without
        that submit and this thread polls for submission ``index`` alone, which also
        delivers the map's callback."""
        size = (int(nbytes) + 3) & ~3
        promise = staging.map_async("READ_NOSYNC", 0, size)
        self.wait(index)
        promise.sync_wait()
        try:
            yield np.frombuffer(staging.read_mapped(0, size, copy=False), np.uint8, count=int(nbytes))
        finally:
            staging.unmap()

    # ----------------------------------------------------------- profiling
    def _query_resources(self, step, n_queries):
        dev = self.device
        q = step._queries
        if q is None or q["n"] != n_queries:
            sets = []
            for start in range(0, n_queries, _MAX_QUERIES):
                cnt = min(_MAX_QUERIES, n_queries - start)
                sets.append(dev.raw.create_query_set(type="timestamp", count=cnt))
            resolve = dev.create_buffer(8 * n_queries, "query")
            # the step's own staging buffer: a pooled one could be mapped by another thread
            staging = dev.create_buffer(8 * n_queries, "staging", label="timestamps")
            q = {"n": n_queries, "sets": sets, "resolve": resolve, "staging": staging}
            step._queries = q
        return q

    def _run_timed(self, step, copies_before, copies_after):
        dev = self.device
        n = len(step.ops)
        nq = 2 * n
        q = self._query_resources(step, nq)
        sets = q["sets"]
        enc = dev.raw.create_command_encoder()
        encode_copies(enc, copies_before)
        if dev.has_timestamps_in_passes:
            # One pass, a timestamp before and after every dispatch.
            write = lib.wgpuComputePassEncoderWriteTimestamp
            set_pipeline = lib.wgpuComputePassEncoderSetPipeline
            set_bind_group = lib.wgpuComputePassEncoderSetBindGroup
            dispatch = lib.wgpuComputePassEncoderDispatchWorkgroups
            set_imm = lib.wgpuComputePassEncoderSetImmediates
            cpass = enc.begin_compute_pass()
            p = cpass._internal
            for i, (ph, bh, x, y, z, imm) in enumerate(step.ops):
                if ph is not None:
                    set_pipeline(p, ph)
                if bh is not None:
                    set_bind_group(p, 0, bh, 0, ffi.NULL)
                if imm is not None:
                    set_imm(p, 0, imm[0], imm[1])
                k = 2 * i
                write(p, sets[k // _MAX_QUERIES]._internal, k % _MAX_QUERIES)
                dispatch(p, x, y, z)
                k += 1
                write(p, sets[k // _MAX_QUERIES]._internal, k % _MAX_QUERIES)
            cpass.end()
        else:
            # Pass-level timestamps only: one pass per dispatch (slower, profiling only).
            for i, op in enumerate(step.ops):
                k = 2 * i
                qs = sets[k // _MAX_QUERIES]
                cpass = enc.begin_compute_pass(timestamp_writes={
                    "query_set": qs,
                    "beginning_of_pass_write_index": k % _MAX_QUERIES,
                    "end_of_pass_write_index": k % _MAX_QUERIES + 1,
                })
                ph, bh, x, y, z, imm = op
                # Every pass starts with no state: set pipeline and bind group again.
                pipe = step.pipelines[i]
                bg_handle = bh if bh is not None else self._bind_group_of(step, i)
                lib.wgpuComputePassEncoderSetPipeline(cpass._internal, pipe.handle)
                lib.wgpuComputePassEncoderSetBindGroup(cpass._internal, 0, bg_handle, 0, ffi.NULL)
                if imm is not None:
                    lib.wgpuComputePassEncoderSetImmediates(cpass._internal, 0, imm[0], imm[1])
                lib.wgpuComputePassEncoderDispatchWorkgroups(cpass._internal, x, y, z)
                cpass.end()
        for si, qs in enumerate(sets):
            cnt = min(_MAX_QUERIES, nq - si * _MAX_QUERIES)
            enc.resolve_query_set(qs, 0, cnt, q["resolve"], si * _MAX_QUERIES * 8)
        encode_copies(enc, copies_after)
        st = q["staging"]
        enc.copy_buffer_to_buffer(q["resolve"], 0, st, 0, 8 * nq)
        dev.submit([enc.finish()])
        ticks = dev.read_staging(st, 8 * nq, np.uint64).astype(np.float64)
        ns = (ticks * dev.timestamp_period()).astype(np.int64).reshape(n, 2)
        self.last_timestamps_ns = ns
        return ns

    @staticmethod
    def _bind_group_of(step, i):
        # The bind group of dispatch i: the last one set at or before it.
        for j in range(i, -1, -1):
            if step.ops[j][1] is not None:
                return step.ops[j][1]
        raise RuntimeError("no bind group recorded")
