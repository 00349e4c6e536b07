"""The flash attention kernel (query tiles, key tiles, online softmax) against the NumPy
reference and PyTorch's CPU SDPA on the GPU: every mask kind, grouped heads, Lq != Lk,
partial tiles, odd and wide head dims, strided views, a fused epilogue; routing and
dispatch counts at a scaled-down Whisper shape. Small shapes are forced onto the flash
path by switching the one-row kernel off."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import attention as attn, flash
from meganeura.compiler import CompileOptions, compile_plan

from .samples_attention import head_split_block, sdpa_graph

CASES = {
    # name: (q shape, k shape, v width, mask kind, causal, gqa)
    "d64_partial_tiles": ((1, 2, 70, 64), (1, 2, 130, 64), 64, None, False, False),
    "causal_lq_gt_lk": ((1, 2, 100, 64), (1, 2, 60, 64), 64, None, True, False),
    "causal_lq_lt_lk_odd_d": ((2, 1, 40, 5), (2, 1, 150, 5), 7, None, True, False),
    "float_mask_masked_rows": ((1, 2, 36, 16), (1, 2, 90, 16), 24, "float", False, False),
    "int_mask_masked_rows": ((2, 2, 36, 8), (2, 2, 70, 8), 40, "int", False, False),
    "gqa_causal_odd_d": ((1, 4, 70, 33), (1, 2, 50, 33), 70, None, True, True),
    "batch_dims_float_mask": ((2, 2, 2, 9, 8), (2, 2, 2, 66, 8), 8, "float", False, False),
    "wide_d256": ((1, 1, 20, 256), (1, 1, 70, 256), 256, None, False, False),
    "d130_dv200_mask": ((1, 1, 20, 130), (1, 1, 70, 130), 200, "float", False, False),
}


@pytest.fixture
def flash_only(monkeypatch):
    """Small shapes take the flash kernel instead of the one-row kernel."""
    monkeypatch.setattr(attn, "MAX_ROW_WORK", 0)
    monkeypatch.setattr(attn, "ACCELERATED_MAX_ROW_WORK", 0)


def _case(name):
    qs, ks, dv, mask, causal, gqa = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    vs = ks[:-1] + (dv,)
    feeds = {"q": rng.standard_normal(qs), "k": rng.standard_normal(ks), "v": rng.standard_normal(vs)}
    scores = qs[:-1] + (ks[-2],)
    if mask == "float":
        mv = np.where(rng.random(scores[-2:]) < 0.3, -np.inf, rng.standard_normal(scores[-2:]))
        mv[0, :] = -np.inf                       # a fully masked row: zeros
        feeds["m"] = mv
    elif mask == "int":
        mv = (rng.random(scores[-3:]) < 0.6).astype(np.int32)
        mv[..., 1, :] = 0
        feeds["m"] = mv
    return {n: a.astype(np.int32 if a.dtype.kind == "i" else np.float32) for n, a in feeds.items()}


@pytest.mark.parametrize("name", list(CASES))
def test_flash_matches_reference_and_torch(name, flash_only):
    qs, ks, dv, mask, causal, gqa = CASES[name]
    feeds = _case(name)
    g, ins, out = sdpa_graph(feeds, causal, gqa)
    kp = compile_plan([out], options=CompileOptions(max_bindings=32))
    assert kp.names == ["flash_attention"], kp.names
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=2e-6)
    if mask is not None:                          # the fully masked row gives zeros
        assert np.all(got[..., 0 if mask == "float" else 1, :] == 0)
    torch = pytest.importorskip("torch")
    F = torch.nn.functional
    m = feeds.get("m")
    tm = None if m is None else torch.tensor(m != 0) if mask == "int" else torch.tensor(m)
    ref = F.scaled_dot_product_attention(*(torch.tensor(feeds[n], dtype=torch.float64) for n in "qkv"),
                                         attn_mask=None if tm is None else tm.to(torch.float64) if mask == "float" else tm,
                                         is_causal=causal, enable_gqa=gqa)
    ref = torch.nan_to_num(ref, nan=0.0).numpy()     # torch's math path gives NaN for fully masked rows
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)


def test_flash_reads_strided_views_and_fuses_epilogue(flash_only):
    """q, k, v as head splits of (batch, seq, heads * dim) projections (transposed views)
    are read in place; the output's transpose back and a residual add after it are the
    kernel's store."""
    g, out, _, feeds, weights = head_split_block(2, 75, 3, 16, seed=3)
    feeds.update(weights)
    kp = compile_plan([out], options=CompileOptions(max_bindings=32))
    fl = [dp.kernel for dp in kp.dispatches if dp.kernel.archetype == "attention"]
    assert len(fl) == 1 and fl[0].spec.get("flash") and fl[0].epilogue is not None, kp.names
    assert kp.names[-1].startswith("flash_attention"), kp.names       # nothing runs after it
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def _whisper_like(length):
    g = mg.Graph()
    q, k, v = (g.input(n, (1, 6, length, 64)) for n in "qkv")
    return g, mg.ops.scaled_dot_product_attention(q, k, v)


def test_routing_short_flash_decomposition():
    """Decode and short prefill keep the one-row kernel, long sequences take the flash
    kernel (one dispatch instead of scores, softmax and probabilities), shapes past the
    flash kernel's loop bound decompose."""
    g, out = _whisper_like(400)                 # Whisper's encoder self-attention, scaled down
    kp = compile_plan([out])
    assert kp.names == ["flash_attention"], kp.names
    g = mg.Graph()
    q, k, v = g.input("q", (1, 6, 1, 64)), g.input("k", (1, 6, 300, 64)), g.input("v", (1, 6, 300, 64))
    assert compile_plan([mg.ops.scaled_dot_product_attention(q, k, v)]).names == ["attention"]
    q = g.input("q128", (1, 6, 128, 64))      # a 128-token prefill: Lq * Lk within MAX_ROW_WORK
    assert compile_plan([mg.ops.scaled_dot_product_attention(q, q, q)]).names == ["attention"]
    # in accelerated precision the flash kernels run on tensor cores and take it (not a decode)
    accel = CompileOptions(precision="accelerated")
    assert compile_plan([mg.ops.scaled_dot_product_attention(q, q, q)], options=accel).names[-1] == "flash_attention"
    q1 = g.input("q1", (1, 6, 1, 64))
    assert compile_plan([mg.ops.scaled_dot_product_attention(q1, k, v)], options=accel).names[-1] == "attention"
    g = mg.Graph()
    long = 64 * (flash.LOOP_BOUND // 40)        # more key tiles than the loop bound allows
    q, k, v = g.input("q", (1, 1, 64, 64)), g.input("k", (1, 1, long, 64)), g.input("v", (1, 1, long, 64))
    kp = compile_plan([mg.ops.scaled_dot_product_attention(q, k, v)])
    assert "flash_attention" not in kp.names and kp.n_dispatches > 1, kp.names
    assert flash.loop_trips(1500, 64, 64) * 20 < flash.LOOP_BOUND     # Whisper's shape: far inside


def test_whisper_like_shape_on_gpu():
    g, out = _whisper_like(400)
    rng = np.random.default_rng(5)
    feeds = {n: rng.standard_normal((1, 6, 400, 64)).astype(np.float32) for n in "qkv"}
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_whisper_encoder_dispatches_drop(monkeypatch):
    """A Whisper encoder at 400 positions: each layer's attention is one dispatch, three
    fewer than the decomposition (scores matmul, softmax, probabilities matmul)."""
    from dataclasses import replace

    from meganeura.bench.dispatches import BINDINGS
    from meganeura.models.whisper import WhisperEncoderConfig, build_whisper_encoder
    cfg = replace(WhisperEncoderConfig.tiny(), max_source_positions=400, d_model=64, encoder_attention_heads=2)
    counts = {}
    for on in (True, False):
        _, _, out = build_whisper_encoder(cfg, 1)
        if not on:                        # both attention kernels decline: the decomposition
            monkeypatch.setattr(flash, "LOOP_BOUND", 0)
            monkeypatch.setattr(attn, "MAX_ROW_WORK", 0)
        kp = compile_plan([out], options=CompileOptions(max_bindings=BINDINGS))
        counts[on] = kp.n_dispatches
        assert ("flash_attention" in " ".join(kp.names)) == on, kp.names
    assert counts[True] <= counts[False] - 2 * cfg.encoder_layers, counts


def test_tiles_follow_the_adapters_workgroup_memory(monkeypatch):
    """With an adapter's 48 KiB of workgroup memory the flash kernel takes twice the query
    rows per workgroup (half the workgroups); without a limit it keeps a portable 32 KiB.
    (Unsplit over keys, so that the grid counts query tiles alone.)"""
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "1")
    g, out = _whisper_like(1500)
    small = compile_plan([out]).dispatches[0]
    big = compile_plan([out], options=CompileOptions(workgroup_storage=49152)).dispatches[0]
    assert big.kernel.spec["smem"] == 49152 and "smem" not in small.kernel.spec
    assert (small.groups[0], big.groups[0]) == (6 * -(-1500 // 32), 6 * -(-1500 // 64))
