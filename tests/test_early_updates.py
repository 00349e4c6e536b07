"""Updates applied as soon as their gradients are complete (passes/order.py): a training
step's gradients are not all live at once, the step trains exactly as with the updates at
the end, and activation checkpointing with it gives the plain step's loss and weights."""
import numpy as np
import pytest

import meganeura as mg
from meganeura import nn
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.memplan import check_plan
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=64)
S = 16


def _graph(checkpointed):
    nn.init.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    for layer in model.model.layers:
        layer.activation_checkpointing = checkpointed
    g = mg.Graph()
    ids, target = g.input("ids", (1, S), mg.i32), g.input("target", (S,), mg.i32)
    loss = mg.ops.cross_entropy(mg.ops.reshape(model(ids), (S, CFG.vocab_size)), target)
    return g, loss


def _feeds():
    rng = np.random.default_rng(0)
    return {"ids": rng.integers(0, 64, (1, S)).astype(np.int32), "target": rng.integers(0, 64, S).astype(np.int32)}


def _step_plan(session, disabled=frozenset()):
    fetches, grad_names, upd, targets = session.program.targets("step")
    base = len(fetches) + len(grad_names)
    return compile_plan(targets, n_forward=len(fetches), options=CompileOptions(disabled=frozenset(disabled)),
                        updates={base + j: n for j, (n, _) in enumerate(upd)})


def test_gradients_die_in_their_updates_during_the_backward_pass(monkeypatch):
    from meganeura.passes import order
    monkeypatch.setattr(order, "MIN_GROUP_BYTES", 0)     # groups of this tiny model's size
    g, loss = _graph(False)
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-3), backend="numpy")
    late, early = _step_plan(s, {"early_updates"}), _step_plan(s)
    for kp in (late, early):
        check_plan(kp.memory, [(d.kernel.written_bufs(), d.bufs) for d in kp.dispatches])
    # every parameter and moment is still written in place
    assert early.stats["in_place"] == late.stats["in_place"] == 3 * len(s.program.grads)
    writes = [i for i, d in enumerate(early.dispatches) if any(b.kind == "parameter" for b in d.kernel.written_bufs())]
    assert writes[0] < len(early.dispatches) // 2      # the first update runs early in the backward pass
    assert early.memory.live_peak < late.memory.live_peak
    assert early.memory.bytes_with < late.memory.bytes_with


# AdamW where the two programs run the same arithmetic (the interpreter); SGD with momentum on
# the GPUs, whose plans fuse the two programs differently: AdamW's second step divides by the
# root of its second moment, magnifying rounding where two steps' gradients nearly cancel
# (1e-5 of a weight on lavapipe), while a recomputation reading an already updated weight
# would still move SGD's result by about lr * grad
@pytest.mark.parametrize("backend,optimizer", [("numpy", lambda: mg.optim.AdamW(lr=1e-2)),
                                               ("gpu", lambda: mg.optim.SGD(lr=0.1, momentum=0.9)),
                                               ("wgpu", lambda: mg.optim.SGD(lr=0.1, momentum=0.9))],
                         ids=["numpy-adamw", "gpu-sgd", "wgpu-sgd"])
def test_checkpointed_step_equals_the_plain_step(backend, optimizer, monkeypatch):
    from meganeura.passes import order
    monkeypatch.setattr(order, "MIN_GROUP_BYTES", 0)
    feeds = _feeds()
    out, programs = [], []
    for ck in (False, True):
        g, loss = _graph(ck)
        s = mg.compile(g, loss=loss, optimizer=optimizer(), backend=backend)
        losses = [s.step(feeds) for _ in range(2)]
        out.append((losses, s.state_dict()))
        programs.append(sum(t.op == "recompute" for t in s.program.targets("step")[3][0].graph.nodes))
        s.close()
    assert programs[0] == 0 < programs[1]          # two programs: the second recomputes its layers
    (l0, w0), (l1, w1) = out
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    for k, v in w0.items():
        np.testing.assert_allclose(w1[k], v, rtol=1e-5, atol=1e-6, err_msg=k)


# eps=1e-6, not 1e-8: a weight whose gradient is a few 1e-8 (a near cancellation, rounded
# differently by each plan's summation order) moves by lr * g / (|g| + eps), whose slope in g
# is up to lr / (4 eps); with eps=1e-8 an f32 rounding of 2.5e-10 in such a gradient moved a
# weight 1.4e-5 from the interpreter's; with 1e-6 the worst weight is 2.4e-6 from it
@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_early_updates_train_as_updates_at_the_end(backend, monkeypatch):
    from meganeura.passes import order
    monkeypatch.setattr(order, "MIN_GROUP_BYTES", 0)
    feeds = _feeds()
    out = []
    for off in ("early_updates", ""):
        monkeypatch.setenv("MEGANEURA_NO_FUSE", off)
        g, loss = _graph(True)
        s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2, eps=1e-6), backend=backend)
        out.append(([s.step(feeds) for _ in range(2)], s.state_dict()))
        s.close()
    g, loss = _graph(True)
    ref = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2, eps=1e-6), backend="numpy")
    ref_losses = [ref.step(feeds) for _ in range(2)]
    (l0, w0), (l1, w1) = out
    np.testing.assert_allclose(l1, l0, rtol=1e-5)
    np.testing.assert_allclose(l1, ref_losses, rtol=1e-4)
    for k, v in w0.items():
        np.testing.assert_allclose(w1[k], v, rtol=1e-5, atol=1e-6, err_msg=k)
        np.testing.assert_allclose(w1[k], ref.state_dict()[k], rtol=1e-4, atol=1e-5, err_msg=k)


def test_role_breakdown_sees_the_gradients_go(monkeypatch):
    from meganeura.bench.memory_roles import role_breakdown
    from meganeura.passes import order
    monkeypatch.setattr(order, "MIN_GROUP_BYTES", 0)
    g, loss = _graph(False)
    s = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-3), backend="numpy")
    late, early = (role_breakdown(kp, kp.target_locs[0][0], S * CFG.vocab_size * 4)
                   for kp in (_step_plan(s, {"early_updates"}), _step_plan(s)))
    n_params = sum(int(np.prod(p.shape)) for p in g.parameters.values())
    assert late["persistent"]["weights"] * 2 ** 20 == pytest.approx(4 * n_params)
    assert late["persistent"]["optimizer_moments"] == pytest.approx(2 * late["persistent"]["weights"])
    # with the updates at the end every gradient is live at once
    assert late["most_live"]["gradients"] == pytest.approx(late["persistent"]["weights"], rel=1e-3)
    assert early["most_live"]["gradients"] < 0.5 * late["most_live"]["gradients"]
