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
           "matplotlib": "pip install 'meganeura[bench]'  (matplotlib)"}


class CliError(Exception):
    """A user mistake, reported as one line."""


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
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise CliError(f"{what} {path!r}: folder {parent!r} does not exist")


def cmd_info(args):
    if args.vulkan:
        from .runtime.vulkan import describe as describe_vulkan
        print(describe_vulkan())
        return
    from .runtime import describe
    print(describe())


def cmd_train_demo(args):
    """Train the digits MLP on the default device, save a checkpoint, reload it into a
    separately compiled inference program and report test accuracy."""
    need("train-demo", "sklearn")
    _folder_file(args.out, "--out")
    for name in ("epochs", "batch", "hidden"):
        if getattr(args, name) < 1:
            raise CliError(f"--{name} must be >= 1, got {getattr(args, name)}")
    import numpy as np
    from tqdm import tqdm

    from . import compile, optim
    from .models.mlp import build_mlp, load_digits_split

    if args.backend == "gpu":
        from .runtime import get_device
        dev = get_device()
        note = " (a software Vulkan driver on the CPU: no GPU found)" if dev.is_software else ""
        print(f"device: {dev.name}{note}")
    (xtr, ytr), (xte, yte) = load_digits_split()
    batch = args.batch
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
    if args.backend == "gpu":
        print(tr.memory_report())
    return 0 if acc >= 0.9 else 1


def cmd_generate(args):
    """Stream a continuation of ``--prompt`` from a Hugging Face Llama-family folder."""
    check_model_folder(args.model)
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


def check_model_folder(path):
    """A Hugging Face model folder as ``generate`` needs it, or one line saying what is missing."""
    if not os.path.exists(path):
        raise CliError(f"--model {path!r} does not exist")
    if not os.path.isdir(path):
        raise CliError(f"--model {path!r} is a file; give the model's folder (config.json, model.safetensors, "
                       "tokenizer.json)")
    for need_file in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, need_file)):
            raise CliError(f"--model {path!r} has no {need_file}")
    if not any(os.path.isfile(os.path.join(path, f)) for f in ("model.safetensors", "model.safetensors.index.json")):
        raise CliError(f"--model {path!r} has no model.safetensors (or model.safetensors.index.json)")


def cmd_bench(argv):
    from .bench.__main__ import COMMANDS, main as bench_main
    helping = any(a in ("-h", "--help") for a in argv)
    if not helping:
        if argv[:1] == ["report"]:
            for f in argv[1:]:
                if not f.startswith("-") and f.endswith(".json") and not os.path.isfile(f):
                    raise CliError(f"bench report: file {f!r} does not exist")
        else:
            need("bench" if not argv or argv[0] not in COMMANDS else f"bench {argv[0]}", "torch", "transformers")
    return bench_main(argv)


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
    p = argparse.ArgumentParser(prog="meganeura", description="Portable GPU training and inference (wgpu).")
    sub = p.add_subparsers(dest="cmd", required=True)
    info = sub.add_parser("info", help="list adapters, the chosen one, its features and limits")
    info.add_argument("--vulkan", action="store_true",
                      help="report the direct Vulkan backend instead: device, features, cooperative matrices, caches")
    info.set_defaults(fn=cmd_info)
    sub.add_parser("bench", help="benchmark the five workloads against PyTorch (see: meganeura bench --help)")
    d = sub.add_parser("train-demo", help="train a small MLP on the digits, save, reload, evaluate")
    d.add_argument("--backend", default="gpu", choices=["gpu", "numpy"],
                   help="gpu (WGSL through wgpu; lavapipe when there is no GPU) or numpy (the reference)")
    d.add_argument("--epochs", type=int, default=20, help="passes over the training set (default 20)")
    d.add_argument("--batch", type=int, default=64, help="batch size (default 64)")
    d.add_argument("--hidden", type=int, default=128, help="hidden width of the MLP (default 128)")
    d.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default 3e-3)")
    d.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the shuffling")
    d.add_argument("--out", default="digits_mlp.safetensors", help="checkpoint path (default digits_mlp.safetensors)")
    d.add_argument("--quiet", action="store_true", help="no progress bar")
    d.set_defaults(fn=cmd_train_demo)
    gen = sub.add_parser("generate", help="generate text with a Hugging Face Llama-family model folder")
    gen.add_argument("--model", required=True, help="folder with config.json, model.safetensors, tokenizer.json")
    gen.add_argument("--prompt", required=True, help="text to continue")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=None, help="sample among the k most likely tokens")
    gen.add_argument("--top-p", type=float, default=None, help="sample within the top-p probability mass")
    gen.add_argument("--seed", type=int, default=0, help="sampling seed")
    gen.add_argument("--backend", default="gpu", choices=["gpu", "numpy"], help="gpu or numpy (the reference)")
    gen.add_argument("--precision", default="strict", choices=["strict", "accelerated"],
                     help="strict: f32 everywhere; accelerated: f16 operands for forward matmuls")
    gen.set_defaults(fn=cmd_generate)
    args = p.parse_args(argv)
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
