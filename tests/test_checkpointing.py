"""Activation checkpointing a user asks for (mg.nn.checkpoint, Module.activation_checkpointing):
the same loss and gradients, less planned memory."""
import numpy as np
import pytest

import meganeura as mg
from meganeura import nn
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

CFG = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
                  num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256)
B, S = 2, 64


def _session(checkpointed):
    nn.init.manual_seed(0)
    model = LlamaForCausalLM(CFG)
    for layer in model.model.layers:
        layer.activation_checkpointing = checkpointed
    g = mg.Graph()
    ids, target = g.input("ids", (B, S), mg.i32), g.input("target", (B * S,), mg.i32)
    loss = mg.ops.cross_entropy(mg.ops.reshape(model(ids), (B * S, CFG.vocab_size)), target)
    return mg.compile(g, loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend="numpy")


def _planned(session, phase="step"):
    fetches, grad_names, upd, targets = session.program.targets(phase)
    base = len(fetches) + len(grad_names)
    return compile_plan(targets, n_forward=len(fetches), options=CompileOptions(),
                        updates={base + j: n for j, (n, _) in enumerate(upd)})


def test_checkpointed_layers_same_gradients_less_planned_memory():
    rng = np.random.default_rng(0)
    feeds = {"ids": rng.integers(0, 64, (B, S)).astype(np.int32), "target": rng.integers(0, 64, B * S).astype(np.int32)}
    plain, ck = _session(False), _session(True)
    assert len(mg.autodiff.checkpointed_regions(ck.graph)) == CFG.num_hidden_layers
    assert ck.compute_grads(feeds) == plain.compute_grads(feeds)
    g0, g1 = plain.grads(), ck.grads()
    for k in g0:
        np.testing.assert_allclose(g1[k], g0[k], rtol=1e-5, atol=1e-8, err_msg=k)
    m0, m1 = _planned(plain).memory, _planned(ck).memory
    print(f"planned intermediates {m0.bytes_with / 2**20:.2f} MiB -> {m1.bytes_with / 2**20:.2f} MiB checkpointed "
          f"(live peak {m0.live_peak / 2**20:.2f} -> {m1.live_peak / 2**20:.2f})")
    assert m1.bytes_with < 0.8 * m0.bytes_with and m1.live_peak < 0.8 * m0.live_peak


def test_checkpoint_function_on_gpu_matches_and_is_reported():
    nn.init.manual_seed(1)
    mlp = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh())
    head = nn.Linear(16, 3)
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal((4, 8)).astype(np.float32), rng.integers(0, 3, 4).astype(np.int32)
    start = mlp.state_dict(), head.state_dict()
    results = []
    for use in (False, True):
        mlp.load_state_dict(start[0])
        head.load_state_dict(start[1])
        def loss_fn(x, y):
            h = nn.checkpoint(mlp, x) if use else mlp(x)
            return mg.ops.cross_entropy(head(h), y)
        step = mg.jit(loss_fn, optimizer=mg.optim.SGD(lr=0.5), backend="gpu")
        losses = [step(x, y) for _ in range(3)]
        results.append((losses, {**mlp.state_dict(), **{"head." + k: v for k, v in head.state_dict().items()}}))
        sess = next(iter(step.sessions.values()))
        assert ("checkpointed region" in sess.memory_report()) == use
    np.testing.assert_allclose(results[1][0], results[0][0], rtol=1e-5)
    for k, v in results[0][1].items():
        np.testing.assert_allclose(results[1][1][k], v, rtol=1e-5, atol=1e-7, err_msg=k)


def test_checkpoint_outside_a_graph_is_refused():
    with pytest.raises(TypeError, match="checkpoint: call it on mg Tensors"):
        nn.checkpoint(lambda a: a, np.ones(3))
