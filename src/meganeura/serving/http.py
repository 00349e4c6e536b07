"""``meganeura serve``: an OpenAI-compatible HTTP server for a Llama-family model folder.

Endpoints: ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``
(``stream: true`` sends server-sent events ending with ``data: [DONE]``), ``GET /health``
(slots in use, requests waiting). Requests are decoded together by ``serving.batch``'s
continuous batching on one device cache of ``slots`` rows; each has its own sampling
options (OpenAI's ``temperature``, ``top_p``, ``max_tokens``, ``stop``, ``seed``, plus
``top_k``, ``min_p`` and ``repetition_penalty``). Errors come in OpenAI's shape,
``{"error": {"message", "type", "param", "code"}}``: malformed JSON or a bad value 400,
a prompt over ``max_prompt_tokens`` 400 (``context_length_exceeded``), an unknown model
404, a body over ``max_body_bytes`` 413, more than ``max_concurrent`` requests at once 429.
A client that disconnects mid-stream frees its slot at the next step; on shutdown running
requests finish within the graceful timeout, then the rest are cancelled.

Needs ``pip install 'meganeura[serve]'`` (starlette, uvicorn, tokenizers, jinja2)."""
from __future__ import annotations

import asyncio
import json
import os
import secrets
import sys
import time
import uuid
from dataclasses import dataclass

from .batch import BatchDecoder, ContextLengthError, Engine, SamplingParams, SlotCache
from .chat import ChatTemplate, ChatTemplateError

INSTALL = "pip install 'meganeura[serve]'"


def require_serve():
    """Import starlette and uvicorn, or fail naming the extra."""
    try:
        import starlette  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError as e:
        raise ImportError(f"meganeura serve needs the optional package {e.name!r}: {INSTALL}") from e


class ApiError(Exception):
    def __init__(self, status, message, type="invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self):
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


@dataclass
class Limits:
    """Per-server limits: requests in flight at once (running or queued), new tokens per
    request, prompt tokens per request, request body bytes."""
    max_concurrent: int = 64
    max_tokens: int = 256
    max_prompt_tokens: int = 512
    max_body_bytes: int = 1 << 20


def _load_gguf(path):
    """A GGUF file's config, f32 tensors, quantized blocks (kept as blocks on the device),
    tokenizer and chat template."""
    from ..io import load_gguf
    from ..models.generate import split_quantized
    m = load_gguf(path)
    if m.tokenizer is None:
        raise ValueError(f"serve: {path} holds no tokenizer the server can use"
                         + (f" ({m.tokenizer_error})" if m.tokenizer_error else ""))
    state, blocks = split_quantized(m)

    def token(i):
        return m.tokenizer.id_to_token(int(i)) if isinstance(i, int) else None
    chat = ChatTemplate(m.chat_template, token(m.config.bos_token_id), token(m.config.eos_token_id))
    return m.config, state, blocks, m.tokenizer, chat


class ServedModel:
    """A model folder loaded for serving: weights, tokenizer, chat template, the slot cache
    (``max_prompt_tokens + max_tokens`` positions a slot) and its engine thread."""

    def __init__(self, model_dir, backend="gpu", precision="strict", slots=4, limits: Limits | None = None,
                 name=None, chunk=16):
        from ..io import load_hf
        from ..models.generate import load_tokenizer
        self.limits = limits or Limits()
        for field in ("max_concurrent", "max_tokens", "max_prompt_tokens", "max_body_bytes"):
            v = getattr(self.limits, field)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"serve: {field} must be a positive integer, got {v!r}")
        self.model_dir, self.backend = os.fspath(model_dir), backend
        self.name = name or os.path.basename(os.path.normpath(self.model_dir)).removesuffix(".gguf")
        blocks = None
        if self.model_dir.endswith(".gguf") and not os.path.isdir(self.model_dir):
            self.config, state, blocks, self.tokenizer, self.chat = _load_gguf(self.model_dir)
        else:
            self.config, state = load_hf(self.model_dir)
            self.tokenizer = load_tokenizer(self.model_dir)
            self.chat = ChatTemplate.from_folder(self.model_dir)
        max_len = self.limits.max_prompt_tokens + self.limits.max_tokens
        if max_len > self.config.max_position_embeddings:
            raise ValueError(f"serve: max_prompt_tokens + max_tokens = {max_len} exceeds the model's "
                             f"max_position_embeddings ({self.config.max_position_embeddings}); lower them")
        self.weight_bytes = sum(v.size for v in state.values()) * 4 + sum(raw.size for raw, _ in (blocks or {}).values())
        self.cache = SlotCache(self.config, state, slots=slots, max_len=max_len, chunk=chunk, backend=backend,
                               precision=precision, blocks=blocks)
        del state
        self.decoder = BatchDecoder(self.cache, self.tokenizer)
        self.engine = Engine(self.decoder)
        self.inflight = 0
        self.created = int(time.time())
        self.closing = False

    def device(self) -> str:
        if self.backend == "numpy":
            return "numpy (the reference interpreter on the CPU)"
        from ..runtime.backends import get_runtime_device, resolve
        kind = resolve(self.backend)
        dev = get_runtime_device(kind)
        return f"{dev.name} ({'vulkan' if kind == 'vulkan' else 'wgpu'}{', software' if dev.is_software else ''})"

    def status_line(self, url) -> str:
        mib = 1 << 20
        return (f"meganeura serve: {self.name} ({self.cache.parameters / 1e6:.2f}M parameters, "
                f"{self.weight_bytes / mib:.1f} MiB weights) on {self.device()}; {self.cache.slots} slots x "
                f"{self.cache.max_len} positions (key/value cache {self.cache.cache_bytes / mib:.1f} MiB), "
                f"up to {self.limits.max_concurrent} requests at once; listening on {url}")

    def health(self) -> dict:
        return {"status": "closing" if self.closing else "ok", "model": self.name, "slots": self.cache.slots,
                "active": self.decoder.active, "pending": self.decoder.pending(), "inflight": self.inflight,
                "steps": self.decoder.steps, "generated_tokens": self.decoder.generated,
                "cancelled": self.decoder.cancelled}

    def close(self):
        self.closing = True
        self.engine.stop()
        self.cache.close()


# ------------------------------------------------------------------------ parsing
async def read_json(request, limit):
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > limit:
        raise ApiError(413, f"the request body is {int(size)} bytes; the limit is {limit}", code="request_too_large")
    chunks, n = [], 0
    async for c in request.stream():
        n += len(c)
        if n > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large")
        chunks.append(c)
    try:
        body = json.loads(b"".join(chunks))
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}", code="invalid_json")
    return body


def _get(body, key, kinds, default=None, check=None, want=""):
    v = body.get(key, default)
    if v is None:
        return default
    if isinstance(v, bool) and bool not in kinds or not isinstance(v, kinds) or (check and not check(v)):
        raise ApiError(400, f"'{key}' must be {want}, got {v!r}", param=key, code="invalid_value")
    return v


# options this server does not implement, with the value that means "off"
UNSUPPORTED = {"logprobs": False, "echo": False, "logit_bias": {}, "top_logprobs": 0, "tools": [], "functions": [],
               "best_of": 1, "suffix": ""}


def sampling_params(body, served: ServedModel, chat: bool) -> SamplingParams:
    limit = served.limits.max_tokens
    for key, off in UNSUPPORTED.items():
        if body.get(key) is not None and body[key] != off:
            raise ApiError(400, f"'{key}' is not supported by this server", param=key, code="unsupported_parameter")
    for key in ("presence_penalty", "frequency_penalty"):
        if _get(body, key, (int, float), 0, want="a number"):
            raise ApiError(400, f"'{key}' is not supported (use repetition_penalty)", param=key,
                           code="unsupported_parameter")
    if _get(body, "n", (int,), 1, want="an integer") != 1:
        raise ApiError(400, "only n=1 is supported", param="n", code="unsupported_parameter")
    key = "max_completion_tokens" if chat and body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = _get(body, key, (int,), limit if chat else 16, lambda v: 1 <= v <= limit,
                      f"an integer in [1, {limit}] (this server's --max-tokens)")
    stop = body.get("stop")
    stop = [stop] if isinstance(stop, str) else (stop or [])
    if not isinstance(stop, list) or len(stop) > 4 or not all(isinstance(s, str) and s for s in stop):
        raise ApiError(400, f"'stop' must be a string or a list of up to 4 non-empty strings, got {body.get('stop')!r}",
                       param="stop", code="invalid_value")
    seed = _get(body, "seed", (int,), None, want="an integer")
    temperature = _get(body, "temperature", (int, float), 1.0, lambda v: 0 <= v <= 2, "a number in [0, 2]")
    top_p = _get(body, "top_p", (int, float), 1.0, lambda v: 0 < v <= 1, "a number in (0, 1]")
    try:
        return SamplingParams(max_tokens=max_tokens, temperature=float(temperature),
                              top_p=None if top_p >= 1 else float(top_p),
                              top_k=_get(body, "top_k", (int,), None, want="an integer"),
                              min_p=_get(body, "min_p", (int, float), None, want="a number"),
                              repetition_penalty=_get(body, "repetition_penalty", (int, float), None, want="a number"),
                              stop=tuple(stop), seed=secrets.randbits(31) if seed is None else seed)
    except ValueError as e:
        param = str(e).split(":", 1)[-1].split()[0]
        raise ApiError(400, str(e).replace("SamplingParams: ", ""), param=param, code="invalid_value") from None


def prompt_ids(body, served: ServedModel, chat: bool) -> list:
    tok = served.tokenizer
    if chat:
        try:
            text = served.chat.render(body.get("messages"))
        except ChatTemplateError as e:
            raise ApiError(400, str(e), param="messages", code="invalid_value") from None
        ids = tok.encode(text, add_special_tokens=not served.chat.builtin).ids
        param = "messages"
    else:
        p, param = body.get("prompt"), "prompt"
        if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
            p = p[0]
        if isinstance(p, str):
            ids = tok.encode(p).ids
        elif isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
            vocab = served.config.vocab_size
            if not all(0 <= t < vocab for t in p):
                raise ApiError(400, f"prompt token ids must lie in [0, {vocab})", param="prompt", code="invalid_value")
            ids = list(p)
        else:
            raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list of one of them "
                           "(one prompt per request)", param="prompt", code="invalid_value")
    if not ids:
        raise ApiError(400, f"the {param} encodes to no tokens", param=param, code="invalid_value")
    limit = served.limits.max_prompt_tokens
    if len(ids) > limit:
        raise ApiError(400, f"this model's maximum prompt length is {limit} tokens; the {param} has {len(ids)} "
                       "tokens", param=param, code="context_length_exceeded")
    return ids


# ------------------------------------------------------------------------ the app
def create_app(served: ServedModel):
    """The Starlette app serving ``served``; its lifespan starts the engine and, on
    shutdown, cancels what is left and frees the device."""
    require_serve()
    import contextlib

    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, StreamingResponse
    from starlette.routing import Route

    def error(e: ApiError):
        return JSONResponse(e.body(), status_code=e.status)

    class EventStream(StreamingResponse):
        """Runs ``cleanup`` however the response ends (finished, client gone, shutdown)."""

        def __init__(self, content, cleanup):
            super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
            self.cleanup = cleanup

        async def __call__(self, scope, receive, send):
            try:
                await super().__call__(scope, receive, send)
            finally:
                self.cleanup()

    def model_card():
        return {"id": served.name, "object": "model", "created": served.created, "owned_by": "meganeura"}

    async def models(request):
        return JSONResponse({"object": "list", "data": [model_card()]})

    async def model(request):
        if request.path_params["model"] != served.name:
            return error(ApiError(404, f"The model '{request.path_params['model']}' does not exist", param="model",
                                  code="model_not_found"))
        return JSONResponse(model_card())

    async def health(request):
        return JSONResponse(served.health())

    def submit(ids, params):
        loop, queue = asyncio.get_running_loop(), asyncio.Queue()

        def on_update(req, tokens, text):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, (text, req.finish_reason))
            except RuntimeError:       # the event loop is gone (shutdown): nobody is listening
                pass
        return served.engine.submit(ids, params, on_update), queue

    async def generate(request, chat):
        try:
            body = await read_json(request, served.limits.max_body_bytes)
            name = body.get("model")
            if name is not None and name != served.name:
                raise ApiError(404, f"The model '{name}' does not exist (this server serves '{served.name}')",
                               param="model", code="model_not_found")
            params = sampling_params(body, served, chat)
            ids = prompt_ids(body, served, chat)
            stream = _get(body, "stream", (bool,), False, want="true or false")
            opts = _get(body, "stream_options", (dict,), {}, want="an object")
            if served.closing:
                raise ApiError(503, "the server is shutting down", type="server_error", code="shutting_down")
            if served.inflight >= served.limits.max_concurrent:
                raise ApiError(429, f"too many requests at once (this server takes {served.limits.max_concurrent}); "
                               "retry later", type="rate_limit_error", code="rate_limit_exceeded")
            try:
                req, queue = submit(ids, params)
            except ContextLengthError as e:
                raise ApiError(400, str(e), param="max_tokens", code="context_length_exceeded") from None
        except ApiError as e:
            return error(e)
        served.inflight += 1
        done = [False]

        def cleanup():
            if not done[0]:
                done[0] = True
                served.inflight -= 1
                if not req.done:
                    served.engine.cancel(req)

        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        created = int(time.time())
        kind = "chat.completion" if chat else "text_completion"

        def usage():
            return {"prompt_tokens": len(ids), "completion_tokens": len(req.tokens),
                    "total_tokens": len(ids) + len(req.tokens)}

        def reason():
            return req.finish_reason if req.finish_reason in ("stop", "length") else None

        if not stream:
            loop = asyncio.get_running_loop()
            checked = loop.time()
            try:
                while True:
                    try:
                        if (await asyncio.wait_for(queue.get(), 0.25))[1] is not None:
                            break
                    except asyncio.TimeoutError:
                        pass
                    if loop.time() - checked > 0.25:
                        checked = loop.time()
                        if await request.is_disconnected():     # nobody waits for the answer: free the slot
                            return error(ApiError(499, "the client disconnected", code="client_closed_request"))
            finally:
                cleanup()
            if req.finish_reason == "error":
                return error(ApiError(500, f"generation failed: {req.error}", type="server_error"))
            if req.finish_reason == "cancelled":
                return error(ApiError(503, "the request was cancelled (server shutting down)", type="server_error"))
            choice = ({"index": 0, "message": {"role": "assistant", "content": req.text}, "finish_reason": reason(),
                       "logprobs": None} if chat else
                      {"index": 0, "text": req.text, "finish_reason": reason(), "logprobs": None})
            return JSONResponse({"id": rid, "object": kind, "created": created, "model": served.name,
                                 "choices": [choice], "usage": usage(), "system_fingerprint": None})

        def chunk(delta, finish, **extra):
            choice = ({"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None} if chat else
                      {"index": 0, "text": delta, "finish_reason": finish, "logprobs": None})
            out = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                   "model": served.name, "choices": [choice], **extra}
            return f"data: {json.dumps(out)}\n\n"

        async def events():
            if chat:
                yield chunk({"role": "assistant", "content": ""}, None)
            while True:
                text, finish = await queue.get()
                if finish in ("error", "cancelled"):
                    msg = f"generation failed: {req.error}" if finish == "error" else "the request was cancelled"
                    yield f"data: {json.dumps(ApiError(500, msg, type='server_error').body())}\n\n"
                    break
                if text:
                    yield chunk({"content": text} if chat else text, None)
                if finish is not None:
                    yield chunk({} if chat else "", reason())
                    if opts.get("include_usage"):
                        out = {"id": rid, "object": kind + (".chunk" if chat else ""), "created": created,
                               "model": served.name, "choices": [], "usage": usage()}
                        yield f"data: {json.dumps(out)}\n\n"
                    break
            yield "data: [DONE]\n\n"

        return EventStream(events(), cleanup)

    async def completions(request):
        return await generate(request, chat=False)

    async def chat_completions(request):
        return await generate(request, chat=True)

    async def not_found(request, exc):
        return error(ApiError(404, f"no route {request.method} {request.url.path}", code="not_found"))

    async def not_allowed(request, exc):
        return error(ApiError(405, f"method {request.method} is not allowed on {request.url.path}",
                              code="method_not_allowed"))

    async def crashed(request, exc):
        return error(ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error"))

    @contextlib.asynccontextmanager
    async def lifespan(app):
        if not served.engine.thread.is_alive():
            served.engine.start()
        try:
            yield
        finally:
            served.close()

    routes = [Route("/v1/models", models), Route("/v1/models/{model:path}", model), Route("/health", health),
              Route("/v1/completions", completions, methods=["POST"]),
              Route("/v1/chat/completions", chat_completions, methods=["POST"])]
    return Starlette(routes=routes, lifespan=lifespan,
                     exception_handlers={404: not_found, 405: not_allowed, Exception: crashed})


def serve(model_dir, host="127.0.0.1", port=8000, backend="gpu", precision="strict", slots=4,
          limits: Limits | None = None, name=None, shutdown_timeout=10.0, log_level="info"):
    """Load ``model_dir`` and serve it until interrupted (Ctrl-C: running requests get
    ``shutdown_timeout`` seconds to finish, then are cancelled)."""
    require_serve()
    import uvicorn
    served = ServedModel(model_dir, backend, precision, slots, limits, name)
    app = create_app(served)
    config = uvicorn.Config(app, host=host, port=port, log_level=log_level, lifespan="on",
                            timeout_graceful_shutdown=shutdown_timeout)
    server = uvicorn.Server(config)
    print(served.status_line(f"http://{host}:{port}/v1"), file=sys.stderr, flush=True)
    try:
        server.run()
    except KeyboardInterrupt:    # uvicorn re-raises Ctrl-C once it has shut down gracefully
        pass
    print(f"meganeura serve: stopped ({served.decoder.generated} tokens generated)", file=sys.stderr, flush=True)
    return 0
