"""`meganeura serve`: the OpenAI-compatible HTTP server, run in-process on 127.0.0.1 with a
tiny random Llama folder and driven by the official openai client: greedy output equals
generate_text, streaming, concurrent clients, cancelled streams freeing their slots, the
error shapes and status codes, and memory returned after the load."""
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from meganeura.models.generate import generate_text

from .test_batch_decode import write_tiny_folder

openai = pytest.importorskip("openai")
httpx = pytest.importorskip("httpx")
uvicorn = pytest.importorskip("uvicorn")
from meganeura.serving.http import Limits, ServedModel, create_app  # noqa: E402

WORDS = ["the quick brown fox", "birds sing songs", "old sailors tell stories", "children laugh loudly when",
         "my neighbour bakes fresh bread", "the lazy dog", "a small cat sleeps", "tall green trees near the river"]
LIMITS = Limits(max_concurrent=16, max_tokens=24, max_prompt_tokens=40, max_body_bytes=32 * 1024)


class Server:
    """``served`` behind uvicorn in a thread, on a free port of 127.0.0.1."""

    def __init__(self, served):
        self.served = served
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = uvicorn.Config(create_app(served), log_level="warning", lifespan="on", timeout_graceful_shutdown=10)
        self.server = uvicorn.Server(cfg)
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started:
            assert time.time() < deadline and self.thread.is_alive(), "the server did not start"
            time.sleep(0.01)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)
        self.sock.close()

    def client(self, **kw):
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=60, **kw)

    def health(self):
        return httpx.get(self.url + "/health").json()

    def wait_idle(self, timeout=10):
        deadline = time.time() + timeout
        while True:
            h = self.health()
            if h["active"] == 0 and h["pending"] == 0 and h["inflight"] == 0:
                return h
            assert time.time() < deadline, h
            time.sleep(0.01)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    write_tiny_folder(path)
    return path


@pytest.fixture(scope="module")
def server(folder):
    with Server(ServedModel(folder, backend="numpy", slots=4, limits=LIMITS)) as s:
        yield s


def expected(folder, prompt, n, **kw):
    return generate_text(folder, prompt, n, backend="numpy", **kw)


def test_models_and_greedy_completion_equals_generate_text(server, folder):
    c = server.client()
    assert [m.id for m in c.models.list().data] == [os.path.basename(folder)]
    name = os.path.basename(folder)
    r = c.completions.create(model=name, prompt=WORDS[0], max_tokens=6, temperature=0)
    assert r.choices[0].text == expected(folder, WORDS[0], 6) and r.choices[0].finish_reason == "length"
    n_prompt = len(server.served.tokenizer.encode(WORDS[0]).ids)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (n_prompt, 6, n_prompt + 6)
    # streamed: the pieces add up to the same text; the last chunk says why it stopped
    chunks = list(c.completions.create(model=name, prompt=WORDS[0], max_tokens=6, temperature=0, stream=True,
                                       stream_options={"include_usage": True}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == r.choices[0].text
    assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 6
    # a stop string ends the text before it, finish_reason "stop"
    words = r.choices[0].text.split()
    s = c.completions.create(model=name, prompt=WORDS[0], max_tokens=6, temperature=0, stop=[words[2]])
    assert s.choices[0].finish_reason == "stop" and s.choices[0].text.split() == words[:2]
    # seeded sampling is reproducible and matches generate_text with the same options
    kw = dict(temperature=0.9, top_p=0.9, seed=5)
    a = c.completions.create(model=name, prompt=WORDS[1], max_tokens=8, **kw,
                             extra_body={"top_k": 20, "repetition_penalty": 1.2})
    assert a.choices[0].text == expected(folder, WORDS[1], 8, temperature=0.9, top_p=0.9, seed=5, top_k=20,
                                         repetition_penalty=1.2)


def test_chat_streaming_and_not(server, folder):
    c = server.client()
    name = os.path.basename(folder)
    msgs = [{"role": "user", "content": WORDS[2]}]
    want = expected(folder, f"user: {WORDS[2]}\nassistant:", 5)      # the documented fallback template
    r = c.chat.completions.create(model=name, messages=msgs, max_tokens=5, temperature=0)
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content == want
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    chunks = list(c.chat.completions.create(model=name, messages=msgs, max_tokens=5, temperature=0, stream=True))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(ch.choices[0].delta.content or "" for ch in chunks) == want
    assert chunks[-1].choices[0].finish_reason == "length"
    # the raw stream is server-sent events ending with [DONE]
    with httpx.stream("POST", server.url + "/v1/chat/completions",
                      json={"model": name, "messages": msgs, "max_tokens": 3, "stream": True}) as resp:
        assert resp.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in resp.iter_lines() if ln]
    assert all(ln.startswith("data: ") for ln in lines) and lines[-1] == "data: [DONE]"


def test_sixteen_concurrent_clients_then_429_then_memory_returned(server, folder):
    psutil = pytest.importorskip("psutil")
    c = server.client()
    name = os.path.basename(folder)
    want = {p: expected(folder, p, 8) for p in WORDS}

    def one_round():
        results, errors = {}, []

        def client(i):
            p = WORDS[i % len(WORDS)]
            try:
                if i % 2:
                    r = c.completions.create(model=name, prompt=p, max_tokens=8, temperature=0)
                    results[i] = (p, r.choices[0].text)
                else:
                    text = "".join(ch.choices[0].text for ch in c.completions.create(
                        model=name, prompt=p, max_tokens=8, temperature=0, stream=True) if ch.choices)
                    results[i] = (p, text)
            except Exception as e:   # noqa: BLE001 -- reported below
                errors.append(e)
        server.served.engine.pause()          # all 16 wait, so the 17th finds the server full
        threads = [threading.Thread(target=client, args=(i,)) for i in range(16)]
        for t in threads:
            t.start()
        deadline = time.time() + 20
        while server.health()["inflight"] < 16:
            assert time.time() < deadline and not errors, (server.health(), errors)
            time.sleep(0.01)
        with pytest.raises(openai.RateLimitError) as e:
            c.completions.create(model=name, prompt=WORDS[0], max_tokens=2)
        assert e.value.status_code == 429 and e.value.body["code"] == "rate_limit_exceeded"
        server.served.engine.resume()
        for t in threads:
            t.join(60)
        assert not errors and len(results) == 16
        assert all(text == want[p] for p, text in results.values())
        return server.wait_idle()

    proc = psutil.Process()
    one_round()
    rss1 = proc.memory_info().rss
    h = one_round()
    rss2 = proc.memory_info().rss
    assert h["active"] == 0 and h["inflight"] == 0
    assert rss2 - rss1 < 32 << 20, f"RSS grew by {(rss2 - rss1) >> 20} MiB over a second round of 16 requests"


def test_cancelled_stream_frees_its_slot(server, folder):
    c = server.client()
    name = os.path.basename(folder)
    cache = server.served.cache
    plain = cache.decode

    def slow(rows):                      # a slow model: the stream is still running when it is closed
        time.sleep(0.03)
        return plain(rows)
    cache.decode = slow
    try:
        before = server.health()
        stream = c.completions.create(model=name, prompt=WORDS[3], max_tokens=24, temperature=0, stream=True)
        got = [next(iter(stream)).choices[0].text for _ in range(3)]
        assert all(got) and server.health()["active"] == 1
        stream.close()
        h = server.wait_idle(timeout=5)
        assert h["cancelled"] == before["cancelled"] + 1
        assert h["generated_tokens"] - before["generated_tokens"] < 20, "the cancelled request ran to its end"
    finally:
        cache.decode = plain
    r = c.completions.create(model=name, prompt=WORDS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == expected(folder, WORDS[0], 4)


def test_a_failing_step_fails_its_requests_and_the_server_goes_on(server, folder):
    c = server.client()
    cache = server.served.cache
    plain = cache.decode

    def broken(rows):
        raise RuntimeError("device lost")
    cache.decode = broken
    try:
        with pytest.raises(openai.InternalServerError) as e:
            c.completions.create(model=server.served.name, prompt=WORDS[0], max_tokens=4, temperature=0)
        assert e.value.status_code == 500 and "device lost" in e.value.body["message"]
    finally:
        cache.decode = plain
    server.wait_idle()
    r = c.completions.create(model=server.served.name, prompt=WORDS[0], max_tokens=4, temperature=0)
    assert r.choices[0].text == expected(folder, WORDS[0], 4)


def test_a_client_gone_before_its_answer_frees_the_slot(server, folder):
    cache = server.served.cache
    plain = cache.decode
    cache.decode = lambda rows: (time.sleep(0.03), plain(rows))[1]
    try:
        before = server.health()
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(server.url + "/v1/completions", timeout=0.3,
                       json={"prompt": WORDS[0], "max_tokens": 24, "temperature": 0})
        h = server.wait_idle(timeout=5)
        assert h["cancelled"] == before["cancelled"] + 1
    finally:
        cache.decode = plain


def test_errors_have_openai_shape_and_status(server, folder):
    c = server.client()
    name = os.path.basename(folder)
    r = httpx.post(server.url + "/v1/completions", content=b'{"model": "x", "prompt": ',
                   headers={"content-type": "application/json"})
    assert r.status_code == 400
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert "not valid JSON" in err["message"]
    with pytest.raises(openai.NotFoundError) as e:
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    assert e.value.body["code"] == "model_not_found" and "gpt-4" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=name, messages=[{"role": "user", "content": " ".join(["fox"] * 50)}])
    assert e.value.body["code"] == "context_length_exceeded" and "40 tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="the fox", max_tokens=1000)
    assert e.value.body["param"] == "max_tokens"
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model=name, prompt="the fox", temperature=-1)
    assert e.value.body["param"] == "temperature"
    r = httpx.post(server.url + "/v1/completions", content=json.dumps({"model": name, "prompt": "a" * 40000}),
                   headers={"content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    assert httpx.get(server.url + "/v1/nothing").status_code == 404
    assert server.wait_idle()["active"] == 0


def test_graceful_shutdown_finishes_a_running_stream(folder):
    served = ServedModel(folder, backend="numpy", slots=2, limits=LIMITS)
    plain = served.cache.decode
    served.cache.decode = lambda rows: (time.sleep(0.02), plain(rows))[1]
    s = Server(served).__enter__()
    stream = s.client().completions.create(model=served.name, prompt=WORDS[0], max_tokens=10, temperature=0,
                                           stream=True)
    it = iter(stream)
    first = next(it).choices[0].text
    s.server.should_exit = True          # as Ctrl-C does: the running stream still completes
    rest = [ch for ch in it]
    s.thread.join(30)
    assert first + "".join(ch.choices[0].text for ch in rest if ch.choices) == expected(folder, WORDS[0], 10)
    assert rest[-1].choices[0].finish_reason == "length"
    assert not s.thread.is_alive() and not served.engine.thread.is_alive()


def test_chat_template_from_the_tokenizer_config(tmp_path):
    from meganeura.serving.chat import ChatTemplate, ChatTemplateError
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": {"content": "<s>"}, "chat_template":
        "{{ bos_token }}{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"}))
    t = ChatTemplate.from_folder(tmp_path)
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "text", "text": "hi"}]}]
    assert t.builtin and t.render(msgs) == "<s><|system|>be brief\n<|user|>hi\n<|assistant|>"
    assert ChatTemplate.from_folder(tmp_path / "..").render(msgs[1:]) == "user: hi\nassistant:"
    with pytest.raises(ChatTemplateError, match="messages\\[0\\] must be an object"):
        t.render(["hi"])


def test_serve_on_lavapipe_gpu(folder):
    with Server(ServedModel(folder, backend="gpu", slots=2, limits=LIMITS)) as s:
        c = s.client()
        prompts = WORDS[:3]
        out = {}
        threads = [threading.Thread(target=lambda p=p: out.__setitem__(p, c.completions.create(
            model=s.served.name, prompt=p, max_tokens=6, temperature=0).choices[0].text)) for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert out == {p: expected(folder, p, 6) for p in prompts}
        assert s.wait_idle()["active"] == 0


def test_serve_a_gguf_file_from_its_quantized_blocks(folder, tmp_path):
    """A GGUF file (the folder quantized to Q8_0) served on lavapipe: its matrices stay
    blocks on the device; greedy completions are generate_text's from the same file."""
    pytest.importorskip("gguf")
    from meganeura.cli import main
    path = tmp_path / "tiny.gguf"
    assert main(["quantize", str(folder), "--q8_0", "--out", str(path), "--quiet"]) == 0
    served = ServedModel(path, backend="gpu", slots=2, limits=LIMITS)
    assert served.name == "tiny" and "model.layers.0.mlp.down_proj.weight" in served.cache.quantized
    with Server(served) as s:
        c = s.client()
        for p in WORDS[:2]:
            got = c.completions.create(model="tiny", prompt=p, max_tokens=5, temperature=0).choices[0].text
            assert got == generate_text(path, p, 5, backend="gpu")
        assert s.wait_idle()["active"] == 0


def test_cli_serve_prints_its_status_and_stops_on_interrupt(folder):
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "meganeura.cli", "serve", str(folder), "--port", str(port),
                          "--backend", "numpy", "--max-tokens", "8", "--max-prompt-tokens", "32"],
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        line = p.stderr.readline()
        assert "meganeura serve:" in line and "parameters" in line and "numpy" in line, line
        assert f"http://127.0.0.1:{port}/v1" in line
        deadline = time.time() + 30
        while True:
            try:
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions",
                               json={"prompt": WORDS[0], "max_tokens": 4, "temperature": 0})
                break
            except httpx.ConnectError:
                assert time.time() < deadline and p.poll() is None
                time.sleep(0.05)
        assert r.json()["choices"][0]["text"] == expected(folder, WORDS[0], 4)
        p.send_signal(2)
        assert p.wait(30) == 0
    finally:
        if p.poll() is None:
            p.kill()
        p.stderr.close()


def test_cli_serve_mistakes_are_one_line(tmp_path):
    from .test_cli import _cli, _one_line_error
    _one_line_error(_cli(["serve", str(tmp_path / "nope")]), "MODEL_DIR", "does not exist")
    write_tiny_folder(tmp_path)
    _one_line_error(_cli(["serve", str(tmp_path), "--slots", "0"]), "--slots")
    _one_line_error(_cli(["serve", str(tmp_path)], block=["uvicorn"]), "pip install 'meganeura[serve]'")
    _one_line_error(_cli(["serve", str(tmp_path), "--backend", "numpy", "--max-prompt-tokens", "500"]),
                    "max_position_embeddings")


def test_serving_modules_import_no_optional_package():
    code = ("import sys, meganeura, meganeura.cli, meganeura.serving.batch, meganeura.serving.http\n"
            "print([m for m in ('starlette', 'uvicorn', 'jinja2', 'tokenizers', 'torch') if m in sys.modules])")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "[]", r.stdout + r.stderr
