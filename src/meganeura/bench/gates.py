"""The paper's accuracy gates, per workload and precision mode, against the torch reference.

Forward: relative L2 over 256 evenly spaced output samples < 1% and loss error < 1%.
Backward: total-gradient-norm error < 5% and relative L2 over the vector of per-parameter
gradient norms < 5%. Every measured error is reported, not only pass/fail; strict mode is
expected near 1e-4 or better.

The reference runs in f32 on the torch device, with TF32 off for ``strict`` and on for
``accelerated`` (it only matters on CUDA). ``train_compare`` runs N AdamW steps on both
sides on the same batch and compares the loss curves step by step.
"""
from __future__ import annotations

import contextlib
import math

import numpy as np

from .workloads import GRAPHS, make

FORWARD_TOL = 0.01
LOSS_TOL = 0.01
GRAD_TOL = 0.05
SAMPLES = 256
TRAIN_TOL = 1e-3     # strict mode: per-step relative loss difference over the training run


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30))


def sample_index(n: int, k: int = SAMPLES) -> np.ndarray:
    """``k`` evenly spaced flat indices into ``n`` values (all of them when n <= k)."""
    return np.unique(np.linspace(0, n - 1, min(k, n)).round().astype(np.int64))


def forward_check(ours, ref) -> dict:
    ours, ref = np.asarray(ours).ravel(), np.asarray(ref).ravel()
    if ours.shape != ref.shape:
        return {"error": f"shape {ours.shape} vs reference {ref.shape}", "pass": False}
    idx = sample_index(ref.size)
    e = rel_l2(ours[idx], ref[idx])
    finite = bool(np.isfinite(ours).all())
    return {"rel_l2_sampled": e, "rel_l2_full": rel_l2(ours, ref), "samples": int(idx.size),
            "finite": finite, "pass": finite and e < FORWARD_TOL}


def loss_check(ours: float, ref: float) -> dict:
    err = abs(ours - ref) / max(abs(ref), 1e-30)
    return {"ours": float(ours), "torch": float(ref), "rel_err": float(err),
            "pass": math.isfinite(ours) and err < LOSS_TOL}


def backward_check(ours: dict, ref: dict) -> dict:
    names = sorted(ref)
    missing = [n for n in names if n not in ours]
    extra = sorted(set(ours) - set(ref))
    names = [n for n in names if n in ours]
    a = np.array([np.linalg.norm(np.asarray(ours[n], np.float64)) for n in names])
    b = np.array([np.linalg.norm(np.asarray(ref[n], np.float64)) for n in names])
    total = abs(np.linalg.norm(a) - np.linalg.norm(b)) / max(np.linalg.norm(b), 1e-30)
    norms = rel_l2(a, b)
    full = {n: rel_l2(ours[n], ref[n]) for n in names}
    worst = max(full, key=full.get) if full else None
    ok = not missing and bool(np.isfinite(a).all()) and total < GRAD_TOL and norms < GRAD_TOL
    return {"total_norm_err": float(total), "norms_rel_l2": float(norms), "n_params": len(names),
            "worst_param": worst, "worst_param_rel_l2": full.get(worst) if worst else None,
            "missing": missing, "extra": extra, "pass": ok}


@contextlib.contextmanager
def torch_precision(mode: str):
    """TF32 off (strict) or on (accelerated) for the torch side; restored afterwards."""
    import torch
    m, c = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = mode == "accelerated"
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = m, c


def reference_results(w, mode: str, graphs=GRAPHS) -> dict:
    """The torch side's outputs, loss and gradients (cached on the workload per mode)."""
    cache = w.__dict__.setdefault("_gate_refs", {}).setdefault(mode, {})
    with torch_precision(mode):
        for g in graphs:
            if g in cache:
                continue
            if g in ("inference", "minimal"):
                cache[g] = w.torch_fn(g, w.reference)().detach().float().cpu().numpy()
            else:
                m = w.train_copy()
                loss = w.torch_fn("flb", m)()
                cache[g] = {"loss": float(loss.detach()),
                            "grads": {n: p.grad.detach().float().cpu().numpy()
                                      for n, p in w.trainable(m).items() if p.grad is not None}}
                del m
    return cache


def gate(w, graph: str, sess, feeds, mode: str) -> dict:
    """Run our session once and check it against the reference."""
    ref = reference_results(w, mode, [graph])[graph]
    if graph in ("inference", "minimal"):
        return forward_check(sess.run(feeds)[0], ref)
    loss = sess.compute_grads(feeds)
    lc, bc = loss_check(loss, ref["loss"]), backward_check(sess.grads(), ref["grads"])
    return {"loss": lc, "backward": bc, "pass": lc["pass"] and bc["pass"]}


def evaluate(w, mode: str, backend="gpu", graphs=GRAPHS, sessions=None) -> dict:
    """Gates for ``graphs`` of workload ``w`` in precision ``mode``. ``sessions``: optional
    {graph: (session, feeds)} to reuse; others are compiled here."""
    out = {}
    for g in graphs:
        sess, feeds = (sessions or {}).get(g) or w.session(g, backend, mode)
        try:
            out[g] = gate(w, g, sess, feeds, mode)
        except Exception as e:        # a failing gate is a result, not a crash of the whole run
            out[g] = {"error": f"{type(e).__name__}: {e}", "pass": False}
    out["pass"] = all(v["pass"] for v in out.values())
    return out


def train_compare(w, mode: str, steps: int = 50, lr: float = 1e-4, backend="gpu") -> dict:
    """``steps`` AdamW steps of ours and torch's on the same batch: both loss curves, the
    per-step relative differences and whether the loss decreased."""
    import meganeura as mg
    import torch
    sess, feeds = w.session("train", backend, mode, optimizer=mg.optim.AdamW(lr=lr))
    ours = [float(sess.step(feeds)) for _ in range(steps)]
    with torch_precision(mode):
        m = w.train_copy()
        opt = torch.optim.AdamW(list(w.trainable(m).values()), lr=lr)
        fn = w.torch_fn("train_step", m, opt)
        theirs = [float(fn().detach()) for _ in range(steps)]
    diffs = [abs(a - b) / max(abs(b), 1e-30) for a, b in zip(ours, theirs)]
    worst = max(diffs) if diffs else float("nan")
    return {"steps": steps, "lr": lr, "ours": ours, "torch": theirs, "rel_diff": diffs,
            "max_rel_diff": worst, "worst_step": int(np.argmax(diffs)) + 1 if diffs else None,
            "decreased_ours": ours[-1] < ours[0], "decreased_torch": theirs[-1] < theirs[0],
            "within_tol": bool(worst < TRAIN_TOL), "tol": TRAIN_TOL}


# ------------------------------------------------------------------ command line
def _fmt(x, spec=".2e"):
    return "-" if x is None else format(x, spec)


def gates_markdown(result: dict) -> str:
    lines = [f"# Accuracy gates ({result['options']['size']} size, backend {result['options']['backend']})", "",
             f"Forward: rel L2 over {SAMPLES} evenly spaced outputs < {FORWARD_TOL:.0%}, loss error < "
             f"{LOSS_TOL:.0%}. Backward: total gradient norm error and rel L2 of per-parameter gradient norms "
             f"< {GRAD_TOL:.0%}. Reference: torch f32 on {result['torch_device']} (TF32 off in strict, on in "
             "accelerated).", "",
             "| workload | mode | inference rel L2 | minimal rel L2 | loss err | grad total-norm err | "
             "grad norms rel L2 | worst param grad rel L2 | pass |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, modes in result["workloads"].items():
        for mode, r in modes.items():
            if "error" in r and len(r) <= 2:
                lines.append(f"| {name} | {mode} | error: {r['error']} | | | | | | FAIL |")
                continue
            inf, mini, tr = r.get("inference", {}), r.get("minimal", {}), r.get("train", {})
            bw = tr.get("backward", {})
            worst = bw.get("worst_param_rel_l2")
            lines.append(f"| {name} | {mode} | {_fmt(inf.get('rel_l2_sampled'))} | {_fmt(mini.get('rel_l2_sampled'))} "
                         f"| {_fmt(tr.get('loss', {}).get('rel_err'))} | {_fmt(bw.get('total_norm_err'))} "
                         f"| {_fmt(bw.get('norms_rel_l2'))} | {_fmt(worst)} | {'pass' if r['pass'] else 'FAIL'} |")
            for g in GRAPHS:
                if "error" in r.get(g, {}):
                    lines.append(f"|  | | {g}: {r[g]['error']} | | | | | | |")
    return "\n".join(lines) + "\n"


def train_markdown(result: dict) -> str:
    lines = [f"# Training comparison: {result['options']['steps']} AdamW steps (lr {result['options']['lr']}), "
             f"{result['options']['size']} size", "",
             f"Same weights and batch on both sides; strict-mode target: every step within {TRAIN_TOL:g} relative.",
             "", "| workload | mode | first loss ours / torch | last loss ours / torch | max per-step rel diff "
             "(step) | loss decreased | within target |", "|---|---|---|---|---|---|---|"]
    for name, modes in result["workloads"].items():
        for mode, r in modes.items():
            if "error" in r:
                lines.append(f"| {name} | {mode} | error: {r['error']} | | | | |")
                continue
            lines.append(f"| {name} | {mode} | {r['ours'][0]:.6f} / {r['torch'][0]:.6f} | {r['ours'][-1]:.6f} / "
                         f"{r['torch'][-1]:.6f} | {r['max_rel_diff']:.2e} ({r['worst_step']}) | "
                         f"{'yes' if r['decreased_ours'] else 'NO'} | {'yes' if r['within_tol'] else 'no'} |")
    return "\n".join(lines) + "\n"


def cmd_gates(args) -> int:
    from . import report
    from .workloads import WORKLOADS, parse_list
    names = parse_list(args.workloads, WORKLOADS, "workloads")
    modes = parse_list(args.modes, ("strict", "accelerated"), "modes")
    result = {"kind": "gates", "options": {"size": args.size, "backend": args.backend, "seed": args.seed,
                                           "workloads": names, "modes": modes},
              "environment": report.environment(args.backend), "workloads": {}}
    all_ok = True
    for name in names:
        w = make(name, args.size, args.seed)
        result["torch_device"] = w.device
        result["workloads"][name] = {}
        for mode in modes:
            try:
                r = evaluate(w, mode, args.backend)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}", "pass": False}
            result["workloads"][name][mode] = r
            all_ok &= r["pass"]
            print(_gate_line(name, mode, r), flush=True)
    md = gates_markdown(result)
    report.write_outputs(args.out, "gates", result, md)
    return 0 if all_ok else 1


def _gate_line(name, mode, r):
    if "inference" not in r:
        return f"{name} [{mode}]: {r.get('error')}"
    tr = r.get("train", {})
    bw = tr.get("backward", {})
    return (f"{name} [{mode}]: forward rel L2 {_fmt(r['inference'].get('rel_l2_sampled'))}, minimal "
            f"{_fmt(r['minimal'].get('rel_l2_sampled'))}, loss err {_fmt(tr.get('loss', {}).get('rel_err'))}, "
            f"grad total-norm err {_fmt(bw.get('total_norm_err'))}, grad norms rel L2 "
            f"{_fmt(bw.get('norms_rel_l2'))} -> {'pass' if r['pass'] else 'FAIL'}")


def cmd_train(args) -> int:
    from . import report
    from .workloads import WORKLOADS, parse_list
    names = parse_list(args.workloads, WORKLOADS, "workloads")
    modes = parse_list(args.modes, ("strict", "accelerated"), "modes")
    result = {"kind": "train", "options": {"size": args.size, "backend": args.backend, "seed": args.seed,
                                           "steps": args.steps, "lr": args.lr, "workloads": names, "modes": modes},
              "environment": report.environment(args.backend), "workloads": {}}
    ok = True
    for name in names:
        w = make(name, args.size, args.seed)
        result["workloads"][name] = {}
        for mode in modes:
            try:
                r = train_compare(w, mode, args.steps, args.lr, args.backend)
                ok &= r["decreased_ours"] and (r["within_tol"] or mode != "strict")
                print(f"{name} [{mode}]: loss {r['ours'][0]:.5f} -> {r['ours'][-1]:.5f} (torch {r['torch'][0]:.5f} "
                      f"-> {r['torch'][-1]:.5f}), max per-step rel diff {r['max_rel_diff']:.2e}", flush=True)
            except Exception as e:
                r = {"error": f"{type(e).__name__}: {e}"}
                ok = False
                print(f"{name} [{mode}]: {r['error']}", flush=True)
            result["workloads"][name][mode] = r
    report.write_outputs(args.out, "train", result, train_markdown(result))
    return 0 if ok else 1
