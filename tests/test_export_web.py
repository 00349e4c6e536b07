"""The web export (``meganeura export --web``, ``Session.export_web``) runs in a real
browser: headless Chromium with WebGPU (SwiftShader), driven by Playwright, loads each
exported folder from a local HTTP server, and its outputs match the Python session's
(strict mode: relative L2 below 1e-5). The plan serialization is also checked without a
browser. ``MEGANEURA_SCREENSHOT_DIR=docs/img`` keeps the demo pages' screenshots."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

import meganeura as mg
from meganeura.export import export_llama_web, plan_json
from meganeura.export.web import portable_wgsl
from meganeura.models import llama
from meganeura.models.mlp import build_mlp

from .web_browser import Browser, StaticServer

RUN = "async ([feeds, program]) => { const m = await window.mgModel; " \
      "return (await m.run(feeds, {program})).map((a) => Array.from(a)); }"


def rel_l2(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def feeds_json(feeds):
    return {n: np.asarray(v).ravel().tolist() for n, v in feeds.items()}


@pytest.fixture(scope="module")
def web_root(tmp_path_factory):
    return tmp_path_factory.mktemp("web")


@pytest.fixture(scope="module")
def server(web_root):
    s = StaticServer(web_root)
    yield s
    s.close()


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    b = Browser(tmp_path_factory.mktemp("chromium-profile"))
    yield b
    b.close()


def open_model(browser, server, folder, init_script=None):
    pg = browser.page(f"{server.url}/{folder}/index.html", init_script)
    pg.evaluate("async () => { await window.mgModel; }")     # rejects (fails the test) with the page's message
    return pg


def keep_screenshot(pg, name):
    folder = os.environ.get("MEGANEURA_SCREENSHOT_DIR")
    if folder:
        os.makedirs(folder, exist_ok=True)
        pg.screenshot(path=os.path.join(folder, name))


# ----------------------------------------------------------------- plan (no browser)
def test_plan_serializes_the_compiled_plan():
    from meganeura.compiler import CompileOptions, compile_plan
    g, _, _, logits, _ = build_mlp(2, 64, 16, 10)
    s = mg.compile(g, outputs=[logits], backend="numpy")
    plan, weights = plan_json({"run": s})
    kp = compile_plan([logits], n_forward=1, options=CompileOptions(max_bindings=8))
    prog = plan["variants"][0]["programs"]["run"]
    assert [d["name"] for d in prog["dispatches"]] == kp.names
    assert [plan["shaders"][d["shader"]]["wgsl"] for d in prog["dispatches"]] == [portable_wgsl(d.wgsl) for d in kp.dispatches]
    assert prog["reads"] == ["x"] and prog["outputs"][0]["shape"] == [2, 10]
    assert set(weights) == {"0.weight", "0.bias", "2.weight", "2.bias"}
    assert plan["variants"][0]["requires"] == []
    json.dumps(plan)


def test_plan_of_a_kv_cache_decoder_and_of_accelerated_precision():
    cfg = llama.LlamaConfig.tiny()
    g, logits, cache = llama.build_decoder(cfg, 1, 1, 16, cache_as_state=True)
    past = [g.states[n] for n in llama.cache_names(cfg)]
    s = mg.compile(g, outputs=[logits], state_updates=dict(zip(past, cache)), precision="accelerated")
    plan, weights = plan_json({"decode": s})
    # the empty cache is filled on the device, not shipped; it is updated by every call
    for n in llama.cache_names(cfg):
        assert plan["tensors"][n]["fill"] == 0.0 and n not in weights
    acc, strict = plan["variants"]
    assert acc["precision"] == "accelerated" and acc["requires"] == ["shader-f16"]
    assert strict["precision"] == "strict" and strict["requires"] == []
    assert all("enable f16" not in plan["shaders"][d["shader"]]["wgsl"] for d in strict["programs"]["decode"]["dispatches"])
    prog = strict["programs"]["decode"]
    writes = {plan["shaders"][d["shader"]]["access"][i] == "rw" and prog["buffers"][b].get("name")
              for d in prog["dispatches"] for i, b in enumerate(d["bindings"])}
    for n in llama.cache_names(cfg):    # updated in place by a kernel, or copied after the pass
        assert n in writes or n in {u["state"] for u in prog["updates"]}


def test_export_errors_name_the_problem(tmp_path):
    g, _, _, logits, loss = build_mlp(2, 8, 4, 3)
    s = mg.compile(g, outputs=[logits])
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.export_web(tmp_path / "a")
    with pytest.raises(TypeError, match="expected an mg.compile Session or an mg.jit function"):
        mg.export.export_web(object(), tmp_path / "a")
    s2 = mg.compile(g, outputs=[logits])
    with pytest.raises(ValueError, match="does not exist"):
        s2.export_web(tmp_path / "missing" / "b")
    with pytest.raises(ValueError, match="unknown demo"):
        s2.export_web(tmp_path / "c", demo={"kind": "nope"})


# ------------------------------------------------------------------------ in Chromium
def test_digits_mlp_cli_export_runs_in_chromium(browser, server, web_root, capsys):
    """`meganeura export --web DIR` (trained here), opened in Chromium: the page predicts
    drawn and example digits; the plan's outputs match the Python session's."""
    from meganeura.cli import main
    from meganeura.models.mlp import load_digits_split
    out = web_root / "digits"
    assert main(["export", "--web", str(out), "--epochs", "4", "--hidden", "32"]) == 0
    assert "exported the digits MLP" in capsys.readouterr().out
    g, _, _, logits, _ = build_mlp(1, 64, 32, 10)
    ref = mg.compile(g, outputs=[logits], backend="gpu")
    ref.load(str(out / "weights.safetensors"))
    _, (xte, yte) = load_digits_split()
    pg = open_model(browser, server, "digits")
    assert "strict plan" in pg.inner_text("#status")
    errs = []
    for i in range(4):
        want = ref.run({"x": xte[i:i + 1]})[0]
        got = pg.evaluate(RUN, [feeds_json({"x": xte[i:i + 1]}), None])[0]
        errs.append(rel_l2(got, want))
    assert max(errs) < 1e-5, errs
    # the demo: an example digit, then one drawn with the mouse
    pg.click("#example")
    best = pg.evaluate("async () => (await window.mgLast).best")
    plan = json.loads((out / "plan.json").read_text())
    ex = np.array(plan["demo"]["examples"][0]["pixels"], np.float32)[None]
    assert best == int(ref.run({"x": ex})[0].argmax())
    assert pg.inner_text("#pred") == str(best)
    pg.click("#clear")
    box = pg.locator("#pad").bounding_box()
    pts = [(60, 50), (200, 50), (150, 130), (110, 210)]    # a seven
    pg.mouse.move(box["x"] + pts[0][0], box["y"] + pts[0][1])
    pg.mouse.down()
    for x, y in pts[1:]:
        pg.mouse.move(box["x"] + x, box["y"] + y, steps=8)
    pg.mouse.up()
    drawn = pg.evaluate("async () => (await window.mgLast).best")
    assert 0 <= drawn <= 9 and pg.inner_text("#pred") == str(drawn)
    assert not pg.page_errors, pg.page_errors
    keep_screenshot(pg, "web-digits.png")
    ref.close()


def test_digits_cnn_jit_export_matches_python(browser, server, web_root):
    """The digits CNN (mg.nn, mg.jit, eval mode: convolutions, batch norm, pooling) with
    batch 3, exported from its jit function; one page run against the Python session."""
    from meganeura.models.digits import DigitsCNN
    model = DigitsCNN()
    model.eval()
    predict = mg.jit(model, backend="gpu")
    x = np.random.default_rng(1).random((3, 1, 8, 8)).astype(np.float32)
    want = predict(x)
    mg.export.export_web(predict, web_root / "cnn")
    pg = open_model(browser, server, "cnn")
    name = json.loads((web_root / "cnn" / "plan.json").read_text())["variants"][0]["programs"]["run"]["reads"]
    assert len(name) == 1
    got = pg.evaluate(RUN, [feeds_json({name[0]: x}), None])[0]
    assert rel_l2(got, want) < 1e-5, rel_l2(got, want)
    assert pg.inner_text("#status").startswith("google") or "swiftshader" in pg.inner_text("#status").lower()


def test_accelerated_export_falls_back_to_strict_and_feeds_are_checked(browser, server, web_root):
    """An accelerated export on an adapter without shader-f16 (SwiftShader) runs its strict
    plan and says so; bad feeds get errors naming the input and its shape."""
    g, _, _, logits, _ = build_mlp(2, 64, 16, 10)
    s = mg.compile(g, outputs=[logits], backend="gpu", precision="accelerated")
    s.export_web(web_root / "f16")
    strict = mg.compile(g, outputs=[logits], backend="gpu", share_with=s)
    x = np.random.default_rng(2).random((2, 64)).astype(np.float32)
    pg = open_model(browser, server, "f16")
    info = pg.evaluate("async () => { const m = await window.mgModel; return [m.precision, m.notes.join(' ')]; }")
    assert info[0] == "strict" and "shader-f16" in info[1], info
    got = pg.evaluate(RUN, [feeds_json({"x": x}), None])[0]
    assert rel_l2(got, strict.run({"x": x})[0]) < 1e-5
    bad = "async (f) => { const m = await window.mgModel; try { await m.run(f); return 'ran'; } catch (e) { return e.message; } }"
    assert "input 'x': got 3 values, expected 128 (shape (2, 64) f32)" in pg.evaluate(bad, {"x": [1, 2, 3]})
    assert "missing input(s): 'x' (2, 64) f32" in pg.evaluate(bad, {})
    assert "unknown input(s) y" in pg.evaluate(bad, {"y": [1]})
    strict.close()
    s.close()


def test_page_without_webgpu_says_so(browser, server, web_root):
    g, _, _, logits, _ = build_mlp(1, 64, 8, 10)
    mg.compile(g, outputs=[logits]).export_web(web_root / "nogpu", demo={"kind": "digits", "input": "x"})
    pg = browser.page(f"{server.url}/nogpu/index.html",
                      "Object.defineProperty(Navigator.prototype, 'gpu', {get: () => undefined});")
    msg = pg.evaluate("async () => { try { await window.mgModel; return 'loaded'; } catch (e) { return e.name + ': ' + e.message; } }")
    assert msg.startswith("WebGPUUnavailableError: WebGPU is not available in this browser"), msg
    assert "WebGPU is not available" in pg.inner_text("#status")


def test_tiny_smollm2_generates_in_chromium_with_the_kv_cache(browser, server, web_root):
    """Tiny SmolLM2 (Llama architecture) exported for greedy generation: the page feeds
    the prompt and then its own tokens one per call, the cache staying on the GPU; every
    step's logits and the generated ids match the Python decoder's (GPU backend)."""
    from meganeura.api import default_init
    from meganeura.models.generate import LlamaGenerator
    cfg = llama.LlamaConfig.tiny()
    g = llama.build_causal_lm(cfg, 1, 1)[0]
    rng = np.random.default_rng(3)
    state = {n: (rng.standard_normal(t.shape) * (0.5 if len(t.shape) > 1 else 0.1) + (1.0 if "norm" in n else 0.0))
             .astype(np.float32) for n, t in g.parameters.items()}
    max_len, prompt, n_new = 32, [5, 17, 42, 8], 12
    export_llama_web(cfg, state, web_root / "llama", max_len=max_len)
    gen = LlamaGenerator(cfg, state, backend="gpu")
    want_logits, ids = [], list(prompt)
    for pos in range(len(prompt) + n_new - 1):
        want_logits.append(gen.forward(np.array([[ids[pos]]], np.int32), pos, max_len)[0])
        if pos >= len(prompt) - 1:
            ids.append(int(want_logits[-1].argmax()))
    pg = open_model(browser, server, "llama")
    got = pg.evaluate("""async ([prompt, n]) => {
        const m = await window.mgModel;
        const { generate } = await import('./meganeura.js');
        const r = await generate(m, prompt, n, { keepLogits: true });
        return [r.ids, r.logits.map((a) => Array.from(a))]; }""", [prompt, n_new])
    assert got[0] == ids[len(prompt):]
    errs = [rel_l2(a, b) for a, b in zip(got[1], want_logits)]
    assert len(errs) == len(want_logits) and max(errs) < 1e-5, errs
    # the page itself: ids in, ids out
    pg.fill("#prompt", " ".join(map(str, prompt)))
    pg.fill("#n", str(n_new))
    pg.click("#go")
    pg.wait_for_function("document.getElementById('timing').textContent.includes('tokens/s')")
    assert pg.inner_text("#out").split() == [str(i) for i in ids]
    assert not pg.page_errors, pg.page_errors
    keep_screenshot(pg, "web-text.png")
    for s in gen.sessions.values():
        s.close()


def test_text_page_tokenizer_matches_tokenizers(browser, server, web_root, tmp_path):
    """The page's byte-level BPE encodes like the tokenizers package (a tokenizer trained
    here, SmolLM2's kind) and decodes back to the text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    text = ("The quick brown fox jumps over the lazy dog. It's 42 degrees; they'll say 1999 was fine! "
            "Once upon a time, a small model learned to speak in the browser. ") * 20
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([text], trainer)
    path = tmp_path / "tokenizer.json"
    tok.save(str(path))
    cfg = llama.LlamaConfig.tiny()
    cfg.vocab_size = tok.get_vocab_size()
    g = llama.build_causal_lm(cfg, 1, 1)[0]
    from safetensors.numpy import save_file

    from meganeura.api import default_init
    from meganeura.cli import main
    state = {n: default_init(t, 0) for n, t in g.parameters.items()}
    save_file(state, str(tmp_path / "model.safetensors"))      # a Hugging Face folder, exported by the CLI
    (tmp_path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    assert main(["export", "--web", str(web_root / "llama-tok"), "--model", str(tmp_path), "--max-len", "16"]) == 0
    assert (web_root / "llama-tok" / "tokenizer.json").exists()
    pg = open_model(browser, server, "llama-tok")
    pg.wait_for_function("window.mgTokenizer !== undefined")
    for s in ["Once upon a time, the fox said 123 things.", "It's lazy; they'll jump!  Twice", "naïve café ✓"]:
        want = tok.encode(s).ids
        got = pg.evaluate("(s) => window.mgTokenizer.encode(s)", s)
        assert got == want, (s, got, want)
        assert pg.evaluate("(ids) => window.mgTokenizer.decode(ids)", want) == tok.decode(want)


def test_cli_export_mistakes_are_one_line(tmp_path, capsys):
    from meganeura.cli import main
    assert main(["export"]) == 2
    assert "give --web DIR" in capsys.readouterr().err
    assert main(["export", "--web", str(tmp_path / "no" / "w")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", "--web", str(tmp_path / "w"), "--model", "nonsense"]) == 2
    assert "not one of digits-mlp, llama-tiny" in capsys.readouterr().err
    assert main(["export", "--web", str(tmp_path / "w"), "--checkpoint", str(tmp_path / "x.safetensors")]) == 2
    assert "--checkpoint" in capsys.readouterr().err


def test_an_onnx_model_exports_from_the_cli_and_runs_in_chromium(browser, server, web_root, capsys):
    """`meganeura export --web DIR --model FILE.onnx`: an ONNX graph written by the onnx
    package (Gemm, Relu, Softmax) imported and exported; the page's outputs are numpy's."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from meganeura.cli import main
    rng = np.random.default_rng(7)
    w1, b1 = rng.standard_normal((6, 5)).astype(np.float32), rng.standard_normal(5).astype(np.float32)
    w2 = rng.standard_normal((5, 3)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gemm", ["x", "w1", "b1"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
         helper.make_node("MatMul", ["r", "w2"], ["z"]), helper.make_node("Softmax", ["z"], ["y"], axis=-1)],
        "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 6])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        [numpy_helper.from_array(w1, "w1"), numpy_helper.from_array(b1, "b1"), numpy_helper.from_array(w2, "w2")])
    path = web_root / "mlp.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path)
    assert main(["export", "--web", str(web_root / "onnx"), "--model", str(path)]) == 0
    assert "exported" in capsys.readouterr().out
    x = rng.standard_normal((2, 6)).astype(np.float32)
    z = np.maximum(x @ w1 + b1, 0) @ w2
    want = np.exp(z - z.max(-1, keepdims=True))
    want /= want.sum(-1, keepdims=True)
    pg = open_model(browser, server, "onnx")
    got = pg.evaluate(RUN, [feeds_json({"x": x}), None])[0]
    assert rel_l2(got, want) < 1e-5, rel_l2(got, want)
