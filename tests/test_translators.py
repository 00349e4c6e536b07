"""WGSL -> GLSL translation in worker processes (compilation.translators): the same GLSL
as in-process, the translator's errors raised as in-process, a lost worker reported (and its
kernels translated in-process by the runtime), and a plan compiled through the workers on
the device."""
import os
import time
import warnings

import numpy as np
import pytest

from meganeura.codegen.glsl import GlslTranslationError, to_glsl
from meganeura.compilation import translators

from .harness import mlp_training_losses


EMPTY = "@compute @workgroup_size(1)\nfn main() {\n}\n"


@pytest.fixture
def two_workers(monkeypatch):
    translators.stop()
    monkeypatch.setattr(translators, "_cannot_start", False)
    monkeypatch.setenv(translators.WORKERS_ENV, "2")
    yield
    translators.stop()


def _kernels(name="whisper"):
    from meganeura.bench.dispatches import phase_targets
    from meganeura.bench.workloads import make
    from meganeura.compiler import compile_plan
    targets, n, upd = phase_targets(make(name, size="tiny"), "train_step")
    return {d.wgsl: d.kernel.name for d in compile_plan(targets, n_forward=n, updates=upd).dispatches}


def test_workers_translate_as_in_process(two_workers):
    kernels = _kernels()
    assert len(kernels) >= translators.MIN_KERNELS
    pool = translators.pool_for(len(kernels))
    assert pool is not None and len(pool.workers) == 2
    assert translators.pool_for(translators.MIN_KERNELS - 1) is None      # small requests stay here
    asked = {text: pool.submit(text, name, True) for text, name in kernels.items()}
    for text, fut in asked.items():
        glsl, seconds = fut.result(timeout=60)
        assert glsl == to_glsl(text, kernels[text], unroll=True) and seconds >= 0
    assert pool.submit(next(iter(kernels)), "k", False).result(timeout=60)[0] == to_glsl(next(iter(kernels)), "k")


def test_rejected_kernels_raise_and_lost_workers_are_reported(two_workers):
    pool = translators.start()
    with pytest.raises(GlslTranslationError, match="broken_kernel: line 1"):
        pool.submit("fn main( {", "broken_kernel", True).result(timeout=60)
    for w in pool.workers:
        w.proc.kill()
    assert all(w.wait_lost(timeout=30) for w in pool.workers)
    with pytest.raises(translators.WorkerLost):
        pool.submit("fn main() {}", "k", True).result(timeout=60)
    assert not pool.alive()
    again = translators.start()         # a new pool replaces the dead one
    assert again is not pool and again.alive()


def _fake_translator(tmp_path, monkeypatch, body):
    """The workers run ``body`` (a module defining ``to_glsl``) instead of codegen/glsl.py."""
    import types
    path = tmp_path / "fake_glsl.py"
    path.write_text("class GlslTranslationError(ValueError):\n    pass\n" + body)
    monkeypatch.setattr(translators, "glsl", types.SimpleNamespace(__file__=str(path),
                                                                    GlslTranslationError=GlslTranslationError))


def test_what_a_worker_prints_does_not_reach_the_answers(two_workers, tmp_path, monkeypatch):
    _fake_translator(tmp_path, monkeypatch, "print('hello from the translator')\n"
                     "def to_glsl(wgsl, name, unroll, preserve_ieee):\n    print('debug', name)\n    return wgsl.upper()\n")
    pool = translators.start()
    futs = [pool.submit(f"kernel {i}", f"k{i}", True) for i in range(50)]
    assert [f.result(timeout=60)[0] for f in futs] == [f"KERNEL {i}" for i in range(50)]


def test_workers_that_cannot_start_are_not_started_again(two_workers, tmp_path, monkeypatch):
    _fake_translator(tmp_path, monkeypatch, "raise ImportError('no translator here')\n")
    pool = translators.start()
    with pytest.raises(translators.WorkerLost):
        pool.submit("k", "k", True).result(timeout=60)
    assert all(w.wait_lost(timeout=30) for w in pool.workers)
    assert translators.start() is None and translators.pool_for(1000) is None


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_lets_go_of_the_workers_pipes(two_workers):
    pool = translators.start()
    assert "void main()" in pool.submit(EMPTY, "k", False).result(timeout=60)[0]
    with warnings.catch_warnings():     # Python 3.12 warns of fork() beside threads
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:                # the child: alive while the parent ends its workers
        time.sleep(3)
        os._exit(0)
    try:
        translators.stop()
        # each worker saw its input end and exited by itself (not killed after the timeout)
        assert [w.proc.returncode for w in pool.workers] == [0, 0]
    finally:
        os.waitpid(pid, 0)


def test_worker_count_switch(monkeypatch):
    translators.stop()
    monkeypatch.setattr(translators, "_cannot_start", False)
    monkeypatch.setenv(translators.WORKERS_ENV, "2")
    assert translators.start() is not None
    monkeypatch.setenv(translators.WORKERS_ENV, "0")    # off, even with a pool running
    assert translators.worker_count() == 0 and translators.start() is None
    translators.stop()
    monkeypatch.setenv(translators.WORKERS_ENV, "many")
    with pytest.raises(ValueError, match="MEGANEURA_TRANSLATE_WORKERS='many'"):
        translators.worker_count()
    monkeypatch.delenv(translators.WORKERS_ENV)
    assert 0 <= translators.worker_count() <= translators.MAX_WORKERS


@pytest.mark.parametrize("lose_workers", [False, True])
def test_a_plan_compiles_through_the_workers(two_workers, monkeypatch, tmp_path, lose_workers):
    """A training step compiled with every kernel translated by the workers (or, with the
    workers killed, here) gives the NumPy reference's losses."""
    pytest.importorskip("vulkan", reason="the vulkan extra (pip install 'meganeura[vulkan]')")
    from meganeura.runtime.vulkan.backend import get_vulkan_runtime
    try:
        get_vulkan_runtime()
    except Exception as e:           # noqa: BLE001
        pytest.skip(f"no Vulkan device: {e}")
    monkeypatch.setenv("MEGANEURA_CACHE_DIR", str(tmp_path))
    monkeypatch.setenv("MEGANEURA_NO_DISK_CACHE", "1")
    monkeypatch.setattr(translators, "MIN_KERNELS", 1)
    get_vulkan_runtime().clear_caches()
    from meganeura.compilation import vulkan
    vulkan.clear_memory()           # every kernel finished again (none kept from before)
    pool = translators.start()
    if lose_workers:
        for w in pool.workers:
            w.proc.kill()
            w.proc.wait()
        monkeypatch.setattr(translators, "pool_for", lambda n: pool)
    jobs = pool.jobs
    np.testing.assert_allclose(mlp_training_losses("vulkan", steps=3), mlp_training_losses("numpy", steps=3), rtol=1e-5)
    assert pool.jobs > jobs        # the kernels were asked of the workers
