"""Chat messages to prompt text: the model folder's chat template (``chat_template`` of
tokenizer_config.json, or a chat_template.jinja file), rendered as transformers does it
(Jinja in a sandbox, ``add_generation_prompt=True``, ``bos_token``/``eos_token`` given);
without one, a plain fallback::

    system: You are terse.
    user: Hello!
    assistant:

one ``role: content`` line per message, then ``assistant:`` for the reply."""
from __future__ import annotations

import json
import os


class ChatTemplateError(ValueError):
    """The messages could not be rendered (the template raised, or a message is malformed)."""


def _token_text(v):
    return v.get("content") if isinstance(v, dict) else v


class ChatTemplate:
    def __init__(self, source: str | None = None, bos_token=None, eos_token=None):
        self.source, self.bos_token, self.eos_token = source, bos_token, eos_token
        self._compiled = None
        if source is not None:
            try:
                from jinja2.sandbox import ImmutableSandboxedEnvironment
            except ImportError as e:
                raise ImportError("the model's chat template needs jinja2: pip install 'meganeura[serve]'") from e

            def raise_exception(message):
                raise ChatTemplateError(message)

            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = raise_exception
            env.filters["tojson"] = lambda v, indent=None: json.dumps(v, indent=indent, ensure_ascii=False)
            self._compiled = env.from_string(source)

    @property
    def builtin(self) -> bool:
        """True where the text carries its own special tokens (encode it without adding them)."""
        return self._compiled is not None

    @classmethod
    def from_folder(cls, folder):
        """The folder's template, or the fallback where it has none."""
        folder = os.fspath(folder)
        cfg = {}
        path = os.path.join(folder, "tokenizer_config.json")
        if os.path.isfile(path):
            with open(path, encoding="utf-8") as f:
                cfg = json.load(f)
        source = cfg.get("chat_template")
        if isinstance(source, list):      # named templates: the default one
            source = next((t.get("template") for t in source if t.get("name") == "default"), None)
        jinja = os.path.join(folder, "chat_template.jinja")
        if source is None and os.path.isfile(jinja):
            with open(jinja, encoding="utf-8") as f:
                source = f.read()
        return cls(source, _token_text(cfg.get("bos_token")), _token_text(cfg.get("eos_token")))

    def render(self, messages) -> str:
        """Prompt text for ``messages``: a list of {"role", "content"} (content a string or
        a list of {"type": "text", "text"} parts)."""
        if not isinstance(messages, list) or not messages:
            raise ChatTemplateError("'messages' must be a non-empty list of {role, content} objects")
        clean = []
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ChatTemplateError(f"messages[{i}] must be an object with a string 'role'")
            content = m.get("content")
            if isinstance(content, list):
                parts = []
                for j, p in enumerate(content):
                    if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                        raise ChatTemplateError(f"messages[{i}].content[{j}]: only text parts are supported")
                    parts.append(p["text"])
                content = "".join(parts)
            if content is None:
                content = ""
            if not isinstance(content, str):
                raise ChatTemplateError(f"messages[{i}].content must be a string or a list of text parts")
            clean.append({"role": m["role"], "content": content})
        if self._compiled is None:
            return "".join(f"{m['role']}: {m['content']}\n" for m in clean) + "assistant:"
        try:
            return self._compiled.render(messages=clean, add_generation_prompt=True, bos_token=self.bos_token or "",
                                         eos_token=self.eos_token or "")
        except ChatTemplateError:
            raise
        except Exception as e:    # noqa: BLE001 -- a template error is the request's problem
            raise ChatTemplateError(f"the chat template failed: {type(e).__name__}: {e}") from e
