"""WGSL -> GLSL translation in worker processes, beside the driver's compiles.

The translator (``codegen.glsl``) is Python. In-process it runs on the thread that hands
kernels to the compile pool, holding the GIL while sixteen threads wait for kernels (H200,
the U-Net's training plans: 1.8 s translating 422 kernels; with translation made free
their cold compile went 3.0 / 3.5 -> 2.9 / 3.2 s, ResNet-50's 2.0 / 2.8 -> 1.8 / 2.1). A few
worker processes translate side by side instead. Each loads ``codegen/glsl.py`` by its path
(standard library only, no package import), so one starts in tens of milliseconds; they
start when a plan begins compiling (``VulkanRuntime.prepare_compile``), beside the compiler
passes, and serve the process's later compiles.

``MEGANEURA_TRANSLATE_WORKERS=n`` sets how many (0: translate in-process); by default one per
four CPUs, at most four, so none on a machine of fewer than four. Requests of fewer than
``MIN_KERNELS`` kernels translate in-process. A worker that dies fails its requests with
``WorkerLost`` (the caller translates those in-process); a kernel the translator rejects
raises ``GlslTranslationError`` as in-process.
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
from concurrent.futures import Future

from ...codegen import glsl

WORKERS_ENV = "MEGANEURA_TRANSLATE_WORKERS"
MAX_WORKERS = 4
MIN_KERNELS = 24       # fewer: in-process (the requests' round trips are not worth it)

# the worker: frames of a little-endian u32 length and a pickle, (job, wgsl, name, unroll) in
# and (job, status, text, seconds) out; status True: GLSL, False: the translator's error,
# None: anything else
_BOOT = r"""
import importlib.util, pickle, struct, sys, time
spec = importlib.util.spec_from_file_location("_meganeura_glsl", sys.argv[1])
mod = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = mod
spec.loader.exec_module(mod)
inp, out = sys.stdin.buffer, sys.stdout.buffer
while True:
    head = inp.read(4)
    if len(head) < 4:
        break
    job, wgsl, name, unroll = pickle.loads(inp.read(struct.unpack("<I", head)[0]))
    t = time.process_time()
    try:
        res = (job, True, mod.to_glsl(wgsl, name, unroll))
    except mod.GlslTranslationError as e:
        res = (job, False, str(e))
    except Exception as e:
        res = (job, None, f"{type(e).__name__}: {e}")
    data = pickle.dumps(res + (time.process_time() - t,), protocol=pickle.HIGHEST_PROTOCOL)
    out.write(struct.pack("<I", len(data)) + data)
    out.flush()
"""


class WorkerLost(RuntimeError):
    """A translation worker ended (or could not start) before answering."""


def worker_count() -> int:
    """``MEGANEURA_TRANSLATE_WORKERS``, else one per four CPUs up to ``MAX_WORKERS``."""
    raw = os.environ.get(WORKERS_ENV, "").strip()
    if raw:
        try:
            return max(0, int(raw))
        except ValueError:
            raise ValueError(f"{WORKERS_ENV}={raw!r}: expected a number of worker processes (0: none)") from None
    return min(MAX_WORKERS, (os.cpu_count() or 1) // 4)


class _Worker:
    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, "-I", "-c", _BOOT, glsl.__file__], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
        self.lock = threading.Lock()
        self.pending: dict[int, Future] = {}
        self.lost = False
        self.outbox: queue.SimpleQueue = queue.SimpleQueue()
        # requests are written on a thread of their own: a full pipe never blocks the caller
        threading.Thread(target=self._write, name="translate-write", daemon=True).start()
        threading.Thread(target=self._read, name="translate-read", daemon=True).start()

    def submit(self, job: int, fut: Future, request: bytes):
        with self.lock:
            if self.lost:
                fut.set_exception(WorkerLost("a translation worker ended"))
                return
            self.pending[job] = fut
        self.outbox.put(request)

    def _write(self):
        try:
            while True:
                data = self.outbox.get()
                if data is None:
                    break
                self.proc.stdin.write(struct.pack("<I", len(data)) + data)
                self.proc.stdin.flush()
            self.proc.stdin.close()
        except (OSError, ValueError):      # the worker ended: its reader fails what waits
            pass

    def _read(self):
        out = self.proc.stdout
        try:
            while True:
                head = out.read(4)
                if len(head) < 4:
                    break
                job, status, text, seconds = pickle.loads(out.read(struct.unpack("<I", head)[0]))
                with self.lock:
                    fut = self.pending.pop(job, None)
                if fut is None:
                    continue
                if status:
                    fut.set_result((text, seconds))
                elif status is False:
                    fut.set_exception(glsl.GlslTranslationError(text))
                else:
                    fut.set_exception(WorkerLost(f"a translation worker failed: {text}"))
        except (OSError, ValueError, EOFError, pickle.UnpicklingError):
            pass
        with self.lock:
            self.lost = True
            waiting, self.pending = list(self.pending.values()), {}
        for fut in waiting:
            fut.set_exception(WorkerLost("a translation worker ended"))

    def load(self) -> int:
        return len(self.pending)

    def close(self):
        self.outbox.put(None)
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()


class TranslatorPool:
    """``n`` worker processes; ``submit`` returns a Future of (GLSL, the worker's CPU seconds)."""

    def __init__(self, n: int):
        self.pid = os.getpid()
        self.workers = [_Worker() for _ in range(n)]
        self.jobs = 0
        self.lock = threading.Lock()

    def submit(self, wgsl: str, name: str, unroll: bool) -> Future:
        fut: Future = Future()
        with self.lock:
            self.jobs += 1
            job = self.jobs
            worker = min((w for w in self.workers if not w.lost), key=_Worker.load, default=None)
        if worker is None:
            fut.set_exception(WorkerLost("every translation worker ended"))
        else:
            worker.submit(job, fut, pickle.dumps((job, wgsl, name, unroll), protocol=pickle.HIGHEST_PROTOCOL))
        return fut

    def alive(self) -> bool:
        return os.getpid() == self.pid and any(not w.lost for w in self.workers)

    def close(self):
        for w in self.workers:
            w.close()


_pool: TranslatorPool | None = None
_pool_lock = threading.Lock()


def start() -> TranslatorPool | None:
    """The process's pool, started now if it is not (None with no workers asked for, or
    where they cannot start)."""
    global _pool
    with _pool_lock:
        if _pool is not None and _pool.alive():
            return _pool
        n = worker_count()
        if n <= 0:
            return None
        try:
            _pool = TranslatorPool(n)
        except OSError:
            _pool = None
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
