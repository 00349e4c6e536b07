"""The ``meganeura`` command."""
from __future__ import annotations

import argparse
import os
import sys
import time


def cmd_info(args):
    from .runtime import describe
    print(describe())


def cmd_train_demo(args):
    """Train the digits MLP on the default device, save a checkpoint, reload it into a
    separately compiled inference program and report test accuracy."""
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


def main(argv=None):
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:          # the benchmark harness has its own options
        from .bench.__main__ import main as bench_main
        return bench_main(argv[1:])
    p = argparse.ArgumentParser(prog="meganeura", description="Portable GPU training and inference (wgpu).")
    sub = p.add_subparsers(dest="cmd", required=True)
    sub.add_parser("info", help="list adapters, the chosen one, its features and limits").set_defaults(fn=cmd_info)
    sub.add_parser("bench", help="benchmark the five workloads against PyTorch (see: meganeura bench --help)")
    d = sub.add_parser("train-demo", help="train a small MLP on the digits, save, reload, evaluate")
    d.add_argument("--backend", default="gpu", choices=["gpu", "numpy"])
    d.add_argument("--epochs", type=int, default=20)
    d.add_argument("--batch", type=int, default=64)
    d.add_argument("--hidden", type=int, default=128)
    d.add_argument("--lr", type=float, default=3e-3)
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--out", default="digits_mlp.safetensors")
    d.add_argument("--quiet", action="store_true")
    d.set_defaults(fn=cmd_train_demo)
    gen = sub.add_parser("generate", help="generate text with a Hugging Face Llama-family model folder")
    gen.add_argument("--model", required=True, help="folder with config.json, model.safetensors, tokenizer.json")
    gen.add_argument("--prompt", required=True)
    gen.add_argument("--max-new-tokens", type=int, default=64)
    gen.add_argument("--temperature", type=float, default=0.0, help="0 means greedy")
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=0)
    gen.add_argument("--backend", default="gpu", choices=["gpu", "numpy"])
    gen.add_argument("--precision", default="strict", choices=["strict", "accelerated"])
    gen.set_defaults(fn=cmd_generate)
    args = p.parse_args(argv)
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")
    return args.fn(args) or 0


if __name__ == "__main__":
    sys.exit(main())
