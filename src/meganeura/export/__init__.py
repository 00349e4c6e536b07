"""Deployment targets for compiled sessions. ``web``: a folder a static web server can
serve, whose JavaScript runtime runs the session's inference plan with WebGPU."""
from .web import export_web, export_llama_web, plan_json

__all__ = ["export_web", "export_llama_web", "plan_json"]
