"""The ``meganeura`` command. User mistakes (a missing folder or file, a missing optional
package, a bad value) end with one ``meganeura <command>: error: ...`` line on stderr and
a non-zero exit, never a traceback (``MEGANEURA_DEBUG=1`` shows it for bug reports)."""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

# optional package -> the install line that provides it
INSTALL = {"sklearn": "pip install 'meganeura[examples]'  (scikit-learn)",
           "tokenizers": "pip install 'meganeura[examples]'  (tokenizers)",
           "torch": "pip install 'meganeura[bench]'  (torch)",
           "transformers": "pip install 'meganeura[bench]'  (transformers)",
           "diffusers": "pip install 'meganeura[bench]'  (diffusers)",
           "matplotlib": "pip install 'meganeura[bench]'  (matplotlib)",
           "gguf": "pip install 'meganeura[gguf]'  (gguf)",
           "onnx": "pip install 'meganeura[onnx]'  (onnx)",
           "starlette": "pip install 'meganeura[serve]'  (starlette)",
           "uvicorn": "pip install 'meganeura[serve]'  (uvicorn)",
           "jinja2": "pip install 'meganeura[serve]'  (jinja2)"}


class CliError(Exception):
    """A user mistake, reported as one line."""


class HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows each option's default after its help, except for switches (False) and options
    with no default (None), where "(default: None)" would say nothing. A description written
    on several lines (a module docstring) is kept as written; one line is wrapped."""

    def _fill_text(self, text, width, indent):
        if "\n" in text.strip():
            return "".join(indent + line for line in text.splitlines(keepends=True))
        return super()._fill_text(text, width, indent)

    def _get_help_string(self, action):
        if any(action.default is v for v in (None, False, argparse.SUPPRESS)) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


BACKEND_HELP = ("gpu: the direct Vulkan backend where the 'vulkan' extra and a Vulkan driver are present "
                "(lavapipe runs it on the CPU when there is no GPU), else wgpu; MEGANEURA_BACKEND=vulkan|wgpu "
                "overrides. vulkan: the direct Vulkan backend only (GLSL compiled to SPIR-V). wgpu: WGSL through "
                "wgpu (Vulkan, Metal or DX12), the runtime browsers use. numpy: the reference interpreter on the "
                "CPU (slow; the oracle of the tests)")


def need(what, *modules):
    """Fail with the install line when an optional package is missing."""
    for m in modules:
        try:
            found = importlib.util.find_spec(m) is not None
        except (ImportError, ValueError):   # e.g. a module set to None in sys.modules
            found = False
        if not found:
            raise CliError(f"{what} needs the optional package {m!r}: {INSTALL.get(m, 'pip install ' + m)}")


def _folder_file(path, what):
    """``path`` can be written as a file: its folder exists and it is not a folder itself."""
    if os.path.isdir(path):
        raise CliError(f"{what} {path!r} is a folder; give a file name")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CliError(f"{what} {path!r}: folder {parent!r} does not exist")


def cmd_info(args):
    """The backend that ``backend='gpu'`` runs on and its device first, then each runtime's
    details (``--vulkan``: the direct Vulkan backend's whole report). With a folder that
    ``meganeura import`` wrote: what that saved model holds (importers/saved.py)."""
    if args.model:
        return _saved_model("cli_info", args.model)
    if args.vulkan:
        from .runtime.vulkan import describe as describe_vulkan
        print(describe_vulkan())
        return
    from .runtime.backends import get_runtime_device, resolve, vulkan_unavailable_reason
    kind = resolve("gpu")
    dev = get_runtime_device(kind)
    where = "a software driver on the CPU: timings are not GPU performance" if dev.is_software else "a hardware GPU"
    runtime = "the direct Vulkan backend" if kind == "vulkan" else "wgpu"
    print(f"backend='gpu' runs on: {runtime}, device {dev.name} ({where}); "
          "MEGANEURA_BACKEND=vulkan|wgpu overrides")
    from .api import default_backend
    print(f"mg.jit / mg.compile without backend= run on: {default_backend()!r} (a software device counts as no GPU)")
    why = vulkan_unavailable_reason()
    if why is None:
        from .runtime.vulkan.backend import coopmat_mode, get_vulkan_runtime
        rt, mode = get_vulkan_runtime(), coopmat_mode()
        tc = "off (MEGANEURA_COOPMAT=off)" if mode == "off" else "emulated (MEGANEURA_COOPMAT=emulate)" \
            if mode == "emulate" else f"not available: {rt.coopmat_reason}" if rt.coopmat_reason else \
            "f16 cooperative matrices for accelerated-precision matmuls"
        print(f"direct Vulkan backend: available on {rt.name} (meganeura info --vulkan for its details)")
        print(f"  tensor cores: {tc}")
    else:
        print(f"direct Vulkan backend: not available: {why}")
    from .runtime.device import get_device
    print("wgpu (backend='wgpu'):")
    print("\n".join("  " + line for line in _wgpu_report(get_device()).splitlines()))


def cmd_import(args):
    """Import an ONNX model and save it as a folder (importers/saved.py)."""
    need("import", "onnx")
    _saved_model("cli_import", args)


def _saved_model(fn, arg):
    from .importers import saved
    try:
        return getattr(saved, fn)(arg)
    except saved.SavedModelError as e:
        raise CliError(str(e)) from None


def _wgpu_report(dev):
    """``runtime.describe`` of the wgpu device, where the adapter's ``pipeline-cache``
    feature is named beside the disk cache it would give rather than among the features
    used, when wgpu-native offers no way to use it."""
    from .runtime import describe
    text = describe(dev)
    if "pipeline-cache" in dev.features and not dev.disk_pipeline_cache:
        listed = "  features: " + ", ".join(sorted(dev.features))
        text = text.replace(listed, "  features: " + ", ".join(sorted(dev.features - {"pipeline-cache"})))
        text = text.replace("  disk pipeline cache: off (",
                            "  disk pipeline cache: off, though the adapter offers the pipeline-cache feature (")
    return text


def cmd_train_demo(args):
    """Train the digits MLP on the default device, save a checkpoint, reload it into a
    separately compiled inference program and report test accuracy."""
    need("train-demo", "sklearn")
    _folder_file(args.out, "--out")
    for name in ("epochs", "batch", "hidden"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name} must be >= 1, got {getattr(args, name)}")
    if not args.lr > 0:
        raise CliError(f"--lr must be > 0, got {args.lr}")
    import numpy as np
    from tqdm import tqdm

    from . import compile, optim
    from .models.mlp import build_mlp, load_digits_split

    (xtr, ytr), (xte, yte) = load_digits_split()
    batch = args.batch
    if batch > len(xtr):
        raise CliError(f"--batch {batch} is larger than the training set ({len(xtr)} digits): "
                       f"give at most {len(xtr)}")
    if args.backend != "numpy":
        from .runtime.backends import get_runtime_device, resolve
        kind = resolve(args.backend)
        dev = get_runtime_device(kind)
        note = " (a software Vulkan driver on the CPU: no GPU found)" if dev.is_software else ""
        print(f"device: {dev.name}{note}, {'the direct Vulkan backend' if kind == 'vulkan' else 'wgpu'}")
    g, _, _, logits, loss = build_mlp(batch=batch, n_in=64, hidden=args.hidden, n_out=10)
    t0 = time.perf_counter()
    tr = compile(g, outputs=[logits], loss=loss, optimizer=optim.AdamW(lr=args.lr, weight_decay=1e-4),
                 backend=args.backend, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    steps_per_epoch = len(xtr) // batch
    bar = tqdm(total=args.epochs * steps_per_epoch, desc="training", unit="step", disable=args.quiet)
    for epoch in range(args.epochs):
        order = rng.permutation(len(xtr))
        for k in range(steps_per_epoch):
            idx = order[k * batch:(k + 1) * batch]
            lv = tr.step({"x": xtr[idx], "labels": ytr[idx]})
            bar.set_postfix(epoch=epoch + 1, loss=f"{lv:.4f}", refresh=False)
            bar.update()
    bar.close()
    train_s = time.perf_counter() - t0
    path = tr.save(args.out)
    print(f"trained {tr.steps_done} steps in {train_s:.1f} s; checkpoint saved to {path}")
    gi, _, _, logits_i, _ = build_mlp(batch=len(xte), n_in=64, hidden=args.hidden, n_out=10)
    inf = compile(gi, outputs=[logits_i], backend=args.backend)
    inf.load(path)
    acc = float((inf.run({"x": xte})[0].argmax(1) == yte).mean())
    print(f"reloaded {path} into an inference program: test accuracy {acc * 100:.1f}% on {len(xte)} digits")
    if args.backend != "numpy":
        print(tr.memory_report())
    return 0 if acc >= 0.9 else 1


def cmd_generate(args):
    """Stream a continuation of ``--prompt`` from a Hugging Face Llama-family folder or a GGUF file."""
    check_model(args.model, "generate")
    need("generate", "tokenizers")
    if args.max_new_tokens < 1:
        raise CliError(f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise CliError(f"--temperature must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise CliError(f"--top-k must be >= 1, got {args.top_k}")
    if args.top_p is not None and not 0 < args.top_p <= 1:
        raise CliError(f"--top-p must be in (0, 1], got {args.top_p}")
    from .models.generate import LlamaGenerator, generate_text
    t0 = time.perf_counter()
    model = LlamaGenerator.from_pretrained(args.model, backend=args.backend, precision=args.precision)
    print(f"loaded {args.model} in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    print(args.prompt, end="", flush=True)
    t1 = time.perf_counter()
    text = generate_text(args.model, args.prompt, args.max_new_tokens, args.temperature, args.top_k, args.top_p,
                         args.seed, args.backend, stream=lambda piece: print(piece, end="", flush=True),
                         model=model)
    print()
    print(f"{len(text)} characters in {time.perf_counter() - t1:.1f} s (compiles included)", file=sys.stderr)


def cmd_serve(args):
    """Serve a model folder over an OpenAI-compatible HTTP API (meganeura.serving.http)."""
    check_model(args.model_dir, "serve", "MODEL_DIR")
    need("serve", "starlette", "uvicorn", "tokenizers")
    for opt in ("port", "slots", "max_concurrent", "max_tokens", "max_prompt_tokens", "max_body_bytes"):
        least, v = (0 if opt == "port" else 1), getattr(args, opt)
        if v < least:
            raise CliError(f"--{opt.replace('_', '-')} must be >= {least}, got {v}")
    from .serving.http import Limits, serve
    limits = Limits(args.max_concurrent, args.max_tokens, args.max_prompt_tokens, args.max_body_bytes)
    return serve(args.model_dir, args.host, args.port, args.backend, args.precision, args.slots, limits, args.name)


WEB_MODELS = ("digits-mlp", "llama-tiny")


def cmd_quantize(args):
    """A Hugging Face Llama-family folder as a quantized GGUF file (see meganeura.gguf_write)."""
    need("quantize", "gguf")
    if not os.path.isdir(args.src):
        raise CliError(f"SRC {args.src!r} is not a folder (a Hugging Face model folder with config.json)")
    if not args.out.endswith(".gguf"):
        raise CliError(f"--out {args.out!r} must name a .gguf file")
    _folder_file(args.out, "--out")
    from .gguf_write import quantize_folder
    qtype = "Q4_K" if args.q4_k else "Q8_0"
    t0 = time.perf_counter()
    counts = quantize_folder(args.src, args.out, qtype, progress=not args.quiet)
    kinds = ", ".join(f"{n} {t}" for t, n in sorted(counts.items()))
    print(f"wrote {args.out} ({os.path.getsize(args.out) / 2**20:.1f} MiB; tensors: {kinds}) "
          f"in {time.perf_counter() - t0:.1f} s")


def digits_examples(x, y, n=10):
    """The first test image of each class (up to ``n``), for the demo page's Example button."""
    out = []
    for k in range(10):
        idx = [i for i in range(len(y)) if y[i] == k][:1]
        out += [{"pixels": [round(float(v), 4) for v in x[i]], "label": int(y[i])} for i in idx]
    return out[:n]


def cmd_export(args):
    """Write a folder that runs a model in the browser with WebGPU (see meganeura.export.web)."""
    if not args.web:
        raise CliError("give --web DIR (the only export target so far)")
    out = args.web
    if os.path.exists(out) and not os.path.isdir(out):
        raise CliError(f"--web {out!r} exists and is not a folder")
    parent = os.path.dirname(os.path.abspath(out))
    if not os.path.isdir(parent):
        raise CliError(f"--web {out!r}: folder {parent!r} does not exist")
    if args.max_len < 2:
        raise CliError(f"--max-len must be >= 2, got {args.max_len}")
    for name in ("epochs", "hidden"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name} must be >= 1, got {getattr(args, name)}")
    model = args.model
    if model == "digits-mlp":
        return export_digits(args)
    if model.endswith(".onnx"):
        return export_onnx_web(model, out, args.precision)
    from .export import export_llama_web
    from .models import llama
    if model == "llama-tiny":
        cfg = llama.LlamaConfig.tiny()
        g = llama.build_causal_lm(cfg, 1, 1)[0]
        from .api import default_init
        state = {n: default_init(t, args.seed) for n, t in g.parameters.items()}
        tok = None
    else:
        if model not in WEB_MODELS and not os.path.isdir(model):
            raise CliError(f"--model {model!r}: not one of {', '.join(WEB_MODELS)} and not a folder")
        check_model_folder(model)
        from .io import load_hf
        cfg, state = load_hf(model)
        tok = os.path.join(model, "tokenizer.json")
    t0 = time.perf_counter()
    export_llama_web(cfg, state, out, max_len=args.max_len, precision=args.precision, tokenizer_json=tok,
                     prompt=args.prompt)
    print(f"exported {model} (cache of {args.max_len} positions) to {out} in {time.perf_counter() - t0:.1f} s")
    print(f"open it: python3 -m http.server --directory {out} 8000, then http://localhost:8000")


def export_onnx_web(path, out, precision):
    """An ONNX model, imported (mg.from_onnx) and exported with the default page (runs it once)."""
    from .export import export_web
    from .importers import ModelImportError, from_onnx
    need("export --model FILE.onnx", "onnx")
    if not os.path.isfile(path):
        raise CliError(f"--model {path!r} does not exist")
    try:
        imported = from_onnx(path)
    except ModelImportError as e:
        raise CliError(f"--model {path!r}: {e}") from e
    session = imported.compile(backend="numpy", precision=precision)
    export_web(session, out)
    print(f"exported {path} ({len(imported.graph.parameters)} parameters, inputs "
          f"{', '.join(f'{n} {tuple(t.shape)}' for n, t in imported.inputs.items())}) to {out}")
    print(f"open it: python3 -m http.server --directory {out} 8000, then http://localhost:8000")


def export_digits(args):
    """The digits MLP: from --checkpoint (train-demo's), else trained here on the numpy backend."""
    import numpy as np

    from . import compile, optim
    from .models.mlp import build_mlp, load_digits_split
    need("export --model digits-mlp", "sklearn")
    (xtr, ytr), (xte, yte) = load_digits_split()
    if args.checkpoint:
        if not os.path.isfile(args.checkpoint):
            raise CliError(f"--checkpoint {args.checkpoint!r} does not exist")
        from .checkpoint import CheckpointError, read
        try:
            tensors, _ = read(args.checkpoint)
        except CheckpointError as e:
            if e.__cause__ is None:      # a safetensors file, but not one of ours
                raise CliError(f"--checkpoint: {e}") from e
            raise CliError(f"--checkpoint {args.checkpoint!r} is not a safetensors checkpoint "
                           f"(meganeura train-demo writes one): {e.__cause__}") from e
        if "0.weight" not in tensors:
            raise CliError(f"--checkpoint {args.checkpoint!r} has no '0.weight': not a digits MLP checkpoint "
                           "(meganeura train-demo writes one)")
        hidden = tensors["0.weight"].shape[0]
    else:
        hidden, batch = args.hidden, 64
        g, _, _, logits, loss = build_mlp(batch=batch, n_in=64, hidden=hidden, n_out=10)
        tr = compile(g, outputs=[logits], loss=loss, optimizer=optim.AdamW(lr=3e-3, weight_decay=1e-4),
                     backend="numpy", seed=args.seed)
        rng = np.random.default_rng(args.seed)
        for _ in range(args.epochs):
            order = rng.permutation(len(xtr))
            for k in range(len(xtr) // batch):
                idx = order[k * batch:(k + 1) * batch]
                tr.step({"x": xtr[idx], "labels": ytr[idx]})
        state = tr.state_dict()
        print(f"trained the digits MLP for {args.epochs} epochs (numpy backend)")
    gi, _, _, logits_i, _ = build_mlp(batch=1, n_in=64, hidden=hidden, n_out=10)
    inf = compile(gi, outputs=[logits_i], backend="numpy", precision=args.precision)
    if args.checkpoint:
        inf.load(args.checkpoint, strict=False)
    else:
        inf.load_state_dict(state)
    w = inf.state_dict()
    h = np.maximum(xte @ w["0.weight"].T + w["0.bias"], 0)
    acc = float(((h @ w["2.weight"].T + w["2.bias"]).argmax(1) == yte).mean())
    inf.export_web(args.web, demo={"kind": "digits", "input": "x", "accuracy": acc,
                                   "examples": digits_examples(xte, yte)})
    print(f"exported the digits MLP (test accuracy {acc * 100:.1f}%) to {args.web}")
    print(f"open it: python3 -m http.server --directory {args.web} 8000, then http://localhost:8000")


def check_model(path, command, what="--model"):
    """A GGUF file (with the gguf package there to read it) or a model folder (``check_model_folder``)."""
    if path.endswith(".gguf") and not os.path.isdir(path):
        if not os.path.isfile(path):
            raise CliError(f"{what} {path!r} does not exist")
        need(command, "gguf")
    else:
        check_model_folder(path, what)


def check_model_folder(path, what="--model"):
    """A Hugging Face model folder as ``generate`` needs it, or one line saying what is missing."""
    if not os.path.exists(path):
        raise CliError(f"{what} {path!r} does not exist")
    if not os.path.isdir(path):
        raise CliError(f"{what} {path!r} is a file; give the model's folder (config.json, model.safetensors, "
                       "tokenizer.json)")
    for need_file in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, need_file)):
            raise CliError(f"{what} {path!r} has no {need_file}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
        raise CliError(f"{what} {path!r} has no model.safetensors (or model.safetensors.index.json)")


def check_bench_json(path):
    """A file ``bench report`` can merge (what ``bench run`` writes), or one line saying why not."""
    import json
    if not os.path.isfile(path):
        raise CliError(f"bench report: file {path!r} does not exist")
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise CliError(f"bench report: {path!r} is not a JSON file: {e}") from e
    missing = [k for k in ("options", "cells") if not isinstance(result, dict) or k not in result]
    if missing:
        raise CliError(f"bench report: {path!r} has no {' or '.join(map(repr, missing))}: not a result "
                       "of meganeura bench run")
    lacking = [k for k in ("workloads", "phases", "modes") if k not in result["options"]]
    if lacking:
        raise CliError(f"bench report: {path!r}: its options lack {', '.join(map(repr, lacking))}")


def cmd_bench(argv):
    from .bench.__main__ import COMMANDS, main as bench_main
    helping = any(a in ("-h", "--help") for a in argv)
    if not helping:
        if argv[:1] == ["report"]:
            for f in argv[1:]:
                if not f.startswith("-") and f.endswith(".json"):
                    check_bench_json(f)
        else:
            need("bench" if not argv or argv[0] not in COMMANDS else f"bench {argv[0]}", "torch", "transformers")
    return bench_main(argv, prog="meganeura bench")


def _report(cmd, e):
    print(f"meganeura{' ' + cmd if cmd else ''}: error: {e}", file=sys.stderr)


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    cmd = argv[0] if argv and not argv[0].startswith("-") else ""
    try:
        return _main(argv)
    except CliError as e:
        _report(cmd, e)
        return 2
    except KeyboardInterrupt:
        _report(cmd, "interrupted")
        return 130
    except ModuleNotFoundError as e:
        if os.environ.get("MEGANEURA_DEBUG"):
            raise
        hint = INSTALL.get((e.name or "").split(".")[0])
        _report(cmd, f"missing package {e.name!r}" + (f": {hint}" if hint else f" ({e})"))
        return 2
    except Exception as e:   # noqa: BLE001 -- one line, not a traceback; MEGANEURA_DEBUG=1 shows it
        if os.environ.get("MEGANEURA_DEBUG"):
            raise
        _report(cmd, f"{type(e).__name__}: {e} (MEGANEURA_DEBUG=1 shows the traceback)")
        return 1


def _main(argv):
    if argv[:1] == ["bench"]:          # the benchmark harness has its own options
        return cmd_bench(argv[1:])
    p = argparse.ArgumentParser(prog="meganeura", formatter_class=HelpFormatter,
                                description="Portable GPU training and inference (Vulkan directly, or wgpu "
                                            "for Metal, DX12 and browsers).")
    sub = p.add_subparsers(dest="cmd", required=True)

    def command(name, fn, help):
        c = sub.add_parser(name, help=help, description=help, formatter_class=HelpFormatter)
        c.set_defaults(fn=fn)
        return c

    info = command("info", cmd_info, "the backend that runs backend='gpu' and its device, then each runtime's "
                   "adapters, features and limits")
    info.add_argument("--vulkan", action="store_true",
                      help="report the direct Vulkan backend instead: device, features, cooperative matrices, caches")
    info.add_argument("model", nargs="?", help="a folder written by meganeura import: describe that model instead")
    from .importers.saved import add_import_arguments
    add_import_arguments(command("import", cmd_import, "import an ONNX model and save it as a folder (weights, "
                                 "the inference executable, a manifest that meganeura info DIR describes)"))
    sub.add_parser("bench", help="benchmark the five workloads against PyTorch (see: meganeura bench --help)")
    d = command("train-demo", cmd_train_demo, "train a small MLP on scikit-learn's 8x8 digits, save a "
                "checkpoint, reload it into an inference program, report test accuracy")
    d.add_argument("--backend", default="gpu", choices=["gpu", "vulkan", "wgpu", "numpy"], help=BACKEND_HELP)
    d.add_argument("--epochs", type=int, default=20, help="passes over the training set")
    d.add_argument("--batch", type=int, default=64, help="batch size (at most the size of the training set)")
    d.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP")
    d.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    d.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the shuffling")
    d.add_argument("--out", default="digits_mlp.safetensors", help="checkpoint path")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    gen = command("generate", cmd_generate, "generate text with a Hugging Face Llama-family model folder or a GGUF file")
    gen.add_argument("--model", required=True, help="folder with config.json, model.safetensors, tokenizer.json; "
                     "or a .gguf file with its tokenizer")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most")
    gen.add_argument("--temperature", type=float, default=0.0, help="sampling temperature; 0 means greedy")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=float, default=None, help="sample within the top-p probability mass")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--backend", default="gpu", choices=["gpu", "vulkan", "wgpu", "numpy"], help=BACKEND_HELP)
    gen.add_argument("--precision", default="strict", choices=["strict", "accelerated"],
                     help="strict: f32 everywhere; accelerated: f16 operands for forward matmuls")
    qz = command("quantize", cmd_quantize, "quantize a Hugging Face Llama, Qwen2 or Gemma folder into a GGUF file "
                 "(with its tokenizer and chat template) that llama.cpp and mg.io.load_gguf read")
    qz.add_argument("src", metavar="SRC", help="Hugging Face model folder (config.json, model.safetensors)")
    kind = qz.add_mutually_exclusive_group(required=True)
    kind.add_argument("--q8_0", action="store_true", help="8-bit blocks of 32 (Q8_0)")
    kind.add_argument("--q4_k", action="store_true", help="4-bit k-quant blocks of 256 (Q4_K); matrices whose "
                      "rows do not divide into 256 fall back to Q5_0 (as llama.cpp's)")
    qz.add_argument("--out", required=True, metavar="FILE.gguf", help="GGUF file to write (atomically)")
    qz.add_argument("--quiet", action="store_true", help="no progress bars")
    sv = command("serve", cmd_serve, "serve a Hugging Face Llama-family model folder over an OpenAI-compatible "
                 "HTTP API (/v1/completions, /v1/chat/completions, /v1/models) with batched decoding")
    sv.add_argument("model_dir", metavar="MODEL_DIR", help="folder with config.json, model.safetensors, tokenizer.json; "
                    "or a .gguf file (its quantized matrices stay quantized on the device)")
    sv.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    sv.add_argument("--port", type=int, default=8000, help="TCP port")
    sv.add_argument("--name", default=None, help="the model's name in the API (default: the folder's name)")
    sv.add_argument("--slots", type=int, default=4, help="requests decoded together (rows of the key/value cache)")
    sv.add_argument("--max-concurrent", type=int, default=64,
                    help="requests accepted at once, running or queued; more get 429")
    sv.add_argument("--max-tokens", type=int, default=256, help="new tokens a request may ask for at most")
    sv.add_argument("--max-prompt-tokens", type=int, default=512,
                    help="prompt tokens a request may have at most (a slot holds this plus --max-tokens)")
    sv.add_argument("--max-body-bytes", type=int, default=1 << 20, help="request body size limit; larger get 413")
    sv.add_argument("--backend", default="gpu", choices=["gpu", "vulkan", "wgpu", "numpy"], help=BACKEND_HELP)
    sv.add_argument("--precision", default="strict", choices=["strict", "accelerated"],
                    help="strict: f32 everywhere; accelerated: f16 operands for forward matmuls")
    ex = command("export", cmd_export, "export a model to run in the browser with WebGPU (--web DIR)")
    ex.add_argument("--web", metavar="DIR", help="folder to write: plan.json, weights.safetensors, meganeura.js, "
                    "index.html (serve it over http and open it)")
    ex.add_argument("--model", default="digits-mlp",
                    help="digits-mlp (from --checkpoint, else trained here), llama-tiny (random weights), "
                         "a Hugging Face Llama-family folder (SmolLM2) for text generation, "
                         "or an ONNX file (imported with mg.from_onnx; the page runs it once)")
    ex.add_argument("--checkpoint", help="digits-mlp: a checkpoint written by train-demo")
    ex.add_argument("--epochs", type=int, default=20, help="digits-mlp without --checkpoint: training epochs")
    ex.add_argument("--hidden", type=int, default=128, help="digits-mlp without --checkpoint: hidden width")
    ex.add_argument("--max-len", type=int, default=128, help="text models: key/value cache positions")
    ex.add_argument("--prompt", default=None, help="text models: the page's initial prompt")
    ex.add_argument("--precision", default="strict", choices=["strict", "accelerated"],
                    help="accelerated adds an f16 plan, used where the browser's adapter has shader-f16")
    ex.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the training")
    args = p.parse_args(argv)
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
