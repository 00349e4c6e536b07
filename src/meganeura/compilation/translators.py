"""WGSL -> GLSL translation in worker processes, beside the driver's compiles.

The translator (``codegen.glsl``) is Python. In-process it runs on the thread that hands
kernels to the compile pool, holding the GIL while sixteen threads wait for kernels (H200,
the U-Net's training plans: 1.8 s translating 422 kernels; with translation made free
their cold compile went 3.0 / 3.5 -> 2.9 / 3.2 s, ResNet-50's 2.0 / 2.8 -> 1.8 / 2.1). A few
worker processes translate side by side instead. Each loads ``codegen/glsl.py`` and
``codegen/glsl_lex.py`` from their folder as a package of their own (standard library only,
no meganeura import), so one starts in tens of milliseconds; they
start when a plan begins compiling (``compilation.vulkan.VulkanKernels.prepare``), beside the compiler
passes, and serve the process's later compiles.

``MEGANEURA_TRANSLATE_WORKERS=n`` sets how many (0: translate in-process); by default one per
four CPUs, at most four, so none on a machine of fewer than four. Requests of fewer than
``MIN_KERNELS`` kernels translate in-process, and so does everything where this interpreter
cannot start a plain copy of itself (embedded, frozen, the package inside an archive) or
where workers died before their first answer. A worker that dies, or whose answers are not
frames of ours, fails its requests with ``WorkerLost`` (the caller translates those
in-process); a kernel the translator rejects raises ``GlslTranslationError`` as in-process.
What a worker prints goes to the null device, not into its answers. A forked child lets go
of its parent's workers (``os.register_at_fork``).
"""
from __future__ import annotations

import atexit
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError

from ..codegen import glsl

WORKERS_ENV = "MEGANEURA_TRANSLATE_WORKERS"
MAX_WORKERS = 4
MIN_KERNELS = 24       # fewer: in-process (the requests' round trips are not worth it)

# the worker: frames of a little-endian u32 length and a pickle, (job, wgsl, name, unroll,
# preserve_ieee) in
# and (job, status, text, seconds) out; status True: GLSL, False: the translator's error,
# None: anything else. Its first frame says it is ready. The channel is a private copy of
# fd 1: whatever else writes to stdout goes to stderr (discarded), not into the frames.
_BOOT = r"""
import importlib, os, pickle, struct, sys, time, types
out = os.fdopen(os.dup(1), "wb")
os.dup2(2, 1)
sys.stdout = sys.stderr
inp = sys.stdin.buffer

def send(res):
    data = pickle.dumps(res, protocol=pickle.HIGHEST_PROTOCOL)
    out.write(struct.pack("<I", len(data)) + data)
    out.flush()

# codegen/glsl.py and the module it imports (glsl_lex.py) as a package of their own, without
# the rest of meganeura
pkg = types.ModuleType("_meganeura_glsl")
pkg.__path__ = [os.path.dirname(sys.argv[1])]
sys.modules[pkg.__name__] = pkg
mod = importlib.import_module("_meganeura_glsl." + os.path.splitext(os.path.basename(sys.argv[1]))[0])
send((0, True, "ready", 0.0))
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    job, wgsl, name, unroll, ieee = pickle.loads(inp.read(struct.unpack("<I", head)[0]))
    t = time.process_time()
    try:
        res = (job, True, mod.to_glsl(wgsl, name, unroll, ieee))
    except mod.GlslTranslationError as e:
        res = (job, False, str(e))
    except Exception as e:
        res = (job, None, f"{type(e).__name__}: {e}")
    send(res + (time.process_time() - t,))
"""
MAX_FRAME = 1 << 28      # a longer frame means the stream is not ours: the worker is dropped


class WorkerLost(RuntimeError):
    """A translation worker ended (or could not start) before answering."""


def worker_count() -> int:
    """``MEGANEURA_TRANSLATE_WORKERS``, else one per four CPUs up to ``MAX_WORKERS``; 0 where
    this interpreter cannot start a plain copy of itself running ``codegen/glsl.py`` (an
    embedded or frozen one, or a package inside an archive)."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            n = max(0, int(raw))
        except ValueError:
            raise ValueError(f"{WORKERS_ENV}={raw!r}: expected a number of worker processes (0: none)") from None
    else:
        n = min(MAX_WORKERS, (os.cpu_count() or 1) // 4)
    if not sys.executable or getattr(sys, "frozen", False) or not os.path.isfile(glsl.__file__):
        return 0
    return n


def _settle(fut: Future, result=None, error=None):
    """Resolve ``fut`` unless its caller gave up on it (cancelled)."""
    if fut.done():
        return
    try:
        if error is not None:
            fut.set_exception(error)
        else:
            fut.set_result(result)
    except InvalidStateError:       # cancelled meanwhile
        pass


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, glsl.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.lost = False
        self.ready = threading.Event()     # its first frame came
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        # requests are written on a thread of their own: a full pipe never blocks the caller
        self.threads = [threading.Thread(target=self._write, name="translate-write", daemon=True),
                        threading.Thread(target=self._read, name="translate-read", daemon=True)]
        for t in self.threads:
            t.start()

    def submit(self, job: int, fut: Future, request: bytes):
        with self.lock:
            if not self.lost:
                self.pending[job] = fut
                self.outbox.put((fut, request))
                return
        _settle(fut, error=WorkerLost("a translation worker ended"))

    def _write(self):
        try:
            while True:
                item = self.outbox.get()
                if item is None:
                    break
                fut, data = item
                if fut.cancelled():         # given up (the compile failed): not sent
                    continue
                self.proc.stdin.write(struct.pack("<I", len(data)) + data)
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except Exception:       # noqa: BLE001 (the pipe or the worker is gone: drop the worker)
            self._drop()

    def _read(self):
        out, ended = self.proc.stdout, False
        try:
            while True:
                head = out.read(4)
                if len(head) < 4:
                    ended = True        # the worker exited (its input ended, or it died)
                    break
                n = struct.unpack("<I", head)[0]
                if n > MAX_FRAME:
                    break
                job, status, text, seconds = pickle.loads(out.read(n))
                if not self.ready.is_set():
                    if (job, status, text) != (0, True, "ready"):
                        break
                    self.ready.set()
                    continue
                with self.lock:
                    fut = self.pending.pop(job, None)
                if fut is None:
                    continue
                if status:
                    _settle(fut, (text, seconds))
                elif status is False:
                    _settle(fut, error=glsl.GlslTranslationError(text))
                else:
                    _settle(fut, error=WorkerLost(f"a translation worker failed: {text}"))
        except Exception:       # noqa: BLE001 (a stream that is not ours: drop the worker)
            pass
        self._drop(kill=not ended)

    def _drop(self, kill=True):
        """The worker is gone or not to be trusted: fail what waits on it, and end it
        (``kill``) unless it is ending by itself."""
        with self.lock:
            self.lost = True
            waiting, self.pending = list(self.pending.values()), {}
        if kill:
            try:
                self.proc.kill()
            except OSError:
                pass
        for fut in waiting:
            _settle(fut, error=WorkerLost("a translation worker ended"))

    def load(self) -> int:
        return len(self.pending)

    def wait_lost(self, timeout: float) -> bool:
        """Whether the worker has been dropped within ``timeout`` seconds (tests)."""
        self.threads[1].join(timeout)
        return self.lost


class TranslatorPool:
    """``n`` worker processes; ``submit`` returns a Future of (GLSL, the worker's CPU seconds)."""

    def __init__(self, n: int):
        self.pid = os.getpid()
        self.workers: list[_Worker] = []
        try:
            for _ in range(n):
                self.workers.append(_Worker())
        except BaseException:
            self.close()
            raise
        self.jobs = 0
        self.lock = threading.Lock()

    def submit(self, wgsl: str, name: str, unroll: bool, preserve_ieee: bool = True) -> Future:
        fut: Future = Future()
        with self.lock:
            self.jobs += 1
            job = self.jobs
            worker = min((w for w in self.workers if not w.lost), key=_Worker.load, default=None)
        if worker is None:
            _settle(fut, error=WorkerLost("every translation worker ended"))
        else:
            worker.submit(job, fut, pickle.dumps((job, wgsl, name, unroll, preserve_ieee), protocol=pickle.HIGHEST_PROTOCOL))
        return fut

    def alive(self) -> bool:
        return os.getpid() == self.pid and any(not w.lost for w in self.workers)

    def booted(self) -> bool:
        """Whether any worker ever answered (one that never did cannot start here)."""
        return any(w.ready.is_set() for w in self.workers)

    def close(self, timeout: float = 1.0):
        """End the workers: their input closes at once (they exit when it ends); those still
        running after ``timeout`` seconds are killed."""
        for w in self.workers:
            w.outbox.put(None)
        deadline = time.monotonic() + timeout
        for w in self.workers:
            try:
                w.proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                w.proc.kill()
                w.proc.wait()


_pool: TranslatorPool | None = None
_pool_lock = threading.Lock()
_cannot_start = False       # workers died before answering once: translate in-process from then on
_forked_away: list = []     # a forked child's inherited pools (their pipes' fds now the null device)


def start() -> TranslatorPool | None:
    """The process's pool, started now if it is not (None with no workers asked for, or
    where they cannot start)."""
    global _pool, _cannot_start
    n = worker_count()
    with _pool_lock:
        if n <= 0 or _cannot_start:
            return None
        if _pool is not None:
            if _pool.alive():
                return _pool
            if not _pool.booted():
                _cannot_start = True
                return None
        try:
            _pool = TranslatorPool(n)
        except Exception:       # noqa: BLE001 (no processes here: translate in-process)
            _pool, _cannot_start = None, True
        return _pool


def pool_for(kernels: int) -> TranslatorPool | None:
    """The pool for a request of ``kernels`` translations, or None: translate in-process."""
    return start() if kernels >= MIN_KERNELS else None


@atexit.register
def stop():
    """End the workers (they also end when this process does: their input closes)."""
    global _pool
    with _pool_lock:
        pool, _pool = _pool, None
    if pool is not None and os.getpid() == pool.pid:
        pool.close()


def _after_fork_in_child():
    """A forked child does not use its parent's workers, and lets go of their pipes at once
    (held open, a worker would not see its input end when the parent closes it)."""
    global _pool, _pool_lock
    _pool_lock = threading.Lock()
    pool, _pool = _pool, None
    if pool is not None:
        _forked_away.append(pool)
        # the pipes' fds point at the null device instead: released, and never a number
        # that something else of the child's could be given and have closed under it
        null = os.open(os.devnull, os.O_RDWR)
        try:
            for w in pool.workers:
                for f in (w.proc.stdin, w.proc.stdout):
                    try:
                        os.dup2(null, f.fileno())
                    except (OSError, ValueError):
                        pass
        finally:
            os.close(null)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
