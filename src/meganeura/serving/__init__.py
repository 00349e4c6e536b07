"""Serving Llama-family models: batched decoding over a slot-based key/value cache
(``batch``), a thread that runs it for many callers (``engine``), and an OpenAI-compatible
HTTP server (``http``, needs ``pip install meganeura[serve]``)."""
