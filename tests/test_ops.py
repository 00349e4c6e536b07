"""Every op of the sample table: forward vs PyTorch, gradient vs torch.autograd and
central finite differences, on each backend."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.reference import evaluate

from .harness import assert_close, build, finite_difference_check, torch_reference
from .opinfo import all_samples

SAMPLES = all_samples()
IDS = [s.name for s in SAMPLES]


@pytest.mark.parametrize("sample", SAMPLES, ids=IDS)
def test_forward_matches_torch(sample):
    g, feeds, _, outs, _, _ = build(sample)
    ours = evaluate(g, outs, feeds)
    ref, _ = torch_reference(sample, with_grads=False)
    assert len(ours) == len(ref)
    for k, (o, r) in enumerate(zip(ours, ref)):
        assert_close(o, r, sample.rtol, sample.atol, f"{sample.name} output {k}")


@pytest.mark.parametrize("sample", [s for s in SAMPLES if s.grad], ids=[s.name for s in SAMPLES if s.grad])
def test_gradient_matches_torch_and_finite_differences(sample):
    g, feeds, float_inputs, outs, _, loss = build(sample)
    grads = mg.grad(loss, [t for _, t in float_inputs])
    ours = evaluate(g, grads, feeds)
    _, ref = torch_reference(sample)
    for (i, _), o in zip(float_inputs, ours):
        if i in sample.no_grad_inputs:
            continue
        assert_close(o, ref[i], sample.rtol, sample.atol, f"{sample.name} d/input{i}")
    if sample.fd:
        finite_difference_check(sample, g, feeds, float_inputs, loss, grads)
