"""Language-model decoding: tokens/s of ours against PyTorch and the bytes-per-token bound.

    python bench/decode.py [--size real|tiny] [--batches 1,8,32] [--formats f32,f16,q8_0,q4_k]
                           [--prompt 128] [--steps 32] [--backend gpu] [--torch] [--out DIR]

SmolLM2-135M's shape (``--size real``; random weights, seeded) or the tiny Llama. For each
weight format and batch, ours runs the slot decoder of ``meganeura.serving.batch`` (the one
``meganeura serve`` runs): every slot prefilled with a ``--prompt``-token prompt, then
``--steps`` decode steps of one token a slot, timed as wall time per step (logits fetched
to the host, as serving does). Prompt processing is one ``--prompt``-token prefill of one
slot. Formats: f32 (strict), f16 (accelerated: f16 operands), q8_0 and q4_k (GGUF blocks
kept on the device; a matrix whose rows do not divide into 256 falls back to Q5_0, as
llama.cpp's quantizer does). The bound is the bytes a step must read (weights once, the
keys and values of every slot up to its position) over the device's bandwidth
(``--bandwidth-gbs``; by default the H200's 4800 or the H100's 3350 where the adapter
says so). ``--torch``: transformers' LlamaForCausalLM with a StaticCache on the same
weights (dequantized for the quantized formats), eager and, on CUDA, the step captured in
a CUDA graph, in f32 and with the weights in bf16. Each cell also gates ours: the first decode
step's logits against PyTorch eager f32 on the same (dequantized) weights.
Writes ``decode.json`` and ``decode.md`` under ``--out``.
"""
from __future__ import annotations

import argparse
import copy
import inspect
import json
import os
import time

import numpy as np

from meganeura.models import llama
from meganeura.serving.batch import SlotCache

BYTES_PER_WEIGHT = {"F32": 4.0, "F16": 2.0, "Q8_0": 34 / 32, "Q4_K": 144 / 256, "Q5_0": 22 / 32}


def random_state(cfg, seed=0):
    """transformers' initialisation: N(0, 0.02) matrices, unit norms."""
    g = llama.build_causal_lm(cfg, 1, 1)[0]
    rng = np.random.default_rng(seed)
    return {n: (np.ones(t.shape, np.float32) if len(t.shape) == 1 else
                (rng.standard_normal(t.shape) * 0.02).astype(np.float32)) for n, t in g.parameters.items()}


def quantize(state, fmt):
    """(f32 state of what stays float, blocks {name: (raw, type)}, dequantized state for the reference)."""
    from meganeura.gguf_write import quantize_tensor
    from meganeura.ops.quantized import dequantize_words, weight_words
    floats, blocks, deq = {}, {}, {}
    for name, w in state.items():
        data, t = quantize_tensor(w, fmt.upper()) if w.ndim == 2 else (w, "F32")
        if t in ("F32", "F16"):
            floats[name] = deq[name] = data.astype(np.float32)
            continue
        blocks[name] = (data, t)
        deq[name] = dequantize_words(weight_words(data), t, *w.shape)
    return floats, blocks, deq


def weight_bytes(cfg, state, blocks, fmt):
    per = BYTES_PER_WEIGHT["F16" if fmt == "f16" else "F32"]
    total = sum(v.size * (4 if v.ndim == 1 else per) for n, v in state.items() if n not in blocks)
    return total + sum(raw.size for raw, _ in blocks.values())


def time_ours(cfg, state, blocks, fmt, batch, prompt, steps, backend, samples=3):
    max_len = -(-(prompt + steps + 1) // 32) * 32
    cache = SlotCache(cfg, state, slots=batch, max_len=max_len, chunk=prompt, backend=backend,
                      precision="accelerated" if fmt == "f16" else "strict", blocks=blocks)
    rng = np.random.default_rng(1)
    prompts = {s: rng.integers(0, cfg.vocab_size, prompt).tolist() for s in range(batch)}
    t0 = time.perf_counter()
    first = cache.prefill(prompts)
    compile_s = time.perf_counter() - t0
    pre = []
    for _ in range(samples):
        t0 = time.perf_counter()
        cache.prefill({0: prompts[0]})
        pre.append(time.perf_counter() - t0)     # slot 0 holds the same prompt again
    step_logits = cache.decode({s: (int(np.argmax(first[s])), prompt) for s in range(batch)})
    per = []
    for i in range(steps):
        t0 = time.perf_counter()
        cache.decode({s: (1, prompt + 1 + i) for s in range(batch)})
        per.append(time.perf_counter() - t0)
    cache.close()
    step = float(np.median(per))
    return {"decode_ms": step * 1e3, "decode_tok_s": batch / step, "prefill_tok_s": prompt / float(np.median(pre)),
            "first_call_s": compile_s, "prompts": prompts, "first": first, "step_logits": step_logits}


def torch_model(cfg, state, device):
    import torch
    import transformers
    m = transformers.LlamaForCausalLM(transformers.LlamaConfig(**cfg.to_hf_dict())).eval()
    sd = {k: torch.from_numpy(v) for k, v in state.items()}
    m.load_state_dict(sd, strict=False)
    if cfg.tie_word_embeddings:
        m.tie_weights()
    return m.to(device)


def time_torch(model, cfg, batch, prompt, steps, device, bf16):
    """Decode steps of a StaticCache (eager; on CUDA also the step captured in a CUDA graph)."""
    import torch
    import transformers
    max_len = prompt + steps + 1
    ids = torch.randint(0, cfg.vocab_size, (batch, prompt), generator=torch.Generator().manual_seed(1)).to(device)
    if bf16:        # the model's weights in bf16 (autocast would hand the f32 cache bf16 keys)
        model = copy.deepcopy(model).to(torch.bfloat16)
    cache = transformers.StaticCache(config=model.config, max_cache_len=max_len)
    tok = torch.ones(batch, 1, dtype=torch.long, device=device)
    pos = torch.tensor([prompt], device=device)
    # transformers 5 renamed past_key_values to cache
    key = "cache" if "cache" in inspect.signature(type(model).forward).parameters else "past_key_values"
    out = {}
    with torch.no_grad():
        model(ids, **{key: cache}, cache_position=torch.arange(prompt, device=device), use_cache=True)

        def step():
            # StaticCache advances its own write position on every call: rewound, each step
            # decodes into slot `prompt` again (in bounds however many steps run)
            for layer in getattr(cache, "layers", ()):
                if hasattr(layer, "cumulative_length"):
                    layer.cumulative_length.fill_(prompt)
            return model(tok, **{key: cache}, cache_position=pos, use_cache=True).logits

        def sync():
            if device == "cuda":
                torch.cuda.synchronize()
        per = []
        for i in range(steps):
            sync()
            t0 = time.perf_counter()
            step().float().cpu()
            sync()
            per.append(time.perf_counter() - t0)
        out["eager"] = batch / float(np.median(per[1:] or per))
        if device == "cuda":
            from meganeura.bench.baselines import _capture
            try:
                replay = _capture(torch, step)
                per = []
                for _ in range(steps):
                    sync()
                    t0 = time.perf_counter()
                    replay().float().cpu()
                    sync()
                    per.append(time.perf_counter() - t0)
                out["graph"] = batch / float(np.median(per))
            except Exception as e:          # recorded, not fatal: the other cells still count
                out["graph_error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
    return out


def reference_logits(model, prompts, first_tokens, prompt, device):
    """PyTorch eager f32: logits of the first decode step after each prompt (full recompute)."""
    import torch
    rows = [prompts[s] + [first_tokens[s]] for s in sorted(prompts)]
    with torch.no_grad():
        return model(torch.tensor(rows, device=device)).logits[:, -1].float().cpu().numpy()


def bandwidth(backend, given):
    if given:
        return given
    if backend == "numpy":
        return None
    from meganeura.runtime.backends import get_runtime_device, resolve
    name = get_runtime_device(resolve(backend)).name
    return 4800.0 if "H200" in name else 3350.0 if "H100" in name else None


def write(a, bw, device, cells):
    """decode.json and decode.md under ``--out`` (rewritten after every cell: a run cut short keeps
    what it measured)."""
    os.makedirs(a.out, exist_ok=True)
    result = {"size": a.size, "backend": a.backend, "prompt": a.prompt, "steps": a.steps,
              "bandwidth_gbs": bw, "torch_device": device if a.torch else None, "cells": cells}
    with open(os.path.join(a.out, "decode.json"), "w") as f:
        json.dump(result, f, indent=1)
    lines = ["| format | batch | ours tok/s | prompt tok/s | bound tok/s (ours: x its time) | best PyTorch tok/s "
             "| time ours / PyTorch (below 1: faster) | gate |",
             "|---|---|---|---|---|---|---|---|"]
    for c in cells:
        bound = f"{c['bound_tok_s']:.0f} ({c['of_bound']:.1f}x)" if "bound_tok_s" in c else "-"
        torch_s = f"{c['torch_best_tok_s']:.0f} ({c['torch_best'][6:]})" if "torch_best" in c else "-"
        vs = f"{c['ratio']:.2f}" if "ratio" in c else "-"
        gate = f"{c['gate_rel_l2']:.1e} {'pass' if c['gate_pass'] else 'FAIL'}" if "gate_rel_l2" in c else "-"
        lines.append(f"| {c['format']} | {c['batch']} | {c['decode_tok_s']:.0f} | {c['prefill_tok_s']:.0f} | {bound} "
                     f"| {torch_s} | {vs} | {gate} |")
    with open(os.path.join(a.out, "decode.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=("real", "tiny"), default="real")
    p.add_argument("--batches", default="1,8,32")
    p.add_argument("--formats", default="f32,f16,q8_0,q4_k")
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--backend", default="gpu")
    p.add_argument("--torch", action="store_true", help="time PyTorch on the same weights too")
    p.add_argument("--bandwidth-gbs", type=float, default=None)
    p.add_argument("--out", default="decode-results")
    a = p.parse_args(argv)
    cfg = llama.LlamaConfig.smollm2_135m() if a.size == "real" else llama.LlamaConfig.tiny()
    base = random_state(cfg)
    bw = bandwidth(a.backend, a.bandwidth_gbs)
    device = "cpu"
    if a.torch:
        import torch
        device = "cuda" if torch.cuda.is_available() else "cpu"
    cells = []
    for fmt in a.formats.split(","):
        floats, blocks, deq = (base, {}, base) if fmt in ("f32", "f16") else quantize(base, fmt)
        wbytes = weight_bytes(cfg, floats, blocks, fmt)
        ref = torch_model(cfg, deq, device) if a.torch else None
        for b in (int(x) for x in a.batches.split(",")):
            ours = time_ours(cfg, floats, blocks, fmt, b, a.prompt, a.steps, a.backend)
            cell = {"format": fmt, "batch": b, "weight_bytes": int(wbytes),
                    "types": sorted({t for _, t in blocks.values()}),
                    **{k: v for k, v in ours.items() if k not in ("prompts", "first", "step_logits")}}
            kv = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * (a.prompt + 1) * b * 4
            if bw:
                cell["bound_tok_s"] = b / ((wbytes + kv) / (bw * 1e9))
                cell["of_bound"] = cell["bound_tok_s"] / cell["decode_tok_s"]
            if ref is not None:
                first = {s: int(np.argmax(v)) for s, v in ours["first"].items()}
                want = reference_logits(ref, ours["prompts"], first, a.prompt, device)
                got = np.stack([ours["step_logits"][s] for s in sorted(ours["step_logits"])])
                err = float(np.linalg.norm(got - want) / np.linalg.norm(want))
                cell["gate_rel_l2"], cell["gate_pass"] = err, err < (2e-2 if fmt == "f16" else 1e-4)
                for bf16 in (False, True):
                    for k, v in time_torch(ref, cfg, b, a.prompt, a.steps, device, bf16).items():
                        cell[f"torch_{'bf16' if bf16 else 'f32'}_{k}"] = v
                best = max((v, k) for k, v in cell.items() if k.startswith("torch_") and isinstance(v, float))
                cell["torch_best"], cell["torch_best_tok_s"] = best[1], best[0]
                cell["ratio"] = best[0] / cell["decode_tok_s"]     # time a token, ours / PyTorch's
            cells.append(cell)
            print(json.dumps(cell))
            write(a, bw, device, cells)
    lines = write(a, bw, device, cells)
    print("\n".join(lines))
    return 0 if all(c.get("gate_pass", True) for c in cells) else 1


if __name__ == "__main__":
    raise SystemExit(main())
