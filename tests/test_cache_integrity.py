"""Caches that cannot poison results: every disk entry is self-checking, so a flipped,
truncated, foreign or unreadable entry is a miss that is rebuilt and rewritten, never a crash
or a wrong answer; SPIR-V is checked whole before a driver sees it. Also the switch table
(``env``) and the floors of the cache modules (no import of the runtime or the compiler)."""
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import meganeura as mg
from meganeura import disk, env

SRC = pathlib.Path(mg.__file__).parent


# ------------------------------------------------------------------ env: the switch table
def test_every_switch_the_source_names_is_in_the_table():
    named = set()
    for p in SRC.rglob("*.py"):
        named |= set(re.findall(r"MEGANEURA_[A-Z0-9_]*[A-Z0-9]", p.read_text()))
    assert named and not named - set(env.SWITCHES), sorted(named - set(env.SWITCHES))
    table = env.markdown_table()
    assert all(f"`{name}`" in table for name in env.SWITCHES)
    assert table.splitlines()[0].startswith("| switch | type | default | meaning | read by |")


def test_typed_readers_name_the_switch(monkeypatch):
    monkeypatch.setenv("MEGANEURA_MATMUL_GROUPS", "12x")
    with pytest.raises(ValueError, match="MEGANEURA_MATMUL_GROUPS='12x': expected an integer"):
        env.integer("MEGANEURA_MATMUL_GROUPS")
    monkeypatch.setenv("MEGANEURA_MATMUL_GROUPS", " 12 ")
    assert env.integer("MEGANEURA_MATMUL_GROUPS") == 12
    monkeypatch.delenv("MEGANEURA_MATMUL_GROUPS")
    assert env.integer("MEGANEURA_MATMUL_GROUPS", 256) == 256
    for raw, want in (("1", True), ("ON", True), ("0", False), ("no", False), ("", True)):
        monkeypatch.setenv("MEGANEURA_EARLY_KERNELS", raw)
        assert env.flag("MEGANEURA_EARLY_KERNELS", default=True) is want
    monkeypatch.setenv("MEGANEURA_NO_FUSE", "epilogue, ,all")
    assert env.names("MEGANEURA_NO_FUSE") == ["epilogue", "all"]
    with pytest.raises(KeyError, match="MEGANEURA_NOT_A_SWITCH is not a meganeura switch"):
        env.flag("MEGANEURA_NOT_A_SWITCH")


def test_plan_keyed_switches_leave_out_those_that_change_no_plan(monkeypatch):
    for k in [k for k in os.environ if k.startswith("MEGANEURA_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("MEGANEURA_TRACE", "t.json")
    monkeypatch.setenv("MEGANEURA_MATMUL_TILE", "64")
    monkeypatch.setenv("MEGANEURA_SOME_NEW_SWITCH", "1")            # unknown names key: they may be new
    assert env.plan_keyed() == [("MEGANEURA_MATMUL_TILE", "64"), ("MEGANEURA_SOME_NEW_SWITCH", "1")]


# ------------------------------------------------------------------ the floors
def test_the_caches_import_neither_the_runtime_nor_the_compiler():
    """plan_cache and the Vulkan cache stand on disk and env: imported alone (the package's
    __init__, which imports the API, left out), they pull in no runtime, compiler or API."""
    code = textwrap.dedent("""
        import importlib.util, sys, types
        spec = importlib.util.find_spec("meganeura")
        pkg = types.ModuleType("meganeura")
        pkg.__path__ = list(spec.submodule_search_locations)
        sys.modules["meganeura"] = pkg
        import meganeura.plan_cache
        bad = [m for m in sys.modules if m.startswith(("meganeura.runtime", "meganeura.compiler", "meganeura.api"))]
        assert not bad, bad
        import meganeura.runtime.vulkan.cache
        above = ("meganeura.compiler", "meganeura.api", "meganeura.runtime.executor")
        bad = [m for m in sys.modules if m.startswith(above)]
        assert not bad, bad
        import meganeura.disk, meganeura.env
        print("ok")
    """)
    path = str(SRC.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": path})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def _imported(path):
    """Every module a source file imports, at module level or in a function (relative
    imports resolved against the package)."""
    import ast
    mod = ".".join(path.relative_to(SRC.parent).with_suffix("").parts)
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = mod.split(".")[:-node.level] if node.level else []
            full = ".".join(base + ([node.module] if node.module else []))
            out |= {full} | {f"{full}.{a.name}" for a in node.names}
    return out


def test_no_import_circle_through_the_caches():
    """Not even in a function: the plan cache imports no runtime, the Vulkan cache neither
    the plan cache nor the compiler, and disk / env nothing of the package but env."""
    def hits(path, prefixes):
        return sorted(m for m in _imported(SRC / path) if m.startswith(prefixes))
    assert hits("plan_cache.py", ("meganeura.runtime",)) == []
    assert hits("runtime/vulkan/cache.py", ("meganeura.plan_cache", "meganeura.compiler", "meganeura.api")) == []
    assert {m for m in _imported(SRC / "disk.py") if m.startswith("meganeura")} <= {"meganeura", "meganeura.env"}
    assert hits("env.py", ("meganeura",)) == []


# ------------------------------------------------------------------ disk entries
def _unreadable(path: pathlib.Path):
    """Make ``path`` fail to read: mode 000, or (as root, whom modes do not stop) a folder in
    its place."""
    if os.geteuid() != 0:
        os.chmod(path, 0)
    else:
        path.unlink()
        path.mkdir()
    with pytest.raises(OSError):
        path.read_bytes()


def test_an_entry_reads_back_only_whole_and_under_its_name(tmp_path, caplog):
    import logging
    path = tmp_path / "a" / "k1.bin"
    content = bytes(range(256)) * 3
    assert disk.store(path, content) and disk.load(path) == content
    data = path.read_bytes()
    assert len(data) == disk.HEAD_BYTES + len(content)
    bad = [data[:n] for n in range(0, len(data), 7)]                        # truncated at every 7th length
    bad += [data[:i] + bytes([data[i] ^ (1 << (i % 8))]) + data[i + 1:] for i in range(len(data))]   # every byte
    bad += [data + b"\0", b"garbage", disk.encode("k2.bin", content)]        # longer, foreign, another name's
    caplog.set_level(logging.DEBUG, logger="meganeura.disk")
    for b in bad:
        path.write_bytes(b)
        assert disk.load(path) is None and not path.exists()                 # a miss, and the entry is gone
    assert len(bad) == len(data) + -(-len(data) // 7) + 3 and "not a whole entry" in caplog.text
    # reported once per path, not once per read
    assert sum("not a whole entry" in r.getMessage() for r in caplog.records) == 1
    assert disk.store(path, content)
    _unreadable(path)
    assert disk.load(path) is None
    assert disk.store(path, content) and disk.load(path) == content         # rewritten
    os.mkfifo(tmp_path / "a" / "pipe.bin")                                  # would block a plain read
    assert disk.load(tmp_path / "a" / "pipe.bin") is None


def test_writes_leave_no_temp_files_and_dead_writers_temps_are_cleaned(tmp_path):
    path = tmp_path / "x.bin"
    disk.write_atomic(path, b"abc")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
    with pytest.raises(RuntimeError):
        with disk.atomic_file(path) as f:
            f.write(b"half")
            raise RuntimeError("killed")
    assert path.read_bytes() == b"abc" and sorted(p.name for p in tmp_path.iterdir()) == ["x.bin"]
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    stale = tmp_path / f".x.bin{disk.TMP_MARK}{int(dead.stdout)}-0000"
    live = tmp_path / f".x.bin{disk.TMP_MARK}{os.getppid()}-0000"          # a running process's write
    stale.write_bytes(b"left by a killed write")
    live.write_bytes(b"in progress")
    assert disk.clean_temp_files(tmp_path, "x.bin") == 1
    assert not stale.exists() and live.exists()


def test_concurrent_writers_and_readers_of_one_entry(tmp_path):
    """8 threads storing, loading and pruning one entry at once: a read gives the content
    or a miss, never anything else, and no temp file is left."""
    import threading
    path = tmp_path / "e.bin"
    content = os.urandom(1 << 16)
    seen, errors = set(), []
    disk.store(path, content)       # stored before the threads start: a reader's hit never hangs on scheduling

    def work(k):
        try:
            for _ in range(40):
                if k % 2:
                    disk.store(path, content)
                    disk.prune(tmp_path, 1 << 30, ("*.bin",))
                else:
                    got = disk.load(path)
                    seen.add(None if got is None else got == content)
        except Exception as e:      # noqa: BLE001
            errors.append(e)
    threads = [threading.Thread(target=work, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and False not in seen and True in seen
    assert [p.name for p in tmp_path.iterdir()] == ["e.bin"] and disk.load(path) == content


# ------------------------------------------------------------------ plans on the device
@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("MEGANEURA_NO_DISK_CACHE", raising=False)
    monkeypatch.delenv("MEGANEURA_NO_PLAN_CACHE", raising=False)
    return tmp_path


X = np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)


def _times3(backend):
    """(session of ``x * 3.0 + 1.0``, how its plan was got: "stored" compiled, "hit" read)."""
    g = mg.Graph()
    x = g.input("x", (3, 4))
    s = mg.compile(g, outputs=[x * 3.0 + 1.0], backend=backend)
    return s, s.executor.plans["run"].kernel_plan.stats["cache"]


def _run_times3(backend):
    s, how = _times3(backend)
    try:
        return s.run({"x": X})[0], how
    finally:
        s.close()


def _flip(data: bytes, i: int, bit: int) -> bytes:
    return data[:i] + bytes([data[i] ^ (1 << bit)]) + data[i + 1:]


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_every_flipped_byte_of_a_plan_entry_is_rebuilt_and_rewritten(cache, backend):
    """gpu: one bit of every byte of the entry flipped in turn (bit i % 8 of byte i); wgpu,
    slower to compile: every 23rd byte. Each later compile gives the right answer from a plan
    compiled again, and leaves the entry whole (the next compile reads it)."""
    want = X * np.float32(3.0) + np.float32(1.0)
    out, how = _run_times3(backend)
    assert how == "stored" and np.array_equal(out, want)
    (path,) = (cache / "plans").glob("*.plan")
    good = path.read_bytes()
    step = 1 if backend == "gpu" else 23
    flips = range(0, len(good), step)
    for i in flips:
        path.write_bytes(_flip(good, i, i % 8))
        out, how = _run_times3(backend)
        assert how == "stored", f"byte {i}: a flipped entry was read"
        assert np.array_equal(out, want), f"byte {i}"
        assert path.read_bytes() == good, f"byte {i}: not rewritten as it was"
    assert len(flips) >= (len(good) if backend == "gpu" else 40)
    out, how = _run_times3(backend)
    assert how == "hit" and np.array_equal(out, want)


def test_a_constant_flipped_from_3_to_7_is_not_read(cache):
    """'3' -> '7' is one bit (0x04) of the kernel's text: the digest differs, the plan is
    compiled again and the answer stays x * 3 + 1."""
    _run_times3("gpu")
    (path,) = (cache / "plans").glob("*.plan")
    good = path.read_bytes()
    at = good.find(b"3.0")
    assert at > 0, "the constant's text is in the entry"
    path.write_bytes(_flip(good, at, 2))
    assert path.read_bytes()[at:at + 3] == b"7.0"
    out, how = _run_times3("gpu")
    assert how == "stored" and np.array_equal(out, X * np.float32(3.0) + np.float32(1.0))


def _trainer():
    g = mg.Graph()
    x, y = g.input("x", (8, 4)), g.input("y", (8,), mg.i32)
    logits = mg.ops.linear(mg.ops.relu(mg.ops.linear(x, g.parameter("w1", (16, 4)))), g.parameter("w2", (3, 16)))
    return mg.compile(g, loss=mg.ops.cross_entropy(logits, y), optimizer=mg.optim.Adam(lr=0.05), backend="gpu", seed=0)


def _losses(s, n=6):
    rng = np.random.default_rng(1)
    feeds = {"x": rng.standard_normal((8, 4)).astype(np.float32), "y": rng.integers(0, 3, 8).astype(np.int32)}
    try:
        return [s.step(feeds) for _ in range(n)]
    finally:
        s.close()


def test_a_flipped_training_manifest_does_not_rename_the_step_size(cache):
    """A bit flipped in ``optim.step_size`` of a session's manifest (and, in turn, in every
    19th byte): the session differentiates again and trains as the first did."""
    from meganeura.api import CachedProgram
    want = _losses(_trainer())
    assert want[-1] < want[0]
    (path,) = (cache / "plans").glob("*.session")
    good = path.read_bytes()
    at = good.find(b"optim.step_size")
    assert at > 0
    flips = [at + 7, *range(0, len(good), 19)]
    for i in flips:
        path.write_bytes(_flip(good, i, i % 8))
        s = _trainer()
        assert not isinstance(s.program, CachedProgram), f"byte {i}: a flipped manifest was read"
        assert _losses(s) == want, f"byte {i}"
    s = _trainer()
    assert isinstance(s.program, CachedProgram)                 # rewritten: read again
    assert _losses(s) == want


# ------------------------------------------------------------------ SPIR-V entries
_CHILD = textwrap.dedent("""
    import json, sys
    import numpy as np
    import meganeura as mg
    from meganeura.compilation import glslang
    g = mg.Graph()
    x = g.input("x", (3, 4))
    h = mg.ops.relu(mg.ops.linear(x, g.parameter("w", (5, 4))))
    s = mg.compile(g, outputs=[mg.ops.softmax(h * 3.0, -1), mg.ops.sum(h, 0)], backend="vulkan")
    s.assign({"w": np.arange(20, dtype=np.float32).reshape(5, 4) / 10 - 1})
    outs = s.run({"x": np.linspace(-2, 2, 12, dtype=np.float32).reshape(3, 4)})
    print(json.dumps({"outs": [o.tolist() for o in outs], "glslang": dict(glslang.STATS),
                      "plan": s.executor.plans["run"].kernel_plan.stats["cache"]}))
""")


def _child(cache):
    """The child's (outputs, glslang's counts, how the plan was got); the child must exit 0."""
    import json
    out = subprocess.run([sys.executable, "-c", _CHILD], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "MEGANEURA_CACHE_DIR": str(cache)})
    assert out.returncode == 0, f"exit {out.returncode}: {out.stderr[-2000:]}"
    got = json.loads(out.stdout.strip().splitlines()[-1])
    return [np.array(o, np.float32) for o in got["outs"]], got["glslang"], got["plan"]


def _spirv_entries(cache):
    return sorted((cache / "spirv").glob("*.spv")), sorted((cache / "kernels").glob("*.bin"))


@pytest.fixture
def warm(cache):
    """A cache folder a first child filled, and that child's outputs."""
    want, counts, how = _child(cache)
    spv, kernels = _spirv_entries(cache)
    assert how == "stored" and counts.get("compiles", 0) == len(spv) >= 2 and len(kernels) == len(spv)
    return want


def _same(got, want):
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))


def test_every_cut_of_a_module_is_refused_and_the_whole_one_accepted(cache):
    """glslang's module of a kernel with a helper function, cut after every word: each cut is
    refused by ``spirv.validate`` (at an instruction boundary too), the whole module passes."""
    from meganeura.compilation import glslang
    from meganeura.runtime.vulkan.spirv import SpirvError, validate
    source = textwrap.dedent("""
        #version 450
        layout(local_size_x = 64) in;
        layout(std430, binding = 0) buffer B { float x[]; };
        float twice(float v) { return v + v; }
        void main() { uint i = gl_GlobalInvocationID.x; x[i] = twice(x[i]); }
    """)
    code = glslang.compile_glsl(source, name="twice", disk_cache=False)
    validate(code)
    refused = 0
    for cut in range(0, len(code), 4):
        with pytest.raises(SpirvError):
            validate(code[:cut])
        refused += 1
    assert refused == len(code) // 4 > 50


def test_truncated_spirv_never_reaches_the_driver(cache, warm):
    """Each module cut to a multiple of 4 bytes, once as a cut file and once inside a whole
    entry (a digest that matches: only ``spirv.validate`` stands between it and the driver),
    in the SPIR-V entries and the kernel entries alike: the child exits 0, right, compiling
    every kernel again."""
    from meganeura.runtime.vulkan import cache as vkcache
    from meganeura.runtime.vulkan.spirv import SpirvError, validate
    spv, kernels = _spirv_entries(cache)
    for whole_entry in (False, True):
        for p in spv:
            code = disk.load(p)
            assert code is not None
            cut = code[:(len(code) // 2) & ~3]
            with pytest.raises(SpirvError):
                validate(cut)
            if whole_entry:
                assert vkcache.store_spirv(p.stem, cut)
            else:
                p.write_bytes(p.read_bytes()[:(p.stat().st_size // 2) & ~3])
        for p in kernels:
            ck = vkcache.load_kernel(p.stem)
            cut = ck.spirv[:(len(ck.spirv) * 3 // 4) & ~3]
            if whole_entry:
                assert vkcache.store_kernel(p.stem, vkcache.CompiledKernel(cut, ck.info, ck.subgroup32))
            else:
                p.write_bytes(p.read_bytes()[:-8])
        got, counts, how = _child(cache)
        _same(got, warm)
        assert how == "hit" and counts.get("compiles", 0) == len(spv) and counts.get("disk_hits", 0) == 0
        assert all(vkcache.load_kernel(p.stem) is not None for p in kernels)      # rewritten whole
        assert all(vkcache.load_spirv(p.stem) is not None for p in spv)


def test_random_flips_in_spirv_entries_are_compiled_again(cache, warm):
    """Three rounds of one random bit flipped in every SPIR-V and kernel entry (seeded)."""
    rng = np.random.default_rng(5)
    spv, kernels = _spirv_entries(cache)
    for _ in range(3):
        for p in spv + kernels:
            data = p.read_bytes()
            i = int(rng.integers(len(data)))
            p.write_bytes(_flip(data, i, int(rng.integers(8))))
        got, counts, _ = _child(cache)
        _same(got, warm)
        assert counts.get("compiles", 0) == len(spv) and counts.get("disk_hits", 0) == 0


def test_an_unreadable_spirv_entry_is_compiled_again(cache, warm):
    spv, kernels = _spirv_entries(cache)
    for p in kernels:
        p.unlink()                  # so that glslang's own entries are asked for
    _unreadable(spv[0])
    got, counts, _ = _child(cache)
    _same(got, warm)
    assert counts.get("compiles", 0) == 1 and counts.get("disk_hits", 0) == len(spv) - 1
    assert spv[0].is_file() and disk.load(spv[0]) is not None                   # rewritten


def test_a_plan_entry_builds_data_only(cache, tmp_path):
    """Even inside a whole entry (a matching digest), a plan is read as data: a pickle that
    would call a function is refused before the call, and the entry is a miss."""
    import pickle

    from meganeura import plan_cache
    marker = tmp_path / "called"

    class Calls:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))
    for payload in (pickle.dumps(Calls()), pickle.dumps({"not": "a plan"}), b"\x80\x05junk"):
        assert disk.store(plan_cache.folder() / "k.plan", payload)
        assert plan_cache.load("k") is None
    assert not marker.exists()


def test_a_whole_manifest_that_manifest_of_would_not_write_is_not_read(cache):
    """Inside a whole entry too: a scalar that is not an optimizer's, an unknown dtype, a
    missing field, a list in place of the object: each is a miss."""
    import json

    from meganeura import plan_cache
    good = {"phases": {"step": "k1"}, "states": [["w.exp_avg", [3, 4], "f32"]], "scalars": ["optim.step_size"],
            "kept": ["w", "w.exp_avg"], "grads": ["w"], "updates": {"step": ["w", "w.exp_avg"]}}
    path = plan_cache.folder() / "s1.session"
    assert disk.store(path, json.dumps(good).encode())
    assert plan_cache.load_manifest("s1")["states"] == [("w.exp_avg", (3, 4), "f32")]
    for bad in ({**good, "scalars": ["optin.step_size"]}, {**good, "states": [["w.exp_avg", [3, 4], "f64"]]},
                {k: v for k, v in good.items() if k != "kept"}, {**good, "phases": {}}, [good]):
        assert disk.store(path, json.dumps(bad).encode())
        assert plan_cache.load_manifest("s1") is None, bad
