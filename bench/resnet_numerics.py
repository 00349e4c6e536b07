"""ResNet numerics against a float64 reference: which f32 side is closer to the truth, and
which op makes a ResNet-50's gradients (and its training curve) so sensitive to f32.

    python bench/resnet_numerics.py [--size tiny|small|real] [--steps N] [--out FILE]

Sides, all from the same weights (``resnet_reference``: transformers' ResNet with
non-trivial batch norms) and the same batch, in training mode (batch statistics):

- ``torch64``: transformers' model in float64 (on CUDA when there is one): the reference;
- ``torch32``: the same in float32, TF32 off (what the gates compare us with);
- ``ours_gpu``: our strict f32 kernels on the default adapter (lavapipe here);
- ``ours_numpy32`` / ``ours_numpy64``: our graph (forward and autodiff backward) in the
  NumPy reference, computed in f32 / in f64 (``--numpy``; on by default below real size).

Measured per side against ``torch64``: loss error, relative L2 of all gradients together,
the gates' backward metrics, each parameter's relative L2 (median, worst, and the stem,
i.e. the parameters before the max pool, apart), and an AdamW loss curve (``--steps``).
Then the causes: ``conditioning`` (per convolution that feeds a batch norm, how much larger
the conv's terms are than the per-channel spread the batch norm keeps, and the error that
f32 leaves in the normalised output), ``maxpool_near_ties`` (stem max-pool windows whose
two largest inputs are closer than f32 can tell apart) and ``ablation`` (our graph in f64
with one op kind computed in f32: which op's f32 arithmetic produces the gradient error).

Findings (``--size small``: ResNet-50's depths and widths on 64x64 images, batch 4, 10
classes, lavapipe, CPU torch; ``--size real`` repeats this at the issue's size on the H200):

- Neither side is closer to float64. All gradients together, relative L2 from torch
  float64: torch f32 6.68e-3, ours (GPU kernels) 6.82e-3, our NumPy f32 reference 1.24e-2;
  worst parameter 1.05e-2 for both torch and ours (the stem batch norm's bias). Ours and
  torch differ from each other by less (1.37e-3; the gates' total-norm error 1.4e-5) than
  either does from float64. Our graph evaluated in float64 matches torch float64 to
  1.2e-11 (loss 9e-15): batch norm's statistics (biased variance to normalise, unbiased
  for the running variance), its VJP and the max-pool gradient are the same maths on both
  sides; only f32 rounding differs.
- The op: the f32 accumulation of the **convolution forward**, in the early layers.
  Our graph in float64 with only one op kind in f32: conv2d forward 1.8e-2, batch norm
  2.1e-5, conv input gradient 1.6e-6, conv weight gradient 3.4e-7, matmul and reductions
  below 2e-7. Each conv's own f32 error is ordinary (3.5e-7 of the channel's spread in the
  normalised output; conv terms are 15-60x the spread: no cancellation), and batch norm's
  backward does not cancel either (|dy| / |dy - mean - projection| is about 1, at most
  3.5). What is large is the depth sensitivity: the stem conv alone in f32 gives 3.6e-3,
  the last conv alone 1.3e-7; Gaussian noise of the same size (3.5e-7 of the spread) on
  every conv output in float64 gives 2.7e-2, on the stem alone 7.8e-3, on the last conv
  1.4e-7. A deep stack of training-mode batch norms at initialisation amplifies an early
  perturbation layer by layer (the gradient explosion of batch-normalised nets at init),
  so any f32 convolution (cuDNN, ours, NumPy's BLAS) leaves about 1e-2 in the gradients
  at this depth and batch; at the tiny test size (2 stages) it is 7e-7 on every side.
- Not the variance formula (ours is two-pass: mean, then the mean of squared deviations;
  batch norm in f32 alone costs 2e-5), and not max-pool ties (no stem window's two largest
  inputs are within an f32 ulp at this size; a tie would move only the stem's gradients).
- The curve: at the tiny size torch f32 and ours stay within 1.3e-7 of the float64 curve
  over 5 AdamW steps (both); the small and real sizes' curves are left to the GPU run
  (``curve.max_rel_diff`` in the JSON; ten steps of the small size take many minutes on
  lavapipe). With the gradients ~1e-2 apart from the first step, the real size's curves
  must part as well, and their per-step relative difference grows as the loss falls (it
  memorises its batch of 4, 7.19 -> 7e-5 in 50 steps), so a fixed absolute difference
  turns into percent; the float64 curve says which one drifts. Nothing to fix on our side
  at the gradient level: ResNet-50's strict gradient
  gate should be read against torch f32's own distance from float64, which this script
  reports, not against the 1e-7 of the workloads without batch norm.
"""
from __future__ import annotations

import argparse
import copy
import json
import os
import platform
import sys
import time

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))

SIZES = ("tiny", "small", "real")
ABLATE_OPS = ("conv2d", "batch_norm", "conv2d_input_grad", "conv2d_weight_grad", "matmul", "reduce_mean",
              "reduce_sum")


def config(size):
    from meganeura.models.resnet import ResNetConfig
    if size == "tiny":
        return ResNetConfig.tiny()
    if size == "small":
        return ResNetConfig(image_size=64, num_labels=10)    # ResNet-50's depths and widths
    return ResNetConfig.resnet50()


def batch_data(cfg, batch, seed):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((batch, cfg.num_channels, cfg.image_size, cfg.image_size)).astype(np.float32)
    return x, rng.integers(0, cfg.num_labels, batch).astype(np.int32)


def rel(a, b):
    from meganeura.bench.gates import rel_l2
    return rel_l2(a, b)


def compare(grads, loss, ref_grads, ref_loss, stem):
    """Distances of one side's (loss, gradients) from the reference's."""
    from meganeura.bench.gates import backward_check
    names = sorted(ref_grads)
    per = {n: rel(grads[n], ref_grads[n]) for n in names}
    worst = max(per, key=per.get)
    flat = lambda g, ns: np.concatenate([np.asarray(g[n], np.float64).ravel() for n in ns])  # noqa: E731
    body = [n for n in names if n not in stem]
    gate = backward_check(grads, ref_grads)
    return {"loss_rel_err": abs(loss - ref_loss) / abs(ref_loss),
            "all_grads_rel_l2": rel(flat(grads, names), flat(ref_grads, names)),
            "stem_grads_rel_l2": rel(flat(grads, stem), flat(ref_grads, stem)),
            "body_grads_rel_l2": rel(flat(grads, body), flat(ref_grads, body)),
            "median_param_rel_l2": float(np.median(list(per.values()))),
            "worst_param": worst, "worst_param_rel_l2": per[worst],
            "gate_total_norm_err": gate["total_norm_err"], "gate_norms_rel_l2": gate["norms_rel_l2"]}


# ------------------------------------------------------------------------ torch side
def torch_grads(ref, x, labels, dtype, device):
    import torch
    m = copy.deepcopy(ref).to(device=device, dtype=dtype).train()
    out = m(pixel_values=torch.tensor(x, dtype=dtype, device=device),
            labels=torch.tensor(labels, dtype=torch.long, device=device))
    out.loss.backward()
    return float(out.loss.detach()), {n: p.grad.detach().double().cpu().numpy() for n, p in m.named_parameters()}


def torch_curve(ref, x, labels, dtype, device, steps, lr):
    import torch
    m = copy.deepcopy(ref).to(device=device, dtype=dtype).train()
    opt = torch.optim.AdamW(m.parameters(), lr=lr)
    xt = torch.tensor(x, dtype=dtype, device=device)
    yt = torch.tensor(labels, dtype=torch.long, device=device)
    out = []
    for _ in range(steps):
        opt.zero_grad()
        loss = m(pixel_values=xt, labels=yt).loss
        loss.backward()
        opt.step()
        out.append(float(loss.detach()))
    return out


def conditioning(ref, x, device, top=8):
    """Per convolution followed by a batch norm (float64 forward): the median over channels
    of sum|w||x| / std(y) (how much larger the conv's terms are than what the batch norm
    keeps), the number of values per channel, and the relative L2 error that an f32
    convolution leaves in the normalised output."""
    import torch
    m = copy.deepcopy(ref).to(device=device, dtype=torch.float64).train()
    rows, hooks = [], []

    def hook(name, conv):
        def fn(mod, inp, out):
            xin = inp[0].detach()
            w = conv.weight.detach()
            kw = dict(stride=conv.stride, padding=conv.padding, dilation=conv.dilation, groups=conv.groups)
            f = torch.nn.functional.conv2d
            y64 = out.detach()
            y32 = f(xin.float(), w.float(), **kw).double()
            terms = f(xin.abs(), w.abs(), **kw)
            dims = (0, 2, 3)
            mean, std = y64.mean(dims, keepdim=True), y64.std(dims, unbiased=False, keepdim=True)
            n64, n32 = (y64 - mean) / std, (y32 - y32.mean(dims, keepdim=True)) / y32.std(dims, unbiased=False,
                                                                                           keepdim=True)
            ratio = (terms.mean(dims) / std.flatten()).cpu().numpy()
            rows.append({"conv": name, "values_per_channel": int(y64.numel() // y64.shape[1]),
                         "terms_over_spread_median": float(np.median(ratio)), "terms_over_spread_max": float(ratio.max()),
                         "f32_normalised_rel_l2": float(torch.linalg.norm(n32 - n64) / torch.linalg.norm(n64))})
        return fn

    for name, mod in m.named_modules():
        if name.endswith(".convolution"):
            hooks.append(mod.register_forward_hook(hook(name, mod)))
    with torch.no_grad():
        m(pixel_values=torch.tensor(x, dtype=torch.float64, device=device))
    for h in hooks:
        h.remove()
    rows.sort(key=lambda r: -r["f32_normalised_rel_l2"])
    corr = float(np.corrcoef(np.log([r["terms_over_spread_median"] for r in rows]),
                             np.log([r["f32_normalised_rel_l2"] for r in rows]))[0, 1])
    return {"convs": len(rows), "log_correlation": corr, "worst": rows[:top]}


def maxpool_near_ties(ref, x, device):
    """Stem max-pool windows (float64 forward) whose two largest inputs are closer than
    2^-23 of the larger: f32 cannot tell which is the maximum, so the gradient's route
    depends on rounding."""
    import torch
    m = copy.deepcopy(ref).to(device=device, dtype=torch.float64).train()
    got = {}
    pool = m.resnet.embedder.pooler
    h = pool.register_forward_hook(lambda mod, inp, out: got.setdefault("x", inp[0].detach()))
    with torch.no_grad():
        m(pixel_values=torch.tensor(x, dtype=torch.float64, device=device))
    h.remove()
    xin = got["x"]
    k, s, p = pool.kernel_size, pool.stride, pool.padding
    n, c, hh, ww = xin.shape
    padded = torch.nn.functional.pad(xin, (p, p, p, p), value=-float("inf")).reshape(n * c, 1, hh + 2 * p, ww + 2 * p)
    win = torch.nn.functional.unfold(padded, k, stride=s)          # (n*c, k*k, windows)
    top2 = win.topk(2, dim=1).values
    big, second = top2[:, 0], top2[:, 1]
    positive = big > 0
    near = positive & ((big - second) <= big.abs() * 2.0 ** -23)
    return {"windows": int(big.numel()), "windows_with_positive_max": int(positive.sum()),
            "near_ties": int(near.sum())}


# ------------------------------------------------------------------------ our side
def our_session(cfg, batch, state, backend, optimizer=None):
    import meganeura as mg
    from meganeura.models.resnet import build_resnet_training
    m = build_resnet_training(cfg, batch)
    s = mg.compile(m.graph, loss=m.loss, optimizer=optimizer, backend=backend, eager=False)
    s.load_state_dict(state)
    return m, s


def our_grads(cfg, x, labels, state, backend):
    m, s = our_session(cfg, len(x), state, backend)
    loss = s.compute_grads({"pixel_values": x, "labels": labels})
    grads = {k: v.astype(np.float64) for k, v in s.grads().items()}
    s.close()
    return loss, grads


class Graph64:
    """Our training graph's loss and gradients evaluated by the NumPy reference in float64,
    optionally with some op kinds computed in f32 (inputs rounded, op in f32)."""

    def __init__(self, cfg, x, labels, state):
        from meganeura.reference import needed_nodes
        m, s = our_session(cfg, len(x), state, "numpy")
        self.names = list(s.program.grads)
        self.outs = [m.loss] + [s.program.grads[n] for n in self.names]
        self.nodes = needed_nodes(self.outs)
        self.forward = {t.id for t in needed_nodes([m.loss])}
        self.values = dict(s.values, pixel_values=x, labels=labels)

    def convs(self):
        """The forward conv2d nodes, stem first."""
        return [t for t in self.nodes if t.op == "conv2d" and t.id in self.forward]

    def run(self, f32_ops=(), phase="both", f32_nodes=(), noise_nodes=(), noise=0.0):
        """(loss, gradients); ``f32_ops`` kinds (in ``phase``) and ``f32_nodes`` ids computed
        in f32; ``noise_nodes`` get ``noise`` times their channel's spread of Gaussian noise."""
        from meganeura.ops.registry import OPS
        from meganeura.reference import _normalize
        env, rng = {}, np.random.default_rng(0)
        for t in self.nodes:
            if t.op in ("input", "parameter", "state"):
                v = self.values[t.name]
            elif t.op == "constant":
                v = t.attrs["value"]
            else:
                in_phase = phase == "both" or (t.id in self.forward) == (phase == "forward")
                c = np.float32 if (t.op in f32_ops and in_phase) or t.id in f32_nodes else np.float64
                args = [env[i.id].astype(c) if env[i.id].dtype.kind == "f" else env[i.id] for i in t.inputs]
                v = OPS[t.op].ref(*args, **t.attrs)
                if t.id in noise_nodes:
                    v = v + noise * v.std(axis=(0, 2, 3), keepdims=True) * rng.standard_normal(v.shape)
            env[t.id] = _normalize(t, v, np.float64)
        return float(env[self.outs[0].id]), {n: env[g.id] for n, g in zip(self.names, self.outs[1:])}


def our_curve(cfg, x, labels, state, backend, steps, lr):
    import meganeura as mg
    m, s = our_session(cfg, len(x), state, backend, mg.optim.AdamW(lr=lr))
    out = [float(s.step({"pixel_values": x, "labels": labels})) for _ in range(steps)]
    s.close()
    return out


# ------------------------------------------------------------------------ driver
def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=SIZES)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--steps", type=int, default=None, help="AdamW steps of the curves (tiny 5, small 10, real 50)")
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--numpy", action=argparse.BooleanOptionalAction, default=None,
                    help="our NumPy reference in f32 and f64, and the f64 op ablation (default: not at real size)")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/resnet_numerics_<size>.json)")
    args = ap.parse_args(argv)
    import torch

    from meganeura.bench.gates import torch_precision
    from meganeura.bench.workloads import default_device, resnet_reference
    from meganeura.models.resnet import torch_state_dict
    from meganeura.runtime import get_device

    steps = args.steps if args.steps is not None else {"tiny": 5, "small": 10, "real": 50}[args.size]
    use_numpy = args.numpy if args.numpy is not None else args.size != "real"
    out_path = args.out or f"bench/results/resnet_numerics_{args.size}.json"
    cfg = config(args.size)
    device = default_device()
    ref = resnet_reference(cfg, args.seed)
    state = torch_state_dict(ref.state_dict())
    x, labels = batch_data(cfg, args.batch, args.seed)
    stem = [n for n, _ in ref.named_parameters() if n.startswith("resnet.embedder.")]
    dev = get_device()
    print(f"ResNet {args.size}: {cfg.image_size}x{cfg.image_size}, batch {args.batch}, depths {cfg.depths}, "
          f"widths {cfg.hidden_sizes}; torch on {device}, ours on {dev.name}", flush=True)

    timings, sides = {}, {}

    def timed(key, fn):
        t0 = time.perf_counter()
        r = fn()
        timings[key] = round(time.perf_counter() - t0, 2)
        print(f"  {key}: {timings[key]:.1f} s", flush=True)
        return r

    with torch_precision("strict"):
        l64, g64 = timed("torch64", lambda: torch_grads(ref, x, labels, torch.float64, device))
        sides["torch32"] = timed("torch32", lambda: torch_grads(ref, x, labels, torch.float32, device))
    sides["ours_gpu"] = timed("ours_gpu", lambda: our_grads(cfg, x, labels, state, "gpu"))
    g64_ours = None
    if use_numpy:
        sides["ours_numpy32"] = timed("ours_numpy32", lambda: our_grads(cfg, x, labels, state, "numpy"))
        g64_ours = Graph64(cfg, x, labels, state)
        sides["ours_numpy64"] = timed("ours_numpy64", g64_ours.run)

    result = {"size": args.size, "config": {"image_size": cfg.image_size, "depths": list(cfg.depths),
                                            "hidden_sizes": list(cfg.hidden_sizes), "num_labels": cfg.num_labels},
              "batch": args.batch, "seed": args.seed, "torch_device": device, "our_device": dev.name,
              "python": platform.python_version(), "torch": torch.__version__, "reference_loss": l64,
              "vs_float64": {k: compare(g, l, g64, l64, stem) for k, (l, g) in sides.items()},
              "ours_gpu_vs_torch32": compare(sides["ours_gpu"][1], sides["ours_gpu"][0], sides["torch32"][1],
                                             sides["torch32"][0], stem)}
    print(f"\ngradients against torch float64 (loss {l64:.6f})")
    print(f"{'side':14} {'loss err':>9} {'all grads':>10} {'body':>9} {'stem':>9} {'median p':>9} "
          f"{'gate total':>10} {'gate norms':>10}  worst parameter")
    rows = list(result["vs_float64"].items()) + [("gpu vs t32", result["ours_gpu_vs_torch32"])]
    for k, r in rows:
        print(f"{k:14} {r['loss_rel_err']:9.2e} {r['all_grads_rel_l2']:10.2e} {r['body_grads_rel_l2']:9.2e} "
              f"{r['stem_grads_rel_l2']:9.2e} {r['median_param_rel_l2']:9.2e} {r['gate_total_norm_err']:10.2e} "
              f"{r['gate_norms_rel_l2']:10.2e}  {r['worst_param_rel_l2']:.2e} {r['worst_param']}")

    result["conditioning"] = timed("conditioning", lambda: conditioning(ref, x, device))
    c = result["conditioning"]
    print(f"\nconvolutions feeding a batch norm: log-correlation of (terms / spread) with the f32 error of the "
          f"normalised output: {c['log_correlation']:.2f}; worst {len(c['worst'])}:")
    print(f"{'conv':62} {'values/ch':>9} {'terms/spread med':>16} {'max':>9} {'f32 err':>9}")
    for r in c["worst"]:
        print(f"{r['conv']:62} {r['values_per_channel']:9d} {r['terms_over_spread_median']:16.1f} "
              f"{r['terms_over_spread_max']:9.1f} {r['f32_normalised_rel_l2']:9.2e}")
    result["maxpool_near_ties"] = maxpool_near_ties(ref, x, device)
    print(f"\nstem max pool: {result['maxpool_near_ties']}")

    if g64_ours is not None:
        ab = {}
        ref64 = sides["ours_numpy64"][1]
        names = sorted(ref64)
        flat = lambda g: np.concatenate([np.asarray(g[n], np.float64).ravel() for n in names])  # noqa: E731
        print("\nablation: our graph in f64 with one op kind in f32 (forward / backward nodes); gradient rel L2 "
              "from all-f64")
        for op in ABLATE_OPS:
            row = {}
            for phase in ("forward", "backward"):
                if any(t.op == op and ((t.id in g64_ours.forward) == (phase == "forward")) for t in g64_ours.nodes):
                    row[phase] = rel(flat(g64_ours.run({op}, phase)[1]), flat(ref64))
            ab[op] = row
            print(f"  {op:20} " + "  ".join(f"{p} {v:.2e}" for p, v in row.items()), flush=True)
        ab["all_ops_f32"] = rel(flat(sides["ours_numpy32"][1]), flat(ref64))
        print(f"  {'every op (f32 run)':20} {ab['all_ops_f32']:.2e}")
        result["ablation"] = ab
        # where in depth: one conv in f32, and f32-sized noise (the conditioning table's
        # median error of a normalised output) added to conv outputs in f64
        convs = g64_ours.convs()
        size = float(np.median([r["f32_normalised_rel_l2"] for r in c["worst"]]))
        sens = {"noise_rel_spread": size,
                "stem_conv_f32": rel(flat(g64_ours.run(f32_nodes={convs[0].id})[1]), flat(ref64)),
                "last_conv_f32": rel(flat(g64_ours.run(f32_nodes={convs[-1].id})[1]), flat(ref64)),
                "stem_conv_noise": rel(flat(g64_ours.run(noise_nodes={convs[0].id}, noise=size)[1]), flat(ref64)),
                "last_conv_noise": rel(flat(g64_ours.run(noise_nodes={convs[-1].id}, noise=size)[1]), flat(ref64)),
                "every_conv_noise": rel(flat(g64_ours.run(noise_nodes={t.id for t in convs}, noise=size)[1]),
                                        flat(ref64))}
        result["depth_sensitivity"] = sens
        print(f"\ndepth: gradient rel L2 from all-f64 when one conv runs in f32, or conv outputs get "
              f"{size:.1e} x spread of noise")
        for k, v in sens.items():
            if k != "noise_rel_spread":
                print(f"  {k:18} {v:.2e}")

    if steps:
        curves = {}
        with torch_precision("strict"):
            curves["torch64"] = timed("curve torch64", lambda: torch_curve(ref, x, labels, torch.float64, device,
                                                                           steps, args.lr))
            curves["torch32"] = timed("curve torch32", lambda: torch_curve(ref, x, labels, torch.float32, device,
                                                                           steps, args.lr))
        curves["ours_gpu"] = timed("curve ours_gpu", lambda: our_curve(cfg, x, labels, state, "gpu", steps, args.lr))
        diff = lambda a, b: [abs(p - q) / abs(q) for p, q in zip(a, b)]  # noqa: E731
        cmp = {"torch32_vs_torch64": diff(curves["torch32"], curves["torch64"]),
               "ours_gpu_vs_torch64": diff(curves["ours_gpu"], curves["torch64"]),
               "ours_gpu_vs_torch32": diff(curves["ours_gpu"], curves["torch32"])}
        result["curve"] = {"steps": steps, "lr": args.lr, "losses": curves, "rel_diff": cmp,
                           "max_rel_diff": {k: max(v) for k, v in cmp.items()}}
        print(f"\nAdamW curve, {steps} steps (lr {args.lr}): first/last loss "
              + ", ".join(f"{k} {v[0]:.6f}/{v[-1]:.6f}" for k, v in curves.items()))
        for k, v in cmp.items():
            print(f"  max per-step rel diff {k:22} {max(v):.2e} (step {int(np.argmax(v)) + 1})")

    result["timings_s"] = timings
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(result, f, indent=1)
    print(f"wrote {out_path}")
    return result


if __name__ == "__main__":
    main()
