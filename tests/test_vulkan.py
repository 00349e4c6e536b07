"""The direct Vulkan backend: dependency levels, sub-allocation and SPIR-V reflection
device-free; hand-written GLSL kernels through the runtime on the Vulkan device (lavapipe in
CI) against numpy; the SPIR-V and pipeline disk caches across processes; the benchmark."""
import json
import os
import pathlib
import subprocess
import sys

import numpy as np
import pytest

from meganeura.runtime.vulkan import levels as lv
from meganeura.runtime.vulkan.memory import OffsetAllocator

ROOT = pathlib.Path(__file__).resolve().parents[1]


def R(block, off=0, size=16):
    return lv.Access(block, off, size, False)


def W(block, off=0, size=16):
    return lv.Access(block, off, size, True)


# ---------------------------------------------------------------- device-free: levels
def test_independent_dispatches_share_a_level():
    # both read a, each writes its own output
    assert lv.group_levels([[R("a"), W("b")], [R("a"), W("c")], [R("a"), W("d")]]) == [[0, 1, 2]]


@pytest.mark.parametrize("first,second,kind", [
    ([W("b")], [R("b"), W("c")], "read after write"),
    ([R("b"), W("x")], [W("b")], "write after read"),
    ([W("b")], [W("b")], "write after write"),
])
def test_hazards_split_levels(first, second, kind):
    assert lv.group_levels([first, second]) == [[0], [1]], kind


def test_byte_ranges_of_one_block():
    ops = [[W("m", 0, 256)],                  # 0
           [W("m", 256, 256)],                # 1: disjoint from 0 -> level 0
           [R("m", 200, 100), W("m", 1024)],  # 2: overlaps both writes -> level 1
           [R("m", 512, 256), W("n")],        # 3: touches nothing written yet -> level 0
           [W("m", 1024, 16)]]                # 4: WAW with 2 -> level 2
    assert lv.assign_levels(ops) == [0, 0, 1, 0, 2]
    assert lv.group_levels(ops) == [[0, 1, 3], [2], [4]]


def test_reads_never_conflict_and_chains_serialise():
    assert lv.assign_levels([[R("a")], [R("a")], [R("a", 8, 64)]]) == [0, 0, 0]
    chain = [[R("x"), W("y")], [R("y"), W("z")], [R("z"), W("x")]]
    assert lv.assign_levels(chain) == [0, 1, 2]
    # a write after reads at several levels goes after the highest of them
    ops = [[W("a")], [R("a"), W("b")], [R("b"), R("a"), W("c")], [W("a")]]
    assert lv.assign_levels(ops) == [0, 1, 2, 3]
    assert lv.assign_levels([[R("a", 0, 0), W("b")], [W("a")]]) == [0, 0]   # empty ranges touch nothing


def test_levels_match_a_quadratic_reference():
    rng = np.random.default_rng(0)
    ops = []
    for _ in range(200):
        ops.append([lv.Access(int(rng.integers(3)), int(rng.integers(0, 64)) * 4, int(rng.integers(1, 16)) * 4,
                              bool(rng.random() < 0.4)) for _ in range(rng.integers(1, 4))])

    def conflict(a, b):
        return a.block == b.block and a.offset < b.end and b.offset < a.end and (a.write or b.write)
    ref = []
    for i, acc in enumerate(ops):
        deps = [ref[j] for j in range(i) if any(conflict(a, b) for a in acc for b in ops[j])]
        ref.append(max(deps) + 1 if deps else 0)
    assert lv.assign_levels(ops) == ref


# ---------------------------------------------------------------- device-free: memory
def test_offset_allocator_aligns_reuses_and_merges():
    al = OffsetAllocator(4096, 256)
    a, b, c = al.alloc(10), al.alloc(300), al.alloc(256)
    assert (a, b, c) == (0, 256, 768) and al.bytes_used == 1024
    assert al.alloc(4096) is None
    al.free(b)
    assert al.alloc(512) == 256            # the freed hole is reused
    al.free(256)
    al.free(a)
    al.free(c)
    assert al.free_list == [(0, 4096)]     # neighbours merged back into one range
    with pytest.raises(ValueError, match="not an allocated range"):
        al.free(c)
    with pytest.raises(ValueError, match="power of two"):
        OffsetAllocator(100, 3)


def test_offset_allocator_refuses_what_it_refused_until_a_free():
    al = OffsetAllocator(4096, 256)
    a = al.alloc(1024)
    al.alloc(2048)
    assert al.alloc(2048) is None and al.refused == 2048
    assert al.alloc(4096) is None and al.refused == 2048      # larger: refused without a walk
    assert al.alloc(1024) == 3072                              # smaller still fits
    al.free(a)
    assert al.refused == float("inf") and al.alloc(1024) == 0


# ---------------------------------------------------------------- glslang (no device)
glslang = pytest.importorskip("meganeura.compilation.glslang")


def _need_glslang():
    try:
        glslang.glslang_version()
    except glslang.GlslangUnavailable as e:
        pytest.skip(str(e))


def test_spirv_reflection_reads_bindings_access_and_push_constants():
    _need_glslang()
    from meganeura.runtime.vulkan import samples, spirv
    info = spirv.reflect(glslang.compile_glsl(samples.SGEMM, samples.defines(samples.SGEMM_SMALL), name="sgemm"))
    assert info["bindings"] == {0: "read", 1: "read", 2: "write"}
    assert info["push_constant_size"] == 12 and info["local_size"] == (64, 1, 1)
    info = spirv.reflect(glslang.compile_glsl(samples.SAXPY, name="saxpy"))
    assert info["bindings"] == {0: "read", 1: "rw"} and info["push_constant_size"] == 8
    with pytest.raises(spirv.SpirvError, match="not a SPIR-V module"):
        spirv.reflect(b"\0" * 24)
    assert spirv.reflect(glslang.compile_glsl(_shared_kernel(1000), name="shared"))["workgroup_memory"] == 4016
    # an array of buffers is one binding of several descriptors
    arrays = ("#version 450\nlayout(local_size_x = 1) in;\n"
              "layout(set = 0, binding = 0) readonly buffer A { float d[]; } a[3];\n"
              "layout(set = 0, binding = 1) buffer O { float o[]; };\n"
              "void main() { o[0] = a[gl_WorkGroupID.x].d[0]; }\n")
    info = spirv.reflect(glslang.compile_glsl(arrays, name="arrays"))
    assert info["bindings"] == {0: "read", 1: "rw"} and info["counts"] == {0: 3, 1: 1}


def _shared_kernel(n):
    """A kernel with ``n`` floats and one vec4 of workgroup memory."""
    return (f"#version 450\nlayout(local_size_x = 64) in;\nshared float big[{n}];\nshared vec4 v;\n"
            "layout(set = 0, binding = 0) buffer B { float x[]; };\n"
            "void main() { big[gl_LocalInvocationIndex] = x[0]; v = vec4(1.0); barrier(); x[gl_LocalInvocationIndex] = big[63] + v.x; }\n")


def test_cooperative_matrix_kernel_compiles():
    _need_glslang()
    from meganeura.runtime.vulkan import samples, spirv
    code = glslang.compile_glsl(samples.HGEMM_COOP, samples.defines(samples.HGEMM_COOP_DEFAULT),
                                name="hgemm_coop", target="vulkan1.3")
    assert "CooperativeMatrixKHR" in spirv.reflect(code)["capabilities"]


def test_glsl_errors_name_the_kernel_and_show_the_lines():
    _need_glslang()
    src = "#version 450\nlayout(local_size_x = 1) in;\nvoid main() {\n    float y = nope + 1.0;\n}\n"
    with pytest.raises(glslang.GlslError) as e:
        glslang.compile_glsl(src, name="broken_kernel", disk_cache=False)
    msg = str(e.value)
    assert "'broken_kernel'" in msg and "nope" in msg and ">    4 |     float y = nope + 1.0;" in msg
    with pytest.raises(ValueError, match="not an identifier"):
        glslang.compile_glsl(src, {"1bad": 1})
    a = glslang.spirv_key(src, {"N": 1}, version="v")
    assert a != glslang.spirv_key(src, {"N": 2}, version="v") != glslang.spirv_key(src, {"N": 1}, version="w")


def test_spirv_validation_is_opt_in_and_raises_its_errors(monkeypatch):
    """glslang emits this barrier (a device execution scope); SPIRV-Tools' validator rejects
    it under Vulkan's rules. Off by default (it doubled glslang's time); asked for, by
    argument or MEGANEURA_SPIRV_VALIDATE, it compiles past the caches and raises."""
    _need_glslang()
    from meganeura.runtime.vulkan import samples
    src = ("#version 450\n#extension GL_KHR_memory_scope_semantics : require\nlayout(local_size_x = 1) in;\n"
           "void main() { controlBarrier(gl_ScopeDevice, gl_ScopeDevice, gl_StorageSemanticsBuffer, "
           "gl_SemanticsAcquireRelease); }\n")
    monkeypatch.delenv("MEGANEURA_SPIRV_VALIDATE", raising=False)
    code = glslang.compile_glsl(src, name="device_barrier", disk_cache=False)
    assert int.from_bytes(code[:4], "little") == glslang.SPIRV_MAGIC
    with pytest.raises(glslang.GlslError, match=r"'device_barrier' failed to validate SPIR-V(.|\n)*Execution Scope"):
        glslang.compile_glsl(src, name="device_barrier", disk_cache=False, validate=True)
    monkeypatch.setenv("MEGANEURA_SPIRV_VALIDATE", "1")
    with pytest.raises(glslang.GlslError, match="validate SPIR-V"):
        glslang.compile_glsl(src, name="device_barrier", disk_cache=False)
    # a valid kernel validates to the same words as without
    assert glslang.compile_glsl(samples.SAXPY, name="saxpy", disk_cache=False) == \
        glslang.compile_glsl(samples.SAXPY, name="saxpy", disk_cache=False, validate=False)


# ---------------------------------------------------------------- on the device
@pytest.fixture(scope="module")
def dev():
    pytest.importorskip("vulkan")
    _need_glslang()
    from meganeura.runtime.vulkan import VulkanDevice, VulkanUnavailable
    try:
        d = VulkanDevice(pipeline_cache=False)
    except VulkanUnavailable as e:
        pytest.skip(str(e))
    yield d
    d.close()


def _vk():
    from meganeura.runtime import vulkan
    from meganeura.runtime.vulkan import samples  # noqa: F401  (a submodule: vk.samples, run alone too)
    return vulkan


def test_capability_report(dev):
    cap = dev.capabilities()
    json.dumps(cap)  # plain data
    assert cap["backend"] == "vulkan" and cap["name"] and cap["api_version"] >= "1.2"
    for f in ("storageBuffer16BitAccess", "shaderFloat16", "vulkanMemoryModel", "subgroupSizeControl",
              "cooperativeMatrix"):
        assert f in cap["features"]
    assert cap["cooperative_matrix"]["enabled"] or cap["cooperative_matrix"]["reason"]
    assert cap["limits"]["maxComputeWorkGroupInvocations"] >= 64


def test_saxpy_levels_and_reuse(dev):
    vk = _vk()
    k = glslang.kernel_from_glsl(dev, vk.samples.SAXPY, name="saxpy")
    n = 1000
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32)
    bx, by = dev.array(x), dev.array(y)
    # three dependent updates of y: three levels
    ops = [vk.Dispatch(k, [bx, by], -(-n // 64), vk.pack_push(n, 0.5)) for _ in range(3)]
    with vk.Program(dev, ops) as p:
        p.run()
        np.testing.assert_allclose(dev.download(by, np.float32), y + 1.5 * x, rtol=1e-5, atol=1e-5)
        assert p.stats["levels"] == 3 and p.stats["barriers"] == 2
        p.run()                                    # resubmitted as recorded
        assert p.stats["recorded"] == 1
        np.testing.assert_allclose(dev.download(by, np.float32), y + 3.0 * x, rtol=1e-5, atol=1e-5)
        p.set_push(0, vk.pack_push(n, -3.0))      # a change re-records
        p.run()
        assert p.stats["recorded"] == 2
        np.testing.assert_allclose(dev.download(by, np.float32), y + 1.0 * x, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("M,N,K", [(37, 45, 70), (64, 32, 8), (1, 1, 1)])
def test_tiled_sgemm(dev, M, N, K):
    vk = _vk()
    p = vk.samples.SGEMM_SMALL
    k = glslang.kernel_from_glsl(dev, vk.samples.SGEMM, vk.samples.defines(p), name="sgemm")
    rng = np.random.default_rng(M)
    A, B = rng.standard_normal((M, K)).astype(np.float32), rng.standard_normal((K, N)).astype(np.float32)
    ba, bb, bc = dev.array(A), dev.array(B), dev.alloc(M * N * 4)
    with vk.Program(dev, [vk.Dispatch(k, [ba, bb, bc], vk.samples.sgemm_groups(M, N, K, p),
                                      vk.pack_push(M, N, K))]) as prog:
        prog.run()
    np.testing.assert_allclose(dev.download(bc, np.float32, (M, N)), A @ B, rtol=1e-4, atol=1e-4)
    for r in (ba, bb, bc):
        dev.free(r)


def test_reductions_group_into_levels_on_one_block(dev):
    """Row sums of two halves of one buffer are independent (one level); summing their
    outputs again depends on both (a second level); a copy of the input is independent."""
    vk = _vk()
    k = glslang.kernel_from_glsl(dev, vk.samples.ROW_SUM, vk.samples.defines(dict(WG=64)), name="row_sum")
    rng = np.random.default_rng(2)
    X = rng.standard_normal((8, 256)).astype(np.float32)
    bx = dev.array(X)
    top, bottom = bx.sub(0, 4 * 256 * 4), bx.sub(4 * 256 * 4, 4 * 256 * 4)   # binding offsets stay aligned
    s_top, s_bot = dev.alloc(16), dev.alloc(16)
    total = dev.alloc(4)
    both = dev.alloc(32)
    copy_dst = dev.alloc(X.nbytes)
    ops = [vk.Dispatch(k, [top, s_top], 4, vk.pack_push(4, 256), name="rows 0-3"),
           vk.Dispatch(k, [bottom, s_bot], 4, vk.pack_push(4, 256), name="rows 4-7"),
           vk.Copy(s_top, both.sub(0, 16)), vk.Copy(s_bot, both.sub(16, 16)),
           vk.Dispatch(k, [both, total], 1, vk.pack_push(1, 8), name="total"),
           vk.Copy(bx, copy_dst)]
    with vk.Program(dev, ops, timestamps=True) as p:
        assert p.levels == [[0, 1, 5], [2, 3], [4]]
        assert p.stats == dict(dispatches=3, copies=3, levels=3, barriers=2, edge_barriers=2,
                               max_level_width=3, recorded=0)
        p.run()
        ts = p.timestamps_ns()
        assert ts.shape == (6, 2) and (ts[:, 1] >= ts[:, 0]).all() and p.gpu_seconds() >= 0
        assert p.names[:2] == ["rows 0-3", "rows 4-7"]
    with vk.Program(dev, ops, timestamps="step") as p:
        p.run()
        assert p.gpu_seconds() >= 0
        with pytest.raises(RuntimeError, match="whole step only"):
            p.timestamps_ns()
    np.testing.assert_allclose(dev.download(total, np.float32), [X.sum()], rtol=1e-4)
    np.testing.assert_allclose(dev.download(both, np.float32), X.sum(1), rtol=1e-4, atol=1e-5)
    np.testing.assert_array_equal(dev.download(copy_dst, np.float32, X.shape), X)


def test_serial_mode_records_a_barrier_per_op(dev):
    vk = _vk()
    k = glslang.kernel_from_glsl(dev, vk.samples.SAXPY, name="saxpy")
    bufs = [dev.alloc(256) for _ in range(5)]
    ops = [vk.Dispatch(k, [bufs[0], b], 1, vk.pack_push(64, 1.0)) for b in bufs[1:]]
    with vk.Program(dev, ops) as p, vk.Program(dev, ops, levels=False) as q:
        assert p.stats["levels"] == 1 and p.stats["barriers"] == 0
        assert q.stats["levels"] == 4 and q.stats["barriers"] == 3


def test_f16_storage_kernel(dev):
    if not (dev.features["storageBuffer16BitAccess"] and dev.features["shaderFloat16"]):
        pytest.skip("device has no 16-bit storage / shaderFloat16")
    vk = _vk()
    k = glslang.kernel_from_glsl(dev, vk.samples.F16_AXPB, name="f16_axpb")
    rng = np.random.default_rng(3)
    x, b = rng.standard_normal(130).astype(np.float16), rng.standard_normal(130).astype(np.float16)
    bx, bb, by = dev.array(x), dev.array(b), dev.alloc(130 * 4)
    with vk.Program(dev, [vk.Dispatch(k, [bx, bb, by], 3, vk.pack_push(130, 1.5))]) as p:
        p.run()
    ref = (x * np.float16(1.5) + b).astype(np.float32)
    np.testing.assert_allclose(dev.download(by, np.float32), ref, rtol=2e-3, atol=2e-3)


def _staged_device(block_bytes):
    """A device whose transfers all go through staging copies (a discrete GPU's path), with
    blocks of ``block_bytes``; or a skip."""
    pytest.importorskip("vulkan")
    vk = _vk()
    try:
        return vk.VulkanDevice(direct_host_access=False, pipeline_cache=False, block_bytes=block_bytes)
    except vk.VulkanUnavailable as e:
        pytest.skip(str(e))


def test_staging_path_and_large_blocks():
    """Uploads and downloads through staging copies (as on a discrete GPU) and a request
    larger than a block getting a block of its own."""
    _need_glslang()
    with _staged_device(1 << 16) as d:
        a = np.arange(100_000, dtype=np.float32)
        r = d.array(a)
        small = d.array(np.ones(10, np.int32))
        assert r.block is not small.block and r.block.mapped is None and r.block.size >= a.nbytes
        np.testing.assert_array_equal(d.download(r, np.float32), a)
        np.testing.assert_array_equal(d.download(r.sub(4 * 10, 4 * 5), np.float32), a[10:15])
        assert d.memory_report()["staging"][0]["used"] == 0    # staging ranges are returned


def test_device_blocks_made_beside_the_caller_and_filled_before_gpu_work(monkeypatch):
    """Device memory the host never maps: blocks are created on the device's memory thread
    while allocation goes on, and each new block is filled with zeros once, in the next GPU
    submission (with its copies), before any use; a small staging request takes a small
    block; a block the driver refuses fails where it is used, naming it, and the device
    goes on."""
    from meganeura.runtime.vulkan import device as vdev
    with _staged_device(1 << 20) as d:
        vk = _vk()
        submits = []
        real_submit = d.submit
        monkeypatch.setattr(d, "submit", lambda *a, **k: (submits.append(a[0]), real_submit(*a, **k)))
        blocks = [d.alloc(400_000, zeroed=True) for _ in range(3)]      # a block each (1 MiB blocks)
        assert len({r.block for r in blocks}) == 3 and all(r.block.mapped is None for r in blocks)
        assert d._maker is not None and len(d._unfilled) == 3 and not submits
        d.free(blocks.pop())                      # freed before any GPU work: no fill left for it
        assert len(d._unfilled) == 2
        a = np.arange(1000, dtype=np.float32)
        d.upload(blocks[0].sub(4000, 4000), a)    # one submit: both fills, then the copy
        assert len(submits) == 1 and not d._unfilled
        np.testing.assert_array_equal(d.download(blocks[0], np.float32)[:1000], 0)
        np.testing.assert_array_equal(d.download(blocks[0].sub(4000, 4000), np.float32), a)
        np.testing.assert_array_equal(d.download(blocks[1], np.float32), 0)
        staging = d.memory_report()["staging"]
        assert staging and all(b["size"] == vdev.SMALL_STAGING_BYTES for b in staging)
        # a memory type the driver refuses: the block fails where it is first used
        good = d.device_mem_type
        monkeypatch.setattr(d, "device_mem_type", len(d.memory_types) + 5)
        bad = d.alloc(400_000)
        monkeypatch.setattr(d, "device_mem_type", good)
        with pytest.raises(vk.VulkanError, match="device#"):
            d.download(bad, np.float32)
        assert bad.block.failed
        later = d.alloc(400_000, zeroed=True)
        np.testing.assert_array_equal(d.download(later, np.float32), 0)     # the failed block's fill skipped
        assert not d._unfilled
        d.free(bad)
        assert bad.block.label not in [b["label"] for b in d.memory_report()["device"]]


def test_clear_errors(dev):
    vk = _vk()
    k = glslang.kernel_from_glsl(dev, vk.samples.SAXPY, name="saxpy")
    b = dev.alloc(64)
    with pytest.raises(ValueError, match="'saxpy' has 2 bindings, got 1 buffers"):
        vk.Program(dev, [vk.Dispatch(k, [b], 1, vk.pack_push(1, 1.0))])
    with pytest.raises(ValueError, match="takes 8 B of push constants, got 4"):
        vk.Program(dev, [vk.Dispatch(k, [b, b], 1, vk.pack_push(1))])
    with pytest.raises(ValueError, match="not a multiple of"):
        vk.Program(dev, [vk.Dispatch(k, [b.sub(2, 16), b], 1, vk.pack_push(1, 1.0))])
    with pytest.raises(ValueError, match="hgemm_coop: shape not a multiple"):
        vk.samples.hgemm_coop_groups(100, 128, 128, vk.samples.HGEMM_COOP_DEFAULT)


CACHE_PROBE = """
import json
from meganeura.compilation import glslang
from meganeura.runtime.vulkan import VulkanDevice, samples
with VulkanDevice() as d:
    k = glslang.kernel_from_glsl(d, samples.SAXPY, name="saxpy")
    print(json.dumps(dict(stats=dict(glslang.STATS), loaded=d.pipeline_cache_loaded_bytes,
                          rejected=d.pipeline_cache_rejected, hit=k.cache_hit)))
"""


def test_spirv_and_pipeline_caches_hit_on_the_second_run(dev, tmp_path):
    env = dict(os.environ, MEGANEURA_CACHE_DIR=str(tmp_path))
    env.pop("MEGANEURA_NO_DISK_CACHE", None)
    runs = [json.loads(subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True,
                                      text=True, check=True).stdout) for _ in range(2)]
    assert runs[0]["stats"] == {"compiles": 1} and runs[0]["loaded"] == 0
    assert runs[1]["stats"] == {"disk_hits": 1}                 # no glslang compile
    files = list((tmp_path / "pipelines").glob("*.bin"))
    assert len(files) == 1 and runs[1]["loaded"] == files[0].stat().st_size > 0 and not runs[1]["rejected"]
    if runs[1]["hit"] is not None and runs[0]["hit"] is not None and dev.driver["name"] != "llvmpipe":
        assert runs[1]["hit"]                                   # drivers that report it (lavapipe caches nothing)
    env["MEGANEURA_NO_DISK_CACHE"] = "1"
    off = json.loads(subprocess.run([sys.executable, "-c", CACHE_PROBE], env=env, capture_output=True,
                                    text=True, check=True).stdout)
    assert off["stats"] == {"compiles": 1} and off["loaded"] == 0


WARM_UP_PROBE = """
import json
from meganeura.compilation import glslang
from meganeura.runtime.vulkan import samples
assert glslang._instance is None
glslang.start_warm_up()
first = glslang._warming
glslang.start_warm_up()                 # once per process
first.join(120)
warm = glslang._instance.warm
glslang.compile_glsl(samples.SAXPY, name="saxpy", disk_cache=False)
print(json.dumps(dict(warm=warm, once=glslang._warming is first, again=glslang.warm_up(), stats=dict(glslang.STATS))))
"""


def test_glslang_warms_up_on_a_thread_once(dev):
    """A fresh process's first glslang compile (its built-in tables) runs on a thread of its
    own when a plan starts compiling, and counts as no kernel compile."""
    _need_glslang()
    env = dict(os.environ, MEGANEURA_NO_DISK_CACHE="1")
    r = json.loads(subprocess.run([sys.executable, "-c", WARM_UP_PROBE], env=env, capture_output=True,
                                  text=True, check=True).stdout)
    assert r == {"warm": True, "once": True, "again": 0.0, "stats": {"compiles": 1}}


def test_a_new_plan_starts_the_warm_up(monkeypatch):
    """A session compiling a plan (not reading it from the plan cache) has the compile stage's
    Vulkan finishing ``prepare`` (glslang's warm-up) before the compiler passes."""
    pytest.importorskip("vulkan")
    _need_glslang()
    import meganeura as mg
    from meganeura.compilation import vulkan
    calls = []
    monkeypatch.setattr(vulkan.VulkanKernels, "prepare", lambda self: calls.append(self))
    g = mg.Graph()
    x = g.input("x", (4, 8))
    y = mg.ops.relu(mg.ops.linear(x, g.parameter("w", (3, 8))))
    s = mg.compile(g, outputs=[y], backend="vulkan", plan_cache=False)
    assert len(calls) == 1
    s.run({"x": np.ones((4, 8), np.float32)})
    assert len(calls) == 1
    s.close()


def test_info_reports_the_vulkan_backend(dev):
    r = subprocess.run([sys.executable, "-m", "meganeura.cli", "info", "--vulkan"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert dev.name in r.stdout and "cooperative matrix" in r.stdout and "maxStorageBufferRange" in r.stdout


def test_dispatch_benchmark_runs_small(dev, tmp_path):
    out = tmp_path / "vk.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "vulkan_dispatch.py"), "--size", "64",
                        "--dispatches", "64", "--repeats", "2", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    data = json.loads(out.read_text())
    names = {row["case"] for row in data["dispatch"]}
    assert {"dependent chain", "independent level"} <= names
    gemm = {row["kernel"]: row for row in data["gemm"]}
    assert gemm["sgemm_f32"]["max_rel_err"] < 1e-4 and gemm["sgemm_f32"]["tflops"] > 0
    assert "hgemm_coop_f16" in gemm
    assert "dependent chain" in r.stdout


def test_kernel_past_the_storage_buffer_limit_is_refused(dev):
    """More buffers than the device binds a kernel (an array of buffers counts each) is
    refused, naming the kernel: past the limit a software driver crashes as it runs."""
    limit = dev.limits["maxPerStageDescriptorStorageBuffers"]
    if limit > 4096:
        pytest.skip(f"the device binds {limit} buffers a kernel: too many to declare")
    src = ("#version 450\nlayout(local_size_x = 1) in;\n"
           "layout(set = 0, binding = 0) buffer A {{ float d[]; }} a[{n}];\n"
           "void main() {{ a[gl_WorkGroupID.x].d[0] = 1.0; }}\n")
    dev.kernel(glslang.compile_glsl(src.format(n=limit), name="fits"), name="fits").destroy()
    with pytest.raises(ValueError, match=f"'many': {limit + 1} storage buffers, the device allows {limit}"):
        dev.kernel(glslang.compile_glsl(src.format(n=limit + 1), name="many"), name="many")


def test_kernel_past_the_workgroup_memory_limit_is_refused(dev):
    """A driver may accept a pipeline with more workgroup memory than it has and lose the
    device when it runs: the runtime refuses it, naming the kernel and the sizes."""
    limit = dev.limits["maxComputeSharedMemorySize"]
    fits = dev.kernel(glslang.compile_glsl(_shared_kernel((limit - 16) // 4), name="fits"), name="fits")
    fits.destroy()
    too_big = glslang.compile_glsl(_shared_kernel(limit // 4), name="too_big")
    with pytest.raises(ValueError, match=f"'too_big': {limit + 16} B of workgroup memory, the device allows {limit}"):
        dev.kernel(too_big, name="too_big")
    import os
    from unittest import mock
    with mock.patch.dict(os.environ, {"MEGANEURA_VK_WORKGROUP_MEMORY": "1e5"}):
        with pytest.raises(ValueError, match="MEGANEURA_VK_WORKGROUP_MEMORY='1e5'"):
            dev.kernel(too_big, name="too_big")
