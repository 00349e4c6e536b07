"""The flash forward split over keys (MEGANEURA_FLASH_SPLIT = S): S workgroups per query
tile write partial outputs and log-sum-exps, a combine kernel merges them. With S = 2 and
3 forced, the output and the LSE match PyTorch / float64 on the flash test cases (partial
tiles, causal with Lq > Lk and Lq < Lk, masks with fully masked rows, grouped heads, batch
dims, wide heads; splits with no key tile at all where S exceeds the tiles), gradients
through the split forward match, the output's epilogue fuses into the combine, and the
automatic rule (off until timed on a GPU) picks what it should."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import flash, flash_grad, flash_split
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.ops.attention import _scores_ref
from meganeura.ops.registry import emit

from . import test_flash_attention as fwd
from .samples_attention import head_split_block, inputs_like, sdpa_graph
from . import test_flash_attention_grad as bwd

torch = pytest.importorskip("torch")

SPLITS = (2, 3)
flash_only = fwd.flash_only


def _lse64(feeds, mask, causal, gqa, scale):
    """float64 log-sum-exp of each row's scaled, masked scores; +inf where all is masked."""
    m = feeds.get("m")
    m = None if m is None else m.astype(np.float64) if mask == "float" else m
    s = _scores_ref(feeds["q"].astype(np.float64), feeds["k"].astype(np.float64), m, causal, scale, gqa)
    top = s.max(-1)
    live = np.isfinite(top)
    with np.errstate(divide="ignore", invalid="ignore"):
        lse = top + np.log(np.exp(s - np.where(live, top, 0.0)[..., None]).sum(-1))
    return np.where(live, lse, np.inf)


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", list(fwd.CASES))
def test_split_forward_and_lse_match_torch(name, split, flash_only, monkeypatch):
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", str(split))
    qs, ks, dv, mask, causal, gqa = fwd.CASES[name]
    feeds = fwd._case(name)
    g = mg.Graph()
    ins = inputs_like(g, feeds)
    args = [ins["q"], ins["k"], ins["v"]] + ([ins["m"]] if "m" in ins else [])
    out = mg.ops.scaled_dot_product_attention(*args, is_causal=causal, enable_gqa=gqa)
    scale = out.attrs["scale"]
    lse = emit("attention_lse", args, is_causal=causal, scale=scale, enable_gqa=gqa)
    kp = compile_plan([out, lse], options=CompileOptions(max_bindings=32))
    assert kp.names == ["flash_attention_split", "flash_attention_combine+lse"], kp.names
    # S workgroups per query tile
    split_groups = kp.dispatches[0].groups
    bq = flash.rows_per_group(qs[-1])
    assert split_groups[0] * split_groups[1] == split * int(np.prod(qs[:-2])) * -(-qs[-2] // bq)
    got, got_lse = mg.compile(g, outputs=[out, lse], backend="gpu").run(feeds)
    m = feeds.get("m")
    tm = None if m is None else torch.tensor(m != 0) if mask == "int" else torch.tensor(m, dtype=torch.float64)
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(torch.tensor(feeds[n], dtype=torch.float64) for n in "qkv"), attn_mask=tm, is_causal=causal,
        enable_gqa=gqa)
    ref = torch.nan_to_num(ref, nan=0.0).numpy()     # torch's math path gives NaN for fully masked rows
    np.testing.assert_allclose(got, ref, rtol=1e-5, atol=2e-6)
    want_lse = _lse64(feeds, mask, causal, gqa, scale)
    assert np.array_equal(np.isposinf(got_lse), np.isposinf(want_lse))
    live = np.isfinite(want_lse)
    np.testing.assert_allclose(got_lse[live], want_lse[live], rtol=1e-5, atol=1e-5)
    if mask is not None:                          # the fully masked row: zeros and +inf
        row = 0 if mask == "float" else 1
        assert np.all(got[..., row, :] == 0) and np.all(np.isposinf(got_lse[..., row]))


@pytest.mark.parametrize("split", SPLITS)
@pytest.mark.parametrize("name", list(bwd.CASES))
def test_gradients_through_the_split_forward(name, split, flash_only, monkeypatch):
    """The backward reads the combined LSE: dQ, dK, dV still match torch in float64."""
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", str(split))
    qs, ks, dv, mask, causal, gqa = bwd.CASES[name]
    feeds = bwd._feeds(name)
    g, ins, out = sdpa_graph(feeds, causal, gqa)
    grads = mg.grad(mg.ops.sum(out * ins["w"]), [ins[n] for n in "qkv"])
    kp = compile_plan([out] + grads, n_forward=1, options=CompileOptions(max_bindings=32))
    attention = [n for n in kp.names if "attention" in n and ".sum" not in n]
    assert attention == ["flash_attention_split", "flash_attention_combine+lse", "flash_attention_dq",
                         "flash_attention_dkv"], kp.names
    # the switch splits the backward too, up to its walked tiles: partial gradients, summed
    split_bwd = [flash_grad.splits(kind, qs, ks) for kind in ("dq", "dkv")]
    assert [d.kernel.spec.get("split", 1) for d in kp.dispatches if d.kernel.spec.get("grad")] == split_bwd
    assert any(".sum" in n for n in kp.names) == (max(split_bwd) > 1), kp.names
    got = mg.compile(g, outputs=[out] + grads, backend="gpu").run(feeds)
    for x, want, what in zip(got, bwd._torch_grads(feeds, mask, causal, gqa), ("out", "dq", "dk", "dv")):
        bwd._close(x, want, what)
    if mask is not None:                          # a fully masked query row has no gradient
        assert np.all(got[1][..., 0 if mask == "float" else 1, :] == 0)


def test_epilogue_fuses_into_the_combine(flash_only, monkeypatch):
    """Head-split views in, the transpose back and a residual add out: the split kernel
    reads the views in place and the combine's store is the fused epilogue."""
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "2")
    g, out, _, feeds, weights = head_split_block(2, 140, 3, 16, seed=4)
    feeds.update(weights)
    kp = compile_plan([out], options=CompileOptions(max_bindings=32))
    # the transpose back is the combine's store map, the residual add its epilogue
    assert kp.names[1:] == ["flash_attention_split", "flash_attention_combine+reshape+add"], kp.names
    combine = kp.dispatches[-1].kernel
    assert combine.spec.get("combine") == 2 and combine.epilogue is not None and "store_map" in combine.spec
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_whisper_like_shape_split_four(monkeypatch):
    """Whisper's encoder attention scaled down (7 key tiles) in 4 splits of 1 or 2 tiles."""
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "4")
    g, out = fwd._whisper_like(400)
    assert compile_plan([out]).names == ["flash_attention_split", "flash_attention_combine"]
    rng = np.random.default_rng(6)
    feeds = {n: rng.standard_normal((1, 6, 400, 64)).astype(np.float32) for n in "qkv"}
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_automatic_rule():
    """About 768 workgroups, S in 1..6, at least 4 key tiles per split."""
    assert flash_split.auto_splits(6 * 24, 24) == 6       # Whisper-tiny, 64-row tiles: 144 -> 864
    assert flash_split.auto_splits(6 * 47, 24) == 3       # 32-row tiles: 282 -> 846
    assert flash_split.auto_splits(768, 100) == 1         # enough workgroups already
    assert flash_split.auto_splits(300, 100) == 3
    assert flash_split.auto_splits(1, 1000) == 6          # never more than 6
    assert flash_split.auto_splits(6, 7) == 1             # fewer than 8 key tiles: no split
    assert flash_split.auto_splits(6, 8) == 2
    assert flash_split.auto_splits(6, 12) == 3


def test_split_follows_the_adapters_query_tile(monkeypatch):
    """The split is counted in the workgroups the kernel runs: with 48 KiB of workgroup
    memory a workgroup takes 64 query rows, half as many workgroups as with 32 KiB's 32
    rows, so Whisper-tiny's attention splits 6 ways instead of 3."""
    monkeypatch.delenv("MEGANEURA_FLASH_SPLIT", raising=False)
    monkeypatch.delenv("MEGANEURA_FLASH_SMEM", raising=False)
    g, out = fwd._whisper_like(1500)
    for storage, want in ((0, 3), (32768, 3), (49152, 6)):
        kp = compile_plan([out], options=CompileOptions(workgroup_storage=storage))
        assert [d.kernel.spec.get("split") for d in kp.dispatches][0] == want, storage


def test_selection_automatic_unless_forced(monkeypatch):
    """Unset, the automatic rule chooses (Whisper-tiny's encoder gets 6 splits); the
    variable forces a count; with AUTO_SPLIT off the forward stays whole."""
    monkeypatch.delenv("MEGANEURA_FLASH_SPLIT", raising=False)
    assert flash_split.AUTO_SPLIT
    assert flash_split.splits(144, 24) == 6
    g, out = fwd._whisper_like(1500)
    assert compile_plan([out]).names == ["flash_attention_split", "flash_attention_combine"]
    monkeypatch.setattr(flash_split, "AUTO_SPLIT", False)
    assert flash_split.splits(144, 24) == 1
    assert compile_plan([out]).names == ["flash_attention"]
    monkeypatch.setattr(flash_split, "AUTO_SPLIT", True)
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "1")
    assert flash_split.splits(144, 24) == 1
    monkeypatch.setattr(flash_split, "AUTO_SPLIT", False)
    monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", "3")
    assert flash_split.splits(144, 24) == 3
    kp = compile_plan([out])
    assert kp.names == ["flash_attention_split", "flash_attention_combine"], kp.names
    groups = kp.dispatches[0].groups
    assert groups[0] * groups[1] == 3 * 6 * -(-1500 // flash.rows_per_group(64))
    for bad in ("0", "-2", "two"):
        monkeypatch.setenv("MEGANEURA_FLASH_SPLIT", bad)
        with pytest.raises(ValueError, match="MEGANEURA_FLASH_SPLIT"):
            flash_split.splits(144, 24)
