"""Export a session's inference plan for the browser (WebGPU).

The folder written by ``export_web`` holds:

- ``plan.json``: what the compiler planned for the session's ``run`` call, serialized as
  it is (``compile_plan``'s kernels are not re-derived): the WGSL of every kernel with the
  access of each binding, the dispatch list (kernel, bound buffers, workgroup counts), the
  buffer plan (named tensors, memory slots shared by intermediates, constants, targets),
  where each output lives, and the copies that write new state values (a KV cache) back
  after each call, in the order the Python executor records them;
- ``weights.safetensors``: the parameters and the state values the plan reads;
- ``meganeura.js``: a dependency-free ES module that reads both with ``fetch``, uploads the
  weights once, creates the pipelines and runs the plan with ``navigator.gpu``;
- ``index.html``: a demo page (draw a digit; generate text; or a generic page that runs
  the model once and shows its outputs).

Kernels are compiled for the limits every WebGPU device has (8 storage buffers per
stage). A session compiled with ``precision="accelerated"`` gets two plan variants: the
f16 one, used where the adapter offers ``shader-f16``, and a strict f32 fallback.
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
from importlib import resources

import numpy as np

FORMAT = "meganeura-web"
FORMAT_VERSION = 1
# storage buffers per shader stage every WebGPU adapter offers (the spec's default limit)
WEB_MAX_BINDINGS = 8
DEMOS = ("digits", "text", "tensor")
_DTYPE_NAMES = {"f32", "f16", "i32", "u32"}


# an f32 bit pattern with every exponent bit set: an infinity or a NaN
_NONFINITE_BITS = re.compile(r"bitcast<f32>\(0x(7f8|ff8|7fc|ffc)([0-9a-fA-F]{5})u\)")
_RUNTIME_ZERO = "mg_rt_zero"


def portable_wgsl(wgsl: str) -> str:
    """The kernel's WGSL as the browser needs it. WGSL makes a constant expression that
    evaluates to an infinity or a NaN a shader-creation error; naga (the Python runtime's
    compiler) lets ``bitcast<f32>(0xff800000u)`` through, Tint (Chromium's) refuses it. Such
    literals become runtime values: the bits xor a private variable that is always zero
    (same value, no constant folding at compile time). Nothing else changes."""
    if not _NONFINITE_BITS.search(wgsl):
        return wgsl
    body = _NONFINITE_BITS.sub(lambda m: f"bitcast<f32>(0x{m.group(1)}{m.group(2)}u ^ {_RUNTIME_ZERO})", wgsl)
    lines = body.split("\n")
    # after any `enable` directives, which must come first
    at = next((i for i, ln in enumerate(lines) if not ln.startswith("enable ")), len(lines))
    lines.insert(at, f"var<private> {_RUNTIME_ZERO}: u32 = 0u;")
    return "\n".join(lines)


def _session_of(model):
    """A Session from a Session or a jit function with exactly one compiled program."""
    from ..api import Session
    from ..jit import Jit
    if isinstance(model, Session):
        return model
    if isinstance(model, Jit):
        if len(model.sessions) != 1:
            raise ValueError(f"export_web: this mg.jit function has {len(model.sessions)} compiled programs; "
                             "call it once with the input shapes to export (or export one of .sessions)")
        return next(iter(model.sessions.values()))
    raise TypeError(f"export_web: expected an mg.compile Session or an mg.jit function, got {type(model).__name__}")


def _compile_run(session, precision):
    """The session's inference ("run") plan, compiled for WebGPU's default limits."""
    from ..compiler import CompileOptions, compile_plan
    fetches, _, upd, targets = session.program.targets("run")
    if not fetches:
        raise ValueError("export_web: the session has no outputs to fetch (compile it with outputs=[...])")
    opts = CompileOptions.from_env(precision, {"max-storage-buffers-per-shader-stage": WEB_MAX_BINDINGS})
    kp = compile_plan(targets, n_forward=len(fetches), options=opts,
                      updates={len(fetches) + j: name for j, (name, _) in enumerate(upd)})
    return kp, fetches, upd


def _dtype_name(dt) -> str:
    name = getattr(dt, "name", None) or np.dtype(dt).name
    name = {"float32": "f32", "float16": "f16", "int32": "i32", "uint32": "u32"}.get(name, name)
    if name not in _DTYPE_NAMES:
        raise ValueError(f"export_web: dtype {name!r} has no WebGPU storage type")
    return name


def serialize_plan(kp, fetches, updates, shaders: list) -> dict:
    """One program of plan.json from a KernelPlan. ``shaders``: the export's list of
    {"wgsl", "access"}, extended in place (identical kernels share one entry)."""
    from ..runtime.device import parse_bindings
    index = {id(b): i for i, b in enumerate(kp.bufs)}
    buffers = []
    for b in kp.bufs:
        if b.kind in ("input", "parameter", "state"):
            buffers.append({"kind": "named", "name": b.name})
        elif b.kind == "constant":
            raw = np.ascontiguousarray(b.value).tobytes()
            buffers.append({"kind": "constant", "name": b.name, "nbytes": int(b.nbytes),
                            "data": base64.b64encode(raw).decode("ascii")})
        elif b.kind == "target":
            buffers.append({"kind": "target", "name": b.name, "nbytes": int(b.nbytes)})
        elif b in kp.memory.slot_of:
            buffers.append({"kind": "slot", "name": b.name, "slot": int(kp.memory.slot_of[b])})
        else:
            raise RuntimeError(f"export_web: buffer {b.name!r} ({b.kind}) has no place in the memory plan")
    shader_ids = {s["wgsl"]: i for i, s in enumerate(shaders)}
    dispatches = []
    for d in kp.dispatches:
        wgsl = portable_wgsl(d.wgsl)
        sid = shader_ids.get(wgsl)
        if sid is None:
            sid = shader_ids[wgsl] = len(shaders)
            shaders.append({"wgsl": wgsl, "access": parse_bindings(wgsl)})
        groups = (tuple(d.groups) + (1, 1))[:3] if not isinstance(d.groups, int) else (d.groups, 1, 1)
        dispatches.append({"name": d.kernel.name, "shader": sid, "bindings": [index[id(b)] for b in d.bufs],
                           "groups": [int(g) for g in groups]})
    locs = kp.target_locs
    outputs = [{"name": t.name, "buffer": index[id(b)], "offset": int(off), "nbytes": int(nb),
                "dtype": _dtype_name(dt), "shape": [int(s) for s in shape]}
               for t, (b, off, nb, dt, shape) in zip(fetches, locs[:len(fetches)])]
    copies = []
    # new values of state (a KV cache) not written in place are copied after the pass,
    # before the outputs are read, as the executor's copies_after
    for (name, _), (b, off, nb, _, _) in zip(updates, locs[len(fetches):]):
        if b.kind in ("parameter", "state") and b.name == name:
            continue
        copies.append({"buffer": index[id(b)], "offset": int(off), "nbytes": int(nb), "state": name})
    reads = sorted({b.name for b in kp.bufs if b.kind == "input"})
    return {"buffers": buffers, "slots": [int(s) for s in kp.memory.slot_sizes], "dispatches": dispatches,
            "outputs": outputs, "updates": copies, "reads": reads,
            "stats": {"dispatches": kp.n_dispatches, "memory": kp.memory.report()}}


def _requires(program, shaders):
    return ["shader-f16"] if any("enable f16;" in shaders[d["shader"]]["wgsl"] for d in program["dispatches"]) else []


def plan_json(programs: dict, demo: dict | None = None) -> tuple[dict, dict]:
    """(plan.json as a dict, {name: array} to write as weights) for ``programs``:
    {program name: Session}, sessions that share their parameters and state by name (as
    those made with ``share_with``); the first is the default program."""
    if not programs:
        raise ValueError("export_web: nothing to export")
    sessions = {name: _session_of(s) for name, s in programs.items()}
    first = next(iter(sessions.values()))
    precision = first.precision
    variants = [precision] + (["strict"] if precision == "accelerated" else [])
    tensors, weights, shaders, out_variants = {}, {}, [], []
    for prec in variants:
        progs = {}
        for pname, s in sessions.items():
            if s.closed:
                raise RuntimeError(f"export_web: session {pname!r} is closed")
            kp, fetches, upd = _compile_run(s, prec)
            progs[pname] = serialize_plan(kp, fetches, upd, shaders)
            for b in kp.bufs:
                if b.kind not in ("input", "parameter", "state") or b.name in tensors:
                    continue
                t = {"input": s.graph.inputs, "parameter": s.graph.parameters, "state": s.graph.states}[b.kind][b.name]
                entry = {"kind": b.kind, "dtype": _dtype_name(t.dtype), "shape": [int(n) for n in t.shape],
                         "nbytes": int(t.size * t.dtype.np.itemsize)}
                if b.kind != "input":
                    value = np.ascontiguousarray(s.executor.get_value(b.name))
                    flat = value.reshape(-1)
                    # a state that holds one value everywhere (an empty KV cache) is filled
                    # on the device instead of shipped
                    if b.kind == "state" and flat.size and (flat == flat[0]).all():
                        entry["fill"] = float(flat[0])
                    else:
                        weights[b.name] = value
                tensors[b.name] = entry
            for n, t in s.feeds.items():     # inputs the plan never reads may still be fed
                tensors.setdefault(n, {"kind": "input", "dtype": _dtype_name(t.dtype),
                                       "shape": [int(k) for k in t.shape], "nbytes": int(t.size * t.dtype.np.itemsize)})
        requires = sorted({f for p in progs.values() for f in _requires(p, shaders)})
        out_variants.append({"precision": prec, "requires": requires, "programs": progs})
    plan = {"format": FORMAT, "version": FORMAT_VERSION, "weights": "weights.safetensors",
            "max_bindings": WEB_MAX_BINDINGS, "tensors": tensors, "shaders": shaders,
            "variants": out_variants, "demo": demo or {"kind": "tensor"}}
    return plan, weights


def _static(name) -> str:
    return resources.files(__package__).joinpath("static", name).read_text(encoding="utf-8")


def write_folder(out_dir, plan: dict, weights: dict, extra: dict | None = None) -> str:
    """Write plan.json, weights.safetensors, meganeura.js and index.html into ``out_dir``."""
    from safetensors.numpy import save_file
    out_dir = os.fspath(out_dir)
    if os.path.exists(out_dir) and not os.path.isdir(out_dir):
        raise ValueError(f"export_web: {out_dir!r} exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(out_dir))
    if not os.path.isdir(parent):
        raise ValueError(f"export_web: folder {parent!r} does not exist")
    os.makedirs(out_dir, exist_ok=True)
    kind = plan["demo"].get("kind", "tensor")
    if kind not in DEMOS:
        raise ValueError(f"export_web: unknown demo {kind!r}; choose one of {DEMOS}")
    with open(os.path.join(out_dir, "plan.json"), "w", encoding="utf-8") as f:
        json.dump(plan, f, separators=(",", ":"))
    wpath = os.path.join(out_dir, plan["weights"])
    # no "format" key: the file also loads as a checkpoint (Session.load)
    save_file({n: np.ascontiguousarray(v) for n, v in weights.items()}, wpath, metadata={"exported_by": FORMAT})
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(wpath, 0o666 & ~umask)      # a web server must be able to read it, as the other files
    with open(os.path.join(out_dir, "meganeura.js"), "w", encoding="utf-8") as f:
        f.write(_static("meganeura.js"))
    with open(os.path.join(out_dir, "index.html"), "w", encoding="utf-8") as f:
        f.write(_static(f"demo_{kind}.html"))
    for name, src in (extra or {}).items():
        shutil.copyfile(src, os.path.join(out_dir, name))
    return out_dir


def export_web(model, out_dir, demo: dict | None = None, programs: dict | None = None) -> str:
    """Write ``model``'s inference plan, weights, the JavaScript runtime and a demo page
    into ``out_dir`` (see the module docstring). ``model``: a Session (``mg.compile`` with
    ``outputs=``) or an ``mg.jit`` function with one compiled program. ``demo``: the
    demo page and its settings ({"kind": "digits"}, {"kind": "text", ...}; default a page
    that runs the model once on zeros and shows the outputs). ``programs``: more sessions
    sharing the weights, by program name (the model itself is program "run").
    Returns the folder."""
    plan, weights = plan_json({"run": model, **(programs or {})}, demo)
    return write_folder(out_dir, plan, weights)


def export_llama_web(config, state: dict, out_dir, max_len: int = 64, precision: str = "strict",
                     tokenizer_json=None, backend: str = "numpy", prompt: str | None = None) -> str:
    """Export a Llama-family model (SmolLM2) as a text-generation page: one program feeds
    one token at a time against a key/value cache of ``max_len`` positions kept on the
    device (the prompt is fed token by token, then greedy decoding). ``state``: the
    transformers state dict; ``tokenizer_json``: a tokenizer.json to copy (byte-level BPE)
    for the page to encode and decode text, else the page works on token ids."""
    from ..models.generate import LlamaGenerator
    if max_len < 2:
        raise ValueError(f"export_llama_web: max_len must be >= 2, got {max_len}")
    gen = LlamaGenerator(config, state, backend=backend, precision=precision)
    s = gen.session(1, 1, max_len)
    eos = config.eos_token_id
    demo = {"kind": "text", "max_len": int(max_len), "head_dim": int(config.head_dim),
            "rope_theta": float(config.rope_theta), "vocab_size": int(config.vocab_size),
            "eos_token_id": [int(e) for e in np.atleast_1d(eos)] if eos is not None else [],
            "tokenizer": "tokenizer.json" if tokenizer_json else None, "prompt": prompt or ""}
    plan, weights = plan_json({"decode": s}, demo)
    try:
        return write_folder(out_dir, plan, weights, {"tokenizer.json": tokenizer_json} if tokenizer_json else None)
    finally:
        s.close()
