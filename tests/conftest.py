import os
import shutil
import tempfile

import pytest

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

# triton (which torch's exporters import) segfaults loading its C module into a process where
# lavapipe's LLVM is already loaded (a worker that ran Vulkan or wgpu tests before a torch
# export): loaded first, it loads cleanly and both work
try:
    import triton  # noqa: F401
except ImportError:
    pass

# the suite's disk caches (compiled plans, SPIR-V) start empty in a folder of their own:
# a test never reads what an older checkout wrote, and the user's cache stays untouched
_CACHE = None
if "MEGANEURA_CACHE_DIR" not in os.environ:
    _CACHE = os.environ["MEGANEURA_CACHE_DIR"] = tempfile.mkdtemp(prefix="meganeura-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)


def pytest_addoption(parser):
    parser.addoption("--update-glsl-digests", action="store_true", default=False,
                     help="rewrite tests/data/glsl_digests.json from the GLSL the tests run print (with -n 0)")


def pytest_configure(config):
    from tests.glsl_reference import GOLDEN
    GOLDEN.update = config.getoption("--update-glsl-digests")
    if GOLDEN.update and getattr(config, "workerinput", None) is not None:
        raise RuntimeError("--update-glsl-digests needs one process (-n 0)")


def pytest_runtest_setup(item):
    from tests.glsl_reference import GOLDEN
    GOLDEN.start(f"{item.module.__name__.rpartition('.')[2]}::{item.name}")


def pytest_unconfigure(config):
    from tests.glsl_reference import GOLDEN
    if GOLDEN.update:
        GOLDEN.write()


@pytest.fixture(autouse=True)
def _printed_trees():
    """Each test's printed kernel ASTs, for ``tests.printed_trees.tree_of``."""
    from meganeura.codegen.kernel_ast import collected_trees
    from tests.printed_trees import PRINTED
    PRINTED.clear()
    with collected_trees(PRINTED):
        yield
    PRINTED.clear()
