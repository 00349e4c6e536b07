"""Device memory of the Vulkan device: blocks (``MemoryBlock``) sub-allocated into ranges,
staging and mapped input blocks, and the copies, uploads and downloads between host and
device (``DeviceMemory``, a part of ``VulkanDevice``)."""
from __future__ import annotations

import numpy as np

from . import _vk
from ._vk import VulkanError, VulkanUnavailable, check, new
from .memory import BufferRange, OffsetAllocator, align_up


DEFAULT_BLOCK_BYTES = 64 << 20
# staging blocks for requests of at most a quarter of this, when none has room (see ``alloc``)
SMALL_STAGING_BYTES = 1 << 20


# host-mappable device-local memory holds inputs only on a heap this large (resizable BAR;
# without it the mappable window is 256 MiB, which the driver needs for itself)
INPUT_HEAP_BYTES = 1 << 30


class MemoryBlock:
    """One ``vkAllocateMemory`` with one ``VkBuffer`` bound over all of it; mapped when
    host-visible and wanted on the host. ``maker``: an executor that creates the Vulkan
    objects while the caller goes on (device memory the host never maps); ``buffer`` and
    ``memory`` wait for them, and raise the creation's error. The driver's allocation costs
    about 24 ms per GiB on an H200 and runs no faster on several threads, so it is what a
    warm compile waits for unless the plan's bookkeeping runs beside it."""

    def __init__(self, dev, size, mem_type, mapped, label, shared=True, maker=None):
        self.device, self.size, self.mem_type, self.label = dev, size, mem_type, label
        self.shared = shared           # sub-allocated (else one tensor's own block)
        self.mapped = None
        self.allocator = OffsetAllocator(size, dev.alignment)
        self._handles = self._pending = None
        if maker is not None and not mapped:
            self._pending = maker.submit(self._create, False)
        else:
            self._handles = self._create(mapped)

    def _create(self, mapped):
        dev, size, label = self.device, self.size, self.label
        ffi, lib = _vk.ffi, _vk.lib
        usage = (_vk.vk.VK_BUFFER_USAGE_STORAGE_BUFFER_BIT | _vk.vk.VK_BUFFER_USAGE_TRANSFER_SRC_BIT
                 | _vk.vk.VK_BUFFER_USAGE_TRANSFER_DST_BIT)
        bi = new("VkBufferCreateInfo", sType=_vk.vk.VK_STRUCTURE_TYPE_BUFFER_CREATE_INFO, size=size,
                 usage=usage, sharingMode=_vk.vk.VK_SHARING_MODE_EXCLUSIVE)
        pb = ffi.new("VkBuffer*")
        check(lib.vkCreateBuffer(dev.handle, bi, ffi.NULL, pb), f"vkCreateBuffer({label}, {size} B)")
        buffer = pb[0]
        req = ffi.new("VkMemoryRequirements*")
        lib.vkGetBufferMemoryRequirements(dev.handle, buffer, req)
        if not req.memoryTypeBits & (1 << self.mem_type):
            lib.vkDestroyBuffer(dev.handle, buffer, ffi.NULL)
            raise VulkanError(f"memory type {self.mem_type} not allowed for a storage buffer ({label})", -2)
        ai = new("VkMemoryAllocateInfo", sType=_vk.vk.VK_STRUCTURE_TYPE_MEMORY_ALLOCATE_INFO,
                 allocationSize=req.size, memoryTypeIndex=self.mem_type)
        pm = ffi.new("VkDeviceMemory*")
        res = lib.vkAllocateMemory(dev.handle, ai, ffi.NULL, pm)
        if res != 0:
            lib.vkDestroyBuffer(dev.handle, buffer, ffi.NULL)
            check(res, f"vkAllocateMemory({label}, {req.size} B, type {self.mem_type})")
        memory = pm[0]
        res = lib.vkBindBufferMemory(dev.handle, buffer, memory, 0)
        if res == 0 and mapped:
            pp = ffi.new("void**")
            res = lib.vkMapMemory(dev.handle, memory, 0, size, 0, pp)
            if res == 0:
                self.mapped = np.frombuffer(ffi.buffer(pp[0], size), dtype=np.uint8)
        if res != 0:
            lib.vkDestroyBuffer(dev.handle, buffer, ffi.NULL)
            lib.vkFreeMemory(dev.handle, memory, ffi.NULL)
            check(res, f"vkBindBufferMemory / vkMapMemory({label})")
        return buffer, memory

    @property
    def failed(self) -> bool:
        """Whether creating the block raised (``buffer`` raises it again)."""
        return self._pending is not None and self._pending.done() and self._pending.exception() is not None

    def created(self):
        """The block's VkBuffer once created (waiting for it), None if that failed."""
        if self._pending is not None and self._pending.exception() is not None:
            return None
        return self.buffer

    def _wait(self):
        if self._pending is not None:
            self._handles, self._pending = self._pending.result(), None   # raises the creation's error
        return self._handles

    @property
    def buffer(self):
        h = self._handles or self._wait()
        return h[0] if h else None      # None once destroyed

    @property
    def memory(self):
        h = self._handles or self._wait()
        return h[1] if h else None

    def destroy(self):
        try:
            handles = self._wait()
        except VulkanError:        # never created: nothing to give back
            handles = None
        self._handles = self._pending = None
        if handles is None:
            return
        lib, ffi, d = _vk.lib, _vk.ffi, self.device.handle
        if self.mapped is not None:
            self.mapped = None
            lib.vkUnmapMemory(d, handles[1])
        lib.vkDestroyBuffer(d, handles[0], ffi.NULL)
        lib.vkFreeMemory(d, handles[1], ffi.NULL)


class DeviceMemory:
    """The part of ``VulkanDevice`` that holds memory: blocks sub-allocated into ranges, and
    the transfers between host and device."""

    def _find_type(self, want, avoid=0):
        for i, fl in enumerate(self.memory_types):
            if fl & want == want and not fl & avoid:
                return i
        return None

    def _find_type_on_heap(self, want, least_heap_bytes):
        for i, fl in enumerate(self.memory_types):
            if fl & want == want and self.memory_heaps[self.memory_type_heaps[i]]["size"] >= least_heap_bytes:
                return i
        return None

    def _init_memory(self, direct):
        vk = _vk.vk
        DL, HV = vk.VK_MEMORY_PROPERTY_DEVICE_LOCAL_BIT, vk.VK_MEMORY_PROPERTY_HOST_VISIBLE_BIT
        HC, HCA = vk.VK_MEMORY_PROPERTY_HOST_COHERENT_BIT, vk.VK_MEMORY_PROPERTY_HOST_CACHED_BIT
        self.alignment = max(256, self.limits["minStorageBufferOffsetAlignment"])
        uma_type = self._find_type(DL | HV | HC)
        if direct is None:
            direct = uma_type is not None and self.device_type in ("cpu", "integrated")
        if direct and uma_type is None:
            raise VulkanUnavailable(f"{self.name}: no host-visible device-local memory for direct host access")
        self.direct_host_access = bool(direct)
        if direct:
            self.device_mem_type = uma_type
        else:
            self.device_mem_type = self._find_type(DL, avoid=HV)
            if self.device_mem_type is None:
                self.device_mem_type = self._find_type(DL)
        if self.device_mem_type is None:
            self.device_mem_type = 0
        # a call's inputs, which the host writes before every step: device-local memory the
        # host maps, where all of it is mappable (resizable BAR), takes one memcpy and no copy
        # in the step (Whisper-tiny's 0.96 MB input on an H200: 0.17 -> 0.07 ms a call)
        self.input_mem_type = None if direct else self._find_type_on_heap(DL | HV | HC, INPUT_HEAP_BYTES)
        st = self._find_type(HV | HC | HCA)
        self.staging_mem_type = st if st is not None else self._find_type(HV | HC)
        if self.staging_mem_type is None:
            raise VulkanUnavailable(f"{self.name}: no host-visible coherent memory type for staging")

    def alloc(self, nbytes, host=False, label=None, zeroed=False, input=False) -> BufferRange:
        """``nbytes`` (rounded up to the alignment) of device memory, or of host-visible
        staging memory when ``host``; ``input``: device memory the host writes directly where
        the device has it (``input_mem_type``), else ordinary device memory. Free with
        ``free``. ``zeroed``: the range holds zeros. Device-only blocks are created on a
        thread of their own while the caller goes on, and filled with zeros once, all new
        ones together before the next GPU work (``_one_shot``, ``submit``), so only a range
        that reuses freed bytes costs a fill of its own. A small staging request with no room
        takes a small block (``SMALL_STAGING_BYTES``): pinning host memory costs about 0.23
        ms per MiB (an H200's host), 15 ms for a whole block, which a plan uploading a few
        constants or reading back a loss would wait for."""
        nbytes = int(nbytes)
        kind = "staging" if host else "input" if input and self.input_mem_type is not None else "device"
        # a large tensor gets a block of its own, so that freeing it gives the memory back
        dedicated = nbytes >= self.block_bytes // 4
        with self._lock:
            # newest block first: while a session allocates its tensors the older blocks are
            # full, and asking each of them first made SmolLM2's 1643 allocations 16 times
            # as many block queries; a hole a free left in an older block is still found
            # before a new block is made
            for blk in ([] if dedicated else reversed(self._blocks[kind])):
                if not blk.shared:
                    continue
                high_water = blk.allocator.high_water
                off = blk.allocator.alloc(nbytes)
                if off is not None:
                    rng = BufferRange(blk, off, nbytes)
                    if zeroed and (blk.mapped is not None or off < high_water):
                        self.zero(rng)
                    return rng
            if dedicated:
                size = align_up(max(nbytes, 1), self.alignment)
            elif kind == "staging" and nbytes <= SMALL_STAGING_BYTES // 4:
                size = min(SMALL_STAGING_BYTES, self.block_bytes)
            else:
                size = self.block_bytes
            size = min(size, max(self.limits["maxMemoryAllocationSize"], align_up(nbytes, self.alignment)))
            mapped = kind != "device" or self.direct_host_access
            mem_type = {"staging": self.staging_mem_type, "input": self.input_mem_type}.get(kind, self.device_mem_type)
            blk = MemoryBlock(self, size, mem_type, mapped, f"{kind}#{len(self._blocks[kind])}",
                              shared=not dedicated, maker=None if mapped else self._block_maker())
            self._blocks[kind].append(blk)
            rng = BufferRange(blk, blk.allocator.alloc(nbytes), nbytes)
            if zeroed and blk.mapped is not None:
                self.zero(rng)
            elif blk.mapped is None:
                self._unfilled.append(blk)      # the block's one fill, before the next GPU work
            return rng

    def _block_maker(self):
        """The thread that creates device blocks (``MemoryBlock``'s ``maker``), started on first use."""
        if self._maker is None:
            from concurrent.futures import ThreadPoolExecutor
            self._maker = ThreadPoolExecutor(1, thread_name_prefix="vk-memory")
        return self._maker

    def free(self, rng: BufferRange):
        """Give a range back. A device block left empty goes back to the driver (closing a
        session frees its memory); one empty staging block of each size is kept for the next
        transfer."""
        with self._lock:
            blk = rng.block
            blk.allocator.free(rng.offset)
            if blk.allocator.used:
                return
            staging = self._blocks["staging"]
            if blk in staging and blk.shared and \
                    not any(b is not blk and b.size == blk.size and not b.allocator.used for b in staging):
                return
            next(blocks for blocks in self._blocks.values() if blk in blocks).remove(blk)
            if blk in self._unfilled:
                self._unfilled.remove(blk)
            blk.destroy()

    def memory_report(self) -> dict:
        return {k: [dict(label=b.label, size=b.size, used=b.allocator.bytes_used, mapped=b.mapped is not None)
                    for b in blocks] for k, blocks in self._blocks.items()}

    def _one_shot(self, record):
        """Record ``record(cmd)`` into the transfer command buffer between full barriers
        (earlier GPU writes -> this work -> host reads), after the fills of new blocks, submit
        and wait."""
        ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
        pc = self._xfer_cmd
        with self._lock:
            fills, self._unfilled = self._unfilled, []
            try:
                check(lib.vkResetCommandBuffer(pc[0], 0), "vkResetCommandBuffer")
                bi = new("VkCommandBufferBeginInfo", sType=vk.VK_STRUCTURE_TYPE_COMMAND_BUFFER_BEGIN_INFO,
                         flags=vk.VK_COMMAND_BUFFER_USAGE_ONE_TIME_SUBMIT_BIT)
                check(lib.vkBeginCommandBuffer(pc[0], bi), "vkBeginCommandBuffer")
                for blk in fills:
                    # waits for a block still being created; one that failed raises where it is used
                    buffer = blk.created()
                    if buffer is not None:
                        lib.vkCmdFillBuffer(pc[0], buffer, 0, blk.size, 0)
                full_barrier(pc[0], entry=True)
                record(pc[0])
                full_barrier(pc[0], entry=False)
                check(lib.vkEndCommandBuffer(pc[0]), "vkEndCommandBuffer")
                self.submit(pc, self._xfer_fence)
            except BaseException:
                self._unfilled = fills + self._unfilled      # the fills run with the next GPU work
                raise

    def copy(self, src: BufferRange, dst: BufferRange, nbytes=None):
        self.copy_many([(src, dst, nbytes)])

    def copy_many(self, copies):
        """Run (src, dst, nbytes or None) copies in one submit and wait."""
        regions = []
        for src, dst, n in copies:
            n = min(src.size, dst.size) if n is None else int(n)
            regions.append((src.block.buffer, dst.block.buffer,
                            new("VkBufferCopy", srcOffset=src.offset, dstOffset=dst.offset, size=n)))

        def record(cmd):
            for sb, db, r in regions:
                _vk.lib.vkCmdCopyBuffer(cmd, sb, db, 1, r)
        if regions:
            self._one_shot(record)

    def zero(self, rng: BufferRange):
        """Fill ``rng`` with zeros (synchronously; its size a multiple of 4)."""
        if rng.block.mapped is not None:
            rng.block.mapped[rng.offset:rng.offset + rng.size] = 0
        elif rng.size:
            self._one_shot(lambda cmd: _vk.lib.vkCmdFillBuffer(cmd, rng.block.buffer, rng.offset, rng.size, 0))

    def upload(self, dst: BufferRange, array):
        """Write ``array``'s bytes at the start of ``dst`` (synchronously)."""
        raw = np.ascontiguousarray(array).reshape(-1).view(np.uint8)
        if raw.size > dst.size:
            raise ValueError(f"upload of {raw.size} B into a range of {dst.size} B ({dst})")
        if raw.size == 0:
            return
        if dst.block.mapped is not None:
            dst.block.mapped[dst.offset:dst.offset + raw.size] = raw
            return
        stage = self.alloc(raw.size, host=True)
        try:
            stage.block.mapped[stage.offset:stage.offset + raw.size] = raw
            self.copy(stage, dst, raw.size)
        finally:
            self.free(stage)

    def download(self, src: BufferRange, dtype=np.uint8, shape=None) -> np.ndarray:
        """A copy of ``src``'s bytes as ``dtype`` (and ``shape``)."""
        dtype = np.dtype(dtype)
        count = int(np.prod(shape)) if shape is not None else src.size // dtype.itemsize
        n = count * dtype.itemsize
        if n > src.size:
            raise ValueError(f"download of {n} B from a range of {src.size} B ({src})")
        if src.block.mapped is not None:
            out = src.block.mapped[src.offset:src.offset + n].copy()
        else:
            stage = self.alloc(max(n, 4), host=True)
            try:
                self.copy(src, stage, n)
                out = stage.block.mapped[stage.offset:stage.offset + n].copy()
            finally:
                self.free(stage)
        out = out.view(dtype)
        return out.reshape(shape) if shape is not None else out

    def array(self, array, label=None) -> BufferRange:
        """A new device range holding ``array``."""
        arr = np.ascontiguousarray(array)
        rng = self.alloc(max(arr.nbytes, 4), label=label)
        self.upload(rng, arr)
        return rng


def full_barrier(cmd, entry):
    """entry: earlier writes (GPU and host) -> compute/transfer reads and writes of this
    command buffer; exit: its compute/transfer writes -> host reads."""
    ffi, lib, vk = _vk.ffi, _vk.lib, _vk.vk
    CT = vk.VK_PIPELINE_STAGE_COMPUTE_SHADER_BIT | vk.VK_PIPELINE_STAGE_TRANSFER_BIT
    W = vk.VK_ACCESS_SHADER_WRITE_BIT | vk.VK_ACCESS_TRANSFER_WRITE_BIT
    RW = W | vk.VK_ACCESS_SHADER_READ_BIT | vk.VK_ACCESS_TRANSFER_READ_BIT
    if entry:
        mb = new("VkMemoryBarrier", sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=W | vk.VK_ACCESS_HOST_WRITE_BIT,
                 dstAccessMask=RW)
        src, dst = CT | vk.VK_PIPELINE_STAGE_HOST_BIT, CT
    else:
        mb = new("VkMemoryBarrier", sType=vk.VK_STRUCTURE_TYPE_MEMORY_BARRIER, srcAccessMask=W,
                 dstAccessMask=vk.VK_ACCESS_HOST_READ_BIT | vk.VK_ACCESS_HOST_WRITE_BIT)
        src, dst = CT, vk.VK_PIPELINE_STAGE_HOST_BIT
    lib.vkCmdPipelineBarrier(cmd, src, dst, 0, 1, mb, 0, ffi.NULL, 0, ffi.NULL)
