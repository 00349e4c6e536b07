"""Weight-only quantized products (mg.ops.quantized_linear, mg.ops.dequantize,
mg.nn.QuantizedLinear): weights quantized by the gguf package, its own dequantization in
float64 the reference, on the NumPy interpreter and both GPU backends (lavapipe)."""
import gguf
import numpy as np
import pytest
from gguf import quants

import meganeura as mg
from meganeura.ops.quantized import QTYPES, dequantize_words, weight_words

from .harness import assert_close

BACKENDS = ["numpy", "gpu", "wgpu"]


def _blocks(qtype, n, k, seed=0):
    """(raw uint8 blocks (n, row bytes), their float64 dequantization by gguf). Q8_0, Q4_0,
    Q4_1, Q5_0 and Q5_1 come from gguf.quants.quantize of seeded data whose rows span several
    magnitudes (f16 scales subnormal for the smallest, a zero row: scale 0); gguf cannot
    quantize the K types, so those super-blocks are random bytes with finite f16 scales
    (some subnormal, some negative), which any reader must decode alike."""
    rng = np.random.default_rng(seed)
    t = gguf.GGMLQuantizationType[qtype]
    if qtype.endswith("_K"):
        bs, nb = QTYPES[qtype]
        at = {"Q2_K": slice(80, 84), "Q3_K": slice(108, 110), "Q4_K": slice(0, 4), "Q5_K": slice(0, 4),
              "Q6_K": slice(208, 210)}[qtype]     # d (and dmin)
        raw = rng.integers(0, 256, (n, k // bs, nb), dtype=np.uint8)
        d = rng.standard_normal((n, k // bs, (at.stop - at.start) // 2)) * 0.01
        d.flat[::5] *= 1e-3                            # f16 subnormals
        raw[..., at] = d.astype(np.float16).view(np.uint8).reshape(n, k // bs, -1)
        raw = raw.reshape(n, -1)
    else:
        data = rng.standard_normal((n, k)) * np.logspace(-7, 1, n)[:, None]
        data[n // 2] = 0.0
        raw = quants.quantize(data.astype(np.float32), t)
    return raw, quants.dequantize(raw, t).astype(np.float64)


def _run(backend, qtype, m, n, k, bias=False, seed=0):
    raw, w = _blocks(qtype, n, k, seed)
    words = weight_words(raw)
    rng = np.random.default_rng(seed + 1)
    x = rng.standard_normal((m, k)).astype(np.float32)
    b = rng.standard_normal(n).astype(np.float32)
    g = mg.Graph()
    xt, wt = g.input("x", (m, k)), g.input("w", words.shape, mg.u32)
    bt = g.input("b", (n,)) if bias else None
    y = mg.ops.quantized_linear(xt, wt, qtype, n, k, bt)
    sess = mg.compile(g, outputs=[y], backend=backend)
    got = sess.run({"x": x, "w": words, **({"b": b} if bias else {})})[0]
    want = x.astype(np.float64) @ w.T + (b if bias else 0.0)
    return sess, got, want


@pytest.mark.parametrize("qtype", list(QTYPES))
def test_numpy_decoding_matches_gguf(qtype):
    for n, k in [(1, 256), (7, 512), (5, 768)]:       # odd rows: the last word padded
        raw, w = _blocks(qtype, n, k)
        np.testing.assert_array_equal(dequantize_words(weight_words(raw), qtype, n, k), w)


# Q8_0 / Q4_0 rows of 3 blocks (102 / 54 bytes): blocks and rows start off word boundaries
SHAPES = {"Q8_0": [(1, 9, 96), (3, 5, 96), (37, 67, 96), (70, 130, 64)], "Q4_0": [(1, 9, 96), (3, 5, 96), (37, 67, 96)],
          "Q4_1": [(1, 9, 96), (37, 67, 96)], "Q5_0": [(1, 9, 96), (37, 67, 96)], "Q5_1": [(1, 9, 96), (37, 67, 96)],
          "Q4_K": [(1, 9, 512), (3, 5, 256), (37, 67, 512)], "Q5_K": [(1, 9, 512), (37, 67, 512)],
          "Q6_K": [(1, 9, 512), (37, 67, 512)], "Q2_K": [(1, 9, 512), (37, 67, 512)],
          "Q3_K": [(1, 9, 512), (37, 67, 512)]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype,m,n,k", [(q, *s) for q, ss in SHAPES.items() for s in ss])
def test_quantized_linear_matches_gguf(backend, qtype, m, n, k):
    sess, got, want = _run(backend, qtype, m, n, k)
    assert_close(got, want, 1e-5, 1e-5, f"{qtype} ({m}, {k}) x ({n}, {k}).T on {backend}")
    if backend != "numpy":      # dequantized in the loads: no f32 weight is stored first
        assert sess.executor.plans["run"].names == ["quantized_gemv" if m <= 4 else "quantized_tiled"]


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_bias_and_leading_dims(backend):
    raw, w = _blocks("Q8_0", 6, 64)
    lin = mg.nn.QuantizedLinear(64, 6, "q8_0", bias=True, blocks=raw)
    lin.bias.data = np.linspace(-1, 1, 6).astype(np.float32)
    x = np.random.default_rng(3).standard_normal((2, 3, 64)).astype(np.float32)
    got = mg.jit(lin, backend=backend)(x)
    assert_close(got, x.astype(np.float64) @ w.T + lin.bias.data, 1e-5, 1e-5, "QuantizedLinear")
    assert sorted(lin.state_dict()) == ["bias", "weight"] and lin.state_dict()["weight"].dtype == np.uint32


def _same_weights(got, want, qtype):
    """Weights that are scale x integer are exact in f32; the types with an offset (m, dmin)
    round once more, which a GPU may fuse into an fma: within an ulp of the row's largest."""
    if qtype in ("Q8_0", "Q4_0", "Q5_0", "Q3_K", "Q6_K"):
        np.testing.assert_array_equal(got, want)
    else:
        err = np.abs(got - want) / np.maximum(np.abs(want).max(1, keepdims=True), 1e-30)
        assert err.max() <= 1.2e-7, f"{qtype}: weights differ by {err.max():.3g} of their row's largest"


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", list(QTYPES))
def test_dequantize_op(backend, qtype):
    n, k = 5, QTYPES[qtype][0] * 3
    raw, w = _blocks(qtype, n, k)
    words = weight_words(raw)
    g = mg.Graph()
    y = mg.ops.dequantize(g.input("w", words.shape, mg.u32), qtype, n, k)
    got = mg.compile(g, outputs=[y], backend=backend).run({"w": words})[0]
    _same_weights(got, w, qtype)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradient_reaches_x_only(backend):
    n, k, m = 7, 64, 3
    raw, w = _blocks("Q4_0", n, k)
    words = weight_words(raw)
    rng = np.random.default_rng(5)
    x, c = rng.standard_normal((m, k)).astype(np.float32), rng.standard_normal((m, n)).astype(np.float32)
    g = mg.Graph()
    xt, wt = g.input("x", (m, k)), g.input("w", words.shape, mg.u32)
    loss = mg.ops.sum(mg.ops.quantized_linear(xt, wt, "Q4_0", n, k) * g.constant(c))
    dx, dw = mg.grad(loss, [xt, wt])
    assert dw is None
    got = mg.compile(g, outputs=[dx], backend=backend).run({"x": x, "w": words})[0]
    assert_close(got, c.astype(np.float64) @ w, 1e-5, 1e-5, "d loss / d x")


def test_weight_is_not_trainable():
    lin = mg.nn.QuantizedLinear(32, 2, "Q4_0")
    with pytest.raises(TypeError, match="Q4_0 weight is not trainable"):
        lin.requires_grad_()
    g = mg.Graph()
    wf = g.parameter("w", (2, 32))
    with pytest.raises(TypeError, match=r"weight 'w' has dtype f32, expected u32 words of Q4_0 blocks"):
        mg.ops.quantized_linear(g.input("x", (1, 32)), wf, "Q4_0", 2, 32)


def test_bad_shapes_and_types_are_named():
    g = mg.Graph()
    x, w = g.input("x", (2, 64)), g.input("w", (34,), mg.u32)      # (4, 64) Q8_0: 272 bytes, 68 words
    with pytest.raises(mg.ShapeError, match=r"a \(4, 64\) Q8_0 weight is 272 bytes: expected \(68,\) u32 words"):
        mg.ops.quantized_linear(x, w, "Q8_0", 4, 64)
    with pytest.raises(mg.ShapeError, match=r"input's last dim must equal in_features 96.*'x' \(2, 64\)"):
        mg.ops.quantized_linear(x, w, "Q8_0", 1, 96)
    with pytest.raises(mg.ShapeError, match=r"in_features 64 is not a multiple of Q4_K's block of 256"):
        mg.ops.quantized_linear(x, w, "Q4_K", 1, 64)
    with pytest.raises(ValueError, match=r"qtype must be one of 'Q8_0', 'Q4_0', .*'Q6_K' .*got 'IQ2_XS'"):
        mg.ops.quantized_linear(x, w, "IQ2_XS", 1, 64)
    with pytest.raises(TypeError, match=r"quantized_matmul: .* has dtype f16, expected f32"):
        mg.ops.quantized_linear(mg.ops.cast(x, mg.f16), g.input("w2", (17,), mg.u32), "Q8_0", 2, 64)
    with pytest.raises(ValueError, match=r"load_blocks: a \(2, 64\) Q8_0 weight is 136 bytes \(uint8\), got uint8 \(10,\)"):
        mg.nn.QuantizedLinear(64, 2, "Q8_0").load_blocks(np.zeros(10, np.uint8))


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_fused_epilogue(backend):
    """A bias, SiLU and residual after the product run in its store: one dispatch."""
    raw, w = _blocks("Q8_0", 7, 64)
    words = weight_words(raw)
    rng = np.random.default_rng(4)
    for m in (1, 9):
        x, b, r = (rng.standard_normal(s).astype(np.float32) for s in ((m, 64), (7,), (m, 7)))
        g = mg.Graph()
        xt, wt, bt, rt = g.input("x", (m, 64)), g.input("w", words.shape, mg.u32), g.input("b", (7,)), g.input("r", (m, 7))
        y = mg.ops.silu(mg.ops.quantized_linear(xt, wt, "Q8_0", 7, 64, bt)) + rt
        sess = mg.compile(g, outputs=[y], backend=backend)
        got = sess.run({"x": x, "w": words, "b": b, "r": r})[0]
        z = x.astype(np.float64) @ w.T + b
        assert_close(got, z / (1 + np.exp(-z)) + r, 1e-5, 1e-5, f"silu(linear) + r, {m} rows")
        assert len(sess.executor.plans["run"].names) == 1, sess.executor.plans["run"].names


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_tiny_llama_with_quantized_linears(backend):
    """Every projection of a tiny Llama swapped for Q8_0 / Q4_0 blocks (nn.quantize_weights):
    a 5-token prompt (the tiled kernel) then one decoded token (the GEMV) give the logits
    and caches of the same model with the dequantized weights in f32 on NumPy."""
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, build_decoder, cache_names, decode_feeds
    cfg, max_len = LlamaConfig.tiny(), 8
    ref = LlamaForCausalLM(cfg)
    sd = {k: np.asarray(v) for k, v in ref.state_dict().items()}
    blocks, deq = {}, {}
    for i, k in enumerate(k for k, v in sd.items() if v.ndim == 2 and "embed" not in k):
        t = ["Q8_0", "Q4_0"][i % 2]
        raw = quants.quantize(sd[k], gguf.GGMLQuantizationType[t])
        blocks[k], deq[k] = (raw, t), quants.dequantize(raw, gguf.GGMLQuantizationType[t])
    ref.load_state_dict({**sd, **deq})
    qm = LlamaForCausalLM(cfg)
    qm.load_state_dict(sd)
    assert len(mg.nn.quantize_weights(qm, blocks)) == 15
    assert isinstance(qm.model.layers[1].mlp.down_proj, mg.nn.QuantizedLinear)
    ids = np.random.default_rng(6).integers(0, cfg.vocab_size, (1, 6)).astype(np.int32)
    caches = {n: [np.zeros((1, 2, max_len, 8), np.float32)] * len(cache_names(cfg)) for n in ("ours", "ref")}
    pos = 0
    for t in (5, 1):
        feeds = {**decode_feeds(cfg, pos, t, max_len), "input_ids": ids[:, pos:pos + t]}
        outs = {}
        for who, model, be in (("ours", qm, backend), ("ref", ref, "numpy")):
            g, logits, cache = build_decoder(cfg, 1, t, max_len, model=model)
            res = mg.compile(g, outputs=[logits] + cache, backend=be).run({**feeds, **dict(zip(cache_names(cfg), caches[who]))})
            outs[who], caches[who] = res[0], res[1:]
        assert_close(outs["ours"], outs["ref"], 1e-5, 1e-5, f"logits after {pos + t} tokens")
        for a, b in zip(caches["ours"], caches["ref"]):
            assert_close(a, b, 1e-5, 1e-5, "caches")
        pos += t


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
@pytest.mark.parametrize("m", [2, 6])
def test_x_off_a_vec4_boundary(backend, m):
    """x a view starting one float into its buffer: read by scalars instead of vec4s."""
    raw, w = _blocks("Q4_K", 3, 256)
    words = weight_words(raw)
    flat = np.random.default_rng(8).standard_normal(1 + m * 256).astype(np.float32)
    g = mg.Graph()
    ft, wt = g.input("flat", flat.shape), g.input("w", words.shape, mg.u32)
    y = mg.ops.quantized_linear(mg.ops.reshape(mg.ops.slice(ft, 0, 1, None), (m, 256)), wt, "Q4_K", 3, 256)
    sess = mg.compile(g, outputs=[y], backend=backend)
    got = sess.run({"flat": flat, "w": words})[0]
    assert_close(got, flat[1:].reshape(m, 256).astype(np.float64) @ w.T, 1e-5, 1e-5, "offset x")
    assert sess.executor.plans["run"].names == ["quantized_gemv" if m <= 4 else "quantized_tiled"]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("qtype", list(QTYPES))
def test_quantized_embedding(backend, qtype):
    n, k = 7, QTYPES[qtype][0] * 2
    raw, w = _blocks(qtype, n, k)
    words = weight_words(raw)
    ids = np.array([[6, 0, 3], [3, 1, 5]], np.int32)
    g = mg.Graph()
    y = mg.ops.quantized_embedding(g.input("ids", ids.shape, mg.i32), g.input("w", words.shape, mg.u32), qtype, n, k)
    got = mg.compile(g, outputs=[y], backend=backend).run({"ids": ids, "w": words})[0]
    _same_weights(got.reshape(-1, k), w[ids].reshape(-1, k), qtype)


def test_quantized_embedding_bad_id():
    raw, _ = _blocks("Q8_0", 3, 32)
    words = weight_words(raw)
    g = mg.Graph()
    ids = g.input("ids", (2,), mg.i32)
    y = mg.ops.quantized_embedding(ids, g.input("w", words.shape, mg.u32), "Q8_0", 3, 32)
    with pytest.raises(Exception, match="quantized_embedding: id 3 is out of range for 3 embeddings"):
        mg.compile(g, outputs=[y], backend="numpy").run({"ids": np.array([0, 3], np.int32), "w": words})
    got = mg.compile(g, outputs=[y], backend="gpu").run({"ids": np.array([3, -1], np.int32), "w": words})[0]
    assert not got.any()          # the GPU reads nothing out of bounds: zero rows
    with pytest.raises(TypeError, match="quantized_embedding: ids 'f' have dtype f32, expected i32 or u32"):
        mg.ops.quantized_embedding(g.input("f", (2,)), g.input("w2", words.shape, mg.u32), "Q8_0", 3, 32)


@pytest.mark.parametrize("backend", ["gpu"])
def test_tied_llama_with_quantized_embedding(backend):
    """A Llama whose head is tied to a Q8_0 token embedding: the lookup and the head read
    the same blocks (QuantizedEmbedding.as_linear)."""
    import dataclasses

    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    cfg = dataclasses.replace(LlamaConfig.tiny(), tie_word_embeddings=True)
    ref = LlamaForCausalLM(cfg)
    sd = {k: np.asarray(v) for k, v in ref.state_dict().items()}
    t = gguf.GGMLQuantizationType.Q8_0
    raw = quants.quantize(sd["model.embed_tokens.weight"], t)
    ref.load_state_dict({**sd, "model.embed_tokens.weight": quants.dequantize(raw, t)})
    qm = LlamaForCausalLM(cfg)
    qm.load_state_dict(sd)
    assert mg.nn.quantize_weights(qm, {"model.embed_tokens.weight": (raw, "Q8_0")}) == ["model.embed_tokens.weight"]
    ids = np.array([[1, 7, 63, 2]], np.int32)
    got = mg.jit(qm, backend=backend)(ids)
    assert_close(got, mg.jit(ref, backend="numpy")(ids), 1e-5, 1e-5, "tied quantized head")


def _train_three_steps(backend, raw):
    from meganeura import nn
    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.QuantizedLinear(64, 32, "Q8_0", blocks=raw), nn.Linear(32, 4))
    for i, p in enumerate(model.parameters()):
        p.data = np.linspace(-1, 1, p.data.size).reshape(p.data.shape).astype(np.float32) * (i + 1) / 4
    step = mg.jit(lambda x, y: mg.ops.cross_entropy(model(x), y), optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    x = np.random.default_rng(1).standard_normal((8, 16)).astype(np.float32)
    losses = [float(step(x, np.arange(8, dtype=np.int32) % 4)) for _ in range(3)]
    return losses, model[0].weight.data.copy(), model.state_dict()["2.weight"]


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
def test_training_through_a_quantized_layer(backend):
    """Layers before a quantized one train (the gradient passes through it as x @ W); its
    blocks stay as they were."""
    raw, _ = _blocks("Q8_0", 32, 64)
    losses, w0, words = _train_three_steps(backend, raw)
    ref_losses, ref_w0, _ = _train_three_steps("numpy", raw)
    assert_close(losses, ref_losses, 1e-5, 1e-5, "losses")
    assert_close(w0, ref_w0, 1e-5, 1e-5, "first layer after 3 steps")
    assert losses[0] != losses[-1]
    np.testing.assert_array_equal(words, weight_words(raw))


@pytest.mark.parametrize("backend", ["gpu", "wgpu"])
@pytest.mark.parametrize("norm", ["layer_norm", "rms_norm"])
def test_decoding_fusions(backend, norm):
    """While decoding (2 rows), a norm read only by quantized GEMVs is computed in them,
    sibling GEMVs over it share a launch (blocks of different types), and SwiGLU's gate and
    up run in one loop: one launch for what would be six."""
    k, rng = 256, np.random.default_rng(9)
    ws = {q: _blocks(q, n, k, seed=i) for i, (q, n) in enumerate([("Q8_0", 5), ("Q4_K", 3), ("Q6_K", 7)])}
    gate, up = _blocks("Q5_0", 6, k, seed=4), _blocks("Q4_1", 6, k, seed=5)
    x, nw, nb = rng.standard_normal((2, k)).astype(np.float32), rng.standard_normal(k).astype(np.float32), \
        rng.standard_normal(k).astype(np.float32)
    g = mg.Graph()
    xt, nwt, nbt = g.input("x", (2, k)), g.input("nw", (k,)), g.input("nb", (k,))
    h = mg.ops.layer_norm(xt, (k,), nwt, nbt, 1e-5) if norm == "layer_norm" else mg.ops.rms_norm(xt, (k,), nwt, 1e-5)
    feeds = {"x": x, "nw": nw, **({"nb": nb} if norm == "layer_norm" else {})}

    def lin(name, q, raw, n):
        words = weight_words(raw)
        feeds[name] = words
        return mg.ops.quantized_linear(h, g.input(name, words.shape, mg.u32), q, n, k)
    outs = [lin(f"w{q}", q, raw, raw.shape[0]) for q, (raw, _) in ws.items()]
    outs.append(mg.ops.silu(lin("gate", "Q5_0", gate[0], 6)) * lin("up", "Q4_1", up[0], 6))
    sess = mg.compile(g, outputs=outs, backend=backend)
    got = sess.run(feeds)
    assert sess.executor.plans["run"].names == ["|".join([f"{norm}>quantized_gemv"] * 3 + [
        f"{norm}>quantized_gemv&{norm}>quantized_gemv+silu+mul"])]
    xd = x.astype(np.float64)
    z = xd - xd.mean(1, keepdims=True) if norm == "layer_norm" else xd
    hd = z / np.sqrt((z * z).mean(1, keepdims=True) + 1e-5) * nw + (nb if norm == "layer_norm" else 0)
    wants = [hd @ w.T for _, w in ws.values()]
    a, b = hd @ gate[1].T, hd @ up[1].T
    wants.append(a / (1 + np.exp(-a)) * b)
    for o, w in zip(got, wants):
        assert_close(o, w, 1e-5, 1e-5, f"{norm} > quantized GEMVs")


def test_quantized_llama_decode_budget():
    """Device-free: a tiny Llama decoding with Q8_0 projections takes no more dispatches
    than with f32 ones (the norm, q/k/v and gate/up fusions carry over)."""
    from meganeura.compiler import compile_plan
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, build_decoder
    cfg = LlamaConfig.tiny()

    def dispatches(model):
        g, logits, new = build_decoder(cfg, 1, 1, 16, cache_as_state=True, model=model)
        return compile_plan([logits] + new).names
    qm = LlamaForCausalLM(cfg)
    sd = {k: np.asarray(v) for k, v in qm.state_dict().items()}
    mg.nn.quantize_weights(qm, {k: (quants.quantize(v, gguf.GGMLQuantizationType.Q8_0), "Q8_0")
                                for k, v in sd.items() if v.ndim == 2 and "embed" not in k})
    names, f32_names = dispatches(qm), dispatches(LlamaForCausalLM(cfg))
    assert len(names) <= len(f32_names), (names, f32_names)
    assert sum(n.count("quantized_gemv") for n in names) == 15 and "rms_norm" not in names
