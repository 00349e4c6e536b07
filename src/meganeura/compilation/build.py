"""What a runtime asks the compile stage for: the ``Executable`` of a call's targets on its
``Target`` (compiled, or stood up from the plan cache by key), with the options its device
implies. The runtime passes a ``KernelStream`` to take kernels from as they are finished."""
from __future__ import annotations

from .. import plan_cache
from ..compiler import CompileOptions, _finish, _finisher, compile_plan, gc_paused


def options_for(target, precision, f16_weights=frozenset(), checked=False) -> CompileOptions:
    """The compile options of a session on ``target``: its limits, ``MEGANEURA_NO_FUSE``,
    the parameters read through f16 copies, checked mode."""
    opts = CompileOptions.for_target(target, precision, checked)
    opts.f16_weights = f16_weights
    return opts


def compile_executable(targets, n_forward, updates, target, options, cache=None, stream=None):
    """``compile_plan`` for ``target``, with the plan cache on unless switched off (``cache``:
    ``plan_cache.enabled``'s option) and keyed by the target's adapter."""
    return compile_plan(targets, n_forward=n_forward, options=options, updates=updates,
                        cache=plan_cache.enabled(cache), adapter=target.adapter, target=target, stream=stream)


def cached_executable(key, target, options, cache=None, stream=None):
    """The executable of the plan the plan cache holds under ``key`` (a session stood up from
    its manifest), finished for ``target``; None when it is not there (or the cache is off)."""
    kp = plan_cache.load(key) if key is not None and plan_cache.enabled(cache) and not options.checked else None
    if kp is None:
        if stream is not None:
            stream.close()
        return None
    finisher = _finisher(target, options, stream)
    try:
        with gc_paused():
            return _finish(kp, target, options, finisher)
    finally:
        if finisher is not None:
            finisher.close()
        if stream is not None:
            stream.close()
