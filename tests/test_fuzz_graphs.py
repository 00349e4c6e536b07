"""Seeded random graphs on both GPU backends against the NumPy interpreter (float64):
outputs and, for most graphs, the gradients of every input, with empty and size-1
dimensions among the shapes (an empty reduction is 0 or NaN, as torch; NaN must come
out where the interpreter gives NaN).

The ops and their safe arguments are ``test_graph_properties``'s; here the programs are
drawn with a NumPy generator (no shrinking: a failure names its seed and the program)
and only valid programs are kept, built in batches of independent programs sharing one
graph, so one compile and one run serve ``BATCH`` programs: ``GRAPHS`` graphs a run in
well under a minute on lavapipe. A batch that fails is run again program by program to
name the one at fault."""
import os

import numpy as np
import pytest

import meganeura as mg
from meganeura.reference import evaluate

from .test_graph_properties import BINARY, UNARY

GRAPHS = int(os.environ.get("MEGANEURA_FUZZ_GRAPHS", "320"))
BATCH = 40
SEED = int(os.environ.get("MEGANEURA_FUZZ_SEED", "50"))     # another seed fuzzes other graphs
REFUSED = (mg.ShapeError, TypeError, ValueError)
DIMS = [0, 1, 1, 2, 3, 4, 2, 3]          # an empty dimension now and then, size 1 often


def _shape(rng, rank=None):
    rank = int(rng.integers(0, 4)) if rank is None else rank
    return tuple(int(rng.choice(DIMS)) for _ in range(rank))


def _pick(rng, pool):
    return pool[int(rng.integers(len(pool)))]


def _apply(rng, pool):
    """One random op on tensors of ``pool`` (it may be refused: the caller draws again)."""
    x = _pick(rng, pool)
    kind = str(rng.choice(["unary", "binary", "binary", "reduce", "reduce", "softmax", "norm", "reshape",
                           "permute", "slice", "concat", "broadcast", "unsqueeze"]))
    axis = lambda: int(rng.integers(-x.ndim, x.ndim)) if x.ndim else 0    # noqa: E731
    if kind == "unary":
        return UNARY[str(rng.choice(sorted(UNARY)))](x)
    if kind == "binary":
        return BINARY[str(rng.choice(sorted(BINARY)))](x, _pick(rng, pool))
    if kind == "reduce":
        op = [mg.ops.sum, mg.ops.mean, mg.ops.amax, mg.ops.var][int(rng.integers(4))]
        dim = [None, axis(), [axis(), axis()]][int(rng.integers(3))]
        if 0 in x.shape and rng.integers(2):     # over an empty axis: 0, NaN, or refused (amax)
            dim = x.shape.index(0)
        return op(x, dim, bool(rng.integers(2)))
    if kind == "softmax":
        return [mg.ops.softmax, mg.ops.log_softmax][int(rng.integers(2))](x, axis())
    if kind == "norm":
        n = int(rng.integers(0, min(2, x.ndim) + 1))
        ns = x.shape[x.ndim - n:]
        if rng.integers(2):
            return mg.ops.layer_norm(x, ns, eps=1e-5)
        return mg.ops.rms_norm(x, ns, eps=1e-5)
    if kind == "reshape":
        shape = list(x.shape)
        rng.shuffle(shape)
        if shape and rng.integers(2):
            shape[int(rng.integers(len(shape)))] = -1
        return x.reshape(tuple(shape))
    if kind == "permute":
        return x.permute(tuple(int(i) for i in rng.permutation(x.ndim)))
    if kind == "slice":
        return mg.ops.slice(x, axis(), int(rng.integers(-3, 3)), int(rng.integers(-3, 4)), int(rng.integers(1, 3)))
    if kind == "concat":
        return mg.ops.concat([x, _pick(rng, pool)], axis())
    if kind == "broadcast":
        return mg.ops.broadcast_to(x, _shape(rng, x.ndim + int(rng.integers(0, 2)))[:-x.ndim or None] + x.shape
                                   if x.ndim else _shape(rng))
    return mg.ops.unsqueeze(x, int(rng.integers(-x.ndim - 1, x.ndim + 1)))


def add_program(g, rng, tag):
    """A random program of ``g`` under names ``tag``: (feeds, targets, what it is)."""
    base = _shape(rng)
    feeds, pool = {}, []
    for i in range(int(rng.integers(1, 4))):
        # mostly shapes that broadcast with each other (a suffix of one base shape, some
        # sizes 1), sometimes any shape
        if rng.integers(5):
            shape = tuple(1 if rng.integers(4) == 0 else d for d in base[int(rng.integers(len(base) + 1)):])
        else:
            shape = _shape(rng)
        name = f"{tag}in{i}"
        pool.append(g.input(name, shape))
        feeds[name] = rng.uniform(-2, 2, shape).astype(np.float32)
    inputs = list(pool)
    n_ops, tries = int(rng.integers(1, 6)), 0
    while len(pool) < len(inputs) + n_ops and tries < 40:
        tries += 1
        try:
            pool.append(_apply(rng, pool))
        except REFUSED:
            continue
    outs = [pool[-1]] + ([_pick(rng, pool[:-1])] if len(pool) > 1 and rng.integers(2) else [])
    targets = list(outs)
    if rng.integers(4):                     # three quarters also check the gradients
        loss = mg.ops.sum(outs[0] * outs[0]) * 0.25
        targets += [loss] + [gr for gr in mg.grad(loss, inputs) if gr is not None]
    what = f"{tag}: inputs {[t.shape for t in inputs]}, ops {[t.op for t in pool[len(inputs):]]}"
    return feeds, targets, what


def compare(got, want, what, strict_special=True):
    """Each target as the interpreter's; NaN and inf where it has them when
    ``strict_special`` (else only its finite elements are compared)."""
    for k, (a, b) in enumerate(zip(got, want)):
        assert a.shape == b.shape, f"{what}: target {k} has shape {a.shape}, expected {b.shape}"
        fin = np.isfinite(b)
        if strict_special:
            np.testing.assert_array_equal(np.isnan(a), np.isnan(b), err_msg=f"{what}: NaN positions of target {k}")
            np.testing.assert_array_equal(a[np.isinf(b)], b[np.isinf(b)], err_msg=f"{what}: infinities of target {k}")
        tol = 2e-4 * (1 + float(np.abs(b[fin]).max(initial=0)))
        np.testing.assert_allclose(a[fin], b[fin], rtol=2e-4, atol=tol, err_msg=f"{what}: target {k}")


def run_batch(programs, backend):
    """Build ``programs`` [(seed, tag)] into one graph, compile it for ``backend`` and
    compare every target with the interpreter; the number of graphs checked."""
    g = mg.Graph()
    feeds, targets, spans = {}, [], []
    for seed, tag in programs:
        f, t, what = add_program(g, np.random.default_rng(seed), tag)
        feeds.update(f)
        spans.append((len(targets), len(targets) + len(t), f"seed {seed} {what}"))
        targets += t
    with np.errstate(all="ignore"):
        want = evaluate(g, targets, feeds, compute=np.float64)
    with mg.compile(g, outputs=targets, backend=backend) as s:
        got = s.run(feeds)
    # NaN and inf (a mean over an empty axis, a variance of one element) are checked where the
    # kernels ask the driver to preserve them (the direct Vulkan backend); WGSL cannot ask,
    # and a driver then folds x + (-x) or (a + b) - b to finite values whatever x is
    # (``codegen.expr.ieee_guard`` keeps the literal folds exact on both)
    for lo, hi, what in spans:
        compare(got[lo:hi], want[lo:hi], f"{backend}, {what}", strict_special=backend != "wgpu")
    special = sum(not np.isfinite(w).all() for w in want)
    return len(programs), sum(t.size == 0 for t in targets), sum(hi - lo > 2 for lo, hi, _ in spans), special


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_random_graphs_match_the_interpreter(backend):
    programs = [(SEED * 100_000 + i, f"p{i}_") for i in range(GRAPHS)]
    tally = np.zeros(4, int)       # graphs, empty targets, graphs with gradients, targets with NaN or inf
    for start in range(0, GRAPHS, BATCH):
        batch = programs[start:start + BATCH]
        try:
            tally += run_batch(batch, backend)
        except AssertionError:
            for p in batch:                 # name the program at fault
                run_batch([p], backend)
            raise
    graphs, empty, with_grads, special = tally
    print(f"{backend}: {graphs} graphs, {empty} empty targets, {with_grads} with gradients, "
          f"{special} targets with NaN or inf")
    assert graphs >= 300 and empty >= 20 and with_grads >= GRAPHS // 2 and special >= 10
