"""Train the digits CNN (mg.nn) with mg.jit, save a checkpoint, and deploy it: a fresh
model loads the file and classifies the test set in eval mode (any batch size).

    python examples/digits_cnn.py             # about 98% of the held-out digits in a minute on lavapipe
    python examples/digits_cnn.py --full      # the GPU size: more epochs
"""
import argparse
import sys
import time

import numpy as np

import meganeura as mg
from meganeura.checkpoint import read
from meganeura.cli import HelpFormatter
from meganeura.models.digits import DigitsCNN
from meganeura.models.mlp import load_digits_split

# the default sizes finish in a few minutes on lavapipe (a CPU); --full gives the GPU sizes
SMALL = {"epochs": 8}
FULL = {"epochs": 20}


def sizes(d):
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--full", action="store_true", help="the GPU sizes: " + sizes(FULL))
    p.add_argument("--backend", default="gpu", choices=["gpu", "numpy"], help="where to run")
    p.add_argument("--epochs", type=int, help="passes over the training images")
    p.add_argument("--batch", type=int, default=64, help="training batch size")
    p.add_argument("--lr", type=float, default=1e-2, help="peak AdamW learning rate (cosine schedule, warm-up)")
    p.add_argument("--out", default="digits_cnn.safetensors", help="checkpoint file")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation, shuffling and dropout")
    p.set_defaults(**(FULL if "--full" in argv else SMALL))
    args = p.parse_args(argv)

    (xtr, ytr), (xte, yte) = load_digits_split()
    xtr, xte = xtr.reshape(-1, 1, 8, 8), xte.reshape(-1, 1, 8, 8)
    mg.nn.init.manual_seed(args.seed)
    model = DigitsCNN()
    steps = args.epochs * (len(xtr) // args.batch)
    opt = mg.optim.AdamW(lr=args.lr, weight_decay=1e-4,
                         schedule=mg.optim.cosine(total_steps=steps, warmup_steps=max(1, steps // 20)))
    train_step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=opt, backend=args.backend,
                        seed=args.seed)
    rng = np.random.default_rng(args.seed)
    t0 = time.perf_counter()
    for epoch in range(args.epochs):
        order = rng.permutation(len(xtr))
        losses = [train_step(xtr[idx], ytr[idx]) for idx in np.array_split(order, len(xtr) // args.batch)]
        print(f"epoch {epoch + 1}: mean loss {np.mean(losses):.4f}")
    print(f"{train_step.steps_done} steps in {time.perf_counter() - t0:.1f} s, "
          f"{len(train_step.sessions)} compiled training program(s) (batch sizes differ by one at most)")
    # a training checkpoint (parameters, batch-norm statistics, AdamW's moments: training can resume from it)
    next(iter(train_step.sessions.values())).save(args.out)

    # deploy: a new model, its parameters and buffers from the file, eval mode (running batch-norm
    # statistics, no dropout)
    deployed = DigitsCNN()
    tensors, _ = read(args.out)
    deployed.load_state_dict({name: tensors[name] for name in deployed.state_dict()})
    deployed.eval()
    predict = mg.jit(deployed, backend=args.backend)
    logits = np.concatenate([predict(xte[i:i + 100]) for i in range(0, len(xte), 100)])   # last batch is smaller
    acc = float((logits.argmax(1) == yte).mean())
    print(f"deployed {args.out}: test accuracy {acc * 100:.1f}% on {len(xte)} digits "
          f"({len(predict.sessions)} inference programs)")
    return acc


if __name__ == "__main__":
    main()
