import os
import shutil
import tempfile

os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")

# the suite's disk caches (compiled plans, SPIR-V) start empty in a folder of their own:
# a test never reads what an older checkout wrote, and the user's cache stays untouched
_CACHE = None
if "MEGANEURA_CACHE_DIR" not in os.environ:
    _CACHE = os.environ["MEGANEURA_CACHE_DIR"] = tempfile.mkdtemp(prefix="meganeura-test-cache-")


def pytest_sessionfinish(session, exitstatus):
    if _CACHE:
        shutil.rmtree(_CACHE, ignore_errors=True)
