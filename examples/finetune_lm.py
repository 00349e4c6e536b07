"""Fine-tune a Llama-family causal LM on a text file, then generate from it.

With ``--model DIR`` (a Hugging Face folder: config.json, model.safetensors,
tokenizer.json) that model is fine-tuned with its own tokenizer. Without it, the example
trains a byte-level BPE tokenizer on the text and a small Llama from scratch, so it runs
with nothing to download. Either way the result is written as a Hugging Face folder that
``meganeura generate --model OUT`` (and transformers) can load.

    python examples/finetune_lm.py --prompt "The keeper"     # a few minutes on lavapipe
    python examples/finetune_lm.py --full                    # the GPU size: longer sequences, more steps
"""
import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

import meganeura as mg
from meganeura.cli import HelpFormatter
from meganeura.models import llama
from meganeura.models.generate import generate_text, load_tokenizer

HERE = pathlib.Path(__file__).resolve().parent
# the default sizes finish in a few minutes on lavapipe (a CPU); --full gives the GPU sizes
SMALL = {"steps": 200, "seq": 32}
FULL = {"steps": 300, "seq": 64}


def sizes(d):
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items())


def train_tokenizer(text, vocab_size):
    """A byte-level BPE tokenizer (GPT-2 style) learned from ``text``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator([text], trainer)
    return tok


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--full", action="store_true", help="the GPU sizes: " + sizes(FULL))
    p.add_argument("--text", default=str(HERE / "data" / "lighthouse.txt"), help="UTF-8 text file to train on")
    p.add_argument("--model", default=None, help="Hugging Face Llama folder to fine-tune (default: a new small model)")
    p.add_argument("--out", default="lm_finetuned", help="output folder (Hugging Face layout)")
    p.add_argument("--steps", type=int, help="AdamW steps")
    p.add_argument("--batch", type=int, default=8, help="sequences per step")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (linear warm-up and decay)")
    p.add_argument("--hidden", type=int, default=64, help="hidden size of the new model (without --model)")
    p.add_argument("--layers", type=int, default=2, help="layers of the new model (without --model)")
    p.add_argument("--vocab", type=int, default=384, help="BPE vocabulary of the new tokenizer (>= 257)")
    p.add_argument("--prompt", default="The keeper", help="text to continue after training")
    p.add_argument("--new-tokens", type=int, default=24, help="tokens to generate")
    p.add_argument("--backend", default="gpu", choices=["gpu", "numpy"], help="where to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the batches")
    p.set_defaults(**(FULL if "--full" in argv else SMALL))
    args = p.parse_args(argv)

    text = pathlib.Path(args.text).read_text(encoding="utf-8")
    if args.model:
        cfg, state = mg.io.load_hf(args.model)
        tok = load_tokenizer(args.model)
    else:
        tok = train_tokenizer(text, args.vocab)
        cfg = llama.LlamaConfig(vocab_size=tok.get_vocab_size(), hidden_size=args.hidden,
                                intermediate_size=2 * args.hidden, num_hidden_layers=args.layers,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * args.seq,
                                rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
        state = None
    ids = np.array(tok.encode(text).ids, np.int32)
    if len(ids) <= args.seq:
        raise SystemExit(f"{args.text}: {len(ids)} tokens, need more than --seq {args.seq}")
    print(f"{len(text)} characters -> {len(ids)} tokens (vocabulary {cfg.vocab_size})")

    g, _, _, loss = llama.build_training(cfg, args.batch, args.seq)
    opt = mg.optim.AdamW(lr=args.lr, weight_decay=0.01,
                         schedule=mg.optim.linear(total_steps=args.steps, warmup_steps=max(1, args.steps // 10)))
    tr = mg.compile(g, loss=loss, optimizer=opt, backend=args.backend, seed=args.seed)
    if state is not None:
        tr.load_state_dict(llama.graph_state_dict(g, state))
    rng = np.random.default_rng(args.seed)
    t0, first = time.perf_counter(), None
    for step in range(args.steps):
        starts = rng.integers(0, len(ids) - args.seq, args.batch)
        batch = np.stack([ids[s:s + args.seq] for s in starts])
        lv = tr.step({"input_ids": batch, "labels": batch})      # labels shift inside, as transformers
        first = lv if first is None else first
        if step % max(1, args.steps // 10) == 0 or step == args.steps - 1:
            print(f"step {step + 1}: loss {lv:.3f}")
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; loss {first:.3f} -> {lv:.3f}")

    os.makedirs(args.out, exist_ok=True)
    tr.save(os.path.join(args.out, "model.safetensors"), include_optimizer=False)   # the weights alone
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(cfg.to_hf_dict(), f, indent=1)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    print(f"saved {args.out}/ (config.json, model.safetensors, tokenizer.json)")

    print(args.prompt, end="", flush=True)
    text_out = generate_text(args.out, args.prompt, args.new_tokens, backend=args.backend,
                             stream=lambda s: print(s, end="", flush=True))
    print()
    return first, lv, text_out


if __name__ == "__main__":
    main()
