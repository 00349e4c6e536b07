"""Where the Vulkan backend keeps what it can reuse across processes: compiled SPIR-V and
the driver's pipeline cache.

The folder is ``$MEGANEURA_CACHE_DIR`` when set, else the platform's user cache folder
(``$XDG_CACHE_HOME/meganeura`` or ``~/.cache/meganeura`` on Linux, ``~/Library/Caches/
meganeura`` on macOS, ``%LOCALAPPDATA%\\meganeura\\Cache`` on Windows). Setting
``MEGANEURA_NO_DISK_CACHE=1`` turns both disk caches off (everything is rebuilt each process).
"""
from __future__ import annotations

import os
import pathlib
import sys
import tempfile


def disk_cache_enabled() -> bool:
    return os.environ.get("MEGANEURA_NO_DISK_CACHE", "").strip().lower() not in ("1", "true", "yes", "on")


def cache_dir() -> pathlib.Path:
    """The user cache folder of meganeura (not created here)."""
    env = os.environ.get("MEGANEURA_CACHE_DIR")
    if env:
        return pathlib.Path(env).expanduser()
    home = pathlib.Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "meganeura"
    if os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return pathlib.Path(base) / "meganeura" / "Cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(home / ".cache")
    return pathlib.Path(base) / "meganeura"


def write_atomic(path: pathlib.Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file and a rename, so a concurrent
    reader never sees a half-written file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name + ".", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
