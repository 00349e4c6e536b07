"""The executable: a compiled plan with every dispatch's final kernel for one ``Target``.

``compile_plan(..., target=...)`` returns one. It holds the logical plan (``KernelPlan``:
buffers, memory plan, where the targets lie) and, per dispatch, a ``Step``: the
``FinalKernel`` it runs (WGSL for wgpu; for Vulkan SPIR-V with its reflection, the
tensor-core variants chosen), the logical buffers it binds and its workgroup counts. A
runtime makes pipelines of the kernels, allocates the buffers, binds and records: it
renders, translates and compiles nothing.

``KernelStream`` carries finished kernels out of the compile stage while it is still
running, so a runtime can create their pipelines meanwhile (cold compiles on a hardware
driver spend most of their time there). ``save`` / ``load`` write an executable to a file
and read it back in another process.
"""
from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field, replace

from .target import Target

FORMAT = 1                 # bump when the pickled layout changes
_MAGIC = "meganeura-executable"


@dataclass(frozen=True)
class FinalKernel:
    """One kernel as a runtime makes its pipeline. ``key``: its identity in pipeline caches
    (the WGSL text on wgpu; on Vulkan the compiled kernel's key, which covers the text, the
    target and glslang); ``text``: the WGSL (wgpu), or the GLSL of a Vulkan kernel where it
    was compiled in this process (None when its SPIR-V was read from disk); ``spirv`` and
    ``info`` (``spirv.reflect``'s dict): Vulkan only; ``subgroup_size``: the subgroup size
    the pipeline must be created with (cooperative matrices map subgroups of 32 to
    fragments), or None; ``subgroup32``: the kernel maps subgroups of 32 to fragments (as
    compiled, whatever the device); ``coopmat``: a cooperative-matrix variant; ``from_disk``: its
    SPIR-V was read compiled from disk (the driver's pipeline cache likely has it too)."""
    label: str
    key: str
    text: str | None = None
    spirv: bytes | None = None
    info: dict | None = None
    subgroup_size: int | None = None
    coopmat: bool = False
    from_disk: bool = False
    subgroup32: bool = False


@dataclass
class Step:
    """One dispatch: the kernel, the logical buffers in binding order, the workgroup counts."""
    kernel: FinalKernel
    bufs: list
    groups: tuple


@dataclass
class Executable:
    """What one kind of call runs on one target (see the module docstring). ``checks``:
    checked mode's index checks, (check, kernel name) in the order of the error buffer
    ``error_buf`` (a logical Buf the checked kernels bind last), or empty."""
    plan: object                     # compiler.KernelPlan
    target: Target
    steps: list
    precision: str = "strict"
    checks: list = field(default_factory=list)
    error_buf: object = None
    stats: dict = field(default_factory=dict)

    # the logical plan's parts the runtime reads
    @property
    def bufs(self):
        return self.plan.bufs

    @property
    def memory(self):
        return self.plan.memory

    @property
    def target_locs(self):
        return self.plan.target_locs

    @property
    def copy_updates(self):
        return self.plan.copy_updates

    @property
    def dispatches(self):
        return self.plan.dispatches

    @property
    def names(self):
        return self.plan.names

    @property
    def n_dispatches(self):
        return self.plan.n_dispatches

    @property
    def kernels(self) -> list:
        """Each step's kernel, in launch order (repeats included)."""
        return [s.kernel for s in self.steps]

    def save(self, path) -> None:
        """Write this executable to ``path`` (a pickle: read it only from files you made).
        Each dispatch keeps its kernel's name, archetype and outputs, not its IR."""
        data = pickle.dumps((_MAGIC, FORMAT, replace(self, plan=_slim_plan(self.plan))),
                            protocol=pickle.HIGHEST_PROTOCOL)
        with open(path, "wb") as f:
            f.write(data)


def _slim_kernel(kernel):
    """What the runtime reads of a scheduled kernel once it is rendered (anomaly checks,
    traces): name, archetype, output views and merged parts."""
    from ..schedule import Kernel
    parts = kernel.spec.get("parts")
    return Kernel(kernel.name, kernel.archetype, {"parts": [_slim_kernel(p) for p in parts]} if parts else {},
                  kernel.out, outs=list(kernel.outs))


def _slim_plan(plan):
    texts: dict = {}       # equal WGSL pickled once
    return replace(plan, dispatches=[replace(d, kernel=_slim_kernel(d.kernel), wgsl=texts.setdefault(d.wgsl, d.wgsl))
                                     for d in plan.dispatches],
                   stats={k: v for k, v in plan.stats.items() if k != "seconds"})


def load(path) -> Executable:
    """The executable ``Executable.save`` wrote to ``path``."""
    with open(path, "rb") as f:
        head = pickle.load(f)
    if not (isinstance(head, tuple) and len(head) == 3 and head[0] == _MAGIC):
        raise ValueError(f"{path}: not a saved meganeura executable")
    if head[1] != FORMAT:
        raise ValueError(f"{path}: executable format {head[1]}, this version reads {FORMAT}: compile it again")
    return head[2]


class KernelStream:
    """Finished kernels handed from the compile stage to a runtime as they are made: the
    compile stage ``put``s each and ``close``s the stream at its end (also on an error); a
    runtime takes them with ``batches`` (all that are waiting, at least one, until the end)."""

    def __init__(self):
        self._items: list = []
        self._closed = False
        self._cv = threading.Condition()

    def put(self, kernel: FinalKernel) -> None:
        with self._cv:
            if not self._closed:
                self._items.append(kernel)
                self._cv.notify()

    def close(self) -> None:
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def batches(self):
        while True:
            with self._cv:
                while not self._items and not self._closed:
                    self._cv.wait()
                items, self._items = self._items, []
                if not items and self._closed:
                    return
            yield items
