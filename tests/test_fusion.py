"""The compile stage without a device: dispatch budgets per model (like tinygrad's
kernel-count tests), fusion switches, and fused kernels checked on the GPU."""
from __future__ import annotations

import numpy as np
import pytest

import meganeura as mg
from meganeura.codegen import matmul
from meganeura.compiler import CompileOptions, compile_plan
from meganeura.models import llama

NO_FUSE = CompileOptions(disabled=frozenset({"epilogue", "horizontal"}))


def _assert_gpu_matches_reference(g, outs, feeds, rtol, atol, state=None):
    """``outs`` on the GPU equal the NumPy reference's, with the same parameters."""
    ref = mg.compile(g, outputs=outs, backend="numpy")
    gpu = mg.compile(g, outputs=outs, backend="gpu")
    if state is not None:
        ref.load_state_dict(state)
    gpu.load_state_dict(ref.state_dict())
    for want, got in zip(ref.run(feeds), gpu.run(feeds)):
        np.testing.assert_allclose(got, want, rtol=rtol, atol=atol)


def _decoder_targets(cfg, max_len=16):
    g, logits, new = llama.build_decoder(cfg, 1, 1, max_len, cache_as_state=True)
    return [logits] + new


def _counts(targets):
    fused = compile_plan(targets).n_dispatches
    unfused = compile_plan(targets, options=NO_FUSE).n_dispatches
    return fused, unfused


# Budgets: the tiny configs have the real models' layer structure, so per-layer counts
# carry over. Lower them as fusion improves; a rise is a regression.
def test_llama_decode_budget():
    cfg = llama.LlamaConfig.tiny()
    fused, unfused = _counts(_decoder_targets(cfg))
    per_layer = fused / cfg.num_hidden_layers
    assert fused < unfused
    assert per_layer <= 9.5, f"{fused} dispatches ({per_layer:.1f} per layer)"


def test_llama_prefill_budget():
    cfg = llama.LlamaConfig.tiny()
    g, _, logits = llama.build_causal_lm(cfg, 1, 8)
    fused, unfused = _counts([logits])
    assert fused < unfused
    assert fused <= 16


def test_kernel_plan_is_device_free_and_names_fusions():
    g = mg.Graph()
    x = g.input("x", (8, 16))
    w = g.parameter("w", (32, 16))
    b = g.parameter("b", (32,))
    r = g.input("r", (8, 32))
    y = mg.ops.relu(mg.ops.linear(x, w, b)) + r
    kp = compile_plan([y])
    assert kp.n_dispatches == 1
    assert kp.names[0].startswith("gemv") or kp.names[0].startswith("matmul")
    assert "relu" in kp.names[0] and "add" in kp.names[0]
    assert "store_out" in kp.dispatches[0].wgsl
    # operands the kernel only reads are declared read-only (no barrier between readers)
    assert "var<storage, read> " in kp.dispatches[0].wgsl
    assert compile_plan([y], options=NO_FUSE).n_dispatches == 2   # matmul, add+relu+add


def test_no_fuse_switch(monkeypatch):
    monkeypatch.setenv("MEGANEURA_NO_FUSE", "epilogue")
    assert CompileOptions.from_env().disabled == frozenset({"epilogue"})
    monkeypatch.setenv("MEGANEURA_NO_FUSE", "all")
    assert "epilogue" in CompileOptions.from_env().disabled
    monkeypatch.setenv("MEGANEURA_NO_FUSE", "bogus")
    with pytest.raises(ValueError, match="bogus"):
        CompileOptions.from_env()


def _graph_with_epilogues():
    """matmul (tiled, split-K and GEMV) + bias + activation + residual, a reduction with a
    scale, a softmax with a multiply, a broadcast operand fused across a reshape."""
    g = mg.Graph()
    x = g.input("x", (2, 8, 24))
    w = g.parameter("w", (40, 24))
    b = g.parameter("b", (40,))
    res = g.input("res", (2, 8, 40))
    h = mg.ops.gelu(mg.ops.linear(x, w, b)) + res                      # tiled matmul epilogue
    s = mg.ops.softmax(h, -1) * 3.0                                     # row kernel epilogue
    m = mg.ops.mean(h, -1, keepdim=True) * 0.5 + 1.0                    # reduction epilogue
    v = g.input("v", (1, 24))
    gv = mg.ops.tanh(mg.ops.linear(v, w)) * b                           # GEMV epilogue
    big = g.input("big", (16, 2048))
    wk = g.parameter("wk", (2048, 64))
    sk = mg.ops.reshape(mg.ops.matmul(big, wk), (16, 8, 8)) + g.parameter("pb", (8, 1))  # split-K
    return g, [s, m, gv, sk]


def test_fused_epilogues_match_reference():
    g, outs = _graph_with_epilogues()
    rng = np.random.default_rng(0)
    feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
    state = {n: rng.standard_normal(t.shape).astype(np.float32) * 0.2 for n, t in g.parameters.items()}
    fused = compile_plan(outs)
    assert fused.stats["fused"] >= 4, fused.names
    _assert_gpu_matches_reference(g, outs, feeds, rtol=2e-4, atol=2e-5, state=state)


def test_horizontal_merge_of_independent_pointwise_kernels():
    """Two RoPE-like kernels of different shapes and an optimizer-like update of three
    tensors run as one launch each where nothing between them depends on them."""
    g = mg.Graph()
    q = g.input("q", (2, 3, 8))
    k = g.input("k", (1, 3, 8))
    cos, sin = g.input("cos", (3, 8)), g.input("sin", (3, 8))
    qr = q * cos + mg.ops.rotate_half(q) * sin
    kr = k * cos + mg.ops.rotate_half(k) * sin
    ps = [g.input(f"p{i}", (5 + i,)) for i in range(3)]
    gs = [g.input(f"g{i}", (5 + i,)) for i in range(3)]
    news = [p - 0.1 * mg.ops.tanh(gr) for p, gr in zip(ps, gs)]
    outs = [qr, kr] + news
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    assert kp.n_dispatches == 1 and kp.dispatches[0].kernel.archetype == "multi", kp.names
    assert compile_plan(outs, options=CompileOptions(max_bindings=8)).n_dispatches == 3   # binding limit
    no_h = compile_plan(outs, options=CompileOptions(max_bindings=32, disabled=frozenset({"horizontal"})))
    assert no_h.n_dispatches == 5
    rng = np.random.default_rng(1)
    feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
    _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arrays", [True, False])
def test_merged_parts_alike_share_one_body_through_arrays_of_buffers(monkeypatch, arrays):
    """Where the runtime binds arrays of buffers (``CompileOptions.binding_arrays``), the parts
    of a merged launch that differ only in their buffers and sizes (an update of each
    parameter) are one body reading and writing through arrays indexed by the part; a buffer
    every part reads (the step size) stays one binding, and a part of another form keeps its
    own body. On the Vulkan runtime the results match NumPy with the arrays and without."""
    from meganeura.runtime.backends import get_runtime_device
    g = mg.Graph()
    lr = g.input("lr", (1,))
    ps = [g.input(f"p{i}", (5 + 300 * i,)) for i in range(4)]
    gs = [g.input(f"g{i}", (5 + 300 * i,)) for i in range(4)]
    outs = [p - lr * mg.ops.tanh(gr) for p, gr in zip(ps, gs)] + [g.input("q", (3, 8)) * 2.0]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=64, binding_arrays=True))
    (d,) = kp.dispatches
    assert d.wgsl.count("fn form") == 2 and d.wgsl.count("binding_array<array<f32>, 4>") == 3, d.wgsl
    assert "b2[0u]" in d.wgsl and len(d.bufs) == 1 + 3 * 4 + 2          # lr once; out, p, g per part; 2q and q
    assert [b.name for b in d.bufs[4:9]] == ["p0", "p1", "p2", "p3", "lr"]   # an array's buffers in part order
    # a part past SHARED_MAX_ELEMENTS keeps a body of its own (arrays cost each element a fetch)
    from meganeura.codegen import pointwise
    monkeypatch.setattr(pointwise, "SHARED_MAX_ELEMENTS", 600)
    (big,) = compile_plan(outs, options=CompileOptions(max_bindings=64, binding_arrays=True)).dispatches
    assert big.wgsl.count("fn form") == 4 and big.wgsl.count("binding_array<array<f32>, 2>") == 3
    # no two parts alike: the launch keeps a function per part, without locate's indirection
    monkeypatch.setattr(pointwise, "SHARED_MAX_ELEMENTS", 1)
    (apart,) = compile_plan(outs, options=CompileOptions(max_bindings=64, binding_arrays=True)).dispatches
    assert "fn locate" not in apart.wgsl and apart.wgsl.count("fn part") == 5 and "binding_array" not in apart.wgsl
    monkeypatch.undo()
    # an array binds a buffer two parts share twice: past the bindings the fusion allowed
    # (which counted it once), the parts keep their own bodies
    a = [g.input(f"a{i}", (7 + i,)) for i in range(4)]
    y, z = g.input("y", (1,)), g.input("z", (1,))
    shared = [v * w for v, w in zip(a, (y, y, z, z))]
    assert "binding_array" in compile_plan(shared, options=CompileOptions(max_bindings=12, binding_arrays=True)) \
        .dispatches[0].wgsl
    (d,) = compile_plan(shared, options=CompileOptions(max_bindings=10, binding_arrays=True)).dispatches
    assert "binding_array" not in d.wgsl and len(d.bufs) == 10
    dev = get_runtime_device("vulkan")
    if not arrays or not dev.limits.get("binding-arrays"):
        monkeypatch.setitem(dev.limits, "binding-arrays", False)
    rng = np.random.default_rng(3)
    feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
    want = mg.compile(g, outputs=outs, backend="numpy").run(feeds)
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        texts = [d.wgsl for d in s.executor.plan("run").kernel_plan.dispatches]
        assert ("binding_array" in texts[0]) == arrays
        for w, got in zip(want, s.run(feeds)):
            np.testing.assert_allclose(got, w, rtol=1e-5, atol=1e-6)


def test_merged_tiled_matmuls_alike_share_one_body(monkeypatch):
    """Merged tiled matmuls of the same shapes (sibling projections of one input) share one
    body through arrays of buffers in strict precision, and match NumPy on the Vulkan runtime;
    accelerated precision keeps a body per part (its tensor-core variants bind the parts'
    buffers as the text does)."""
    g = mg.Graph()
    x = g.input("x", (64, 96))
    outs = [x @ g.parameter(f"w{i}", (96, 128)) for i in range(3)] + [x @ g.parameter("w3", (96, 256))]
    opts = CompileOptions(max_bindings=64, binding_arrays=True)
    (d,) = compile_plan(outs, options=opts).dispatches
    assert d.wgsl.count("fn mms") == 2 and "binding_array<array<vec4<f32>>, 3>" in d.wgsl, d.wgsl[:800]
    acc = compile_plan(outs, options=CompileOptions(precision="accelerated", max_bindings=64, binding_arrays=True))
    (d,) = [d for d in acc.dispatches if d.kernel.archetype == "matmul"]
    assert "binding_array" not in d.wgsl and d.wgsl.count("fn mm") == 4
    rng = np.random.default_rng(0)
    feeds = {"x": rng.standard_normal((64, 96)).astype(np.float32)}
    ref = mg.compile(g, outputs=outs, backend="numpy")
    with mg.compile(g, outputs=outs, backend="vulkan") as s:
        s.load_state_dict(ref.state_dict())
        for want, got in zip(ref.run(feeds), s.run(feeds)):
            np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_optimizer_and_cache_updates_are_written_in_place():
    """AdamW's parameter and moment updates, and a decoder's KV-cache blend, write into
    the tensors' own buffers: no copies after the step, and training still matches the
    NumPy reference. Each parameter's update is one kernel that stores its moments too."""
    g = mg.Graph()
    x = g.input("x", (4, 6))
    y = g.input("y", (4, 3))
    h = mg.ops.tanh(mg.ops.linear(x, g.parameter("w1", (5, 6)), g.parameter("b1", (5,), init=0.1)))
    loss = mg.ops.mse_loss(mg.ops.linear(h, g.parameter("w2", (3, 5))), y)
    rng = np.random.default_rng(2)
    feeds = {"x": rng.standard_normal((4, 6)).astype(np.float32), "y": rng.standard_normal((4, 3)).astype(np.float32)}
    ref = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="numpy")
    gpu = mg.compile(g, loss=loss, optimizer=mg.optim.AdamW(lr=1e-2), backend="gpu")
    for _ in range(3):
        lr_, lg = ref.step(feeds), gpu.step(feeds)
        assert abs(lr_ - lg) <= 1e-5 * max(1.0, abs(lr_))
    plan = gpu.executor.plans["step"]
    n_state = len(g.parameters) + len(g.states)
    assert plan.kernel_plan.stats["in_place"] == n_state
    assert len(plan.copies_after) == len(plan.fetch_locs)     # only the loss is copied out
    # one pass per parameter: its update computes both moments and stores them (in place)
    units = [u for d in plan.kernel_plan.dispatches for u in d.kernel.spec.get("parts", [d.kernel])]
    updates = [u for u in units if "adam_step" in u.name]
    assert len(updates) == len(g.parameters) and not [u for u in units if u.name in ("ema", "ema_sq")]
    assert sorted(v.buf.name for u in updates for v in u.outs) == \
        sorted(f"{p}.{m}" for p in g.parameters for m in ("exp_avg", "exp_avg_sq"))
    for name, want in ref.state_dict(include_optimizer=True).items():
        np.testing.assert_allclose(gpu.state_dict(include_optimizer=True)[name], want, rtol=1e-4, atol=1e-6)
    cfg = llama.LlamaConfig.tiny()
    g2, logits, new = llama.build_decoder(cfg, 1, 1, 16, cache_as_state=True)
    names = llama.cache_names(cfg)
    kp = compile_plan([logits] + new, updates={1 + i: n for i, n in enumerate(names)})
    assert kp.stats["in_place"] == len(names)


def test_norm_prologue_in_gemv_matches_reference():
    """Layer and RMS norms read only by few-row products are computed inside them."""
    g = mg.Graph()
    x = g.input("x", (3, 2, 40))           # batch 3 of 2-row GEMVs
    ln = mg.ops.layer_norm(x, (40,), g.parameter("lw", (40,), init="normal"), g.parameter("lb", (40,), init="normal"))
    rn = mg.ops.rms_norm(x * 2.0, (40,), None, 1e-5)
    wa, wb = g.parameter("wa", (24, 40)), g.parameter("wb", (16, 40))
    outs = [mg.ops.linear(ln, wa), mg.ops.linear(ln, wb) + 1.0, mg.ops.linear(rn, wa)]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    assert not any(d.kernel.archetype == "norm" for d in kp.dispatches), kp.names
    assert sum("layer_norm>" in n for n in kp.names) == 1 and sum("rms_norm>" in n for n in kp.names) == 1, kp.names
    rng = np.random.default_rng(3)
    feeds = {"x": rng.standard_normal((3, 2, 40)).astype(np.float32) * 3 + 1}
    _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-4, atol=1e-5)


def test_sibling_tiled_matmuls_and_split_k_sums_share_launches():
    """Projections of one input (q/k/v in a prefill) run as one tiled launch, their split-K
    sums as one pointwise launch, with their epilogues."""
    g = mg.Graph()
    x = g.input("x", (40, 320))
    ws = [g.parameter(f"w{i}", (n, 320), init="normal") for i, n in enumerate((48, 80, 24))]
    r = g.input("r", (40, 80))
    outs = [mg.ops.linear(x, ws[0]), mg.ops.linear(x, ws[1]) + r, mg.ops.silu(mg.ops.linear(x, ws[2]))]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    arch = [d.kernel.archetype for d in kp.dispatches]
    assert arch in (["matmul", "multi"], ["matmul"]), kp.names
    assert "|" in kp.names[0]
    rng = np.random.default_rng(5)
    feeds = {"x": rng.standard_normal((40, 320)).astype(np.float32), "r": rng.standard_normal((40, 80)).astype(np.float32)}
    _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-4, atol=1e-5)


def test_projections_of_an_input_in_every_layer_share_one_launch_at_the_front():
    """Cross-attention keys and values of the same context, projected in every layer of a
    chain: hoisted to the front, their matmuls share launches (``MAX_TILED_PARTS`` each)
    and their split-K sums one more, whatever the chain between them; results still match
    the reference."""
    g = mg.Graph()
    x, ctx = g.input("x", (20, 64)), g.input("ctx", (12, 256))
    h = x
    for i in range(3):
        k = mg.ops.linear(ctx, g.parameter(f"k{i}", (64, 256), init="normal"))
        v = mg.ops.linear(ctx, g.parameter(f"v{i}", (64, 256), init="normal"))
        a = mg.ops.softmax(mg.ops.mm(h, k, tb=True) * 0.125, -1)
        h = mg.ops.tanh(mg.ops.mm(a, v) + h)
    kp = compile_plan([h], options=CompileOptions(max_bindings=64))
    off = compile_plan([h], options=CompileOptions(max_bindings=64, disabled=frozenset({"hoist"})))
    from meganeura.passes.fuse import MAX_TILED_PARTS
    front = [d.kernel for d in kp.dispatches[:2]]
    assert [k.name.count("matmul") for k in front] == [MAX_TILED_PARTS, 6 - MAX_TILED_PARTS], kp.names
    assert all(k.archetype == "matmul" for k in front), kp.names
    assert kp.n_dispatches <= off.n_dispatches - 3, (kp.names, off.names)
    rng = np.random.default_rng(11)
    feeds = {"x": rng.standard_normal((20, 64)).astype(np.float32),
             "ctx": rng.standard_normal((12, 256)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [h], feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("train", [False, True])
def test_norm_computes_its_residual_add_and_stores_it(train):
    """A residual add after a split-K matmul, read by a norm and by a later add: the norm's
    launch computes it, stores it for the later reader and normalises it (RMS and layer
    norms, with and without an epilogue); the training step's gradients still match."""
    g = mg.Graph()
    x, h = g.input("x", (24, 96)), g.input("h", (24, 512))
    w = g.parameter("w", (96, 512), init="normal")
    w2 = g.parameter("w2", (40, 96), init="normal")
    x1 = x + mg.ops.linear(h, w)
    y = mg.ops.linear(mg.ops.rms_norm(x1, (96,), g.parameter("nw", (96,), init="normal"), 1e-6), w2)
    z = mg.ops.silu(mg.ops.layer_norm(x1 * 2.0 + 1.0, (96,), g.parameter("lw", (96,), init="normal"),
                                      g.parameter("lb", (96,), init="normal")))
    outs = [y, x1 * 3.0, z]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    assert "matmul.splitk_sum+add>rms_norm" in kp.names and "mul+add>layer_norm+silu" in kp.names, kp.names
    off = compile_plan(outs, options=CompileOptions(max_bindings=32, disabled=frozenset({"prologue"})))
    assert kp.n_dispatches < off.n_dispatches
    rng = np.random.default_rng(12)
    feeds = {"x": rng.standard_normal((24, 96)).astype(np.float32), "h": rng.standard_normal((24, 512)).astype(np.float32)}
    if not train:
        _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-4, atol=1e-5)
        return
    loss = mg.ops.mean(y * y) + mg.ops.mean(z * x1)
    ref = mg.compile(g, loss=loss, backend="numpy")
    gpu = mg.compile(g, loss=loss, backend="gpu")
    gpu.load_state_dict(ref.state_dict())
    np.testing.assert_allclose(gpu.compute_grads(feeds), ref.compute_grads(feeds), rtol=1e-5)
    want, got = ref.grads(), gpu.grads()
    assert want
    for name in want:
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6, err_msg=name)


def test_common_subexpressions_are_computed_once():
    """Equal nodes (same op, inputs and attributes; equal constants) after lowering are one
    node: a quantity that a backward rule rebuilds is not computed twice."""
    g = mg.Graph()
    x = g.input("x", (4, 8))
    a = mg.ops.softmax(x * 2.0, -1) + mg.ops.exp(x)
    b = mg.ops.softmax(x * 2.0, -1) * mg.ops.exp(x)        # the same softmax and exp again
    kp = compile_plan([a, b])
    assert kp.n_dispatches <= 4, kp.names
    assert sum("softmax" in n for n in kp.names) == 1, kp.names
    feeds = {"x": np.random.default_rng(0).standard_normal((4, 8)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [a, b], feeds, rtol=1e-5, atol=1e-6)


def test_lowering_merges_equal_targets_and_leaves_no_duplicate_needed():
    """Targets that compute the same value become one node, and no two needed nodes of the
    lowered graph are equal (the merge rewires the lowering's graph in place)."""
    from meganeura import codegen
    from meganeura.passes.lower import _cse_key, lower_to_primitives
    from meganeura.reference import needed_nodes
    g = mg.Graph()
    x = g.input("x", (4, 8))
    a = mg.ops.softmax(x * 2.0, -1) + 1.0
    b = mg.ops.softmax(x * 2.0, -1) + 1.0
    _, (la, lb) = lower_to_primitives([a, b], keep=codegen.has_kernel)
    assert la is lb
    keys = [_cse_key(t, t.inputs) for t in needed_nodes([la]) if t.op not in ("input", "parameter", "state")]
    assert len(keys) == len(set(keys)) and None not in keys


def test_batch_and_group_norm_are_one_row_kernel_with_their_affine():
    """Training-mode batch norm is a layer norm over each channel's transposed rows, group
    norm over (sample, group) rows: one kernel each, the per-channel affine and the
    activation stored through the transposed store."""
    g = mg.Graph()
    x = g.input("x", (3, 4, 5, 6))
    w, b = g.parameter("w", (4,), init="normal"), g.parameter("b", (4,), init="normal")
    bn = mg.ops.relu(mg.ops.batch_norm(x, None, None, w, b, training=True)) + x
    gn = mg.ops.silu(mg.ops.group_norm(x, 2, w, b))
    kp = compile_plan([bn, gn], options=CompileOptions(max_bindings=32))
    assert [d.kernel.archetype for d in kp.dispatches] == ["norm", "norm"], kp.names
    feeds = {"x": np.random.default_rng(4).standard_normal((3, 4, 5, 6)).astype(np.float32) * 2 + 1}
    _assert_gpu_matches_reference(g, [bn, gn], feeds, rtol=1e-4, atol=1e-5)


def test_pointwise_read_only_by_a_reduction_runs_in_its_loads():
    """sum(ct * n) over rows (a weight gradient), a mean of squares over a transposed
    view, and a long (chunked) reduction each read their pointwise producer in their loads
    (and, being independent, share one launch)."""
    g = mg.Graph()
    ct, n = g.input("ct", (6, 40)), g.input("n", (6, 40))
    w = g.input("w", (40,))
    outs = [mg.ops.sum(ct * n * w, 0), mg.ops.mean(mg.ops.transpose(mg.ops.tanh(n) ** 2, 0, 1), 1),
            mg.ops.amax(mg.ops.reshape(g.input("big", (3, 20000)) * 2.0 - 1.0, (60000,)), 0)]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    assert not any(d.kernel.archetype == "pointwise" for d in kp.dispatches), kp.names
    assert sum(nm.count(">") for nm in kp.names) >= 3 and kp.n_dispatches <= 2, kp.names
    rng = np.random.default_rng(6)
    feeds = {nm: rng.standard_normal(t.shape).astype(np.float32) for nm, t in g.inputs.items()}
    _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-5, atol=1e-5)


def test_pointwise_kernel_writes_a_transposed_copy_itself():
    """A head merge (transpose, then reshape) of a pointwise result is that kernel's
    strided store, not a copy kernel."""
    g = mg.Graph()
    x = g.input("x", (2, 3, 4, 5))
    y = mg.ops.reshape(mg.ops.transpose(mg.ops.tanh(x) * 2.0, 1, 2), (2, 4, 15))
    z = mg.ops.transpose(mg.ops.exp(x), 0, 3) + 0.0        # a copy with an op stays fused anyway
    kp = compile_plan([y, z], options=CompileOptions(max_bindings=32))
    assert len(kp.dispatches) <= 2 and not any(n.startswith("reshape") for n in kp.names), kp.names
    feeds = {"x": np.random.default_rng(8).standard_normal((2, 3, 4, 5)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [y, z], feeds, rtol=1e-6, atol=1e-6)


def test_coalesce_merges_dims_every_view_walks_as_one():
    from meganeura.codegen.common import coalesce
    # contiguous, and a bias broadcast over the leading dims: the trailing pair merges
    assert coalesce((2, 3, 4, 5), [(60, 20, 5, 1), (0, 0, 5, 1)]) == ((6, 20), [(20, 1), (0, 1)])
    # every view contiguous: one dim; size-1 dims dropped
    assert coalesce((2, 1, 4), [(4, 4, 1), (4, 99, 1)]) == ((8,), [(1,), (1,)])
    # a transposed read keeps the dims it swaps apart
    assert coalesce((3, 4), [(4, 1), (1, 3)]) == ((3, 4), [(4, 1), (1, 3)])
    assert coalesce((1, 1), [(1, 1)]) == ((), [()])


def test_pointwise_kernel_over_contiguous_views_splits_its_index_once():
    """Contiguous operands of a 4-D elementwise kernel are read at the flat index (no
    coordinate splits); a transposed operand, a broadcast one and a strided second output
    keep theirs, and every result matches the reference."""
    g = mg.Graph()
    x, y = g.input("x", (2, 3, 4, 5)), g.input("y", (2, 3, 4, 5))
    b = g.input("b", (4, 5))
    flat = mg.ops.tanh(x) * y + 1.0
    kp = compile_plan([flat], options=CompileOptions(max_bindings=32))
    (d,) = kp.dispatches
    assert " % " not in d.wgsl and "cr / " not in d.wgsl, d.wgsl
    mixed = mg.ops.exp(x) * mg.ops.transpose(y, 2, 3).reshape((2, 3, 4, 5)) + b
    strided = mg.ops.transpose(mg.ops.sigmoid(x) + b, 1, 3) * 1.0
    rng = np.random.default_rng(12)
    feeds = {n: rng.standard_normal((2, 3, 4, 5)).astype(np.float32) for n in "xy"}
    feeds["b"] = rng.standard_normal((4, 5)).astype(np.float32)
    _assert_gpu_matches_reference(g, [flat, mixed, strided], feeds, rtol=1e-5, atol=1e-5)


def test_transposed_copy_that_splits_a_dim_is_the_writers_store():
    """A transformer's tokens read back as channels x height x width (a transpose that
    splits the sequence dim): the pointwise kernel that wrote the tokens stores that
    layout itself."""
    g = mg.Graph()
    x = g.input("x", (1, 64, 8))
    r = g.input("r", (1, 64, 8))
    h = mg.ops.tanh(x) + r
    y = mg.ops.reshape(mg.ops.transpose(h, 1, 2), (1, 8, 8, 8))
    z = mg.ops.exp(y) * 2.0                 # a consumer that needs y in its own layout
    w = mg.ops.reshape(y, (1, 8, 64)) @ mg.ops.reshape(r, (1, 64, 8))
    kp = compile_plan([z, w], options=CompileOptions(max_bindings=32))
    assert not any(n in ("copy", "reshape") for n in kp.names), kp.names
    rng = np.random.default_rng(11)
    feeds = {n: rng.standard_normal((1, 64, 8)).astype(np.float32) for n in "xr"}
    _assert_gpu_matches_reference(g, [z, w], feeds, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("archetype", ["pointwise", "matmul"])
def test_concat_of_an_early_value_is_its_writers_second_store(archetype):
    """A skip connection: a value computed early, used on, and concatenated much later is
    stored into the concat's slice by the kernel that computes it (no copy launch); the
    kernel that writes the concat's other slice in between does not get in the way."""
    g = mg.Graph()
    x = g.input("x", (4, 16))
    w = g.parameter("w", (16, 16))
    skip = mg.ops.tanh(x) * 3.0 if archetype == "pointwise" else mg.ops.relu(x @ w)
    h = mg.ops.exp(skip * 0.1) @ w          # the skip is also read on the way
    h = mg.ops.sigmoid(h) + 1.0
    out = mg.ops.concat([h, skip], dim=1) @ g.parameter("w2", (32, 8))
    kp = compile_plan([out], options=CompileOptions(max_bindings=32))
    assert not any(n == "concat" for n in kp.names), kp.names
    assert any(n.endswith("+concat") for n in kp.names), kp.names
    off = compile_plan([out], options=CompileOptions(max_bindings=32, disabled=frozenset({"stores"})))
    assert off.n_dispatches == kp.n_dispatches + 1, (off.names, kp.names)
    feeds = {"x": np.random.default_rng(12).standard_normal((4, 16)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [out], feeds, rtol=1e-5, atol=1e-5)


def test_cast_of_a_value_read_elsewhere_is_its_writers_second_store():
    """An activation read both as f16 (an accelerated matmul's operand) and as f32 (the
    backward pass): the kernel that computes it stores both; no cast launch."""
    g = mg.Graph()
    x = g.input("x", (8, 16))
    h = mg.ops.rms_norm(x, (16,), g.parameter("n", (16,), init="ones"), 1e-5)
    h16 = mg.ops.cast(h, "f16")
    y = mg.ops.matmul(h16, mg.ops.cast(g.parameter("w", (16, 12)), "f16"))
    z = mg.ops.exp(h) * 2.0                 # the f32 value, read on
    kp = compile_plan([y, z], options=CompileOptions(max_bindings=32, disabled=frozenset({"horizontal"})))
    assert any(n.startswith("rms_norm") and n.endswith("+cast") for n in kp.names), kp.names
    off = compile_plan([y, z], options=CompileOptions(max_bindings=32, disabled=frozenset({"horizontal", "stores"})))
    assert off.n_dispatches == kp.n_dispatches + 1 and off.names.count("cast") == kp.names.count("cast") + 1, \
        (off.names, kp.names)
    feeds = {"x": np.random.default_rng(14).standard_normal((8, 16)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [y, z], feeds, rtol=2e-3, atol=2e-3)


@pytest.mark.parametrize("train", [False, True])
def test_geglu_is_computed_in_the_output_projections_loads(train):
    """GEGLU (gelu of one half of a projection times the other half) is evaluated in the
    loads of the matmuls that read it, forward and (training) the weight gradient's: no
    launch stores it."""
    g = mg.Graph()
    x = g.input("x", (96, 24))
    w1 = g.parameter("w1", (24, 64))
    w2 = g.parameter("w2", (32, 20))
    value, gate = mg.ops.chunk(x @ w1, 2, dim=1)
    y = (mg.ops.gelu(gate) * value) @ w2
    rng = np.random.default_rng(13)
    feeds = {"x": rng.standard_normal((96, 24)).astype(np.float32)}
    if not train:
        kp = compile_plan([y], options=CompileOptions(max_bindings=32))
        assert any(n.startswith("gelu+mul>matmul") for n in kp.names), kp.names
        assert not any(n.startswith("gelu") and ">" not in n for n in kp.names), kp.names
        off = compile_plan([y], options=CompileOptions(max_bindings=32, disabled=frozenset({"prologue"})))
        assert off.n_dispatches == kp.n_dispatches + 1
        _assert_gpu_matches_reference(g, [y], feeds, rtol=1e-5, atol=1e-5)
        return
    loss = mg.ops.mean(y * y)
    ref = mg.compile(g, loss=loss, backend="numpy")
    gpu = mg.compile(g, loss=loss, backend="gpu")
    gpu.load_state_dict(ref.state_dict())
    fetches, _, _, targets = gpu.program.targets("grads")
    names = compile_plan(targets, n_forward=len(fetches), options=CompileOptions(max_bindings=32)).names
    assert sum(n.startswith("gelu+mul>matmul") for n in names) == 2, names      # forward and dW2
    ref.compute_grads(feeds)
    gpu.compute_grads(feeds)
    want, got = ref.grads(), gpu.grads()
    for name in ("w1", "w2"):
        np.testing.assert_allclose(got[name], want[name], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("k,block", [(64, None), (30, None), (2048, None), (30, "128x64/16x8"), (2048, "128x64/16x8"),
                                     (100, "64x64/8x8")])
def test_norm_prologue_in_tiled_matmuls_matches_reference(k, block, monkeypatch):
    """A norm read only by tiled matmuls (a prefill's q/k/v projections): each workgroup
    computes its rows' statistics and normalises A as it loads it; vec4 and scalar loads
    (K % 4), split K, sibling launches; blocks with several threads per row (the square
    tiles of 256 threads) and one (128 threads for 128 rows), with or without a ragged
    last group of loads."""
    if block:
        monkeypatch.setenv("MEGANEURA_MATMUL_BLOCK", block)
    g = mg.Graph()
    x = g.input("x", (40, k))
    ln = mg.ops.layer_norm(x, (k,), g.parameter("lw", (k,), init="normal"), g.parameter("lb", (k,), init="normal"))
    x1 = g.input("x1", (40, k))       # an input: a norm of a pointwise kernel's value absorbs that kernel
    rn = mg.ops.rms_norm(x1, (k,), None, 1e-5)
    wa, wb = g.parameter("wa", (24, k), init="normal"), g.parameter("wb", (36, k), init="normal")
    outs = [mg.ops.linear(ln, wa), mg.ops.linear(ln, wb) * 2.0, mg.ops.linear(rn, wa)]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    assert not any(d.kernel.archetype == "norm" for d in kp.dispatches), kp.names
    rng = np.random.default_rng(9)
    feeds = {"x": (rng.standard_normal((40, k)) * 3 + 1).astype(np.float32)}
    feeds["x1"] = feeds["x"] + 1
    _assert_gpu_matches_reference(g, outs, feeds, rtol=2e-4, atol=2e-4)


def test_norm_read_by_many_tiled_workgroups_keeps_its_launch(monkeypatch):
    """A norm before a wide projection whose column tiles would each recompute the rows'
    statistics (more elements read than the limit, lowered here to keep the test small)
    stays a kernel of its own; the result is the same."""
    from meganeura.passes import fuse_prologue
    monkeypatch.setattr(fuse_prologue, "TILED_PROLOGUE_READ_ELEMENTS", 320 * 96 * 8)
    TILED_PROLOGUE_READ_ELEMENTS = fuse_prologue.TILED_PROLOGUE_READ_ELEMENTS
    g = mg.Graph()
    x = g.input("x", (320, 96))
    ln = mg.ops.layer_norm(x, (96,), g.parameter("lw", (96,), init="normal"), g.parameter("lb", (96,), init="normal"))
    outs = [mg.ops.linear(ln, g.parameter("w", (1536, 96), init="normal"))]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    mm = [d.kernel for d in kp.dispatches if d.kernel.archetype == "matmul"]
    assert len(mm) == 1 and "prologue" not in mm[0].spec, kp.names
    readers = -(-1536 // matmul.block_of(mm[0].spec)[1]) * mm[0].spec["split"]
    assert readers * x.shape[0] * 96 > TILED_PROLOGUE_READ_ELEMENTS
    assert any(d.kernel.archetype == "norm" for d in kp.dispatches), kp.names
    rng = np.random.default_rng(3)
    _assert_gpu_matches_reference(g, outs, {"x": (rng.standard_normal(x.shape) * 2 + 1).astype(np.float32)},
                                  rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("norm", [False, True])
def test_swiglu_gemvs_pair_in_one_launch(norm):
    """Decoding's gate and up projections: up's epilogue silu(gate) * up gets gate from
    the same workgroups (one launch, gate never stored)."""
    g = mg.Graph()
    x = g.input("x", (2, 48))
    h = mg.ops.rms_norm(x, (48,), g.parameter("n", (48,), init="normal"), 1e-5) if norm else x
    gate, up = g.parameter("gate", (40, 48), init="normal"), g.parameter("up", (40, 48), init="normal")
    y = mg.ops.silu(mg.ops.linear(h, gate)) * mg.ops.linear(h, up) + x[:, :40]
    kp = compile_plan([y], options=CompileOptions(max_bindings=32))
    assert kp.n_dispatches == 1 and "&" in kp.names[0], kp.names
    feeds = {"x": np.random.default_rng(10).standard_normal((2, 48)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [y], feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("norm", ["layer_norm", "batch_norm", "group_norm"])
def test_norm_backward_reductions_run_with_their_reader(norm):
    """A norm's input gradient (mean(dn), mean(dn * n), then dx) is one row kernel."""
    g = mg.Graph()
    x = g.parameter("x", (3, 4, 5, 6), init="normal")
    w = g.parameter("w", (4,) if norm != "layer_norm" else (6,), init="normal")
    if norm == "layer_norm":
        y = mg.ops.layer_norm(x, (6,), w)
    elif norm == "batch_norm":
        y = mg.ops.batch_norm(x, None, None, w, None, training=True)
    else:
        y = mg.ops.group_norm(x, 2, w)
    loss = mg.ops.sum(y * g.constant(np.random.default_rng(11).standard_normal((3, 4, 5, 6)).astype(np.float32)))
    ref = mg.compile(g, loss=loss, backend="numpy")
    gpu = mg.compile(g, loss=loss, backend="gpu")
    gpu.load_state_dict(ref.state_dict())
    ref.compute_grads({})
    gpu.compute_grads({})
    plan = gpu.executor.plans["grads"]
    assert any(d.kernel.archetype == "rowfuse" for d in plan.kernel_plan.dispatches), plan.names
    # the backward reads the statistics the forward's norm kernel stored: no second pass
    assert any("&norm_rstd" in n for n in plan.names), plan.names
    assert not any(n.startswith("norm_") for n in plan.names), plan.names
    for name, want in ref.grads().items():
        np.testing.assert_allclose(gpu.grads()[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("center", [False, True])
@pytest.mark.parametrize("merged", [False, True])
def test_norm_statistics_stored_by_the_forward_or_alone(center, merged, monkeypatch):
    """The backward's statistics come from the forward's norm kernel, or (pass switched
    off) from stats-only row kernels; the gradients match either way."""
    if not merged:
        monkeypatch.setenv("MEGANEURA_NO_FUSE", "normstats")
    g = mg.Graph()
    x = g.parameter("x", (96, 32), init="normal")
    w = g.parameter("w", (32, 24), init="normal")
    n = mg.ops.layer_norm(x, (32,)) if center else mg.ops.rms_norm(x, (32,))
    loss = mg.ops.sum(mg.ops.tanh(n @ w))
    ref = mg.compile(g, loss=loss, backend="numpy")
    gpu = mg.compile(g, loss=loss, backend="gpu")
    gpu.load_state_dict(ref.state_dict())
    ref.compute_grads({})
    gpu.compute_grads({})
    names = gpu.executor.plans["grads"].names
    alone = [nm for nm in names if nm.startswith("norm_")]
    assert (not alone) == merged and any("&norm_rstd" in nm for nm in names) == merged, names
    if not merged:
        assert ("norm_mean" in " ".join(alone)) == center, names
    for name, want in ref.grads().items():
        np.testing.assert_allclose(gpu.grads()[name], want, rtol=1e-4, atol=1e-5, err_msg=name)


def test_independent_tiled_matmuls_share_a_launch():
    """Matmuls with different operands but the same tiling (a backward's input and weight
    gradients) run as one launch, each part loading its own operands."""
    g = mg.Graph()
    a, b = g.input("a", (40, 24)), g.input("b", (24, 36))
    c, d = g.input("c", (40, 16)), g.input("d", (20, 16))
    outs = [mg.ops.matmul(a, b), mg.ops.linear(c, d) + 1.0, mg.ops.matmul(mg.ops.transpose(c, 0, 1), a)]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=32))
    assert sum(d_.kernel.archetype == "matmul" for d_ in kp.dispatches) < 3, kp.names
    rng = np.random.default_rng(12)
    feeds = {n: rng.standard_normal(t.shape).astype(np.float32) for n, t in g.inputs.items()}
    _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-5, atol=1e-5)


# Dispatches per call of every workload (tiny configs, the real models' structure), as
# the GPU executor compiles them. Lower a budget when fusion improves; a rise is a
# regression. (Real-size counts: bench/dispatches.py.) The U-Net's and Whisper's training
# counts rose by 12 and 3 when merged tiled matmuls were capped at ``MAX_TILED_PARTS`` parts
# (smaller kernels for the driver; the pieces are independent launches of one level), and
# the U-Net's by 2 when convolution weight gradients with more weights than positions began
# to fold the batch into one matmul (a transposing copy of the cotangent each, where the sum
# over the batch had fused with its neighbours).
BUDGETS = {
    "smollm2": {"inference": 16, "minimal": 15, "flb": 74, "train_step": 74},
    "smolvla": {"inference": 28, "minimal": 28, "flb": 110, "train_step": 111},
    "unet": {"inference": 169, "minimal": 169, "flb": 740, "train_step": 746},
    "resnet50": {"inference": 20, "minimal": 20, "flb": 101, "train_step": 107},
    "whisper": {"inference": 14, "minimal": 14, "flb": 67, "train_step": 68},
}


@pytest.mark.parametrize("workload", list(BUDGETS))
def test_workload_dispatch_budgets(workload):
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    w = make(workload, size="tiny")
    for phase, budget in BUDGETS[workload].items():
        targets, n_fwd, updates = phase_targets(w, phase)
        n = compile_plan(targets, n_forward=n_fwd, options=CompileOptions(max_bindings=BINDINGS),
                         updates=updates).n_dispatches
        assert n <= budget, f"{workload} {phase}: {n} dispatches, budget {budget}"


# The compiler-core target at the paper's sizes: a third of the launches the first
# runtime recorded (SmolLM2 1023 / 1055 / 4551, SmolVLA train 2263, U-Net 711).
REAL_TARGETS = [("smollm2", "inference", 1023 // 3), ("smollm2", "minimal", 1055 // 3),
                ("smollm2", "train_step", 4551 // 3), ("smolvla", "train_step", 2263 // 3),
                ("unet", "inference", 711 // 3)]


@pytest.mark.parametrize("workload,phase,budget", REAL_TARGETS)
def test_real_size_dispatches_are_a_third_of_the_first_runtimes(workload, phase, budget):
    from meganeura.bench.dispatches import BINDINGS, phase_targets
    from meganeura.bench.workloads import make
    targets, n_fwd, updates = phase_targets(make(workload, size="real"), phase)
    n = compile_plan(targets, n_forward=n_fwd, options=CompileOptions(max_bindings=BINDINGS),
                     updates=updates).n_dispatches
    assert n <= budget, f"{workload} {phase} at real size: {n} dispatches, target {budget}"


def test_reshape_view_matches_numpy():
    """reshape_view gives numpy's no-copy reshape of strided views, and None where numpy
    would have to copy."""
    from meganeura.schedule import Buf, View, reshape_view
    rng = np.random.default_rng(5)
    for _ in range(300):
        shape = tuple(int(n) for n in rng.integers(1, 5, rng.integers(1, 5)))
        a = np.arange(int(np.prod(shape)) * 2).reshape(shape[:-1] + (shape[-1] * 2,))[..., ::2]
        a = a.transpose(rng.permutation(len(shape)))
        v = View(Buf(0, "temp", "x"), a.shape, tuple(s // a.itemsize for s in a.strides), 0, None)
        dims = [int(n) for n in rng.permutation(list(a.shape) + [1])]
        target = [dims[0]]
        for n in dims[1:]:
            if rng.random() < 0.4:
                target[-1] *= n
            else:
                target.append(n)
        r = reshape_view(v, target)
        if r is None:
            continue
        idx = np.indices(target).reshape(len(target), -1)
        got = (idx * np.array(r.strides)[:, None]).sum(0)
        np.testing.assert_array_equal(got, a.reshape(target).ravel())


def test_pointwise_producer_sinks_into_a_later_reader():
    """A split-K sum whose reader also needs a value computed after it (a conv output plus a
    time embedding projected later) runs inside that reader, through the reshape between."""
    g = mg.Graph()
    x = g.input("x", (1, 1024, 256))
    w = g.parameter("w", (8, 1024), init="normal")
    t = g.input("t", (1, 16))
    wt = g.parameter("wt", (8, 16), init="normal")
    h = mg.ops.reshape(mg.ops.matmul(w, x), (1, 8, 16, 16))        # split over K
    emb = mg.ops.reshape(mg.ops.linear(mg.ops.silu(t), wt), (1, 8, 1, 1))
    y = h + emb
    kp = compile_plan([y])
    assert kp.n_dispatches == 4 and any(n.startswith("matmul.splitk_sum+") for n in kp.names), kp.names
    rng = np.random.default_rng(6)
    feeds = {"x": rng.standard_normal((1, 1024, 256)).astype(np.float32),
             "t": rng.standard_normal((1, 16)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [y], feeds, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("stride,padding,dilation,groups", [(1, 1, 1, 1), (2, 1, 1, 1), (1, 2, 2, 1), (2, 0, 1, 2)])
def test_convolution_reads_im2col_in_its_matmul_loads(stride, padding, dilation, groups):
    """Implicit GEMM: the column matrix of a convolution is computed in the matmul's operand
    loads (forward and weight gradient), never stored; results match the reference."""
    g = mg.Graph()
    x = g.parameter("x", (2, 4, 13, 11), init="normal")
    w = g.parameter("w", (40, 4 // groups, 3, 3), init="normal")
    y = mg.ops.relu(mg.ops.conv2d(x, w, stride=stride, padding=padding, dilation=dilation, groups=groups))
    kp = compile_plan([y])
    assert not any(n == "im2col" for n in kp.names) and any("im2col>matmul" in n for n in kp.names), kp.names
    _assert_gpu_matches_reference(g, [y], {}, rtol=1e-4, atol=1e-5)
    loss = mg.ops.sum(y * y)
    ref = mg.compile(g, loss=loss, backend="numpy")
    gpu = mg.compile(g, loss=loss, backend="gpu")
    gpu.load_state_dict(ref.state_dict())
    ref.compute_grads({})
    gpu.compute_grads({})
    assert any("im2col>matmul" in n for n in gpu.executor.plans["grads"].names)
    for name, want in ref.grads().items():
        np.testing.assert_allclose(gpu.grads()[name], want, rtol=1e-4, atol=1e-4, err_msg=name)


def test_composed_pointwise_kernels_keep_absorbing_producers():
    """A pointwise kernel composed with one producer goes on to its other pointwise
    producers: two split-K sums added together (a gradient reaching x through two
    projections) are one kernel."""
    g = mg.Graph()
    a = g.input("a", (1, 1024, 256))
    b = g.input("b", (1, 1024, 256))
    w1, w2 = g.parameter("w1", (8, 1024), init="normal"), g.parameter("w2", (8, 1024), init="normal")
    s = mg.ops.matmul(w1, a) + mg.ops.matmul(w2, b)
    kp = compile_plan([s])
    assert kp.names.count("matmul.splitk_sum+matmul.splitk_sum+add") == 1 and kp.n_dispatches <= 3, kp.names
    rng = np.random.default_rng(8)
    feeds = {"a": rng.standard_normal((1, 1024, 256)).astype(np.float32),
             "b": rng.standard_normal((1, 1024, 256)).astype(np.float32)}
    _assert_gpu_matches_reference(g, [s], feeds, rtol=1e-4, atol=1e-5)


def test_small_producer_is_recomputed_so_siblings_share_a_launch():
    """SwiGLU in training keeps silu(gate) for the backward; the product recomputes it
    instead of waiting for it, and both run in one launch."""
    g = mg.Graph()
    gate, up = g.input("gate", (4, 300)), g.input("up", (4, 300))
    s = mg.ops.silu(gate)
    y = s * up
    kp = compile_plan([s, y])
    assert kp.n_dispatches == 1, kp.names
    rng = np.random.default_rng(9)
    feeds = {n: rng.standard_normal((4, 300)).astype(np.float32) for n in ("gate", "up")}
    _assert_gpu_matches_reference(g, [s, y], feeds, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("kept", [False, True], ids=["only_rope", "also_read_later"])
def test_rope_sums_split_k_partials_read_by_heads(kept):
    """A projection split over K, read by heads (a transpose) by RoPE at two positions per
    element: RoPE sums the partials itself, and where something later reads the projection
    too, stores it through the same transpose. Matches the reference."""
    g = mg.Graph()
    x = g.input("x", (6, 512))
    q = mg.ops.linear(x, g.parameter("wq", (32, 512), init="normal"))        # 4 heads of 8
    heads = mg.ops.transpose(mg.ops.reshape(q, (6, 4, 8)), 0, 1)
    r = mg.ops.rope(heads)
    outs = [r, mg.ops.tanh(q) * 2.0] if kept else [r]
    kp = compile_plan(outs, options=CompileOptions(max_bindings=64))
    units = [u for d in kp.dispatches for u in d.kernel.spec.get("parts", [d.kernel])]
    (rot,) = [u for u in units if "rotate_half" in u.name]
    assert rot.name.startswith("matmul.splitk_sum" + ("&" if kept else "+")), kp.names
    assert not [u for u in units if u.name == "matmul.splitk_sum"], kp.names
    assert len(rot.outs) == int(kept)
    feeds = {"x": np.random.default_rng(3).standard_normal((6, 512)).astype(np.float32)}
    _assert_gpu_matches_reference(g, outs, feeds, rtol=1e-4, atol=1e-5)


def test_view_through_a_producers_operands():
    """``fuse._view_through``: a view of a kernel's output re-expressed over one of its
    operands, only where each stride stays inside one output dimension."""
    from meganeura.passes.fuse import _view_through
    from meganeura.schedule import Buf, Kernel, View
    f32 = mg.f32
    out_buf, op_buf = Buf(6 * 32 * 4, "temp", "out"), Buf(2 * 6 * 32 * 4, "temp", "op")
    k = Kernel("k", "pointwise", {"expr": ("leaf", 0)}, View.contiguous(out_buf, (6, 32), f32),
                           [View(op_buf, (6, 32), (32, 1), 192, f32)])
    heads = View(out_buf, (4, 6, 8), (8, 32, 1), 0, f32)                 # (6, 4, 8) transposed
    v = _view_through(heads, k, k.reads[0])
    assert (v.shape, v.strides, v.offset) == ((4, 6, 8), (8, 32, 1), 192)
    bias = View(op_buf, (32,), (1,), 5, f32)                             # broadcast over rows
    v = _view_through(View(out_buf, (3, 6, 8), (8, 32, 1), 8, f32), k, bias)     # heads 1-3
    assert (v.strides, v.offset) == ((8, 0, 1), 13)
    assert _view_through(View(out_buf, (4, 6, 8), (8, 32, 1), 8, f32), k, bias) is None      # past the row
    # a stride of 24 spans 32-wide rows: coordinates would carry from one row to the next
    assert _view_through(View(out_buf, (8, 8), (24, 1), 0, f32), k, k.reads[0]) is None


def test_state_update_stored_through_a_transpose_is_not_written_in_place():
    """A state's new value that its reader stores as a further output through a transpose,
    while that reader reads the old state at its own element: writing it in place would
    let one thread overwrite what another still reads, so the update is copied after."""
    n = 16
    g = mg.Graph()
    x = g.input("x", (n, n))
    s_ = g.state("S", (n, n), init=0.0)
    new = mg.ops.tanh(x) * 2.0
    out = s_ + mg.ops.transpose(new, 0, 1)
    kp = compile_plan([out, new], updates={1: "S"})
    (k,) = [d.kernel for d in kp.dispatches]
    assert [o.strides for o in k.outs] == [(1, n)] and kp.stats["in_place"] == 0
    rng = np.random.default_rng(0)
    s0 = rng.standard_normal((n, n)).astype(np.float32)
    feeds = {"x": rng.standard_normal((n, n)).astype(np.float32)}
    got = {}
    for backend in ("numpy", "gpu"):
        sess = mg.compile(g, outputs=[out], backend=backend, state_updates={s_: new}, plan_cache=False)
        sess.load_state_dict({"S": s0}, strict=False)
        got[backend] = (sess.run(feeds)[0], sess.state_dict(include_optimizer=True)["S"])
    for a, b in zip(got["gpu"], got["numpy"]):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_swiglu_sums_split_k_partials_and_stores_them_for_the_backward_accelerated():
    """Accelerated training of a SwiGLU block whose projections split over K: SiLU's
    product (which also stores its f16 copy for the next matmul) sums the partials of
    gate and up and stores them for the backward; the gradients match the reference."""
    g = mg.Graph()
    x = g.input("x", (6, 512))
    gate = mg.ops.linear(x, g.parameter("wg", (64, 512), init="normal"))
    up = mg.ops.linear(x, g.parameter("wu", (64, 512), init="normal"))
    y = mg.ops.linear(mg.ops.silu(gate) * up, g.parameter("wd", (32, 64), init="normal"))
    loss = mg.ops.mean(y * y)
    feeds = {"x": np.random.default_rng(4).standard_normal((6, 512)).astype(np.float32)}
    ref = mg.compile(g, loss=loss, backend="numpy")
    gpu = mg.compile(g, loss=loss, backend="gpu", precision="accelerated", plan_cache=False)
    gpu.load_state_dict(ref.state_dict())
    np.testing.assert_allclose(gpu.compute_grads(feeds), ref.compute_grads(feeds), rtol=5e-3)   # f16 operands
    names = [d.kernel.name for d in gpu.executor.plans["grads"].kernel_plan.dispatches]
    assert "matmul.splitk_sum&matmul.splitk_sum&silu+mul+cast" in names, names
    want, got = ref.grads(), gpu.grads()
    for name in want:
        scale = np.abs(want[name]).max()
        np.testing.assert_allclose(got[name], want[name], rtol=0, atol=1e-2 * scale, err_msg=name)
