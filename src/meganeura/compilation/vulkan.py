"""Kernels finished for a Vulkan target, with no device: the rendered WGSL of each dispatch
becomes SPIR-V and its reflection (``FinalKernel``).

- in accelerated precision, tiled matmuls with f16 operands (``codegen.coopmat``) and flash
  attention (``codegen.flash_coop``, ``codegen.flash_grad_coop``) become kernels on
  cooperative matrices where the target has them (``Target.tensor_cores``): ``variants``;
- every other kernel is printed as GLSL from its typed kernel AST (``codegen.kernel_ast``:
  the tree its WGSL was printed from, which the plan holds, ``KernelPlan.trees``; a plan
  read from the plan cache holds them packed, each unpacked only when its kernel must be
  printed, ``plan_cache.unpacked_tree``); a WGSL text with no tree is refused
  (``KernelSourceError``): nothing parses WGSL back;
- every kernel is compiled by glslang (``glslang``, a library: no device) and reflected
  (``spirv.reflect``);
- the SPIR-V and its reflection are kept on disk under a key of the kernel text, the
  target's SPIR-V environment, the GLSL switches (unrolling), glslang and the package
  (``cache.CompiledKernel``), those of a whole plan also as one set; the variants too, keyed
  by the WGSL text, so that a plan read from the plan cache (no kernel IR) finds them.

Kernels are compiled on threads (glslang releases the GIL), the longest first, and each is
put on the ``KernelStream`` as it is done, so a runtime creates its pipeline meanwhile.
``start`` takes kernels as the renderers write them (before the rest of the plan is
rendered); ``finish`` makes the rest and returns them all.
"""
from __future__ import annotations

import contextlib
import threading
from collections import OrderedDict
import time

from dataclasses import replace

from .executable import FinalKernel
from .float_controls import ieee_preserve

# archetypes with kernels on cooperative matrices: tiled matmuls and flash attention
VARIANT_ARCHETYPES = ("matmul", "attention")

# While kernels compile, threads return from glslang (which releases the GIL) many times a
# kernel, each time waiting for the GIL from a thread that prints kernels or plans memory
# in Python; that thread gives it up only every switch interval (5 ms by default). A shorter
# interval while they run: H200, U-Net's training plans from empty caches on 16 threads:
# glslang's seconds summed over threads 31.1 -> 16.4 (0.2 ms; 1 ms: 21.5), compile 6.8 -> 5.6 s.
GIL_SWITCH_S = 2e-4
_switch_lock = threading.Lock()
_switch_users = [0, None]       # callers inside, the interval to restore

# kernels finished in this process, by key: a later plan of the same kernels reads no file
FINISHED_KEEP = 1024          # as many as a runtime keeps pipelines (backends.PIPELINE_CACHE_SIZE)
_finished: OrderedDict = OrderedDict()
_finished_lock = threading.Lock()

_variants: dict = {}            # (WGSL text, emulate, config, storage) -> (GLSL, groups) or None
_variants_lock = threading.RLock()


@contextlib.contextmanager
def prompt_gil_handoff():
    """Hand the GIL over every ``GIL_SWITCH_S`` seconds inside (process-wide; nested and
    concurrent users restore the interval once the last leaves)."""
    import sys
    with _switch_lock:
        if _switch_users[0] == 0:
            _switch_users[1] = sys.getswitchinterval()
            sys.setswitchinterval(min(GIL_SWITCH_S, _switch_users[1]))
        _switch_users[0] += 1
    try:
        yield
    finally:
        with _switch_lock:
            _switch_users[0] -= 1
            if _switch_users[0] == 0:
                sys.setswitchinterval(_switch_users[1])


def _tensor_core_renderer(kernel):
    """The module that renders ``kernel`` on cooperative matrices (its ``select`` says whether
    it can)."""
    from ..codegen import coopmat, flash_coop, flash_grad_coop
    if kernel.archetype == "matmul":
        return coopmat
    return flash_grad_coop if kernel.spec.get("grad") else flash_coop


def _has_ir(kernel) -> bool:
    """Whether ``kernel`` has its IR (a plan read from the plan cache keeps only its name,
    archetype and outputs: no reads)."""
    return bool(kernel.spec.get("parts", [kernel])[0].reads)


def _is_glsl(text: str) -> bool:
    return text.startswith("#version")


class VulkanKernels:
    """The kernel finishing of one compile for ``target`` in ``precision`` (see the module
    docstring). ``stream``: a ``KernelStream`` each finished kernel is put on; ``disk``: read
    and write the disk caches (None: unless ``MEGANEURA_NO_DISK_CACHE``); ``threads``: glslang
    threads (``backends.compile_threads``). ``stats``: kernels read compiled from disk,
    seconds printing GLSL and compiling (summed over threads), kernels
    compiled, dispatches on cooperative matrices, kernels printed from their kernel AST."""

    def __init__(self, target, precision="strict", stream=None, disk=None, threads=None):
        from ..runtime.vulkan.cache import disk_cache_enabled
        self.target, self.precision, self.stream, self.threads = target, precision, stream, threads
        self.emulate = target.tensor_cores(precision)
        self.ieee = ieee_preserve(target)      # warns (or raises, on request) where the device lacks it
        self.disk = disk_cache_enabled() if disk is None else bool(disk)
        self.stats = {"kernel_cache_hits": 0, "glsl_seconds": 0.0, "compile_seconds": 0.0, "kernels_compiled": 0,
                      "coopmat_kernels": 0, "kernels_printed": 0}
        self._early: dict = {}          # WGSL text -> Future of its FinalKernel (``start``)
        self._trees: dict = {}          # WGSL text -> its kernel AST (``start``, ``take_trees``)
        self._packed: dict = {}         # WGSL text -> its kernel AST packed by the plan cache
        self._pool = None
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ keys
    def _context(self) -> dict:
        from ..plan_cache import package_digest
        from .glslang import glslang_version_tag
        # kernels without float controls are other kernels: their own cache entries
        env = self.target.spirv_env + ("" if self.ieee else "+no-ieee-preserve")
        return dict(target=env, glslang=glslang_version_tag(), package=package_digest())

    def kernel_key(self, text) -> str:
        """The key of ``text``'s compiled kernel (``cache.kernel_key``): the GLSL printing
        switches count for WGSL only (GLSL is compiled as it is)."""
        from ..runtime.vulkan.cache import kernel_key
        return kernel_key(text, unroll=self.target.unroll and not _is_glsl(text), **self._context())

    def _set_key(self, texts) -> str:
        from ..runtime.vulkan.cache import kernel_set_key
        return kernel_set_key(texts, unroll=self.target.unroll, **self._context())

    # ------------------------------------------------------------------ kernels on the kernel AST
    def take_trees(self, trees, packed=None):
        """The plan's kernel ASTs, {WGSL text: tree} (``KernelPlan.trees``), and those a plan
        read from the plan cache holds packed (``KernelPlan.packed_trees``)."""
        with self._lock:
            self._trees.update(trees)
            self._packed.update(packed or {})

    def _tree(self, text):
        """``text``'s kernel AST, or None: one handed over (``start``, ``take_trees``), else
        one packed by the plan cache, unpacked now (the kernel missed the kernel caches)."""
        tree = self._trees.get(text)
        if tree is None and text in self._packed:
            from ..plan_cache import unpacked_tree
            tree = unpacked_tree(text, self._packed[text])
            if tree is not None:
                with self._lock:
                    self._trees[text] = tree
        return tree

    def _printed(self, text, label="kernel"):
        """(GLSL, seconds) of WGSL ``text`` printed from its kernel AST; ``KernelSourceError``
        where it has none."""
        tree = self._tree(text)
        if tree is None:
            raise KernelSourceError(
                f"kernel {label!r}: its plan holds no kernel AST for its WGSL (neither printed by this compile nor "
                "packed in a plan read from the plan cache); the Vulkan backend prints GLSL from kernel trees only "
                "(a kernel written as WGSL text runs on backend='wgpu')")
        from ..codegen.kernel_ast import print_glsl
        t = time.perf_counter()
        glsl = print_glsl(tree, unroll=self.target.unroll, preserve_ieee=self.ieee)
        self._add("kernels_printed", 1)
        return glsl, time.perf_counter() - t

    # ------------------------------------------------------------------ early kernels
    def prepare(self):
        """A plan is being compiled (not read from the plan cache): glslang's first compile of
        the process, which runs alone, starts now beside the compiler passes
        (``glslang.start_warm_up``)."""
        from .glslang import start_warm_up
        start_warm_up(prompt_gil_handoff)

    def start(self, kernel, text, tree=None):
        """Start finishing ``text`` (``kernel``'s WGSL, printed from ``tree``) now, on threads
        of its own, while the rest of the plan is rendered and its memory planned. A kernel
        that may get a cooperative-matrix variant waits for ``finish``; a failure too
        (``finish`` makes it again and raises there)."""
        if self.emulate is not None and kernel.archetype in VARIANT_ARCHETYPES:
            return
        with self._lock:
            if tree is not None:
                self._trees[text] = tree
            if text in self._early:
                return
            if self._pool is None:
                from concurrent.futures import ThreadPoolExecutor
                from ..runtime.backends import compile_threads
                self._pool = ThreadPoolExecutor(compile_threads(self.threads), thread_name_prefix="vk-finish")
            self._early[text] = self._pool.submit(self._make_early, text, kernel.name or "kernel")

    def _make_early(self, text, label):
        from ..runtime.vulkan.cache import load_kernel
        key = self.kernel_key(text)
        ck = load_kernel(key) if self.disk and self._recall(key, label) is None else None
        fk = self._recall(key, label)
        if fk is not None:
            pass
        elif ck is not None:
            fk = self._remember(self._final(label, key, ck, text, from_disk=True))
        else:
            glsl, seconds = self._printed(text, label)
            self._add("glsl_seconds", seconds)
            fk = self._compile(glsl, label, key, text)
        if self.stream is not None:
            self.stream.put(fk)
        return fk

    def close(self):
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)

    # ------------------------------------------------------------------ variants
    def variants(self, kernels, shaders) -> list:
        """``shaders`` [(text, label, bufs, groups)] of a plan's ``kernels``, with those that run
        on cooperative matrices replaced by their variant (GLSL text, other groups). A
        variant binds the WGSL kernel's buffers in the same order, so it is a function of the
        WGSL text: kept by it in memory and on disk, one file per plan's set of them too."""
        emulate = self.emulate
        texts = sorted({sh[0] for k, sh in zip(kernels, shaders) if k.archetype in VARIANT_ARCHETYPES})
        if emulate is None or not texts:
            return shaders
        from ..codegen.coopmat import config_key
        from ..runtime.vulkan.cache import load_json, store_json
        config = config_key()
        mem = (emulate, config, self.target.workgroup_storage)
        path = self._variant_path(texts, what="set") if self.disk else None
        with _variants_lock:
            missing = [t for t in texts if (t, *mem) not in _variants]
        stored = None
        if missing and path is not None:
            try:
                stored = (load_json(path) or {})["variants"]
            except (KeyError, TypeError):
                stored = None
            if stored is not None and len(stored) == len(texts):
                with _variants_lock:
                    for t, v in zip(texts, stored):
                        _variants.setdefault((t, *mem), None if v is None else (v[0], tuple(v[1])))
        out = []
        for k, (text, label, bufs, groups) in zip(kernels, shaders):
            v = self._variant(k, text, bufs, mem) if k.archetype in VARIANT_ARCHETYPES else None
            if v is None:
                out.append((text, label, bufs, groups))
            else:
                self.stats["coopmat_kernels"] += 1
                out.append((v[0], label, bufs, v[1]))
        if missing and stored is None and path is not None:
            with _variants_lock:
                found = [_variants.get((t, *mem), False) for t in texts]
            if False not in found:          # every variant known (a plan with IR): store the set
                from ..plan_cache import prune
                from ..runtime.vulkan.cache import SET_MAX_BYTES
                if store_json(path, {"variants": [None if v is None else [v[0], list(v[1])] for v in found]}):
                    # variants and sets past the kernel sets' budget: oldest first
                    prune(path.parent, SET_MAX_BYTES, ("*.json",))
        return out

    def _variant(self, kernel, text, bufs, mem):
        key = (text, *mem)
        with _variants_lock:
            found = _variants.get(key, False)
        if found is False:
            found = self._render_variant(kernel, text, bufs)
            if found is not None or _has_ir(kernel):
                with _variants_lock:       # (a kernel without IR may find its variant later)
                    _variants[key] = found
        return found

    def _variant_path(self, texts, what="variant"):
        """The file of the variant of one WGSL text (``what`` "variant"), or of a plan's set of
        them (``texts`` a sorted list, ``what`` "set")."""
        from ..codegen import coopmat
        from ..plan_cache import package_digest
        from ..runtime.vulkan.cache import cache_dir, sha256_of
        texts = [texts] if isinstance(texts, str) else texts
        h = sha256_of([what, repr((self.emulate, coopmat.config_key(), self.target.workgroup_storage)),
                       package_digest(), *texts])
        return cache_dir() / "coopmat" / f"{h.hexdigest()}{'' if what == 'variant' else '.' + what}.json"

    def _render_variant(self, kernel, text, bufs):
        """(GLSL, groups) of ``kernel`` on cooperative matrices, or None."""
        from ..runtime.vulkan.cache import load_json, store_json
        if not _has_ir(kernel):
            if not self.disk:
                return None
            try:        # a kernel without IR: the variant stored when its plan was compiled
                saved = load_json(self._variant_path(text))
                return saved["glsl"], tuple(saved["groups"])
            except (KeyError, TypeError):
                return None
        renderer = _tensor_core_renderer(kernel)
        storage = self.target.workgroup_storage
        if renderer.select(kernel, storage, self.emulate):
            return None
        try:
            glsl, vbufs, groups = renderer.render(kernel, storage, self.emulate, **(
                {"bufs": bufs} if kernel.archetype == "matmul" else {}))
        except ValueError:          # more workgroup memory than the device has: the WGSL kernel
            return None
        # the variant binds the WGSL kernel's buffers in the same order (checked here, so that
        # a variant found by the WGSL text alone is right for any plan)
        if len(vbufs) != len(bufs) or any(x is not y for x, y in zip(vbufs, bufs)):
            return None
        if self.disk:
            store_json(self._variant_path(text), {"glsl": glsl, "groups": groups})
        return glsl, tuple(groups)

    # ------------------------------------------------------------------ compiling
    def _add(self, stat, value):
        with self._lock:
            self.stats[stat] += value

    def _final(self, label, key, ck, text, glsl=None, from_disk=False) -> FinalKernel:
        """``text``: the kernel's text before finishing (a variant's is GLSL already)."""
        sub = self.target.subgroup
        pin = 32 if ck.subgroup32 and (sub["min_size"], sub["max_size"]) != (32, 32) else None
        return FinalKernel(label, key, glsl, ck.spirv, ck.info, pin, _is_glsl(text), from_disk, ck.subgroup32)

    @staticmethod
    def _remember(fk: FinalKernel) -> FinalKernel:
        with _finished_lock:
            _finished[fk.key] = fk
            _finished.move_to_end(fk.key)
            while len(_finished) > FINISHED_KEEP:
                _finished.popitem(last=False)
        return fk

    @staticmethod
    def _recall(key, label) -> FinalKernel | None:
        with _finished_lock:
            fk = _finished.get(key)
        return None if fk is None else fk if fk.label == label else replace(fk, label=label)

    def _compile(self, glsl, label, key, text) -> FinalKernel:
        """The kernel of ``glsl``: compiled to SPIR-V (glslang's own cache is keyed by the
        GLSL) and reflected; stored under ``key`` on disk."""
        from ..runtime.vulkan.cache import CompiledKernel, store_kernel
        from ..runtime.vulkan.spirv import reflect
        from .glslang import compile_glsl
        t = time.perf_counter()
        spirv = compile_glsl(glsl, name=label, target=self.target.spirv_env, disk_cache=self.disk)
        # cooperative-matrix kernels map subgroups of 32 to fragments
        ck = CompiledKernel(spirv, reflect(spirv), "GL_KHR_cooperative_matrix" in glsl)
        if self.disk:
            store_kernel(key, ck)
        self._add("compile_seconds", time.perf_counter() - t)
        self._add("kernels_compiled", 1)
        return self._remember(self._final(label, key, ck, text, glsl))

    def finish(self, entries) -> dict:
        """{text: FinalKernel} for ``entries`` [(text, label)] (WGSL, or a variant's GLSL; each
        distinct text once): those started early, those on disk (one kernel set file where a
        request of at least ``cache.SET_MIN_KERNELS`` stored one, else one file each), the rest
        printed and compiled on threads, the longest first. A failure raises once every
        job has ended."""
        from concurrent.futures import ThreadPoolExecutor
        from ..runtime.backends import compile_threads
        from ..runtime.vulkan.cache import SET_MIN_KERNELS, load_kernel, load_kernel_set, store_kernel_set
        seen, todo = set(), []
        for text, label in entries:
            if text not in seen:
                seen.add(text)
                todo.append((text, label or "kernel"))
        done: dict = {}
        keys = {text: self.kernel_key(text) for text, _ in todo}
        for text, label in todo:
            fk = self._recall(keys[text], label)
            if fk is not None:
                done[text] = fk
        whole = len(done) < len(todo) and self.disk and len(todo) >= SET_MIN_KERNELS
        set_key = self._set_key([t for t, _ in todo]) if whole else None
        stored = load_kernel_set(set_key, len(todo)) if set_key else None
        with self._lock:
            early = {t: self._early.pop(t) for t, _ in todo if t in self._early}
        for text, future in early.items():
            try:
                done[text] = future.result()
            except BaseException:       # noqa: BLE001 (made again below, which raises)
                pass
        misses = []
        for i, (text, label) in enumerate(todo):
            if text in done:
                continue
            key = keys[text]
            ck = stored[i] if stored is not None else (load_kernel(key) if self.disk else None)
            if ck is None:
                misses.append((text, label, key))
                continue
            done[text] = fk = self._remember(self._final(label, key, ck, text, from_disk=True))
            self.stats["kernel_cache_hits"] += 1
            if self.stream is not None:
                self.stream.put(fk)
        if misses:
            self._compile_all(misses, done, compile_threads(self.threads, len(misses)), ThreadPoolExecutor)
        if set_key and stored is None:
            from ..runtime.vulkan.cache import CompiledKernel
            store_kernel_set(set_key, [CompiledKernel(done[t].spirv, done[t].info, done[t].subgroup32) for t, _ in todo])
        return done

    def _compile_all(self, misses, done, workers, pool_type):
        failed = threading.Event()      # a job raised: print and hand out no more

        def job(text, glsl, label, key):
            try:
                fk = self._compile(glsl, label, key, text)
            except BaseException:
                failed.set()
                raise
            if self.stream is not None:
                self.stream.put(fk)
            return text, fk

        jobs, error = [], None
        with contextlib.ExitStack() as inside:
            pool = inside.enter_context(pool_type(workers)) if workers > 1 else None
            if pool is not None:
                inside.enter_context(prompt_gil_handoff())
            try:
                for text, label, key, glsl, seconds in self._glsl_of(misses, failed):
                    self._add("glsl_seconds", seconds)
                    if pool is None:
                        t, fk = job(text, glsl, label, key)
                        done[t] = fk
                    else:
                        jobs.append(pool.submit(job, text, glsl, label, key))
            except BaseException as e:      # a kernel without a tree: let the submitted jobs end
                error = e
            for future in jobs:
                try:
                    t, fk = future.result()
                    done[t] = fk
                except BaseException as e:
                    error = error or e
        if error is not None:
            raise error

    def _glsl_of(self, misses, failed):
        """(text, label, key, GLSL, seconds printing) of ``misses`` [(text, label, key)], the
        longest texts (the longest compiles) first. Stops once ``failed`` is set."""
        for text, label, key in sorted(misses, key=lambda m: -len(m[0])):
            if failed.is_set():
                return
            if _is_glsl(text):          # a variant's GLSL already
                yield text, label, key, text, 0.0
            else:
                yield (text, label, key) + self._printed(text, label)


class KernelSourceError(RuntimeError):
    """A WGSL kernel text with no kernel AST to print its GLSL from."""


def clear_memory():
    """Forget the finished kernels, cooperative-matrix variants, GLSL memos and packed kernel
    trees kept in memory (the disk keeps its own)."""
    with _variants_lock:
        _variants.clear()
    with _finished_lock:
        _finished.clear()
    from ..codegen.glsl_target import clear_caches
    from ..plan_cache import clear_packed
    clear_caches()
    clear_packed()


__all__ = ["KernelSourceError", "VulkanKernels", "VARIANT_ARCHETYPES", "clear_memory", "prompt_gil_handoff"]
