"""Samples for scaled_dot_product_attention (tiny shapes: finite differences run the graph often)."""
import numpy as np

from .opinfo import F, I, Sample

S = Sample


def inputs_like(g, feeds):
    """Graph inputs named and shaped as ``feeds`` (int32 for integer masks, else f32)."""
    import meganeura as mg
    return {n: g.input(n, a.shape, mg.i32 if a.dtype.kind == "i" else mg.f32) for n, a in feeds.items()}


def sdpa_graph(feeds, causal=False, gqa=False):
    """(graph, its inputs as ``inputs_like``, scaled_dot_product_attention over q, k, v and the
    mask m where ``feeds`` has one)."""
    import meganeura as mg
    g = mg.Graph()
    ins = inputs_like(g, feeds)
    out = mg.ops.scaled_dot_product_attention(ins["q"], ins["k"], ins["v"], ins.get("m"), is_causal=causal,
                                              enable_gqa=gqa)
    return g, ins, out


def head_split_block(b, l, h, d, seed, causal=False, weights="input"):
    """A model-like attention block: q, k and v are head splits (transposed views) of three
    projections of x (b, l, h * d), the output is transposed back and x added to it.
    ``weights``: "input" or "parameter" for the projections. Returns (graph, output, the
    projection weights by name, feeds of x, values of the weights), drawn from ``seed``."""
    import meganeura as mg
    g = mg.Graph()
    x = g.input("x", (b, l, h * d))
    make = g.input if weights == "input" else g.parameter
    ws = {n: make(f"w{n}", (h * d, h * d)) for n in "qkv"}

    def heads(t):
        return mg.ops.transpose(mg.ops.reshape(t, (b, l, h, d)), 1, 2)
    q, k, v = (heads(mg.ops.linear(x, ws[n])) for n in "qkv")
    o = mg.ops.scaled_dot_product_attention(q, k, v, is_causal=causal)
    out = mg.ops.reshape(mg.ops.transpose(o, 1, 2), (b, l, h * d)) + x
    rng = np.random.default_rng(seed)
    feeds = {"x": rng.standard_normal((b, l, h * d)).astype(np.float32)}
    values = {f"w{n}": (rng.standard_normal((h * d, h * d)) / 7).astype(np.float32) for n in "qkv"}
    return g, out, ws, feeds, values


def _sdpa(**kw):
    """The same call on both sides: ours through mg.ops, theirs through torch.nn.functional."""
    def ours(o, q, k, v, *m):
        return o.scaled_dot_product_attention(q, k, v, *m, **kw)

    def theirs(t, q, k, v, *m):
        if m and not m[0].is_floating_point():
            m = (m[0] != 0,)                   # integer masks are torch bool masks
        return t.nn.functional.scaled_dot_product_attention(q, k, v, *m, **kw)
    return ours, theirs


def _const_mask(arr, **kw):
    """A mask baked in as a constant (NumPy array on our side, a tensor on torch's)."""
    def ours(o, q, k, v):
        return o.scaled_dot_product_attention(q, k, v, attn_mask=arr, **kw)

    def theirs(t, q, k, v):
        m = t.tensor(arr) if arr.dtype == bool else t.tensor(arr, dtype=q.dtype)
        return t.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=m, **kw)
    return ours, theirs


def _mha_ours(o, x, wq, wk, wv, wo):
    b, l, c = x.shape
    h = 2

    def heads(y):                                   # (B, L, C) -> (B, H, L, C/H)
        return o.transpose(o.reshape(y, (b, l, h, c // h)), 1, 2)
    a = o.scaled_dot_product_attention(heads(o.linear(x, wq)), heads(o.linear(x, wk)), heads(o.linear(x, wv)),
                                       is_causal=True)
    return o.linear(o.reshape(o.transpose(a, 1, 2), (b, l, c)), wo)


def _mha_theirs(t, x, wq, wk, wv, wo):
    b, l, c = x.shape
    h = 2
    f = t.nn.functional

    def heads(y):
        return y.reshape(b, l, h, c // h).transpose(1, 2)
    a = f.scaled_dot_product_attention(heads(f.linear(x, wq)), heads(f.linear(x, wk)), heads(f.linear(x, wv)),
                                       is_causal=True)
    return f.linear(a.transpose(1, 2).reshape(b, l, c), wo)


_ROW_MASKED = np.ones((3, 4), dtype=bool)
_ROW_MASKED[1] = False                              # row 1 has nothing to attend to
_NEG_INF_ROW = np.where(_ROW_MASKED, 0.0, -np.inf).astype(np.float32)
_NEG_INF_ROW[0, 2] = -np.inf

SAMPLES = [
    S("sdpa_basic", *_sdpa(), [F((2, 2, 3, 4)), F((2, 2, 3, 4)), F((2, 2, 3, 4))]),
    S("sdpa_causal", *_sdpa(is_causal=True), [F((1, 2, 4, 3)), F((1, 2, 4, 3)), F((1, 2, 4, 3))]),
    S("sdpa_causal_short_q", *_sdpa(is_causal=True), [F((1, 2, 3, 4)), F((1, 2, 5, 4)), F((1, 2, 5, 2))]),
    S("sdpa_causal_long_q", *_sdpa(is_causal=True), [F((1, 1, 5, 3)), F((1, 1, 3, 3)), F((1, 1, 3, 3))]),
    S("sdpa_gqa", *_sdpa(enable_gqa=True), [F((1, 4, 3, 4)), F((1, 2, 5, 4)), F((1, 2, 5, 3))]),
    S("sdpa_gqa_causal", *_sdpa(is_causal=True, enable_gqa=True),
      [F((2, 4, 3, 2)), F((2, 1, 3, 2)), F((2, 1, 3, 2))]),
    S("sdpa_gqa_3d", *_sdpa(enable_gqa=True), [F((4, 3, 2)), F((2, 5, 2)), F((2, 5, 2))]),
    S("sdpa_cross", *_sdpa(), [F((2, 2, 3, 4)), F((2, 2, 5, 4)), F((2, 2, 5, 2))]),
    S("sdpa_3d", *_sdpa(), [F((2, 3, 4)), F((2, 5, 4)), F((2, 5, 3))]),
    S("sdpa_scale", *_sdpa(scale=0.3), [F((1, 2, 3, 4)), F((1, 2, 4, 4)), F((1, 2, 4, 3))]),
    S("sdpa_mask_lq_lk", *_sdpa(), [F((2, 2, 3, 4)), F((2, 2, 5, 4)), F((2, 2, 5, 3)), F((3, 5))]),
    S("sdpa_mask_key_pad", *_sdpa(), [F((2, 2, 3, 4)), F((2, 2, 5, 4)), F((2, 2, 5, 3)), F((2, 1, 1, 5))]),
    S("sdpa_mask_gqa", *_sdpa(enable_gqa=True),
      [F((1, 4, 4, 2)), F((1, 2, 4, 2)), F((1, 2, 4, 2)), F((1, 4, 4, 4))]),
    S("sdpa_bool_mask", *_sdpa(), [F((2, 2, 3, 4)), F((2, 2, 5, 4)), F((2, 2, 5, 3)), I((2, 1, 3, 5), 2, dtype="u32")]),
    S("sdpa_bool_fully_masked_row", *_const_mask(_ROW_MASKED), [F((1, 2, 3, 2)), F((1, 2, 4, 2)), F((1, 2, 4, 2))]),
    S("sdpa_neg_inf_mask", *_const_mask(_NEG_INF_ROW, scale=0.7),
      [F((2, 1, 3, 2)), F((2, 1, 4, 2)), F((2, 1, 4, 3))]),
    S("sdpa_mha_linear", _mha_ours, _mha_theirs, [F((2, 4, 4)), F((4, 4)), F((4, 4)), F((4, 4)), F((3, 4))]),
    # batch dims broadcast as torch's matmul does, across ranks too (gradients summed back)
    S("sdpa_bcast_ranks", *_sdpa(), [F((2, 3, 4, 4)), F((3, 5, 4)), F((3, 5, 3))]),
    S("sdpa_bcast_one_kv_head", *_sdpa(is_causal=True), [F((2, 3, 4, 4)), F((2, 1, 4, 4)), F((2, 1, 4, 3))]),
    S("sdpa_bcast_2d_q_4d_v", *_sdpa(), [F((3, 4)), F((2, 1, 5, 4)), F((5, 2))]),
    S("sdpa_bcast_kv_batches", *_sdpa(), [F((2, 2, 3, 4)), F((1, 2, 5, 4)), F((2, 1, 5, 3)), F((2, 1, 1, 5))]),
    S("sdpa_bcast_v_heads", *_sdpa(), [F((2, 3, 4, 4)), F((2, 1, 5, 4)), F((2, 3, 5, 3))]),
    S("sdpa_gqa_bcast_batch", *_sdpa(enable_gqa=True), [F((2, 4, 3, 2)), F((1, 2, 5, 2)), F((2, 2, 5, 3))]),
    S("sdpa_gqa_3d_q_4d_kv", *_sdpa(enable_gqa=True, is_causal=True), [F((4, 3, 2)), F((2, 2, 3, 2)), F((2, 2, 3, 2))]),
    # no keys: zeros, as torch
    S("sdpa_no_keys", *_sdpa(), [F((2, 1, 3, 4)), F((2, 1, 0, 4)), F((2, 1, 0, 3))]),
]
