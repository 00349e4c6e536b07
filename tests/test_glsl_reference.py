"""The golden GLSL digests (tests/glsl_reference.py): a case without a digest fails, and so
does GLSL that differs from the recorded one; recording replaces the digests of the tests it
runs and keeps the others'."""
import json

import pytest

import tests.glsl_reference as ref


def test_a_missing_or_changed_digest_fails():
    g = ref.Golden()
    g.stored = {"mod::t": {"k::unroll=0,ieee=1": ref.digest("void main() {}"),
                           "k::unroll=0,ieee=1#2": ref.digest("void main() { }")}}
    g.start("mod::t")
    g.check("void main() {}", "k", False, True)
    g.check("void main() { }", "k", False, True)          # a second text of one name: its own case
    with pytest.raises(AssertionError, match="no golden GLSL digest"):
        g.check("void main() {}", "k", True, True)        # other switches: another case
    with pytest.raises(AssertionError, match="no golden GLSL digest"):
        g.check("void main() {  }", "k", False, True)     # a third text: not recorded
    g.start("mod::t")
    with pytest.raises(AssertionError, match="changed"):
        g.check("void main() {  }", "k", False, True)
    g.start("mod::other")
    with pytest.raises(AssertionError, match="no golden GLSL digest"):
        g.check("void main() {}", "k", False, True)


def test_recording_replaces_the_tests_run_and_keeps_the_others(tmp_path, monkeypatch):
    path = tmp_path / "d.json"
    monkeypatch.setattr(ref, "DIGESTS", path)
    g = ref.Golden()
    g.stored = {"mod::a": {"old::unroll=0,ieee=1": "1"}, "mod::b": {"k::unroll=0,ieee=1": "2"}}
    g.update = True
    g.start("mod::a")
    g.check("text", "new" * 40, True, False)
    g.write()
    stored = json.loads(path.read_text())
    assert stored["mod::b"] == {"k::unroll=0,ieee=1": "2"}
    (case,) = stored["mod::a"]
    assert case.startswith("new" * 16 + "~") and case.endswith("::unroll=1,ieee=0")
    assert stored["mod::a"][case] == ref.digest("text")


def test_the_golden_file_is_committed_beside_the_tests():
    assert ref.DIGESTS.exists() and json.loads(ref.DIGESTS.read_text())


def test_a_wgsl_case_is_its_own_beside_the_glsl_cases():
    g = ref.Golden()
    g.stored = {"mod::t": {"wgsl::k": ref.digest("fn main() {}"), "wgsl::k#2": ref.digest("fn main() { }")}}
    g.start("mod::t")
    g.check_wgsl("fn main() {}", "k")
    g.check_wgsl("fn main() { }", "k")
    with pytest.raises(AssertionError, match="no golden GLSL digest"):
        g.check("fn main() {}", "k", False, True)
    with pytest.raises(AssertionError, match="the printed WGSL changed"):
        g.start("mod::t")
        g.check_wgsl("fn main() {  }", "k")
