"""The references the GLSL and WGSL printed from the kernel AST are checked against.

- the golden digests (``tests/data/glsl_digests.json``: test -> {case -> the first 16 hex
  digits of the sha256 of the printed text}), recorded while the printed GLSL was the
  translator's and the printed WGSL the templates' (WGSL cases: ``wgsl::{kernel name}``).
  They are checked always: a case without a digest fails (regenerate with
  ``pytest -n 0 --update-glsl-digests <the tests>``, which rewrites the digests of the tests
  it runs and keeps the others).

A case id is the test (module and name with its parameters), the kernel's name (a long
one shortened, with the digest of the whole) and the
unroll and IEEE switches; a second text under the same id in one test gets ``#2``, ``#3``...
in the order the test checks them (the tests check kernels in a deterministic order)."""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

DIGESTS = Path(__file__).parent / "data" / "glsl_digests.json"


def digest(text: str) -> str:
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class Golden:
    """The golden digests of one test session (``conftest`` sets ``test`` before each test)."""

    def __init__(self):
        self.update = False
        self.test = None            # "module::test name[params]"
        # test -> {case -> digest}
        self.stored = json.loads(DIGESTS.read_text()) if DIGESTS.exists() else {}
        self.recorded: dict = {}    # test -> {case id: digest} (update mode)
        self._seen: dict = {}       # case id -> digests checked under it in the current test

    def start(self, test: str):
        self.test, self._seen = test, {}

    def check(self, glsl: str, name: str, unroll: bool, ieee: bool):
        self._check(glsl, f"{_short(name)}::unroll={int(bool(unroll))},ieee={int(bool(ieee))}", "GLSL")

    def check_wgsl(self, wgsl: str, name: str):
        """The WGSL printed for kernel ``name`` (case ``wgsl::{name}``), recorded while it was
        the templates' text."""
        self._check(wgsl, f"wgsl::{_short(name)}", "WGSL")

    def _check(self, text: str, base: str, what: str):
        assert self.test is not None, f"a golden {what} check outside a test"
        d = digest(text)
        seen = self._seen.setdefault(base, [])
        if d in seen:
            return
        seen.append(d)
        case = base if len(seen) == 1 else f"{base}#{len(seen)}"
        if self.update:
            self.recorded.setdefault(self.test, {})[case] = d
            return
        want = self.stored.get(self.test, {}).get(case)
        assert want is not None, (f"no golden {what} digest for {self.test}::{case} in {DIGESTS.name}: regenerate "
                                  "with pytest -n 0 --update-glsl-digests")
        assert d == want, f"{self.test}::{case}: the printed {what} changed (digest {d}, golden {want})"

    def write(self):
        """Store the digests of the tests run (those of other tests stay)."""
        if not self.recorded:
            return
        out = {**self.stored, **{test: dict(sorted(cases.items())) for test, cases in self.recorded.items()}}
        DIGESTS.parent.mkdir(exist_ok=True)
        DIGESTS.write_text(json.dumps(dict(sorted(out.items())), indent=1) + "\n")


def _short(name: str) -> str:
    """A kernel's name in a case id: a merged launch's (listing its parts) shortened."""
    return f"{name[:48]}~{digest(name)}" if len(name) > 80 else name


GOLDEN = Golden()


def check_glsl(glsl: str, wgsl: str, name: str, unroll: bool | None = None, preserve_ieee: bool = True):
    """``glsl`` (printed from a kernel's tree; ``wgsl`` its WGSL, kept for the callers' symmetry)
    has the golden digest of its case."""
    if unroll is None:
        from meganeura.codegen.glsl_target import unroll_switch
        unroll = bool(unroll_switch())
    GOLDEN.check(glsl, name, unroll, preserve_ieee)


def check_wgsl(wgsl: str, name: str):
    """``wgsl`` (a kernel's WGSL as printed from its tree) has the golden digest of its case."""
    GOLDEN.check_wgsl(wgsl, name)
