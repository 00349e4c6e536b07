"""A step: a list of dispatches (and buffer copies) recorded once into a command buffer,
level by level, and resubmitted as long as nothing changes.

``Program(device, ops)`` takes ``Dispatch`` and ``Copy`` items in program order. Their
buffer ranges and the kernels' binding access give each op its accesses; ``levels.group_levels``
groups the ops, and the command buffer holds, per level, its ops with no barrier between
them, then one global memory barrier before the next level. An entry barrier makes earlier
submissions' and the host's writes visible; an exit barrier makes this one's writes visible
to the host. Descriptor sets are built once (ops with the same kernel layout and ranges share
one); push constants are recorded per dispatch.

``set_push`` / ``set_buffers`` change an op; the next ``run`` re-records (and for new
buffers re-levels) before submitting. ``stats`` reports dispatches, copies, levels,
barriers (between levels), edge barriers, and how often the buffer was recorded.

With ``timestamps=True`` a timestamp is written before the first op and after each op
(bottom of pipe: when every earlier command is done), so op ``i`` spans
``[t[i], t[i+1]]``; inside a level where ops overlap this is the increment of completion
time, and the spans add up to the step's GPU time. ``timestamps_ns()`` returns them as
an (n, 2) array for ``runtime.profiler``. A timestamp after every op may drain the pipeline
on some drivers, serialising a level; ``timestamps="step"`` writes only one before the first
op and one after the last (``gpu_seconds`` then times the step without disturbing it).
"""
from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field

import numpy as np

from . import _vk
from ._vk import check, new
from .device import Kernel, VulkanDevice, full_barrier
from .levels import Access, group_levels, serial_levels
from .memory import BufferRange


@dataclass
class Dispatch:
    kernel: Kernel
    buffers: list                 # BufferRange per binding
    groups: tuple                 # workgroup counts (x, y, z); an int means (x, 1, 1)
    push: bytes | None = None     # push-constant bytes (kernel.push_size of them)
    name: str | None = None

    def accesses(self):
        for rng, acc in zip(self.buffers, self.kernel.access):
            if acc in ("read", "rw"):
                yield Access(id(rng.block), rng.offset, rng.size, False)
            if acc in ("write", "rw"):
                yield Access(id(rng.block), rng.offset, rng.size, True)


@dataclass
class Copy:
    src: BufferRange
    dst: BufferRange
    nbytes: int | None = None
    name: str | None = field(default=None)

    @property
    def size(self):
        return min(self.src.size, self.dst.size) if self.nbytes is None else int(self.nbytes)

    def accesses(self):
        yield Access(id(self.src.block), self.src.offset, self.size, False)
        yield Access(id(self.dst.block), self.dst.offset, self.size, True)


def pack_push(*values, fmt=None) -> bytes:
    """Push-constant bytes: ints as u32 and floats as f32 (or a numpy struct ``fmt``)."""
    if fmt is not None:
        return np.array([tuple(values)], dtype=fmt).tobytes()
    out = []
    for v in values:
        if isinstance(v, (float, np.floating)):
            out.append(np.float32(v).tobytes())
        elif isinstance(v, (int, np.integer)):
            out.append(np.uint32(v & 0xFFFFFFFF).tobytes() if v >= 0 else np.int32(v).tobytes())
        else:
            raise TypeError(f"push constant {v!r}: int or float expected")
    return b"".join(out)


class Program:
    """Ops recorded into one reusable command buffer (see the module docstring).

    levels: True groups by dependencies; False records every op after a barrier (one op per
    level: the reference a backend without dependency tracking would record)."""

    def __init__(self, device: VulkanDevice, ops, *, levels=True, timestamps=False, name="step"):
        self.device, self.name = device, name
        self.ops = list(ops)
        self.use_levels = bool(levels)
        if timestamps not in (False, True, "ops", "step"):
            raise ValueError(f"{name}: timestamps must be False, True / 'ops' or 'step', got {timestamps!r}")
        self.ts_mode = None if not timestamps or device.timestamp_bits == 0 else \
            ("step" if timestamps == "step" else "ops")
        self.timestamps = self.ts_mode is not None
        self.record_count = 0
        self._dirty = True
        self._cmd = device.allocate_command_buffer()
        device._programs.add(self)
        self._fence = device.create_fence()
        self._pool = None
        self._sets = {}
        self._qpool = None
        self._pushes = []
        for i, op in enumerate(self.ops):
            self._validate(i, op)
        self._build_sets()
        self._relevel()
        if self.timestamps:
            ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
            qp = new("VkQueryPoolCreateInfo", sType=vk.VK_STRUCTURE_TYPE_QUERY_POOL_CREATE_INFO,
                     queryType=vk.VK_QUERY_TYPE_TIMESTAMP, queryCount=self._n_queries)
            p = ffi.new("VkQueryPool*")
            check(lib.vkCreateQueryPool(device.handle, qp, ffi.NULL, p), "vkCreateQueryPool")
            self._qpool = p[0]

    # ------------------------------------------------------------------ building
    def _label(self, i, op):
        return op.name or (op.kernel.name if isinstance(op, Dispatch) else "copy")

    def _validate(self, i, op):
        where = f"{self.name}: op {i} ({self._label(i, op)})"
        if isinstance(op, Copy):
            if op.size > op.src.size or op.size > op.dst.size:
                raise ValueError(f"{where}: copies {op.size} B between ranges of {op.src.size} and {op.dst.size} B")
            if op.size % 4 or op.src.offset % 4 or op.dst.offset % 4:
                raise ValueError(f"{where}: copy size and offsets must be multiples of 4")
            return
        if not isinstance(op, Dispatch):
            raise TypeError(f"{where}: a Dispatch or Copy expected, got {type(op).__name__}")
        k = op.kernel
        if len(op.buffers) != len(k.access):
            raise ValueError(f"{where}: kernel {k.name!r} has {len(k.access)} bindings, got {len(op.buffers)} buffers")
        for b, rng in enumerate(op.buffers):
            if not isinstance(rng, BufferRange) or rng.block.device is not self.device:
                raise ValueError(f"{where}: binding {b} is not a BufferRange of this device")
            if rng.size > self.device.limits["maxStorageBufferRange"]:
                raise ValueError(f"{where}: binding {b} spans {rng.size} B; the device binds at most "
                                 f"maxStorageBufferRange = {self.device.limits['maxStorageBufferRange']} B")
            align = self.device.limits["minStorageBufferOffsetAlignment"]
            if rng.offset % align:
                raise ValueError(f"{where}: binding {b} offset {rng.offset} is not a multiple of "
                                 f"minStorageBufferOffsetAlignment ({align})")
        g = (op.groups,) if isinstance(op.groups, int) else tuple(op.groups)
        g = tuple(int(x) for x in g) + (1,) * (3 - len(g))
        lim = self.device.limits["maxComputeWorkGroupCount"]
        if len(g) != 3 or any(x < 0 or x > m for x, m in zip(g, lim)):
            raise ValueError(f"{where}: workgroup counts {g} outside 0..{lim}")
        op.groups = g
        push = op.push or b""
        if len(push) != k.push_size:
            raise ValueError(f"{where}: kernel {k.name!r} takes {k.push_size} B of push constants, got {len(push)}")

    def _build_sets(self):
        """One descriptor set per distinct (kernel layout, ranges), from a pool sized for them."""
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        d = self.device.handle
        if self._pool is not None:
            lib.vkDestroyDescriptorPool(d, self._pool, ffi.NULL)
        keys = {}
        for op in self.ops:
            if isinstance(op, Dispatch):
                key = (id(op.kernel.set_layout), tuple((id(r.block), r.offset, r.size) for r in op.buffers))
                keys.setdefault(key, op)
        n_sets = max(len(keys), 1)
        n_desc = max(sum(len(op.buffers) for op in keys.values()), 1)
        ps = new("VkDescriptorPoolSize", type=vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER, descriptorCount=n_desc)
        dp = new("VkDescriptorPoolCreateInfo", sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_POOL_CREATE_INFO,
                 maxSets=n_sets, poolSizeCount=1, pPoolSizes=ps)
        p = ffi.new("VkDescriptorPool*")
        check(lib.vkCreateDescriptorPool(d, dp, ffi.NULL, p), f"vkCreateDescriptorPool({self.name})")
        self._pool = p[0]
        self._sets = {}
        for key, op in keys.items():
            ai = new("VkDescriptorSetAllocateInfo", sType=vk.VK_STRUCTURE_TYPE_DESCRIPTOR_SET_ALLOCATE_INFO,
                     descriptorPool=self._pool, descriptorSetCount=1, pSetLayouts=op.kernel._set_layouts)
            s = ffi.new("VkDescriptorSet[1]")
            check(lib.vkAllocateDescriptorSets(d, ai, s), f"vkAllocateDescriptorSets({op.kernel.name})")
            n = len(op.buffers)
            if n:
                infos = ffi.new("VkDescriptorBufferInfo[]", n)
                wr = ffi.new("VkWriteDescriptorSet[]", n)
                # the buffers in order of the bindings and, within an array of buffers, its elements
                slots = [(b, e) for b, c in enumerate(op.kernel.counts) for e in range(c)]
                for b, (rng, (binding, element)) in enumerate(zip(op.buffers, slots)):
                    infos[b].buffer, infos[b].offset, infos[b].range = rng.block.buffer, rng.offset, max(rng.size, 4)
                    wr[b].sType = vk.VK_STRUCTURE_TYPE_WRITE_DESCRIPTOR_SET
                    wr[b].dstSet, wr[b].dstBinding, wr[b].dstArrayElement = s[0], binding, element
                    wr[b].descriptorCount = 1
                    wr[b].descriptorType = vk.VK_DESCRIPTOR_TYPE_STORAGE_BUFFER
                    wr[b].pBufferInfo = infos + b
                lib.vkUpdateDescriptorSets(d, n, wr, 0, ffi.NULL)
            self._sets[key] = s
        self._op_sets = []
        for op in self.ops:
            if isinstance(op, Dispatch):
                key = (id(op.kernel.set_layout), tuple((id(r.block), r.offset, r.size) for r in op.buffers))
                self._op_sets.append(self._sets[key])
            else:
                self._op_sets.append(None)

    def _relevel(self):
        if self.use_levels:
            self.levels = group_levels(list(op.accesses()) for op in self.ops)
        else:
            self.levels = serial_levels(len(self.ops))
        self._dirty = True

    # ------------------------------------------------------------------ changes
    def set_push(self, i, data: bytes):
        op = self.ops[i]
        if not isinstance(op, Dispatch) or len(data) != op.kernel.push_size:
            raise ValueError(f"{self.name}: op {i}: push constants of {len(data)} B for "
                             f"{getattr(getattr(op, 'kernel', None), 'push_size', 0)} B")
        if data != op.push:
            op.push = bytes(data)
            self._dirty = True

    def set_buffers(self, i, buffers):
        op = self.ops[i]
        op.buffers = list(buffers)
        self._validate(i, op)
        self._build_sets()
        self._relevel()

    # ------------------------------------------------------------------ recording and running
    @property
    def stats(self) -> dict:
        n_disp = sum(isinstance(op, Dispatch) for op in self.ops)
        return dict(dispatches=n_disp, copies=len(self.ops) - n_disp, levels=len(self.levels),
                    barriers=max(len(self.levels) - 1, 0), edge_barriers=2,
                    max_level_width=max((len(lv) for lv in self.levels), default=0),
                    recorded=self.record_count)

    def _record(self):
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        cmd = self._cmd[0]
        check(lib.vkResetCommandBuffer(cmd, 0), "vkResetCommandBuffer")
        bi = new("VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO)
        check(lib.vkBeginCommandBuffer(cmd, bi), "vkBeginCommandBuffer")
        qp = self._qpool
        if qp is not None:
            lib.vkCmdResetQueryPool(cmd, qp, 0, self._n_queries)
        full_barrier(cmd, entry=True)
        CT = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
        W = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
        mb = new("VkMemoryBarrier", sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=W,
                 dstAccessMask=W | vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT)
        BP = vk.VK_PIPELINE_BIND_POINT_COMPUTE
        STAGE = vk.VK_SHADER_STAGE_COMPUTE_BIT
        BOTTOM = vk.VK_PIPELINE_STAGE_BOTTOM_OF_PIPE_BIT
        dispatch, bind_p, bind_s = lib.vkCmdDispatch, lib.vkCmdBindPipeline, lib.vkCmdBindDescriptorSets
        push_c, barrier, ts = lib.vkCmdPushConstants, lib.vkCmdPipelineBarrier, lib.vkCmdWriteTimestamp
        keep = []
        self._pushes = keep
        if qp is not None:
            ts(cmd, vk.VK_PIPELINE_STAGE_TOP_OF_PIPE_BIT, qp, 0)
        last_pipe = last_set = None
        for li, level in enumerate(self.levels):
            if li:
                barrier(cmd, CT, CT, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
            for i in level:
                op = self.ops[i]
                if isinstance(op, Copy):
                    r = new("VkBufferCopy", srcOffset=op.src.offset, dstOffset=op.dst.offset, size=op.size)
                    keep.append(r)
                    lib.vkCmdCopyBuffer(cmd, op.src.block.buffer, op.dst.block.buffer, 1, r)
                else:
                    k = op.kernel
                    if k.pipeline != last_pipe:
                        bind_p(cmd, BP, k.pipeline)
                        last_pipe, last_set = k.pipeline, None
                    s = self._op_sets[i]
                    if s is not None and s is not last_set and len(op.buffers):
                        bind_s(cmd, BP, k.layout, 0, 1, s, 0, ffi.NULL)
                        last_set = s
                    if k.push_size:
                        data = ffi.new("char[]", op.push)
                        keep.append(data)
                        push_c(cmd, k.layout, STAGE, 0, k.push_size, data)
                    x, y, z = op.groups
                    if x and y and z:
                        dispatch(cmd, x, y, z)
                if qp is not None and self.ts_mode == "ops":
                    ts(cmd, BOTTOM, qp, self._slot(i))
        if qp is not None and self.ts_mode == "step":
            ts(cmd, BOTTOM, qp, 1)
        full_barrier(cmd, entry=False)
        check(lib.vkEndCommandBuffer(cmd), "vkEndCommandBuffer")
        self.record_count += 1
        self._dirty = False

    def _slot(self, i):
        """Query index written after op ``i`` (its position in recorded order, plus one)."""
        return self._position[i] + 1

    def record(self) -> float:
        """(Re-)record the command buffer now; returns the host seconds it took."""
        t0 = time.perf_counter()
        self._position = {i: pos for pos, i in enumerate(itertools.chain.from_iterable(self.levels))}
        self._record()
        return time.perf_counter() - t0

    def run(self, wait=True):
        """Submit the step (re-recording first if an op changed)."""
        if self.device.handle is None:
            raise RuntimeError(f"{self.name}: the device is closed")
        if self._dirty:
            self.record()
        self.device.submit(self._cmd, self._fence, wait=wait)

    def wait(self):
        self.device.wait_fence(self._fence)

    @property
    def _n_queries(self):
        return 2 if self.ts_mode == "step" else len(self.ops) + 1

    def _read_queries(self):
        if self._qpool is None:
            raise RuntimeError(f"{self.name}: recorded without timestamps (Program(..., timestamps=True))")
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        n = self._n_queries
        data = ffi.new("uint64_t[]", n)
        check(lib.vkGetQueryPoolResults(self.device.handle, self._qpool, 0, n, 8 * n, data, 8,
                                        vk.VK_QUERY_RESULT_64_BIT | vk.VK_QUERY_RESULT_WAIT_BIT),
              "vkGetQueryPoolResults")
        bits = self.device.timestamp_bits
        mask = (1 << bits) - 1 if bits < 64 else (1 << 64) - 1
        t = np.array([int(data[i]) & mask for i in range(n)], dtype=np.float64) * self.device.limits["timestampPeriod"]
        return t - t[0]

    def timestamps_ns(self) -> np.ndarray:
        """(n_ops, 2) [start, end] in ns per op in program order (after ``run``)."""
        if self.ts_mode == "step":
            raise RuntimeError(f"{self.name}: timestamps='step' times the whole step only (gpu_seconds)")
        t = self._read_queries()
        out = np.zeros((len(self.ops), 2), dtype=np.int64)
        for i in range(len(self.ops)):
            pos = self._position[i]
            out[i] = (int(t[pos]), int(t[pos + 1]))
        return out

    def gpu_seconds(self) -> float:
        """GPU time of the last run from the first to the last timestamp."""
        t = self._read_queries()
        return float(t[-1] - t[0]) * 1e-9

    @property
    def names(self):
        return [self._label(i, op) for i, op in enumerate(self.ops)]

    def close(self):
        if self._cmd is None:
            return
        ffi, lib = _vk.ffi, _vk.lib
        d = self.device.handle
        if d is not None:
            lib.vkQueueWaitIdle(self.device.queue)
            if self._qpool is not None:
                lib.vkDestroyQueryPool(d, self._qpool, ffi.NULL)
            if self._pool is not None:
                lib.vkDestroyDescriptorPool(d, self._pool, ffi.NULL)
            lib.vkDestroyFence(d, self._fence[0], ffi.NULL)
            self.device.free_command_buffer(self._cmd)
        self._cmd = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
