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
        bad = [m for m in sys.modules if m.startswith(("meganeura.compiler", "meganeura.api", "meganeura.runtime.executor"))]
        assert not bad, bad
        import meganeura.disk, meganeura.env
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(SRC.parent) + os.pathsep + os.environ.get("PYTHONPATH", "")})
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


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
