"""LoRA fine-tuning of a small Llama on a text file; only the adapters are saved, in peft's
format (``peft.PeftModel.from_pretrained(base, OUT)`` loads them).

With ``--model DIR`` (a Hugging Face Llama folder with tokenizer.json) that model is the
frozen base. Without it the base is a small random Llama over bytes, so the example runs
with nothing to download (the adapters then learn the text on top of noise).

    python examples/lora_finetune.py               # a few minutes on lavapipe
    python examples/lora_finetune.py --full        # the GPU size: longer sequences, more steps
"""
import argparse
import pathlib
import sys
import time

import numpy as np

import meganeura as mg
from meganeura import nn
from meganeura.cli import HelpFormatter
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

HERE = pathlib.Path(__file__).resolve().parent
# the default sizes finish in a few minutes on lavapipe (a CPU); --full gives the GPU sizes
SMALL = {"steps": 60, "seq": 32}
FULL = {"steps": 300, "seq": 128}


def sizes(d):
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items())


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--full", action="store_true", help="the GPU sizes: " + sizes(FULL))
    p.add_argument("--text", default=str(HERE / "data" / "lighthouse.txt"), help="UTF-8 text to fine-tune on")
    p.add_argument("--model", default=None, help="Hugging Face Llama folder (default: a small random byte-level one)")
    p.add_argument("--out", default="lora_adapter", help="folder for adapter_model.safetensors + adapter_config.json")
    p.add_argument("--steps", type=int, help="AdamW steps")
    p.add_argument("--batch", type=int, default=4, help="sequences per step")
    p.add_argument("--seq", type=int, help="tokens per sequence")
    p.add_argument("--r", type=int, default=8, help="LoRA rank")
    p.add_argument("--alpha", type=float, default=16, help="LoRA alpha (the update is scaled by alpha / r)")
    p.add_argument("--targets", default="q_proj,v_proj", help="comma-separated Linear names to adapt")
    p.add_argument("--lr", type=float, default=3e-3, help="learning rate")
    p.add_argument("--backend", default="gpu", choices=["gpu", "numpy"], help="where to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the initialisation and the batches")
    p.set_defaults(**(FULL if "--full" in argv else SMALL))
    args = p.parse_args(argv)

    text = pathlib.Path(args.text).read_text(encoding="utf-8")
    nn.init.manual_seed(args.seed)
    if args.model:
        from meganeura.models.generate import load_tokenizer
        cfg, state = mg.io.load_hf(args.model)
        ids = np.array(load_tokenizer(args.model).encode(text).ids, np.int32)
        model = LlamaForCausalLM(cfg)
        model.load_state_dict({k: v for k, v in state.items() if k in model.state_dict()})
    else:
        cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                          num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4 * args.seq,
                          rms_norm_eps=1e-5, bos_token_id=None, eos_token_id=None)
        ids = np.frombuffer(text.encode("utf-8"), np.uint8).astype(np.int32)
        model = LlamaForCausalLM(cfg)
    nn.lora.apply(model, r=args.r, alpha=args.alpha, target_modules=args.targets.split(","))
    trained = sum(int(np.prod(q.shape)) for q in model.parameters() if q.requires_grad)
    total = sum(int(np.prod(q.shape)) for q in model.parameters())
    print(f"{len(ids)} tokens; training {trained} of {total} parameters ({100 * trained / total:.2f}%)")

    B, S, V = args.batch, args.seq, cfg.vocab_size

    def loss_fn(x, target):
        return mg.ops.cross_entropy(mg.ops.reshape(model(x), (B * S, V)), mg.ops.reshape(target, (B * S,)))

    step = mg.jit(loss_fn, optimizer=mg.optim.AdamW(lr=args.lr), backend=args.backend, seed=args.seed)
    rng = np.random.default_rng(args.seed)
    t0, losses = time.perf_counter(), []
    for i in range(args.steps):
        starts = rng.integers(0, len(ids) - S - 1, B)
        x = np.stack([ids[s:s + S] for s in starts])
        y = np.stack([ids[s + 1:s + S + 1] for s in starts])       # next-token targets
        loss = step(x, y)
        losses.append(loss)
        if i == 0 or (i + 1) % max(1, args.steps // 6) == 0:
            print(f"step {i + 1:4d}  loss {loss:.4f}  ({time.perf_counter() - t0:.1f} s)")
    nn.lora.save(model, args.out, base_model_name_or_path=args.model)
    print(f"adapters written to {args.out}/ (on {step.backend})")
    return losses[0], float(np.mean(losses[-5:]))


if __name__ == "__main__":
    main()
