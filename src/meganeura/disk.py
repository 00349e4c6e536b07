"""Files on disk: the cache folder, atomic writes, self-checking cache entries, pruning and
the package digest that keys every cache.

An entry is ``MAGIC`` (8 bytes), the entry format (u32), the content's length (u64), a
SHA-256 digest of the entry's name and content, then the content. ``load`` returns the
content only when all of that holds; anything else (missing, unreadable, truncated, foreign,
flipped, another name's) is a miss: the caller rebuilds it and ``store`` writes it again.
A bad entry is deleted and reported once at debug level (logger ``meganeura.disk``); no read
raises. A cache must never give a wrong answer: a flipped bit anywhere makes the digest
differ, so the content a reader gets is the content a writer stored under that name.

Writes go to a temporary file in the same folder (``.<name>.meganeura-tmp-<pid>-<nonce>``),
are flushed to disk and renamed over the target, so a reader or a crash never leaves half an
entry; ``clean_temp_files`` removes the temporary files of processes that died mid-write.

The cache folder is ``$MEGANEURA_CACHE_DIR`` when set, else the platform's user cache folder
(``$XDG_CACHE_HOME/meganeura`` or ``~/.cache/meganeura`` on Linux, ``~/Library/Caches/
meganeura`` on macOS, ``%LOCALAPPDATA%\\meganeura\\Cache`` on Windows);
``MEGANEURA_NO_DISK_CACHE=1`` turns every disk cache off. Ground floor: imports nothing from
the package but ``env``.
"""
from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import pathlib
import secrets
import stat
import struct
import sys
import threading

from . import env

MAGIC = b"MGNCACHE"
FORMAT = 1                              # the envelope's layout
_HEAD = struct.Struct("<8sIQ32s")       # magic, format, content length, SHA-256 of name and content
HEAD_BYTES = _HEAD.size
TMP_MARK = ".meganeura-tmp-"

log = logging.getLogger("meganeura.disk")
_reported: set = set()
_reported_lock = threading.Lock()


def enabled() -> bool:
    """Whether the disk caches are on (``MEGANEURA_NO_DISK_CACHE`` unset)."""
    return not env.flag("MEGANEURA_NO_DISK_CACHE")


def cache_dir() -> pathlib.Path:
    """The user cache folder of meganeura (not created here)."""
    configured = env.text("MEGANEURA_CACHE_DIR")
    if configured:
        return pathlib.Path(configured).expanduser()
    home = pathlib.Path.home()
    if sys.platform == "darwin":
        return home / "Library" / "Caches" / "meganeura"
    if os.name == "nt":
        base = os.environ.get("LOCALAPPDATA") or str(home / "AppData" / "Local")
        return pathlib.Path(base) / "meganeura" / "Cache"
    base = os.environ.get("XDG_CACHE_HOME") or str(home / ".cache")
    return pathlib.Path(base) / "meganeura"


# ----------------------------------------------------------------------------- writing
def temp_name(path) -> str:
    """This process's temporary file name for a write of ``path`` (in its folder)."""
    path = pathlib.Path(path)
    return f".{path.name}{TMP_MARK}{os.getpid()}-{secrets.token_hex(4)}"


def process_alive(pid: int) -> bool:
    if os.name == "nt":       # os.kill(pid, 0) there sends CTRL_C_EVENT: never probe, never clean
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):        # someone else's process, or cannot tell
        return True
    return True


def clean_temp_files(folder, name: str | None = None) -> int:
    """Remove the temporary files (of ``name`` only, when given) that processes which no longer
    run left in ``folder`` (killed mid-write); writes in progress are left alone. Returns how
    many were removed."""
    prefix = f".{name}{TMP_MARK}" if name else "."
    removed = 0
    try:
        entries = os.listdir(folder)
    except OSError:
        return 0
    for entry in entries:
        if not entry.startswith(prefix) or TMP_MARK not in entry:
            continue
        pid = entry.rsplit(TMP_MARK, 1)[1].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid() or process_alive(int(pid)):
            continue
        try:
            os.unlink(os.path.join(folder, entry))
            removed += 1
        except OSError:
            pass
    return removed


def fsync_folder(folder) -> None:
    """Make a rename in ``folder`` durable (where the platform lets a folder be opened)."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


@contextlib.contextmanager
def atomic_file(path, mode: int = 0o666):
    """A binary file to write ``path`` through: a temporary file in the same folder, flushed
    to disk and renamed over ``path`` when the block ends; removed if the block raises.
    ``mode`` less the umask, as ``open`` gives a new file."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / temp_name(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), mode)
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (``atomic_file``)."""
    with atomic_file(path) as f:
        f.write(data)


# ----------------------------------------------------------------------------- entries
def _digest(name: str, content) -> bytes:
    h = hashlib.sha256(name.encode())          # SHA-256: about twice BLAKE2b's speed where the CPU has SHA extensions
    h.update(b"\0")
    h.update(content)
    return h.digest()


def encode(name: str, content: bytes) -> bytes:
    """The self-checking entry of ``content`` stored under the file name ``name``."""
    return _HEAD.pack(MAGIC, FORMAT, len(content), _digest(name, content)) + content


def decode(name: str, data: bytes) -> bytes | None:
    """The content of the entry ``data`` of the file name ``name``, or None where it is not
    a whole entry of this format and name."""
    if len(data) < HEAD_BYTES:
        return None
    magic, fmt, size, digest = _HEAD.unpack_from(data)
    if magic != MAGIC or fmt != FORMAT or size != len(data) - HEAD_BYTES:
        return None
    content = memoryview(data)[HEAD_BYTES:]
    return bytes(content) if _digest(name, content) == digest else None


def report(path, why: str) -> None:
    """Log a bad entry at debug level, once per path and process (a cache folder shared by
    many processes must not flood the log)."""
    key = str(path)
    with _reported_lock:
        if key in _reported:
            return
        _reported.add(key)
    log.debug("cache entry %s ignored: %s", path, why)


def _discard(path: pathlib.Path, why: str) -> None:
    report(path, why)
    try:
        path.unlink()
    except IsADirectoryError:
        with contextlib.suppress(OSError):
            path.rmdir()          # an empty folder where the entry goes; a full one stays
    except OSError:
        pass


def _read_regular(path: pathlib.Path) -> bytes:
    """The bytes of the regular file ``path``; OSError for anything else (a pipe in its place
    would block a plain read forever, hence the non-blocking open and the check)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_BINARY", 0))
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise IsADirectoryError(errno.EISDIR, "not a regular file") if stat.S_ISDIR(st.st_mode) else \
                OSError(errno.EINVAL, "not a regular file")
        with os.fdopen(fd, "rb", closefd=False) as f:
            return f.read()
    finally:
        os.close(fd)


def load(path) -> bytes | None:
    """The content stored at ``path`` (``store``), or None: missing, unreadable or not a whole
    entry of its name. A bad entry is deleted (the next ``store`` writes it again)."""
    path = pathlib.Path(path)
    try:
        data = _read_regular(path)
    except FileNotFoundError:
        return None
    except OSError as e:           # no permission, a folder or a pipe in its place, an I/O error
        _discard(path, f"unreadable ({type(e).__name__}: {e.strerror or e})")
        return None
    content = decode(path.name, data)
    if content is None:
        _discard(path, f"not a whole entry ({len(data)} bytes: truncated, corrupt or foreign)")
    return content


def store(path, content: bytes) -> bool:
    """Write ``content`` at ``path`` as a self-checking entry, atomically; False when it could
    not be written (a read-only or full cache folder only costs a rebuild later)."""
    path = pathlib.Path(path)
    try:
        if path.is_dir():
            _discard(path, "a folder in place of the entry")
        write_atomic(path, encode(path.name, content))
        return True
    except OSError as e:
        report(path, f"not written ({type(e).__name__}: {e.strerror or e})")
        return False


def prune(root, max_bytes: int, patterns) -> None:
    """Delete the least recently written files of ``patterns`` in ``root`` while they hold more
    than ``max_bytes``; the temporary files of dead writers go too."""
    root = pathlib.Path(root)
    clean_temp_files(root)
    entries = []
    for p in [p for pattern in patterns for p in root.glob(pattern)]:
        try:
            st = p.stat()
        except OSError:
            continue
        entries.append((st.st_mtime, st.st_size, p))
    total = sum(e[1] for e in entries)
    for _, size, p in sorted(entries):
        if total <= max_bytes:
            break
        try:
            p.unlink()
            total -= size
        except OSError:
            pass


# ----------------------------------------------------------------------------- package
_package_digest = None


def package_digest() -> str:
    """SHA-256 of the package's source: each file's path, size and modification time, and the
    text of ``__init__.py`` (the version); computed once per process. An edited compiler or
    a new version never reads an older one's entries."""
    global _package_digest
    if _package_digest is None:
        root = pathlib.Path(__file__).parent
        h = hashlib.sha256(f"entries {FORMAT}\n".encode())
        with contextlib.suppress(OSError):
            h.update((root / "__init__.py").read_bytes())
        for p in sorted(root.rglob("*.py")):
            try:
                st = p.stat()
            except OSError:
                continue
            h.update(f"{p.relative_to(root)} {st.st_size} {st.st_mtime_ns}\n".encode())
        _package_digest = h.hexdigest()
    return _package_digest
