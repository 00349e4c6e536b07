"""The one-kernel attention (short query rows) against the NumPy reference on the GPU:
grouped heads, float and integer masks with fully masked rows, causal with Lq != Lk,
batch dims, value widths that are not powers of two, keys past one workgroup's width."""
import numpy as np
import pytest

import meganeura as mg
from meganeura.compiler import CompileOptions, compile_plan

CASES = {
    # name: (q shape, k shape, v width, mask kind, causal, gqa)
    "decode_gqa_float_mask": ((1, 6, 1, 16), (1, 2, 40, 16), 16, "float", False, True),
    "prefill_causal_lq_lt_lk": ((2, 3, 5, 8), (2, 3, 7, 8), 12, None, True, False),
    "long_keys_int_mask": ((1, 2, 3, 8), (1, 2, 300, 8), 40, "int", False, False),
    "batch_dims_masked_rows": ((2, 2, 2, 4, 8), (2, 2, 2, 9, 8), 8, "float", False, False),
}


@pytest.mark.parametrize("name", list(CASES))
def test_attention_kernel_matches_reference(name):
    qs, ks, dv, mask, causal, gqa = CASES[name]
    rng = np.random.default_rng(sum(map(ord, name)))
    g = mg.Graph()
    q, k = g.input("q", qs), g.input("k", ks)
    v = g.input("v", ks[:-1] + (dv,))
    feeds = {"q": rng.standard_normal(qs), "k": rng.standard_normal(ks), "v": rng.standard_normal(ks[:-1] + (dv,))}
    m = None
    scores = qs[:-1] + (ks[-2],)
    if mask == "float":
        mv = np.where(rng.random(scores[-2:]) < 0.3, -np.inf, rng.standard_normal(scores[-2:]))
        mv[0, :] = -np.inf                       # a fully masked row: zeros
        m = g.input("m", scores[-2:])
        feeds["m"] = mv
    elif mask == "int":
        mv = (rng.random(scores[-3:]) < 0.6).astype(np.int32)
        mv[..., 1, :] = 0
        m = g.input("m", scores[-3:], mg.i32)
        feeds["m"] = mv
    out = mg.ops.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=gqa) * 2.0
    feeds = {n: a.astype(np.int32 if a.dtype.kind == "i" else np.float32) for n, a in feeds.items()}
    kp = compile_plan([out], options=CompileOptions(max_bindings=32))
    assert [d.kernel.archetype for d in kp.dispatches] == ["attention"], kp.names   # the * 2 is its epilogue
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    if mask is not None:
        assert np.all(got[..., 0 if mask == "float" else 1, :] == 0)


def test_attention_reads_head_split_views_and_writes_merged_layout():
    """q, k, v as transposed views of (batch, seq, heads, dim) tensors are read in place,
    and the output's transpose back to (batch, seq, heads * dim) is the kernel's store."""
    rng = np.random.default_rng(7)
    g = mg.Graph()
    xs = {n: g.input(n, (2, 5, 4, 8)) for n in "qkv"}
    q, k, v = (mg.ops.transpose(mg.ops.tanh(xs[n]), 1, 2) for n in "qkv")
    o = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=True)
    out = mg.ops.reshape(mg.ops.transpose(o, 1, 2), (2, 5, 32))
    feeds = {n: rng.standard_normal((2, 5, 4, 8)).astype(np.float32) for n in "qkv"}
    kp = compile_plan([out], options=CompileOptions(max_bindings=32))
    assert [d.kernel.archetype for d in kp.dispatches] == ["multi", "attention"], kp.names
    want = mg.compile(g, outputs=[out], backend="numpy").run(feeds)[0]
    got = mg.compile(g, outputs=[out], backend="gpu").run(feeds)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
