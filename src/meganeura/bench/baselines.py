"""The PyTorch variants a cell is timed against, strongest included.

A latency-minded PyTorch user does not launch every kernel from Python: they capture the
step in a CUDA graph and, given tensor cores, train in bf16 autocast. Beside eager and
``torch.compile`` (default mode), the harness therefore times on CUDA:

  torch_graph           the eager step captured whole in one ``torch.cuda.CUDAGraph``
                        (train step: fused, capturable AdamW captured with it)
  torch_compile_graphs  ``torch.compile(mode="reduce-overhead")`` (CUDA graph trees),
                        fused AdamW for the train step
  torch_bf16_graph      accelerated mode only: bf16 autocast, captured as torch_graph

Each variant is checked before it counts: its output (inference phases) or loss (training
phases, at the same weights as an eager forward just before) must agree with eager's within
the gate tolerance our own side must meet (``gates.FORWARD_TOL`` / ``LOSS_TOL``). A variant
that fails the check, or cannot be captured, is kept in the JSON with the reason and left
out of ``ratio_best``.
"""
from __future__ import annotations

import contextlib

import numpy as np

from . import gates as G

EAGER, COMPILE = "torch_eager", "torch_compile"
GRAPH, COMPILE_GRAPHS, BF16_GRAPH = "torch_graph", "torch_compile_graphs", "torch_bf16_graph"
# every baseline a cell can carry, in the order the tables list them
VARIANTS = (EAGER, COMPILE, GRAPH, COMPILE_GRAPHS, BF16_GRAPH)
SHORT = {EAGER: "eager", COMPILE: "compile", GRAPH: "graph", COMPILE_GRAPHS: "reduce-overhead",
         BF16_GRAPH: "bf16 graph"}
WARMUP_BEFORE_CAPTURE = 3      # side-stream iterations before capture, as PyTorch's CUDA-graph notes ask


def graph_variants(mode: str) -> tuple:
    """The CUDA-graph variants timed in ``mode``."""
    return (GRAPH, COMPILE_GRAPHS) + ((BF16_GRAPH,) if mode == "accelerated" else ())


def _autocast(torch, bf16: bool):
    return torch.autocast("cuda", dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()


def _capture(torch, body, prepare=None):
    """Warm ``body`` up on a side stream, capture one call in a CUDA graph and return a
    closure that replays it and returns the captured call's result tensor."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(WARMUP_BEFORE_CAPTURE):
            if prepare:
                prepare()
            body()
    torch.cuda.current_stream().wait_stream(s)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    if prepare:
        prepare()
    with torch.cuda.graph(graph):
        out = body()

    def replay():
        graph.replay()
        return out
    replay.graph = graph          # kept alive with the closure; dropped with it
    if prepare:
        replay.prepare = prepare
    return replay


def captured(w, phase: str, model, bf16: bool = False, lr: float = 1e-4):
    """``phase`` of workload ``w`` on ``model`` captured whole in a CUDA graph (see the
    module docstring). Training phases zero the gradients to None before the capture, so
    the backward writes fresh gradient buffers of the graph's pool on every replay."""
    import torch
    if phase in ("inference", "minimal"):
        fwd = w.torch_fn(phase, model)
        prepare = getattr(fwd, "prepare", None)

        def body():
            with _autocast(torch, bf16):
                return fwd()
        return _capture(torch, body, prepare)
    tin = w.torch_inputs("train")
    params = list(w.trainable(model).values())
    opt = (torch.optim.AdamW(params, lr=lr, fused=True, capturable=True)
           if phase == "train_step" else None)

    def body():
        with _autocast(torch, bf16):
            loss = w.torch_loss(model, tin)
        loss.backward()
        if opt is not None:
            opt.step()
        return loss

    def zero():
        for p in model.parameters():
            p.grad = None
    return _capture(torch, body, zero)


def reduce_overhead(w, phase: str, model, lr: float = 1e-4):
    """``phase`` on ``torch.compile(model, mode="reduce-overhead")``; every call starts a
    new CUDA-graph step, so the previous call's outputs may be overwritten (as in a loop)."""
    import torch
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = (torch.optim.AdamW(list(w.trainable(model).values()), lr=lr, fused=True)
           if phase == "train_step" else None)
    inner = w.torch_fn(phase, compiled, opt)

    def call():
        torch.compiler.cudagraph_mark_step_begin()
        return inner()
    if getattr(inner, "prepare", None):
        call.prepare = inner.prepare
    return call


def _np32(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


def reference_value(w, phase: str, model):
    """What a variant's next call must reproduce: the eager output (inference phases) or
    the eager loss at the model's current weights (training phases; no update)."""
    import torch
    if phase in ("inference", "minimal"):
        fwd = w.torch_fn(phase, model)
        if getattr(fwd, "prepare", None):
            fwd.prepare()
        return _np32(fwd())
    with torch.no_grad():
        return float(w.torch_loss(model, w.torch_inputs("train")))


def check(w, phase: str, model, fn) -> dict:
    """One more call of ``fn`` against eager's value at the same state (``reference_value``);
    the tolerance is the gate ours must pass."""
    ref = reference_value(w, phase, model)
    if getattr(fn, "prepare", None):
        fn.prepare()
    got = fn()
    if phase in ("inference", "minimal"):
        return G.forward_check(_np32(got), ref)
    return G.loss_check(float(got.detach()), ref)


def best(cell: dict):
    """(name, median ms) of the fastest valid baseline of ``cell``, or (None, None)."""
    timed = [(cell[v]["median_ms"], v) for v in VARIANTS
             if isinstance(cell.get(v), dict) and cell[v].get("median_ms")
             and cell[v].get("valid", True)]
    if not timed:
        return None, None
    ms, name = min(timed)
    return name, ms
