"""The Vulkan backend's compiled-kernel cache: a kernel text's SPIR-V and reflection kept on
disk under a key of the text, so that a warm process creates its pipelines without
printing GLSL, running glslang or parsing SPIR-V (a request for many kernels
reads them from one set); corrupt entries are ignored and rewritten; ``MEGANEURA_NO_DISK_CACHE=1`` writes and reads nothing. Also: pipelines
made in batches share their layouts, and a failing batch names its kernel."""
import threading

import numpy as np
import pytest

import meganeura as mg
from meganeura.runtime.vulkan import cache

# ------------------------------------------------------------------ device-free: entries


def _spirv(nops=0):
    """A structurally whole compute module (``spirv.validate``): capability, memory model, a
    GLCompute entry point "main", ``nops`` OpNops and the function (void %1() {})."""
    import struct
    words = [0x07230203, 0x00010300, 0, 5, 0, (2 << 16) | 17, 1, (3 << 16) | 14, 0, 1,
             (5 << 16) | 15, 5, 1, *struct.unpack("<2I", b"main\0\0\0\0"), *[(1 << 16)] * nops,
             (5 << 16) | 54, 2, 1, 0, 3, (1 << 16) | 56]
    return struct.pack(f"<{len(words)}I", *words)


def _entry():
    spirv = _spirv(nops=5)
    info = dict(bindings={0: "read", 1: "rw"}, local_size=(64, 1, 1), push_constant_size=8, workgroup_memory=256,
                capabilities=["Shader"], extensions=[])
    return cache.CompiledKernel(spirv, info, True)


def test_an_entry_reads_back_as_written_and_only_under_its_key():
    ck = _entry()
    data = cache.encode_kernel("k1", ck)
    assert cache.decode_kernel("k1", data) == ck
    assert cache.decode_kernel("k2", data) is None                 # another key's entry
    assert cache.decode_kernel("k1", data[:-4]) is None            # truncated
    flipped = bytearray(data)
    flipped[-5] ^= 0xFF
    assert cache.decode_kernel("k1", bytes(flipped)) is None       # corrupted SPIR-V
    assert cache.decode_kernel("k1", b"garbage") is None
    assert cache.decode_kernel("k1", data[:12]) is None
    # a binding that is an array of buffers keeps its count
    arrays = cache.CompiledKernel(ck.spirv, {**ck.info, "counts": {0: 3, 1: 1}}, False)
    assert cache.decode_kernel("k1", cache.encode_kernel("k1", arrays)) == arrays


def test_the_key_follows_everything_that_decides_the_spirv():
    base = dict(unroll=False, target="vulkan1.3", glslang="g 1", package="p")
    k = cache.kernel_key("text", **base)
    assert k == cache.kernel_key("text", **base)
    for change in (dict(unroll=True), dict(target="vulkan1.2"), dict(glslang="g 2"), dict(package="q")):
        assert cache.kernel_key("text", **{**base, **change}) != k
    assert cache.kernel_key("text2", **base) != k


def test_a_kernel_set_reads_back_whole_and_the_oldest_sets_go(tmp_path, monkeypatch):
    import os
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    ks = [_entry(), cache.CompiledKernel(_spirv(nops=7), {**_entry().info, "local_size": None}, False)]
    assert cache.store_kernel_set("s1", ks)
    assert cache.load_kernel_set("s1", 2) == ks
    assert cache.load_kernel_set("s1", 3) is None and cache.load_kernel_set("s2", 2) is None
    path = cache.kernel_set_path("s1")
    data = path.read_bytes()
    for bad in (data[:-4], data[:-5] + bytes([data[-5] ^ 1]) + data[-4:], b""):
        path.write_bytes(bad)
        assert cache.load_kernel_set("s1", 2) is None
        assert not path.exists()                    # a bad entry is deleted (rewritten by the next store)
    # past SET_MAX_BYTES the least recently written sets are deleted
    monkeypatch.setattr(cache, "SET_MAX_BYTES", 2 * len(data))
    for i, key in enumerate(("a", "b", "c")):
        cache.store_kernel_set(key, ks)
        os.utime(cache.kernel_set_path(key), (1000 + i, 1000 + i))
    cache.store_kernel_set("d", ks)
    left = sorted(p.stem for p in path.parent.glob("*.bin"))
    assert left == ["c", "d"]


# ------------------------------------------------------------------ on the device
vulkan = pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
from meganeura.compilation import vulkan as vk_finish  # noqa: E402
from meganeura.runtime.vulkan import backend  # noqa: E402
from meganeura.runtime.vulkan import device as vkdevice  # noqa: E402
from meganeura.runtime.vulkan import pipelines  # noqa: E402
from tests.printed_trees import PRINTED  # noqa: E402


class _Runtime:
    """What a fresh process's Vulkan session does with kernel texts: the compile stage
    finishes them for the runtime's target (nothing compiled kept in memory from before: the
    disk caches serve them; the kernel ASTs the texts were printed from during the test are
    handed over, as a plan hands its own), and the runtime creates their pipelines. ``stats``: the runtime's,
    with the finishing's kernels read from disk and seconds printing GLSL."""

    def __init__(self, dev):
        vk_finish.clear_memory()
        self.rt = backend.VulkanRuntime(dev)
        self.finished = {"kernel_cache_hits": 0, "glsl_seconds": 0.0, "kernels_compiled": 0}

    @property
    def stats(self):
        return {**self.rt.stats, **self.finished}

    @property
    def _pipelines(self):
        return self.rt._pipelines

    def _kernel_set_key(self, texts):
        return vk_finish.VulkanKernels(self.rt.target())._set_key(texts)

    def pipelines(self, shaders, threads=None):
        fin = vk_finish.VulkanKernels(self.rt.target(), threads=threads)
        fin.take_trees(PRINTED)
        try:
            done = fin.finish(shaders)
        finally:
            fin.close()
            for k in self.finished:
                self.finished[k] += fin.stats[k]
        return self.rt.pipelines([done[t] for t, _ in shaders], threads=threads)


def _texts(rt, monkeypatch, with_loss=False):
    """The kernel texts (and names) of a small training step compiled and run on ``rt``
    (and the loss of two steps)."""
    monkeypatch.setattr(backend, "_runtime", rt.rt)
    g = mg.Graph()
    x, y = g.input("x", (16, 8)), g.input("y", (16,), mg.i32)
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("a.weight", (12, 8)), g.parameter("a.bias", (12,))))
    loss = mg.ops.cross_entropy(mg.ops.linear(h, g.parameter("b.weight", (3, 12))), y)
    rng = np.random.default_rng(0)
    feed = {"x": rng.standard_normal((16, 8)).astype(np.float32), "y": rng.integers(0, 3, 16).astype(np.int32)}
    with mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="vulkan", plan_cache=False) as s:
        losses = [float(s.step(feed)) for _ in range(2)]
        shaders = {d.wgsl: d.kernel.name for p in s.executor.plans.values() for d in p.kernel_plan.dispatches}
    return (list(shaders.items()), losses) if with_loss else list(shaders.items())


def _forbid_compiling(monkeypatch):
    """Printing, compiling or reflecting anything fails the test."""
    from meganeura.codegen import kernel_ast
    from meganeura.compilation import glslang

    def fail(*a, **k):
        raise AssertionError("compiled a kernel the cache holds")
    monkeypatch.setattr(kernel_ast, "print_glsl", fail)
    monkeypatch.setattr(glslang, "compile_glsl", fail)
    monkeypatch.setattr(pipelines, "reflect", fail)


def _same(a, b):
    assert (a.access, a.push_size, a.local_size, a.capabilities) == (b.access, b.push_size, b.local_size, b.capabilities)


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEGANEURA_NO_DISK_CACHE", raising=False)
    return tmp_path


def test_a_warm_runtime_creates_the_same_pipelines_without_printing(cache_dir, monkeypatch):
    from meganeura.runtime.vulkan.device import get_vulkan_device
    dev = get_vulkan_device()
    cold = _Runtime(dev)
    shaders, cold_losses = _texts(cold, monkeypatch, with_loss=True)
    assert len(shaders) >= 4
    entries = list((cache_dir / "kernels").glob("*.bin"))
    assert len(entries) == len(shaders) and cold.stats["kernel_cache_hits"] == 0
    first = cold.pipelines(shaders)

    _forbid_compiling(monkeypatch)
    warm = _Runtime(dev)         # a fresh runtime: nothing in memory
    again = warm.pipelines(shaders, threads=2)
    assert warm.stats["kernel_cache_hits"] == len(shaders) == warm.stats["pipelines_compiled"]
    assert warm.stats["glsl_seconds"] < 0.01
    for a, b in zip(first, again):
        _same(a, b)
        assert a.name == b.name
    # kernels with as many bindings and push-constant bytes share their layouts
    by_sig = {}
    for k in again:
        by_sig.setdefault((len(k.access), k.push_size), set()).add(id(k.layout))
    assert all(len(v) == 1 for v in by_sig.values())
    # and a session on the warm runtime runs as the cold one did, compiling nothing
    _, losses = _texts(warm, monkeypatch, with_loss=True)
    assert np.isfinite(losses).all() and losses == cold_losses


def test_corrupt_entries_are_ignored_and_rewritten(cache_dir, monkeypatch):
    from meganeura.runtime.vulkan.device import get_vulkan_device
    dev = get_vulkan_device()
    shaders = _texts(_Runtime(dev), monkeypatch)
    for p in (cache_dir / "kernel_sets").glob("*.bin"):      # the kernels' own entries are read
        p.unlink()
    entries = sorted((cache_dir / "kernels").glob("*.bin"))
    good = {p: p.read_bytes() for p in entries}
    entries[0].write_bytes(good[entries[0]][:len(good[entries[0]]) // 2])      # truncated
    flipped = bytearray(good[entries[1]])
    flipped[-8] ^= 0x5A
    entries[1].write_bytes(bytes(flipped))                                    # a flipped bit
    entries[2].write_bytes(b"")                                               # empty
    rt = _Runtime(dev)
    ks = rt.pipelines(shaders)
    assert rt.stats["kernels_compiled"] == 3 and rt.stats["kernel_cache_hits"] == len(shaders) - 3
    assert all(k.pipeline is not None for k in ks)
    assert {p: p.read_bytes() for p in entries} == good                       # rewritten whole
    assert sorted((cache_dir / "kernels").iterdir()) == entries                    # no temp file left


def test_a_request_for_many_kernels_is_read_back_from_one_set(cache_dir, monkeypatch):
    """Kernels made for one request are stored together too: a warm runtime asking for the
    same texts reads that one file (the kernels' own entries gone, nothing compiles); a
    corrupt set is ignored, the entries are read and the set is rewritten whole."""
    from meganeura.runtime.vulkan.device import get_vulkan_device
    dev = get_vulkan_device()
    shaders = _texts(_Runtime(dev), monkeypatch)
    assert len(shaders) >= cache.SET_MIN_KERNELS
    for folder in ("kernels", "kernel_sets"):      # what compiling them stored: the request is new again
        for p in (cache_dir / folder).glob("*.bin"):
            p.unlink()
    cold = _Runtime(dev)
    first = cold.pipelines(shaders)
    path = cache.kernel_set_path(cold._kernel_set_key([text for text, _ in shaders]))
    assert cache.load_kernel_set(path.stem, len(shaders)) is not None
    whole = path.read_bytes()
    kernels = list((cache_dir / "kernels").glob("*.bin"))
    saved = {p: p.read_bytes() for p in kernels}
    for p in kernels:
        p.unlink()
    with monkeypatch.context() as m:
        _forbid_compiling(m)
        warm = _Runtime(dev)
        again = warm.pipelines(shaders, threads=2)
    assert warm.stats["kernel_cache_hits"] == len(shaders) == warm.stats["pipelines_compiled"]
    for a, b in zip(first, again):
        _same(a, b)
        assert a.name == b.name
    for p, data in saved.items():
        p.write_bytes(data)
    path.write_bytes(whole[:-9] + bytes([whole[-9] ^ 0x5A]) + whole[-8:])      # a flipped bit
    with monkeypatch.context() as m:
        _forbid_compiling(m)
        rt = _Runtime(dev)
        rt.pipelines(shaders)
    assert rt.stats["kernel_cache_hits"] == len(shaders) and path.read_bytes() == whole
    assert cache.load_kernel_set(path.stem, len(shaders) + 1) is None       # another request's length


def test_no_disk_cache_means_no_kernel_entries(cache_dir, monkeypatch):
    from meganeura.runtime.vulkan.device import get_vulkan_device
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    rt = _Runtime(get_vulkan_device())
    shaders = _texts(rt, monkeypatch)
    assert shaders and not any((cache_dir / d).exists() for d in ("kernels", "kernel_sets", "spirv"))
    rt2 = _Runtime(get_vulkan_device())
    rt2.pipelines(shaders)
    assert rt2.stats["kernel_cache_hits"] == 0 and not (cache_dir / "kernels").exists()


def test_a_batch_with_a_bad_kernel_names_it_and_leaves_no_pipeline():
    from meganeura.compilation import glslang
    from meganeura.runtime.vulkan import samples
    from meganeura.runtime.vulkan.device import get_vulkan_device
    dev = get_vulkan_device()
    spirv = glslang.compile_glsl(samples.SAXPY, name="saxpy")
    before = len(dev._kernels)
    specs = [dict(spirv=spirv, name=f"saxpy{i}") for i in range(5)]
    ks = dev.kernels(specs, threads=2)
    assert [k.name for k in ks] == [f"saxpy{i}" for i in range(5)] and len({id(k.layout) for k in ks}) == 1
    assert all(k.access == ("read", "rw") and k.push_size == 8 for k in ks)
    for k in ks:
        k.destroy()
    bad = specs[:2] + [dict(spirv=spirv, name="odd", access=("read",))] + specs[2:]
    with pytest.raises(ValueError, match="'odd': access"):
        dev.kernels(bad)
    assert len([k for k in dev._kernels if k.pipeline is not None]) <= before


def test_glslang_compiles_on_several_threads_as_on_one():
    from meganeura.compilation import glslang
    from meganeura.runtime.vulkan import samples
    sources = [(samples.SGEMM, samples.defines(samples.SGEMM_SMALL)), (samples.SAXPY, None)]
    sources = [(src, {**(d or {}), "MG_VARIANT": i}) for i in range(6) for src, d in sources]
    one = [glslang.compile_glsl(s, d, disk_cache=False) for s, d in sources]
    glslang.clear_memory_cache()
    out = [None] * len(sources)

    def work(i):
        out[i] = glslang.compile_glsl(*sources[i], disk_cache=False)
    threads = [threading.Thread(target=work, args=(i,)) for i in range(len(sources))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert out == one


def test_a_kernel_without_a_tree_names_itself_and_stores_nothing(cache_dir, monkeypatch):
    from meganeura.compilation.vulkan import KernelSourceError
    from meganeura.runtime.vulkan.device import get_vulkan_device
    rt = _Runtime(get_vulkan_device())
    good = _texts(rt, monkeypatch)[:2]
    rt = _Runtime(get_vulkan_device())
    before = sorted((cache_dir / "kernels").glob("*.bin"))
    with pytest.raises(KernelSourceError, match="broken"):
        rt.pipelines(good + [("fn main( {", "broken")])
    assert sorted((cache_dir / "kernels").glob("*.bin")) == before
    assert rt.pipelines(good)[0].pipeline is not None


def test_new_kernels_stream_to_the_threads_and_a_failure_leaves_no_pipeline(cache_dir, monkeypatch):
    """New kernels are printed longest first and compiled on the pool while the rest are
    printed: the same kernels as one at a time; a kernel with no tree to print, met after
    others were handed to the pool, raises once they end, and none of them stays alive."""
    from meganeura.compilation.vulkan import KernelSourceError
    from meganeura.runtime.vulkan.device import get_vulkan_device
    dev = get_vulkan_device()
    texts = _texts(_Runtime(dev), monkeypatch)
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")        # every kernel new: printed and compiled
    one = [_Runtime(dev).pipelines([t], threads=1)[0] for t in texts]
    rt = _Runtime(dev)
    many = rt.pipelines(texts, threads=4)
    assert [(k.name, k.access, k.local_size) for k in many] == [(k.name, k.access, k.local_size) for k in one]
    assert rt.stats["pipelines_compiled"] == len(texts) and rt.stats["glsl_seconds"] > 0
    alive = len([k for k in dev._kernels if k.pipeline is not None])
    rt = _Runtime(dev)
    broken = ("fn main( {", "broken")          # the shortest: met after the others went to the pool
    with pytest.raises(KernelSourceError, match="broken"):
        rt.pipelines(texts + [broken], threads=4)
    assert not rt._pipelines and len([k for k in dev._kernels if k.pipeline is not None]) <= alive


def test_a_plan_allocates_while_its_pipelines_are_created(cache_dir, monkeypatch):
    """The Vulkan backend creates a plan's pipelines on another thread while the plan
    allocates its memory: both happen (the session runs and matches NumPy), and an
    allocation that fails raises its own error after the pipelines have ended."""
    from meganeura.runtime import executor
    assert backend.get_vulkan_runtime().concurrent_pipelines
    threads = {}
    real = backend.VulkanRuntime.pipelines

    def pipelines(self, shaders, **kw):
        threads["pipelines"] = threading.current_thread()
        return real(self, shaders, **kw)
    monkeypatch.setattr(backend.VulkanRuntime, "pipelines", pipelines)
    g = mg.Graph()
    x = g.input("x", (8, 24))
    y = mg.ops.tanh(mg.ops.linear(x, g.parameter("w", (16, 24), init="normal")))
    ref = mg.compile(g, outputs=[y], backend="numpy")
    sess = mg.compile(g, outputs=[y], backend="vulkan")
    sess.load_state_dict(ref.state_dict())
    feeds = {"x": np.random.default_rng(2).standard_normal((8, 24)).astype(np.float32)}
    np.testing.assert_allclose(sess.run(feeds)[0], ref.run(feeds)[0], rtol=1e-5, atol=1e-6)
    assert threads["pipelines"] is not threading.main_thread()

    ended = []

    class Runtime:
        concurrent_pipelines = True

        def pipelines(self, shaders):
            threading.Event().wait(0.05)
            ended.append(True)
            return ["made"]

    def allocate():
        raise MemoryError("no device memory for the plan")
    with pytest.raises(MemoryError, match="no device memory"):
        executor._pipelines_while(Runtime(), ["kernel"], allocate)
    assert ended == [True]
    done = []
    assert executor._pipelines_while(Runtime(), ["kernel"], lambda: done.append(1)) == ["made"] and done


def test_threads_making_pipelines_get_the_gil_promptly_and_the_interval_comes_back(cache_dir, monkeypatch):
    """While a pool of threads makes pipelines the GIL switch interval is short (their calls
    return often to a process whose other thread runs Python); it is restored afterwards,
    after a failure too, and only by the last of overlapping users."""
    import sys
    from meganeura.compilation.vulkan import KernelSourceError
    from meganeura.runtime.vulkan.device import get_vulkan_device
    before = sys.getswitchinterval()
    seen = []
    real = vk_finish.VulkanKernels._compile

    def compile_(self, *a):
        seen.append(sys.getswitchinterval())
        return real(self, *a)
    monkeypatch.setattr(vk_finish.VulkanKernels, "_compile", compile_)
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    dev = get_vulkan_device()
    texts = _texts(_Runtime(dev), monkeypatch)
    seen.clear()
    _Runtime(dev).pipelines(texts, threads=3)
    assert vk_finish.GIL_SWITCH_S < before and seen == pytest.approx([vk_finish.GIL_SWITCH_S] * len(texts), rel=1e-3)
    assert sys.getswitchinterval() == before
    with pytest.raises(KernelSourceError):
        _Runtime(dev).pipelines([("fn main( {", "broken")] + texts[:1], threads=3)
    assert sys.getswitchinterval() == before
    with vk_finish.prompt_gil_handoff():
        with vk_finish.prompt_gil_handoff():
            pass
        assert sys.getswitchinterval() == pytest.approx(vk_finish.GIL_SWITCH_S, rel=1e-3)
    assert sys.getswitchinterval() == before
