"""Benchmarks against PyTorch: the paper's five workloads (``workloads``), their accuracy
gates (``gates``), the timing harness (``harness``) and its reports (``report``). Run as
``python -m meganeura.bench``. torch, transformers and diffusers are imported only when a
workload is built, never by importing this package."""
