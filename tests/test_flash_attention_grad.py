"""The flash attention backward (dQ, dK, dV from the forward's saved log-sum-exp, without
the Lq x Lk matrices) and the forward's second output, against PyTorch's CPU SDPA in
float64 on the GPU: every mask kind, causal with Lq < Lk and Lq > Lk, grouped heads,
broadcast kv heads, partial tiles, D = 64, D not a multiple of 4 and heads wider than one
64-column chunk; head-split views and fused epilogues in a model-like graph; routing.
Small shapes are forced onto the flash path by switching the one-row kernel off."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import attention as attn, flash, flash_grad
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.ops.registry import emit

from .samples_attention import head_split_block, sdpa_graph

torch = pytest.importorskip("torch")

CASES = {
    # name: (q shape, k shape, v width, mask kind, causal, gqa)
    "d64_partial_tiles": ((1, 2, 70, 64), (1, 2, 130, 64), 64, None, False, False),
    "causal_lq_lt_lk_odd_d": ((2, 1, 40, 5), (2, 1, 150, 5), 7, None, True, False),
    "causal_gqa_lq_gt_lk": ((1, 4, 70, 33), (1, 2, 50, 33), 70, None, True, True),
    "float_mask_masked_rows": ((1, 2, 36, 16), (1, 2, 90, 16), 24, "float", False, False),
    "int_mask_masked_rows": ((2, 2, 36, 8), (2, 2, 70, 8), 40, "int", False, False),
    "broadcast_kv_head": ((1, 3, 50, 16), (1, 1, 60, 16), 16, None, False, False),
    "wide_d130_dv200_mask": ((1, 1, 20, 130), (1, 1, 70, 130), 200, "float", False, False),
}


@pytest.fixture
def flash_only(monkeypatch):
    monkeypatch.setattr(attn, "MAX_ROW_WORK", 0)
    monkeypatch.setattr(attn, "ACCELERATED_MAX_ROW_WORK", 0)


def _feeds(name):
    qs, ks, dv, mask, causal, gqa = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    feeds = {"q": rng.standard_normal(qs), "k": rng.standard_normal(ks), "v": rng.standard_normal(ks[:-1] + (dv,))}
    if mask == "float":
        m = np.where(rng.random((qs[-2], ks[-2])) < 0.3, -np.inf, rng.standard_normal((qs[-2], ks[-2])))
        m[0, :] = -np.inf                          # a fully masked row: zero gradients
        feeds["m"] = m
    elif mask == "int":
        m = (rng.random(qs[:-1] + (ks[-2],)) < 0.6).astype(np.int32)
        m[..., 1, :] = 0
        feeds["m"] = m
    feeds["w"] = rng.standard_normal(qs[:-1] + (dv,))      # the loss: sum(out * w)
    return {n: a.astype(np.int32 if a.dtype.kind == "i" else np.float32) for n, a in feeds.items()}


def _torch_grads(feeds, mask, causal, gqa):
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=n in "qkv") for n, a in feeds.items() if n != "m"}
    m = feeds.get("m")
    tm = None if m is None else torch.tensor(m != 0) if mask == "int" else torch.tensor(m, dtype=torch.float64)
    out = torch.nn.functional.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=tm, is_causal=causal,
                                                           enable_gqa=gqa)
    out = torch.nan_to_num(out, nan=0.0)          # torch's math path gives NaN rows where all is masked
    (out * t["w"]).sum().backward()
    return [out.detach().numpy()] + [torch.nan_to_num(t[n].grad, nan=0.0).numpy() for n in "qkv"]


def _close(got, want, what):
    err = np.abs(got - want).max() / max(np.abs(want).max(), 1e-30)
    assert err < 2e-6, f"{what}: max error {err:.2e} of the largest magnitude"


@pytest.mark.parametrize("name", list(CASES))
def test_flash_backward_matches_torch(name, flash_only):
    _check_backward(name)


@pytest.mark.parametrize("name", ["d64_partial_tiles", "causal_lq_lt_lk_odd_d", "int_mask_masked_rows",
                                  "broadcast_kv_head"])
def test_backward_keeps_the_own_operands_resident_with_48k(monkeypatch, name, flash_only):
    """With 48 KiB of workgroup memory (an H200's) and heads of at most 64 columns, the
    backward stages the own rows' two operands once and only the walked rows' per tile.
    (lavapipe reports 32 KiB but runs larger workgroup arrays; the switches force the size
    and let the runtime make such kernels.)"""
    monkeypatch.setenv("MEGANEURA_FLASH_SMEM", "49152")
    monkeypatch.setenv("MEGANEURA_VK_WORKGROUP_MEMORY", "49152")
    kp = _check_backward(name)
    grads = [d.wgsl for d in kp.dispatches if d.kernel.spec.get("grad")]
    assert len(grads) == 2 and all("var<workgroup> XV" in src for src in grads)


def _check_backward(name):
    qs, ks, dv, mask, causal, gqa = CASES[name]
    feeds = _feeds(name)
    g, ins, out = sdpa_graph(feeds, causal, gqa)
    grads = mg.grad(mg.ops.sum(out * ins["w"]), [ins[n] for n in "qkv"])
    kp = compile_plan([out] + grads, n_forward=1, options=CompileOptions(max_bindings=32))
    # the forward with its LSE, D = rowsum(dO * O), dQ, then dK and dV: no Lq x Lk matrix
    attention = [n for n in kp.names if "attention" in n]
    assert attention == ["flash_attention+lse", "flash_attention_dq", "flash_attention_dkv"], kp.names
    assert kp.n_dispatches == 5 and not any("matmul" in n or "softmax" in n for n in kp.names), kp.names
    got = mg.compile(g, outputs=[out] + grads, backend="gpu").run(feeds)
    for x, want, what in zip(got, _torch_grads(feeds, mask, causal, gqa), ("out", "dq", "dk", "dv")):
        _close(x, want, what)
    if mask is not None:                          # a fully masked query row has no gradient
        row = 0 if mask == "float" else 1
        assert np.all(got[1][..., row, :] == 0)
    return kp


def test_lse_is_a_second_output_of_the_forward_kernel(flash_only):
    """Fetching the output and its log-sum-exp runs one kernel with two outputs, both
    planned in memory like any other value."""
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal((2, 2, 45, 12)).astype(np.float32) for n in "qkv"}
    feeds["m"] = np.where(rng.random((45, 45)) < 0.5, -np.inf, 0.0).astype(np.float32)
    feeds["m"][3] = -np.inf
    g = mg.Graph()
    q, k, v, m = (g.input(n, feeds[n].shape) for n in "qkvm")
    attrs = {"is_causal": False, "scale": 0.3, "enable_gqa": False}
    out = mg.ops.scaled_dot_product_attention(q, k, v, m, scale=0.3)
    lse = emit("attention_lse", [q, k, v, m], **attrs)
    kp = compile_plan([out, lse])
    assert kp.names == ["flash_attention+lse"], kp.names
    k0 = kp.dispatches[0].kernel
    assert len(k0.written_bufs()) == 2 and set(k0.written_bufs()) <= set(kp.bufs)
    want = mg.compile(g, outputs=[out, lse], backend="numpy").run(feeds)
    got = mg.compile(g, outputs=[out, lse], backend="gpu").run(feeds)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-5, atol=2e-6)
    assert np.all(np.isposinf(got[1][:, :, 3])) and np.all(np.isposinf(want[1][:, :, 3]))
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-5)
    s = np.einsum("bhid,bhjd->bhij", feeds["q"].astype(np.float64), feeds["k"].astype(np.float64)) * 0.3 + feeds["m"]
    with np.errstate(divide="ignore"):
        ref = np.log(np.exp(s).sum(-1))
    live = np.isfinite(ref)
    np.testing.assert_allclose(got[1][live], ref[live], rtol=1e-5, atol=1e-5)


def test_only_some_gradients_and_model_like_views(flash_only):
    """Head splits of projections (transposed views) in and out, a residual after the
    attention, gradients of the q and k weights only (dV goes to scratch): against the
    NumPy reference."""
    g, o, ws, feeds, vals = head_split_block(2, 70, 3, 16, seed=7, causal=True, weights="parameter")
    loss = mg.ops.mean(o * o)
    grads = mg.grad(loss, [ws["q"], ws["k"]])
    kp = compile_plan([loss] + grads, n_forward=1)
    assert sum("attention" in n for n in kp.names) == 3, kp.names
    want = mg.compile(g, outputs=[loss] + grads, backend="numpy")
    got = mg.compile(g, outputs=[loss] + grads, backend="gpu")
    for s in (want, got):
        for n, a in vals.items():
            s.assign({n: a})
    for a, e in zip(got.run(feeds), want.run(feeds)):
        np.testing.assert_allclose(a, e, rtol=1e-4, atol=1e-6)


def _train_names(length, heads=2, kv_heads=2, causal=False):
    g = mg.Graph()
    q = g.input("q", (1, heads, length, 64))
    k, v = (g.input(n, (1, kv_heads, length, 64)) for n in "kv")
    out = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=heads != kv_heads)
    grads = mg.grad(mg.ops.sum(out * out), [q, k, v])
    return compile_plan([out] + grads, n_forward=1).names


def test_routing_of_the_gradient():
    """Where the forward takes the flash kernel (long rows) the gradient takes the flash
    backward; short rows keep the one-row forward and the decomposed gradient."""
    long = _train_names(400)
    assert [n for n in long if "attention" in n and ".sum" not in n] == ["flash_attention+lse", "flash_attention_dq",
                                                                         "flash_attention_dkv"], long
    # 2 heads x 13 own tiles: the backward splits its 13 walked tiles three ways, and the
    # partial gradients' three sums share one launch
    assert flash_grad.splits("dq", (1, 2, 400, 64), (1, 2, 400, 64)) == 3
    assert "flash_attention_dq.sum|flash_attention_dk.sum|flash_attention_dv.sum" in long, long
    short = _train_names(40)
    assert "attention" in short and not any("flash" in n for n in short), short
    assert any("matmul" in n for n in short)
    # Whisper's and SmolLM2's real shapes stay far inside the loop bound
    for kind in ("dq", "dkv"):
        assert flash_grad.loop_trips(kind, 1500, 1500, 64, 64, 1) * 4 < flash.LOOP_BOUND
        assert flash_grad.loop_trips(kind, 2048, 2048, 64, 64, 3) < flash.LOOP_BOUND


def test_backward_dispatches_drop():
    """Long-sequence training: the flash backward is three dispatches (D, dQ, dK+dV) where
    the decomposition needs the scores, softmax and its backward, and four matmuls."""
    flash_names = _train_names(400, heads=4, kv_heads=2, causal=True)
    saved = attn.MAX_ROW_WORK, flash.LOOP_BOUND
    try:
        attn.MAX_ROW_WORK, flash.LOOP_BOUND = 0, 0
        dec = _train_names(400, heads=4, kv_heads=2, causal=True)
    finally:
        attn.MAX_ROW_WORK, flash.LOOP_BOUND = saved
    assert len(flash_names) + 4 <= len(dec), (flash_names, dec)
