"""PyTorch's own OpInfo float32 samples (torch.testing._internal.common_methods_invocations,
which needs the ``expecttest`` package) run through every op we have, forward only:

    python -m tests.torch_opinfo [--backend numpy|gpu] [--op NAME] [-v]

Each sample is built on our side from its tensors (graph inputs) and its other arguments
as they are, then evaluated and compared with torch's output (1e-4 relative, 1e-5
absolute). A sample passes, is rejected (our op raised: a clear refusal), or is wrong (a
number without an error: the case that must not happen). Prints per-op counts and the
pass rate.
"""
from __future__ import annotations

import argparse
import sys
from collections import Counter

import numpy as np
import torch

# torch name (OpInfo ``name`` or ``name.variant``) -> our function's name in mg.ops
OURS = {
    "nn.functional.relu": "relu", "nn.functional.gelu": "gelu", "nn.functional.silu": "silu",
    "nn.functional.linear": "linear", "nn.functional.embedding": "embedding",
    "nn.functional.layer_norm": "layer_norm", "nn.functional.group_norm": "group_norm",
    "nn.functional.rms_norm": "rms_norm", "nn.functional.batch_norm": "batch_norm",
    "nn.functional.mse_loss": "mse_loss", "nn.functional.cross_entropy": "cross_entropy",
    "nn.functional.one_hot": "one_hot", "nn.functional.conv1d": "conv1d", "nn.functional.conv2d": "conv2d",
    "nn.functional.max_pool2d": "max_pool2d", "nn.functional.avg_pool2d": "avg_pool2d",
    "nn.functional.adaptive_avg_pool2d": "adaptive_avg_pool2d", "nn.functional.softplus": "softplus",
    "nn.functional.leaky_relu": "leaky_relu", "nn.functional.pad": "pad",
    "nn.functional.scaled_dot_product_attention": "scaled_dot_product_attention",
}
SKIP_PREFIXES = ("masked.", "sparse.", "_refs.", "special.", "linalg.", "fft.")
NOT_OURS = {"unfold"}        # Tensor.unfold (sliding windows of one dim), not F.unfold (im2col)
# OpInfo entries whose ``op`` takes its arguments in another order than the torch function
ARGS_ORDER = {"where": lambda fn: lambda x, cond, other: fn(cond, x, other),
              "nn.functional.embedding": lambda fn: lambda weight, idx, **kw: fn(idx, weight, **kw),
              "masked_fill": lambda fn: lambda x, mask, value: fn(x, mask, value)}


def our_ops():
    import meganeura as mg
    from torch.testing._internal.common_methods_invocations import op_db
    out = []
    for op in op_db:
        full = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
        if op.name.startswith(SKIP_PREFIXES) or torch.float32 not in op.supported_dtypes("cpu"):
            continue
        mine = OURS.get(op.name, op.name if "." not in op.name else None)
        fn = getattr(mg.ops, mine, None) if mine and op.name not in NOT_OURS else None
        if fn is not None:
            out.append((full, op, ARGS_ORDER[op.name](fn) if op.name in ARGS_ORDER else fn))
    return out


def _to_graph(x, g, feeds):
    """Tensors (nested in lists and tuples) become graph inputs; the rest stays as it is."""
    import meganeura as mg
    if isinstance(x, torch.Tensor):
        a = x.detach().numpy()
        if a.dtype == np.bool_:
            a = a.astype(np.uint32)
        elif a.dtype.kind in "iu":
            a = a.astype(np.int32)
        elif a.dtype == np.float64:
            a = a.astype(np.float32)
        name = f"x{len(feeds)}"
        feeds[name] = a
        return g.input(name, a.shape, mg.graph.dtype_of(a.dtype))
    if isinstance(x, (list, tuple)):
        return type(x)(_to_graph(i, g, feeds) for i in x)
    return x


def _flat(x):
    if isinstance(x, (list, tuple)):
        return [v for i in x for v in _flat(i)]
    return [x]


def run_sample(fn, op, sample, backend):
    """'pass', 'rejected: ...' or 'wrong: ...'."""
    import meganeura as mg
    from meganeura.reference import evaluate
    with torch.no_grad():
        ref = op.op(sample.input, *sample.args, **sample.kwargs)
    refs = [r for r in _flat(ref) if isinstance(r, torch.Tensor)]
    g, feeds = mg.Graph(), {}
    try:
        args = _to_graph([sample.input, *sample.args], g, feeds)
        kwargs = {k: _to_graph(v, g, feeds) for k, v in sample.kwargs.items()}
        out = fn(*args, **kwargs)
        outs = [o for o in _flat(out) if isinstance(o, mg.Tensor)]
        if len(outs) != len(refs):
            return f"wrong: {len(outs)} outputs, torch gives {len(refs)}"
        if backend == "numpy":
            vals = evaluate(g, outs, feeds)
        else:
            vals = mg.compile(g, outputs=outs, backend=backend).run({k: v for k, v in feeds.items() if k in g.inputs})
    except Exception as e:      # a refusal: what the user sees is an error, not a number
        return f"rejected: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}"
    for o, r in zip(vals, refs):
        r = r.numpy()
        o = np.asarray(o)
        if o.shape != r.shape:
            return f"wrong: shape {o.shape}, torch {r.shape}"
        if r.dtype == np.bool_:
            r = r.astype(o.dtype)
        if not np.allclose(o.astype(np.float64), r.astype(np.float64), rtol=1e-4, atol=1e-5, equal_nan=True):
            err = np.max(np.abs(o.astype(np.float64) - r) / (np.abs(r) + 1e-5)) if r.size else 0
            return f"wrong: max relative error {err:.3g}"
    return "pass"


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backend", default="numpy")
    p.add_argument("--op", action="append", help="only these torch op names (repeatable)")
    p.add_argument("--exclude", action="append", default=[], help="leave these torch op names out (repeatable)")
    p.add_argument("-v", action="store_true", help="print every sample that does not pass")
    args = p.parse_args(argv)
    totals, per_op = Counter(), {}
    for full, op, fn in our_ops():
        if args.op and full not in args.op and op.name not in args.op or op.name in args.exclude:
            continue
        c = Counter()
        for k, sample in enumerate(op.sample_inputs("cpu", torch.float32, requires_grad=False)):
            res = run_sample(fn, op, sample, args.backend)
            kind = res.split(":")[0]
            c[kind] += 1
            if args.v and kind != "pass":
                print(f"  {full} sample {k}: {res}")
        per_op[full] = c
        totals.update(c)
    for full, c in sorted(per_op.items()):
        if c["pass"] != sum(c.values()):
            print(f"{full:45s} pass {c['pass']:3d}  rejected {c['rejected']:3d}  wrong {c['wrong']:3d}")
    n = sum(totals.values())
    print(f"{len(per_op)} ops, {n} samples on {args.backend}: pass {totals['pass']} ({100 * totals['pass'] / max(n, 1):.1f}%), "
          f"rejected {totals['rejected']}, wrong {totals['wrong']}")
    return totals


if __name__ == "__main__":
    sys.exit(0 if main() is not None else 1)
