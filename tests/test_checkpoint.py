"""Checkpoints as a hostile user would try them: killed saves, bad metadata, extra tensors,
folders and garbage instead of files, and the umask."""
import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from safetensors.numpy import save_file

import meganeura as mg
from meganeura import checkpoint, disk
from meganeura.checkpoint import CheckpointError


def _trainer(backend="numpy", optimizer=None):
    g = mg.Graph()
    x, y = g.input("x", (4, 3)), g.input("y", (4, 2))
    w, b = g.parameter("fc.weight", (2, 3)), g.parameter("fc.bias", (2,), init=0.5)
    loss = mg.ops.mse_loss(mg.ops.linear(x, w, b), y)
    return mg.compile(g, loss=loss, optimizer=optimizer or mg.optim.Adam(lr=0.1), backend=backend)


def _step(s):
    rng = np.random.default_rng(0)
    s.step({"x": rng.standard_normal((4, 3)), "y": rng.standard_normal((4, 2))})


def _tamper(src, dst, meta=None, extra=None, drop=()):
    """A copy of checkpoint ``src`` with metadata entries replaced and tensors added or dropped."""
    from safetensors import safe_open
    with safe_open(str(src), framework="numpy") as f:
        m = dict(f.metadata())
        tensors = {k: f.get_tensor(k) for k in f.keys() if k not in drop}
    m.update(meta or {})
    tensors.update(extra or {})
    save_file(tensors, str(dst), metadata=m)
    return dst


def _unchanged(s, before):
    after = s.state_dict(include_optimizer=True)
    assert set(after) == set(before)
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)


@pytest.mark.parametrize("step,why", [("1e3", "1e3"), ("-5", "-5"), ("five", "five"), ("", "")])
def test_bad_step_metadata_is_refused_before_anything_changes(tmp_path, step, why):
    src = _trainer()
    _step(src)
    good = src.save(tmp_path / "good.safetensors")
    bad = _tamper(good, tmp_path / "bad.safetensors", meta={"step": step})
    dst = _trainer()
    before = dst.state_dict(include_optimizer=True)
    with pytest.raises(CheckpointError, match=rf"bad.safetensors.*step='{why}' is not a non-negative integer"):
        dst.load(bad)
    _unchanged(dst, before)
    assert dst.steps_done == 0


def test_bad_format_version_and_parameter_list_name_the_file(tmp_path):
    good = _trainer().save(tmp_path / "good.safetensors")
    s = _trainer()
    with pytest.raises(CheckpointError, match=r"v.safetensors.*format_version='x'"):
        s.load(_tamper(good, tmp_path / "v.safetensors", meta={"format_version": "x"}))
    with pytest.raises(CheckpointError, match=r"p.safetensors.*'parameters' is not a JSON list"):
        s.load(_tamper(good, tmp_path / "p.safetensors", meta={"parameters": "{oops"}))


def test_strict_refuses_extra_tensors(tmp_path):
    good = _trainer().save(tmp_path / "good.safetensors", include_optimizer=False)
    extra = _tamper(good, tmp_path / "extra.safetensors", extra={"fc2.weight": np.zeros((2, 2), np.float32)},
                    meta={"parameters": json.dumps(["fc.bias", "fc.weight", "fc2.weight"])})
    s = _trainer()
    before = s.state_dict(include_optimizer=True)
    with pytest.raises(CheckpointError, match=r"extra.safetensors.*unexpected parameter 'fc2.weight'"):
        s.load(extra)
    _unchanged(s, before)
    s.load(extra, strict=False)          # non-strict: loads what both sides have
    # a plain safetensors file (no metadata): every tensor counts as a parameter
    plain = tmp_path / "plain.safetensors"
    save_file({**s.state_dict(), "stray": np.zeros(3, np.float32)}, str(plain))
    with pytest.raises(CheckpointError, match=r"unexpected parameter 'stray'"):
        s.load(plain)


def test_strict_refuses_another_optimizers_state_but_inference_ignores_it(tmp_path):
    adam = _trainer(optimizer=mg.optim.Adam(lr=0.1))
    _step(adam)
    path = adam.save(tmp_path / "adam.safetensors")
    sgd = _trainer(optimizer=mg.optim.SGD(lr=0.1, momentum=0.9))
    with pytest.raises(CheckpointError, match=r"unexpected optimizer state 'fc.weight.exp_avg' \(written by Adam, "
                                              r"this session's is SGD\)"):
        sgd.load(path)
    assert sgd.steps_done == 0
    g = mg.Graph()
    x = g.input("x", (4, 3))
    out = mg.ops.linear(x, g.parameter("fc.weight", (2, 3)), g.parameter("fc.bias", (2,)))
    inf = mg.compile(g, outputs=[out], backend="numpy")
    inf.load(path)                        # the optimizer state is not the inference session's business
    np.testing.assert_array_equal(inf.state_dict()["fc.weight"], adam.state_dict()["fc.weight"])


def test_errors_name_the_file_for_folders_and_garbage(tmp_path):
    s = _trainer()
    with pytest.raises(IsADirectoryError, match=rf"checkpoint '{tmp_path}' is a folder"):
        s.load(tmp_path)
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json at all")
    with pytest.raises(CheckpointError, match=r"junk.safetensors' is not a readable safetensors file"):
        s.load(junk)
    with pytest.raises(IsADirectoryError, match="is a folder; give a file name"):
        s.save(tmp_path)


def test_saved_file_mode_follows_the_umask(tmp_path):
    s = _trainer()
    old = os.umask(0o022)
    try:
        path = s.save(tmp_path / "a.safetensors")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o644
    old = os.umask(0o077)
    try:
        path = s.save(tmp_path / "b.safetensors")
    finally:
        os.umask(old)
    assert os.stat(path).st_mode & 0o777 == 0o600


def _ours(folder, name="model.safetensors"):
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(f".{name}{disk.TMP_MARK}"))


def test_temp_files_of_killed_saves_are_removed_by_the_next_save(tmp_path):
    """A child process is killed (SIGKILL) in the middle of writing a checkpoint: the old
    checkpoint is intact, the temp file left is ours (named after the checkpoint) and the
    next save removes it, leaving a running process's alone."""
    target = tmp_path / "model.safetensors"
    old = _trainer()
    old.save(target)
    before = target.read_bytes()
    script = textwrap.dedent(f"""
        import os, signal
        import meganeura as mg
        import meganeura.checkpoint as ck
        def die(f, tensors, meta):    # the process dies while the temp file is being written
            f.write(b"partial" * 1000)
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        ck.write_safetensors = die
        g = mg.Graph()
        g.parameter("w", (1000, 100))
        s = mg.compile(g, outputs=[g["w"]], backend="numpy")
        s.save(r"{target}")
    """)
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == -signal.SIGKILL, r.stderr
    assert len(_ours(tmp_path)) == 1 and target.read_bytes() == before
    live = tmp_path / f".model.safetensors{disk.TMP_MARK}{os.getppid()}-abcd"      # a save running elsewhere
    live.write_bytes(b"in progress")
    legacy = tmp_path / ".model.safetensors.999999999.abcd.tmp"                  # an earlier version's, dead
    legacy.write_bytes(b"left")
    old.save(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([target.name, live.name])
    checkpoint.clean_temp_files(target)
    assert live.exists()


def test_saves_killed_at_random_leave_the_checkpoint_whole_and_no_temp_after_the_next_load(tmp_path):
    """kill -9 at a random moment (seeded) of a child saving a 24 MB checkpoint over and over:
    the checkpoint always reads whole (the old one or a newer one), and the next load
    removes the temp file a kill left."""
    import time
    target = tmp_path / "model.safetensors"
    g = mg.Graph()
    g.parameter("w", (2000, 3000))
    s = mg.compile(g, outputs=[g["w"]], backend="numpy")
    s.assign({"w": np.zeros((2000, 3000), np.float32)})
    s.save(target)
    script = textwrap.dedent(f"""
        import numpy as np
        import meganeura as mg
        g = mg.Graph()
        g.parameter("w", (2000, 3000))
        s = mg.compile(g, outputs=[g["w"]], backend="numpy")
        print("ready", flush=True)
        k = 0
        while True:
            k += 1
            s.assign({{"w": np.full((2000, 3000), k, np.float32)}})
            s.save(r"{target}")
    """)
    rng = np.random.default_rng(7)
    kills, left_by_kills = 4, 0
    for _ in range(kills):
        child = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert child.stdout.readline().strip() == "ready"
        time.sleep(float(rng.uniform(0.05, 0.6)))
        child.kill()
        child.wait()
        child.stdout.close()
        left_by_kills += len(list(tmp_path.iterdir())) - 1
        w = checkpoint.read(target)[0]["w"]         # whole: one value throughout
        assert w.shape == (2000, 3000) and np.all(w == w.flat[0])
        assert [p.name for p in tmp_path.iterdir()] == [target.name]     # the load cleaned the dead save's temp
    s.load(target)
    print(f"{kills} kills, {left_by_kills} temp files left by them, all removed")


def test_the_writer_s_files_read_back_with_the_safetensors_package(tmp_path):
    """write_safetensors (ours, streaming) against the package's reader: every dtype a
    session holds, 0-d and empty tensors, big-endian input, metadata."""
    from safetensors.numpy import load_file
    rng = np.random.default_rng(3)
    tensors = {"f32": rng.standard_normal((3, 5)).astype(np.float32), "f16": np.arange(6, dtype=np.float16),
               "i32": np.array([-1, 2, 3], np.int32), "u32": np.array([7], np.uint32), "scalar": np.float32(2.5),
               "empty": np.zeros((0, 4), np.float32), "bool": np.array([True, False]),
               "big_endian": np.arange(4, dtype=">f4"), "strided": np.arange(12, dtype=np.float32).reshape(3, 4).T}
    path = tmp_path / "t.safetensors"
    with disk.atomic_file(path) as f:
        checkpoint.write_safetensors(f, tensors, {"k": "v"})
    back = load_file(str(path))
    assert sorted(back) == sorted(tensors)
    for k, v in tensors.items():
        v = np.asarray(v)
        assert back[k].shape == v.shape and back[k].dtype == v.dtype.newbyteorder("=") and np.array_equal(back[k], v), k
    from safetensors import safe_open
    with safe_open(str(path), framework="numpy") as f:
        assert f.metadata() == {"k": "v"}
    with pytest.raises(CheckpointError, match="tensor 'c': dtype complex64 cannot be saved"):
        with disk.atomic_file(tmp_path / "c.safetensors") as f:
            checkpoint.write_safetensors(f, {"c": np.zeros(2, np.complex64)}, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == ["t.safetensors"]
