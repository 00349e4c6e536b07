"""Data-parallel training (mg.distributed) with two processes on the default device.

Each test launches two worker processes (this file run as a script): under torchrun for
training, or with torchrun's environment set by hand where one rank must die. The digits
MLP trained on two ranks must give the losses and weights of one process trained on the
doubled batch, on both GPU runtimes (the direct Vulkan backend and wgpu); ranks that build
different graphs are refused, and a killed rank must end the other with a DistributedError
instead of a hang.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

import meganeura as mg  # noqa: E402
from meganeura.models.mlp import build_mlp, load_digits_split  # noqa: E402
from meganeura.runtime.backends import vulkan_unavailable_reason  # noqa: E402

HERE = os.path.abspath(__file__)
BATCH = 16          # per rank; the single-process reference trains on 2 * BATCH
STEPS = 6
HIDDEN = 32
LR = 1e-2
RUNTIMES = [pytest.param("vulkan", marks=pytest.mark.skipif(vulkan_unavailable_reason() is not None,
                                                            reason="no direct Vulkan backend here")), "wgpu"]


def global_batches():
    (x, y), _ = load_digits_split()
    n = STEPS * 2 * BATCH
    return x[:n].reshape(STEPS, 2 * BATCH, 64), y[:n].reshape(STEPS, 2 * BATCH)


def write_batches(out_dir):
    """The batches as a file for the workers (importing scikit-learn takes them seconds)."""
    xs, ys = global_batches()
    np.savez(os.path.join(out_dir, "batches.npz"), xs=xs, ys=ys)


def _optimizer():
    # clipping by the global norm: of the averaged gradients, as one process clips its own
    return mg.optim.AdamW(lr=LR, clip_grad_norm=1.0, schedule=mg.optim.cosine(total_steps=STEPS, warmup_steps=1))


# ------------------------------------------------------------------------- worker processes
def worker(mode, out_dir):
    from meganeura import distributed as dist
    ctx = dist.init(timeout_s=30, streams=3 if mode == "streams" else None)
    data = np.load(os.path.join(out_dir, "batches.npz"))
    xs, ys = data["xs"], data["ys"]
    try:
        if mode == "train":
            for k in (1, 2):
                g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN, 10)
                # each rank starts from other weights: rank 0's are broadcast
                s = dist.compile(g, loss, _optimizer(), accumulate=k, seed=10 + ctx.rank, bucket_mb=0.004)
                losses = [s.step(dist.shard({"x": xs[i], "labels": ys[i]})) for i in range(STEPS)]
                state = s.state_dict()
                ckpt = os.path.join(out_dir, f"k{k}.safetensors")
                s.save(ckpt)
                if ctx.rank == 1:       # another rank reads what rank 0 wrote
                    g2, _, _, _, loss2 = build_mlp(BATCH, 64, HIDDEN, 10)
                    fresh = dist.compile(g2, loss2, _optimizer(), accumulate=k, seed=99)
                    fresh.load(ckpt)
                    loaded = fresh.state_dict()
                    assert all(np.array_equal(loaded[n], state[n]) for n in state), "checkpoint differs"
                    assert fresh.steps_done == s.steps_done
                else:
                    g2, _, _, _, loss2 = build_mlp(BATCH, 64, HIDDEN, 10)
                    dist.compile(g2, loss2, _optimizer(), accumulate=k, seed=99)  # the same collectives as rank 1
                np.savez(os.path.join(out_dir, f"rank{ctx.rank}_k{k}.npz"), losses=np.array(losses),
                         mean_loss=s.mean_loss, runtime=s.runtime, grad_path=s.grad_path, transport=s.transport,
                         **state)
                s.close()
            # then ranks that build different graphs: refused on every rank, the group still usable
            g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN + 8 * ctx.rank, 10)
            try:
                dist.compile(g, loss, _optimizer())
            except dist.DistributedError as e:
                with open(os.path.join(out_dir, f"mismatch{ctx.rank}.txt"), "w") as f:
                    f.write(str(e))
            dist.barrier()
        elif mode == "streams":
            # buckets split over 3 concurrent all-reduce streams give the sums of one stream
            dist.transports.MIN_PIECE_BYTES = 256          # so that these small buckets are split too
            assert ctx.streams == 3 and len(ctx.groups) == 3
            # and through shared memory (the ranks share this host) as through Gloo
            for streams, transport in ((1, "gloo"), (3, "gloo"), (1, "shm"), (3, "shm")):
                g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN, 10)
                s = dist.compile(g, loss, _optimizer(), accumulate=2, seed=10 + ctx.rank, bucket_mb=0.004,
                                 streams=streams, transport=transport)
                assert s.transport == transport
                groups = {id(grp) for b in s.buckets for _, _, grp in b.pieces}
                split = max(len(b.pieces) for b in s.buckets)
                losses = [s.step(dist.shard({"x": xs[i], "labels": ys[i]})) for i in range(STEPS)]
                np.savez(os.path.join(out_dir, f"rank{ctx.rank}_s{streams}_{transport}.npz"), losses=np.array(losses),
                         mean_loss=s.mean_loss, groups=len(groups), split=split, **s.state_dict())
                s.close()
            g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN, 10)
            try:                                # ranks asking for other stream counts are refused
                dist.compile(g, loss, _optimizer(), streams=2 + ctx.rank)
            except dist.DistributedError as e:
                with open(os.path.join(out_dir, f"streams_mismatch{ctx.rank}.txt"), "w") as f:
                    f.write(str(e))
            dist.barrier()
        elif mode == "kill":
            g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN, 10)
            s = dist.compile(g, loss, _optimizer())
            for i in range(STEPS):
                if i == 2 and ctx.rank == 1:
                    os.kill(os.getpid(), signal.SIGKILL)
                s.step(dist.shard({"x": xs[i], "labels": ys[i]}))
    except dist.DistributedError as e:
        print(f"DistributedError: {e}", flush=True)
        sys.exit(3)
    dist.shutdown()


def _free_port():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _env(runtime=None):
    """The workers' environment: ``runtime`` sets MEGANEURA_BACKEND (None: the default)."""
    env = dict(os.environ)
    for var in ("MEGANEURA_ADAPTER", "MEGANEURA_VK_DEVICE", "MEGANEURA_BACKEND"):
        env.pop(var, None)
    if runtime is not None:
        env["MEGANEURA_BACKEND"] = runtime
    env["OMP_NUM_THREADS"] = "1"
    return env


def launch_by_hand(mode, tmp_path, timeout=90):
    """Two ranks with torchrun's environment but no torchrun (which would itself kill the
    survivors of a dead rank); returns [(returncode, output, seconds)] per rank."""
    port = _free_port()
    write_batches(tmp_path)
    procs = []
    t0 = time.monotonic()
    for rank in range(2):
        env = _env()
        env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2",
                   MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        procs.append(subprocess.Popen([sys.executable, HERE, mode, str(tmp_path)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    results = []
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1, timeout - (time.monotonic() - t0)))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail(f"{mode}: a rank still runs after {timeout} s (hang)")
        results.append((p.returncode, out, time.monotonic() - t0))
    return results


# ------------------------------------------------------------------------------------ tests
@pytest.fixture(scope="module", params=RUNTIMES)
def trained(request, tmp_path_factory):
    """Two ranks trained under torchrun on one runtime: (output folder, runtime)."""
    out = tmp_path_factory.mktemp(f"dp_{request.param}")
    write_batches(out)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node", "2", HERE, "train", str(out)]
    r = subprocess.run(cmd, env=_env(request.param), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    return out, request.param


@pytest.mark.parametrize("k", [1, 2])
def test_two_ranks_match_one_process_on_the_doubled_batch(trained, k):
    trained, runtime = trained
    xs, ys = global_batches()
    g, _, _, _, loss = build_mlp(2 * BATCH, 64, HIDDEN, 10)
    with mg.compile(g, loss=loss, optimizer=_optimizer(), accumulate=k, seed=10, backend=runtime) as s:
        ref = np.array([s.step({"x": xs[i], "labels": ys[i]}) for i in range(STEPS)])
        ref_state = s.state_dict()
    r0, r1 = (np.load(trained / f"rank{r}_k{k}.npz") for r in range(2))
    assert str(r0["runtime"]) == str(r1["runtime"]) == runtime       # the ranks ran where asked
    # Gloo reduced the mapped staging memory on Vulkan; wgpu copies through host arrays
    assert str(r0["grad_path"]) == str(r1["grad_path"]) == ("mapped" if runtime == "vulkan" else "host")
    assert str(r0["transport"]) == str(r1["transport"]) == "gloo"    # the default transport (shared memory only when asked)
    # each rank's loss is the mean over its half: their mean is the doubled batch's loss
    np.testing.assert_allclose((r0["losses"] + r1["losses"]) / 2, ref, rtol=1e-5, atol=0)
    np.testing.assert_allclose(float(r0["mean_loss"]), ref[-k:].mean(), rtol=1e-5)
    assert not np.allclose(r0["losses"], r1["losses"])      # the ranks did see different data
    for name, want in ref_state.items():
        np.testing.assert_array_equal(r0[name], r1[name])   # replicas stay identical
        np.testing.assert_allclose(r0[name], want, rtol=1e-5, atol=1e-6, err_msg=name)


def test_checkpoint_written_by_rank_0_only(trained):
    files = sorted(p.name for p in trained[0].iterdir())
    assert "k1.safetensors" in files and "k2.safetensors" in files
    assert not [f for f in files if f.endswith(".tmp")]


def test_concurrent_streams_give_the_sums_of_one(tmp_path):
    """Two ranks (default runtime): buckets split over 3 Gloo groups train bitwise as with
    the default group alone, and all-reduced through shared memory bitwise as through Gloo;
    ranks asking for different stream counts are refused."""
    write_batches(tmp_path)
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    r = subprocess.run([torchrun, "--standalone", "--nproc_per_node", "2", HERE, "streams", str(tmp_path)],
                       env=_env(), capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    for rank in range(2):
        one = np.load(tmp_path / f"rank{rank}_s1_gloo.npz")
        for n, transport in ((3, "gloo"), (1, "shm"), (3, "shm")):
            other = np.load(tmp_path / f"rank{rank}_s{n}_{transport}.npz")
            assert int(other["groups"]) == n and (n == 1 or int(other["split"]) > 1)
            np.testing.assert_array_equal(one["losses"], other["losses"])
            assert float(one["mean_loss"]) == float(other["mean_loss"])
            for name in one.files:
                if name not in ("losses", "mean_loss", "groups", "split"):
                    np.testing.assert_array_equal(one[name], other[name], err_msg=f"{n} {transport} {name}")
        msg = (tmp_path / f"streams_mismatch{rank}.txt").read_text()
        assert msg.startswith("ranks disagree on the number of all-reduce streams") and "rank 1: 3" in msg


def test_transport_is_validated(monkeypatch):
    from meganeura import distributed as dist
    monkeypatch.delenv(dist.TRANSPORT_ENV, raising=False)
    assert dist._transport_setting() == "gloo" and dist._transport_setting("shm") == "shm"
    with pytest.raises(ValueError, match=r"transport='tcp': .* auto, shm, gloo"):
        dist._transport_setting("tcp")
    monkeypatch.setenv(dist.TRANSPORT_ENV, "nccl")
    with pytest.raises(ValueError, match=r"\$MEGANEURA_DP_TRANSPORT='nccl'"):
        dist._transport_setting()
    monkeypatch.setattr(dist.transports, "SHM_DIR", "/nonexistent-shm-folder")
    assert not dist._shm_room(1)


def test_streams_are_validated(monkeypatch):
    from meganeura import distributed as dist
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGANEURA_BACKEND", "MEGANEURA_DP_STREAMS"):
        monkeypatch.delenv(var, raising=False)
    for bad in (0, -1, 65, 2.0, True, "4", None):
        with pytest.raises(ValueError, match=r"streams must be an integer from 1 to 64 .*got"):
            dist.check_streams(bad)
    try:
        monkeypatch.setenv("MEGANEURA_DP_STREAMS", "four")
        with pytest.raises(ValueError, match=r"\$MEGANEURA_DP_STREAMS='four': the number of concurrent"):
            dist.init()
        monkeypatch.setenv("MEGANEURA_DP_STREAMS", "2")
        assert dist.init().streams == 2 and dist._context.stream_groups(2) == [None]   # alone: no group
        with pytest.raises(ValueError, match="already joined with streams=2"):
            dist.init(streams=3)
        g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN, 10)
        with pytest.raises(ValueError, match="streams must be an integer from 1 to 64"):
            dist.compile(g, loss, _optimizer(), streams=0)
    finally:
        dist.shutdown()
    monkeypatch.delenv("MEGANEURA_DP_STREAMS")
    with pytest.raises(ValueError, match="got 0"):
        dist.init(streams=0)
    # the split: every value once, pieces of near-equal size, the streams taken in turn
    split = dist.split_pieces([1000, 10, 4096], 4, min_piece=100)
    assert [[(a, z) for a, z, _ in p] for p in split] == [
        [(0, 256), (256, 512), (512, 768), (768, 1000)], [(0, 10)],
        [(0, 1024), (1024, 2048), (2048, 3072), (3072, 4096)]]
    assert [i for p in split for _, _, i in p] == [0, 1, 2, 3, 0, 1, 2, 3, 0]
    assert dist.split_pieces([1000], 1) == [[(0, 1000, 0)]]


def test_killed_rank_ends_the_other_with_a_clear_error(tmp_path):
    results = launch_by_hand("kill", tmp_path)
    (rc0, out0, t0), (rc1, _, _) = results
    assert rc1 == -signal.SIGKILL
    assert rc0 == 3, out0[-3000:]
    assert "DistributedError: rank 0 of 2" in out0 and "another rank exited" in out0, out0[-3000:]
    assert t0 < 60


def test_ranks_with_different_graphs_are_refused(trained):
    for r in range(2):
        msg = (trained[0] / f"mismatch{r}.txt").read_text()
        assert msg.startswith("ranks disagree on the graph")
        assert "rank 0: 4 parameters (2410 values)" in msg and "rank 1: 4 parameters (3010 values)" in msg
        assert "first differing parameter: rank 0 '0.weight' (32, 64), rank 1 '0.weight' (40, 64)" in msg


@pytest.fixture
def staged_vulkan(monkeypatch):
    """The Vulkan runtime with staged memory, as on a discrete GPU without resizable BAR:
    inputs deferred into the next submit, readbacks through host-visible staging ranges."""
    from meganeura.runtime.vulkan import backend
    from meganeura.runtime.vulkan.device import VulkanDevice
    dev = VulkanDevice(direct_host_access=False)
    dev.input_mem_type = None
    monkeypatch.setattr(backend, "_runtime", backend.VulkanRuntime(dev))
    yield
    dev.close()


@pytest.mark.parametrize("k", [1, 2])
@pytest.mark.parametrize("runtime", RUNTIMES)
def test_alone_the_session_trains_as_a_plain_one(monkeypatch, request, runtime, k):
    """Without torchrun's environment: a world of one, the same readback, upload and
    update path, no communication (on Vulkan with staged memory). With accumulate=1 the
    first step is the segmented one: it must send the initial values first."""
    from meganeura import distributed as dist
    if runtime == "vulkan":
        request.getfixturevalue("staged_vulkan")
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGANEURA_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    xs, ys = global_batches()
    try:
        ctx = dist.init(backend=runtime)
        assert (ctx.rank, ctx.world_size, ctx.runtime) == (0, 1, runtime)
        g, _, _, _, loss = build_mlp(2 * BATCH, 64, HIDDEN, 10)
        with dist.compile(g, loss, _optimizer(), accumulate=k, seed=3, bucket_mb=0.004) as s:
            assert len(s.buckets) > 1 and len(s.submissions) > 1 and s.runtime == runtime
            if runtime == "vulkan":
                assert not s.session.executor.dev.vk.direct_host_access
            got = [s.step({"x": xs[i], "labels": ys[i]}) for i in range(4)]
            state = s.state_dict()
            assert s.updates_timed == 4 // k and s.timings["total"] > 0
        with pytest.raises(ValueError, match="init\\(\\) chose this rank's device on"):
            dist.compile(g, loss, _optimizer(), backend="wgpu" if runtime == "vulkan" else "vulkan")
        g, _, _, _, loss = build_mlp(2 * BATCH, 64, HIDDEN, 10)
        with mg.compile(g, loss=loss, optimizer=_optimizer(), accumulate=k, seed=3, backend=runtime) as ref:
            want = [ref.step({"x": xs[i], "labels": ys[i]}) for i in range(4)]
            ref_state = ref.state_dict()
    finally:
        dist.shutdown()
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for name in ref_state:
        np.testing.assert_allclose(state[name], ref_state[name], rtol=1e-6, atol=1e-7, err_msg=name)


@pytest.mark.skipif(vulkan_unavailable_reason() is not None, reason="no direct Vulkan backend here")
def test_vulkan_reduces_in_mapped_staging_memory_without_per_step_submits(monkeypatch, staged_vulkan):
    """On Vulkan with device memory apart from host memory (as on a discrete GPU) the
    collective works on the staging memory the gradients are copied into, and the update
    copies the sums from there inside its own command buffer: no host copy, and no
    synchronous upload per step even for a gradient over the 8 MiB under which ordinary
    inputs are deferred. The result is bitwise that of the host-copy path."""
    from meganeura import distributed as dist
    from meganeura.runtime.vulkan.backend import DEFERRED_UPLOAD_BYTES
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGANEURA_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    xs, ys = global_batches()
    hidden = DEFERRED_UPLOAD_BYTES // (4 * 64) + 64          # the first weight's gradient: over 8 MiB
    results = {}
    try:
        dist.init(backend="vulkan")
        for mapped in (None, False):
            g, _, _, _, loss = build_mlp(2 * BATCH, 64, hidden, 10)
            with dist.compile(g, loss, mg.optim.AdamW(lr=1e-3), seed=5, bucket_mb=4, mapped=mapped) as s:
                big = [b for b in s.buckets if 4 * b.n > DEFERRED_UPLOAD_BYTES]
                assert big and len(s.buckets) > 1
                vk = s.session.executor.dev.vk
                assert not vk.direct_host_access
                submits = []         # one-shot submits that are waited for (synchronous transfers)

                def one_shot(record, vk=vk):
                    submits.append(1)
                    return type(vk)._one_shot(vk, record)
                monkeypatch.setattr(vk, "_one_shot", one_shot)
                losses = []
                for i in range(4):
                    if i == 2:              # steady state: values sent, Programs recorded
                        submits.clear()
                        update = s.session.executor.plan("update").step
                        recorded = sum(p.record_count for p, _ in update.programs.values())
                    losses.append(s.step({"x": xs[i], "labels": ys[i]}))
                if mapped is None:
                    assert s.grad_path == "mapped" and all(b.mapped for b in s.buckets)
                    for b in s.buckets:      # the tensor Gloo reduces is the mapped staging memory
                        assert np.shares_memory(b.host.numpy(), b.staging.block.mapped)
                        assert len(b.upload_copies) == len(b.names)
                    assert submits == []     # no upload of its own, big gradient included
                    assert sum(p.record_count for p, _ in update.programs.values()) == recorded
                else:
                    assert s.grad_path == "host" and not any(b.mapped for b in s.buckets)
                    assert submits          # the big gradient goes up through a synchronous copy
                results[mapped] = (losses, s.state_dict(include_optimizer=True))
    finally:
        dist.shutdown()
    (l_m, st_m), (l_h, st_h) = results[None], results[False]
    assert l_m == l_h
    for name in st_h:
        np.testing.assert_array_equal(st_m[name], st_h[name], err_msg=name)


def test_wgpu_falls_back_to_host_copies(monkeypatch):
    """wgpu maps a buffer only to read it: the gradients go through host arrays, and
    insisting on the mapped path is refused."""
    from meganeura import distributed as dist
    for var in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MEGANEURA_BACKEND"):
        monkeypatch.delenv(var, raising=False)
    try:
        dist.init(backend="wgpu")
        g, _, _, _, loss = build_mlp(BATCH, 64, HIDDEN, 10)
        with dist.compile(g, loss, _optimizer(), bucket_mb=0.004) as s:
            assert s.grad_path == "host" and s.update_copies == []
            assert not any(b.mapped for b in s.buckets)
        with pytest.raises(ValueError, match="keeps no staging memory mapped"):
            dist.compile(g, loss, _optimizer(), mapped=True)
    finally:
        dist.shutdown()


def test_shard_helpers():
    from meganeura import distributed as dist
    ctx = dist.Context(rank=1, world_size=3, local_rank=1, adapter="", timeout_s=1)
    batch = {"x": np.arange(12).reshape(6, 2), "y": np.arange(6)}
    part = dist.shard(batch, ctx)
    np.testing.assert_array_equal(part["y"], [2, 3])
    with pytest.raises(ValueError, match=r"shape \(7,\) does not split into 3"):
        dist.shard(np.arange(7), ctx)
    idx = [dist.shard_indices(10, epoch=2, seed=1, ctx=dist.Context(r, 3, r, "", 1)) for r in range(3)]
    joined = np.concatenate(idx)
    assert len(joined) == 9 and len(set(joined.tolist())) == 9      # disjoint, drop_last
    assert not np.array_equal(idx[0], dist.shard_indices(10, epoch=3, seed=1, ctx=dist.Context(0, 3, 0, "", 1)))


def test_each_local_rank_takes_its_own_vulkan_device(monkeypatch):
    """The Vulkan device of each local rank, from the runtime's device list (as wgpu's)."""
    from meganeura import distributed as dist
    from meganeura.runtime.vulkan import device as vkdev
    gpus = [dict(index=0, name="llvmpipe", type_code=4, type="cpu"),
            dict(index=1, name="GPU A", type_code=2, type="discrete"),
            dict(index=2, name="GPU B", type_code=2, type="discrete")]

    def pick(rank):
        return dist._by_local_rank(rank, "MEGANEURA_VK_DEVICE", gpus, vkdev.choose_physical,
                                   lambda d: (vkdev.device_rank(d), d["type"] == "cpu"))["index"]
    monkeypatch.delenv("MEGANEURA_VK_DEVICE", raising=False)
    assert [pick(r) for r in (0, 1)] == [1, 2]              # the hardware ones, in order
    with pytest.warns(UserWarning, match="ranks share GPU 0"):
        assert pick(2) == 1
    monkeypatch.setenv("MEGANEURA_VK_DEVICE", "2,llvm")
    assert [pick(r) for r in (0, 1)] == [2, 0]
    with pytest.raises(dist.DistributedError, match="names 2 devices, but this process has local rank 2"):
        pick(2)


def test_choosing_the_runtime_opens_the_ranks_own_vulkan_device(monkeypatch):
    """Deciding between Vulkan and wgpu opens the process-wide Vulkan device: for local
    rank 1 that must be rank 1's GPU (it was device 0, and rank 1 then refused to run)."""
    from meganeura import distributed as dist
    from meganeura.runtime.vulkan import _vk, device as vkdev
    gpus = [dict(index=0, name="GPU A", type_code=2, type="discrete"),
            dict(index=1, name="GPU B", type_code=2, type="discrete")]
    opened = []
    monkeypatch.delenv("MEGANEURA_VK_DEVICE", raising=False)
    monkeypatch.delenv("MEGANEURA_BACKEND", raising=False)
    monkeypatch.setattr(_vk, "require", lambda: None)
    monkeypatch.setattr(vkdev, "list_physical_devices", lambda: gpus)
    monkeypatch.setattr(vkdev, "get_vulkan_device", lambda selector=None: opened.append(selector))
    assert dist._resolve_for_rank("gpu", 1) == "vulkan"
    assert opened == ["1"]


def test_core_package_imports_without_torch():
    code = ("import sys; sys.modules['torch'] = None\n"
            "import meganeura, meganeura.distributed as d\n"
            "assert 'torch' not in [m for m, v in sys.modules.items() if v is not None]\n"
            "try:\n    d._torch_dist()\nexcept ImportError as e:\n    print(e)\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "pip install 'meganeura[distributed]'" in r.stdout


if __name__ == "__main__":
    worker(sys.argv[1], sys.argv[2])
