"""GGUF files: every tensor type read against the gguf package's dequantization; tiny
Llama / Qwen2 / Gemma files written as llama.cpp's converter writes them (Q/K rows
permuted, Gemma's norms as 1 + w) give transformers' logits on numpy, gpu and wgpu; the
tokenizers in a file; ``meganeura quantize`` round trips; the errors."""
import json
import subprocess
import sys

import numpy as np
import pytest

import meganeura as mg
from meganeura.gguf_io import TENSOR_TYPES, read_gguf
from meganeura.io import ModelFileError, load_gguf
from meganeura.models.llama import LlamaConfig, build_causal_lm, graph_state_dict

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

Q = gguf.GGMLQuantizationType
BACKENDS = ["numpy", "gpu", "wgpu"]


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def write(path, arch, tensors, meta=None):
    """A GGUF file written by the gguf package: ``tensors`` [(name, data, ggml type or None)]."""
    w = gguf.GGUFWriter(str(path), arch)
    for k, v in (meta or {}).items():
        if isinstance(v, bool):
            w.add_bool(k, v)
        elif isinstance(v, int):
            w.add_uint32(k, v)
        elif isinstance(v, float):
            w.add_float32(k, v)
        elif isinstance(v, str):
            w.add_string(k, v)
        else:
            w.add_array(k, v)
    for name, data, t in tensors:
        if t is None:
            w.add_tensor(name, data)
        else:
            w.add_tensor(name, data, raw_dtype=t)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


# ----------------------------------------------------------------------------- tensor types
# byte offsets of the f16 scales in one block of the k-quants (random bytes elsewhere)
_F16_AT = {"Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def blocks_of(qtype, rows, cols, rng, scale=(0.001, 0.05)):
    """Raw data of one tensor of ``qtype`` (rows, cols) with finite values (k-quants: random
    bytes with f16 scales drawn from ``scale``)."""
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    if qtype == "F32":
        return x
    if qtype == "F16":
        return x.astype(np.float16)
    if qtype not in _F16_AT:
        return gguf.quants.quantize(x, Q[qtype])
    block, size = gguf.GGML_QUANT_SIZES[Q[qtype]]
    raw = rng.integers(0, 256, (rows * cols // block, size), dtype=np.uint8)
    for at in _F16_AT[qtype]:
        raw[:, at:at + 2] = rng.uniform(*scale, (len(raw), 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(rows, -1)


def test_every_tensor_type_matches_the_gguf_dequantization(tmp_path):
    rng = np.random.default_rng(0)
    made = {f"t.{t}": (t, blocks_of(t, 3, 512, rng)) for t in TENSOR_TYPES}
    f = write(tmp_path / "types.gguf", "llama",
              [(n, d, None if t in ("F32", "F16") else Q[t]) for n, (t, d) in made.items()])
    got = read_gguf(f)
    assert set(got.tensors) == set(made)
    for name, (t, data) in made.items():
        g = got.tensors[name]
        want = gguf.quants.dequantize(data, Q[t]).astype(np.float32)
        assert g.qtype == t and g.shape == (3, 512), (name, g.qtype, g.shape)
        assert np.array_equal(np.asarray(g.data), data), name
        v = g.dequantize()
        assert v.dtype == np.float32 and np.isfinite(v).all() and np.array_equal(v, want), name
        assert np.abs(v).max() > 0, name


# ----------------------------------------------------------------------------- models
def tiny(model_type, **kw):
    d = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
             model_type=model_type, bos_token_id=1, eos_token_id=2)
    if model_type == "gemma":
        d.update(head_dim=16, rms_norm_eps=1e-6)            # head_dim != hidden / heads
    if model_type == "qwen2":
        d.update(rope_theta=1e6)
    d.update(kw)
    return LlamaConfig.from_hf_dict(d)


def hf_model(cfg, seed=0):
    """transformers' model of ``cfg`` with random weights, norms and biases (not ones and zeros)."""
    cls = {"llama": "Llama", "qwen2": "Qwen2", "gemma": "Gemma"}[cfg.model_type]
    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    hc = getattr(transformers, cls + "Config")(**d, initializer_range=0.1, attn_implementation="eager")
    torch.manual_seed(seed)
    m = getattr(transformers, cls + "ForCausalLM")(hc).eval()
    with torch.no_grad():
        for n, p in m.named_parameters():
            if "norm" in n or n.endswith("bias"):
                p.normal_(0.0, 0.2) if "bias" in n or cfg.gemma_norm else p.uniform_(0.5, 1.5)
    return m


def convert_permute(w, n_head, n_head_kv=None):
    """llama.cpp convert_hf_to_gguf's LlamaModel.permute, on numpy arrays."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


CONVERT_NAMES = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                 "lm_head.weight": "output.weight"}
CONVERT_LAYER = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
                 "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
                 "post_attention_layernorm": "ffn_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                 "mlp.down_proj": "ffn_down"}


def convert(m, cfg, path, dtype=np.float32, meta=None):
    """A GGUF file of transformers' model ``m`` as llama.cpp's converter writes it."""
    arch = cfg.model_type
    a = arch + "."
    md = {a + "context_length": cfg.max_position_embeddings, a + "embedding_length": cfg.hidden_size,
          a + "block_count": cfg.num_hidden_layers, a + "feed_forward_length": cfg.intermediate_size,
          a + "attention.head_count": cfg.num_attention_heads,
          a + "attention.head_count_kv": cfg.num_key_value_heads,
          a + "attention.layer_norm_rms_epsilon": float(cfg.rms_norm_eps),
          "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 2}
    if arch == "gemma":
        md.update({a + "attention.key_length": cfg.head_dim, a + "attention.value_length": cfg.head_dim})
    else:
        md.update({a + "rope.freq_base": float(cfg.rope_theta), a + "rope.dimension_count": cfg.head_dim,
                   a + "vocab_size": cfg.vocab_size})
    md.update(meta or {})
    out = []
    for name, t in m.state_dict().items():
        w = t.detach().numpy().astype(np.float32)
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        if arch == "llama" and name.endswith("q_proj.weight"):
            w = convert_permute(w, cfg.num_attention_heads, cfg.num_attention_heads)
        if arch == "llama" and name.endswith("k_proj.weight"):
            w = convert_permute(w, cfg.num_attention_heads, cfg.num_key_value_heads)
        if arch == "gemma" and name.endswith("norm.weight"):
            w = w + 1
        if name in CONVERT_NAMES:
            g = CONVERT_NAMES[name]
        else:
            _, _, i, *rest = name.split(".")
            g = f"blk.{i}.{CONVERT_LAYER['.'.join(rest[:-1])]}.{rest[-1]}"
        out.append((g, w if w.ndim == 1 else w.astype(dtype), None))
    return write(path, arch, out, md)


def logits(cfg, state, ids, backend):
    g, _, y = build_causal_lm(cfg, *ids.shape)
    s = mg.compile(g, outputs=[y], backend=backend)
    s.load_state_dict(graph_state_dict(g, state))
    return s.run({"input_ids": ids})[0]


@pytest.fixture(scope="module", params=["llama", "qwen2", "gemma"])
def converted(request, tmp_path_factory):
    cfg = tiny(request.param)
    m = hf_model(cfg)
    path = convert(m, cfg, tmp_path_factory.mktemp(request.param) / "m.gguf")
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 8)).astype(np.int32)
    with torch.no_grad():
        ref = m(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    return cfg, m, path, ids, ref


def test_converted_file_loads_config_and_weights(converted):
    cfg, m, path, _, _ = converted
    got = load_gguf(path)
    c = got.config
    for k in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
              "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_theta", "tie_word_embeddings", "qkv_bias",
              "hidden_act", "gemma_norm", "model_type", "max_position_embeddings"):
        assert getattr(c, k) == pytest.approx(getattr(cfg, k)), k
    sd = m.state_dict()
    for name, w in got.state.items():
        assert np.allclose(w, sd[name].numpy(), rtol=0, atol=1e-6), name      # permutation and 1 + w undone
    assert set(got.quant_types.values()) == {"F32"} and got.gguf_names["model.norm.weight"] == "output_norm.weight"
    assert got.tokenizer is None and got.chat_template is None                 # the file has neither
    cfg2, state2 = got                                                         # unpacks as load_hf
    assert cfg2 is got.config and state2 is got.state


@pytest.mark.parametrize("backend", BACKENDS)
def test_converted_file_gives_transformers_logits(converted, backend):
    _, _, path, ids, ref = converted
    cfg, state = load_gguf(path, tokenizer=False)
    out = logits(cfg, state, ids, backend)
    assert rel(out, ref) < 1e-4, (cfg.model_type, backend, rel(out, ref))


def test_a_model_of_every_tensor_type_loads_as_the_gguf_dequantization(tmp_path):
    """Each matrix of a 2-layer Llama in another type: load_gguf gives exactly the gguf
    package's dequantization (rows unpermuted), and our logits of it are transformers'."""
    from meganeura.gguf_io import unpermute_rows
    cfg = tiny("llama", hidden_size=256, intermediate_size=256, head_dim=64)
    m = hf_model(cfg)
    src = read_gguf(convert(m, cfg, tmp_path / "f32.gguf"))
    rng = np.random.default_rng(0)
    kinds = iter(TENSOR_TYPES * 2)
    made, tensors = {}, []
    for t in src.tensors.values():
        w = np.asarray(t.data)
        kind = "F32" if w.ndim == 1 else next(kinds)
        if kind in ("F32", "F16") or kind not in _F16_AT:
            data = w.astype(np.float16) if kind == "F16" else w if kind == "F32" else gguf.quants.quantize(w, Q[kind])
        else:
            data = blocks_of(kind, *w.shape, rng, scale=(1e-5, 1e-4))      # weights of about 0.1 at most
        made[t.name] = (kind, data)
        tensors.append((t.name, data, None if kind in ("F32", "F16") else Q[kind]))
    assert {k for k, _ in made.values()} == set(TENSOR_TYPES)
    got = load_gguf(write(tmp_path / "mixed.gguf", "llama", tensors,
                          {k: v for k, v in src.metadata.items() if k != "general.architecture"}))
    for name, g in got.gguf_names.items():
        kind, data = made[g]
        want = gguf.quants.dequantize(data, Q[kind]).astype(np.float32)
        if ".attn_q." in g or ".attn_k." in g:
            want = unpermute_rows(want, 4 if ".attn_q." in g else 2)
        assert got.quant_types[name] == kind and np.array_equal(got.state[name], want), (name, kind)
    ids = np.arange(8, dtype=np.int32)[None] * 5 % cfg.vocab_size
    with torch.no_grad():
        m.load_state_dict({k: torch.tensor(v) for k, v in got.state.items()}, strict=False)
        ref = m(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert rel(logits(got.config, got.state, ids, "numpy"), ref) < 1e-4


def test_f16_and_quantized_files_load_within_their_error(tmp_path):
    cfg = tiny("llama", hidden_size=64, intermediate_size=128)
    m = hf_model(cfg)
    ids = np.arange(8, dtype=np.int32)[None] % cfg.vocab_size
    with torch.no_grad():
        ref = m(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    got = load_gguf(convert(m, cfg, tmp_path / "f16.gguf", np.float16))
    assert got.quant_types["model.layers.0.self_attn.q_proj.weight"] == "F16"
    assert got.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == np.float16
    err = rel(logits(got.config, got.state, ids, "numpy"), ref)
    assert 1e-6 < err < 3e-3, err


# ----------------------------------------------------------------------------- tokenizers
CORPUS = ["Hello world! The quick brown fox jumps over the lazy dog 12345.", "naïve café, 東京 and emoji 🙂",
          "def f(x):\n    return x ** 2  # squares", "It's we'll they've I'm you'd"] * 4


def trained_bpe(pre):
    from tokenizers import Regex, decoders, models, pre_tokenizers as pt, trainers
    tok = tokenizers.Tokenizer(models.BPE(ignore_merges=pre == "llama-bpe"))
    if pre == "gpt-2":
        tok.pre_tokenizer = pt.ByteLevel(add_prefix_space=False)
    else:
        from meganeura.gguf_tokenizer import PRE_TOKENIZERS
        tok.pre_tokenizer = pt.Sequence([pt.Split(Regex(PRE_TOKENIZERS[pre]), behavior="isolated"),
                                         pt.ByteLevel(add_prefix_space=False, use_regex=False)])
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>", "<|im_start|>"],
                                                        initial_alphabet=pt.ByteLevel.alphabet(), show_progress=False))
    return tok


def gpt2_fields(tok, pre):
    """The tokenizer fields llama.cpp's converter writes for a byte-level BPE tokenizer."""
    vocab = tok.get_vocab()
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a.content for a in tok.get_added_tokens_decoder().values() if a.special}
    merges = json.loads(tok.to_str())["model"]["merges"]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": [3 if t in special else 1 for t in tokens],
            "tokenizer.ggml.merges": [m if isinstance(m, str) else " ".join(m) for m in merges],
            "tokenizer.ggml.bos_token_id": vocab["<|endoftext|>"], "tokenizer.chat_template": "{{ messages }}"}


@pytest.mark.parametrize("pre", ["gpt-2", "llama-bpe", "qwen2"])
def test_gpt2_tokenizer_from_the_file_matches_the_original(tmp_path, pre):
    tok = trained_bpe(pre)
    cfg = tiny("llama", vocab_size=tok.get_vocab_size())
    m = hf_model(cfg)
    got = load_gguf(convert(m, cfg, tmp_path / "t.gguf", meta=gpt2_fields(tok, pre)))
    assert got.chat_template == "{{ messages }}"
    texts = CORPUS[:4] + ["<|im_start|>user\nHello 2024 fox!<|endoftext|>", "  spaces   and\ttabs\n\n"]
    for text in texts:
        want = tok.encode(text).ids
        ids = got.tokenizer.encode(text).ids
        assert ids == want, (text, ids, want)
        assert got.tokenizer.decode(ids, skip_special_tokens=False) == text
    assert got.tokenizer.token_to_id("<|im_start|>") == tok.token_to_id("<|im_start|>")


def test_generate_from_a_gguf_file(tmp_path, capsys):
    from meganeura.cli import main
    from meganeura.models.generate import generate, generate_text
    tok = trained_bpe("gpt-2")
    cfg = tiny("llama", vocab_size=tok.get_vocab_size())
    m = hf_model(cfg)
    f = convert(m, cfg, tmp_path / "g.gguf", meta=gpt2_fields(tok, "gpt-2"))
    prompt = "The quick brown"
    sd = {k: v.numpy() for k, v in m.state_dict().items()}
    want = generate((cfg, sd), tok.encode(prompt).ids, 4, backend="numpy", stop_at_eos=False)
    text = generate_text(f, prompt, 4, backend="numpy", stop_at_eos=False)
    assert text == tok.decode(want) and text
    assert main(["generate", "--model", str(f), "--prompt", prompt, "--max-new-tokens", "2", "--backend", "numpy"]) == 0
    assert capsys.readouterr().out.startswith(prompt)
    assert main(["generate", "--model", str(tmp_path / "none.gguf"), "--prompt", "x"]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_sentencepiece_tokenizer_from_scores(tmp_path):
    pieces = ["<unk>", "<s>", "</s>", "<0x21>", "\u2581", "h", "e", "l", "o", "w", "r", "d", "he", "ll", "llo",
              "hello", "\u2581hello", "or", "wor", "ld", "\u2581w", "\u2581wor", "\u2581world"]
    scores = [0.0, 0.0, 0.0, 0.0] + [-float(i) for i in range(len(pieces) - 4)][::-1]
    types = [2, 3, 3, 6] + [1] * (len(pieces) - 4)
    meta = {"tokenizer.ggml.model": "llama", "tokenizer.ggml.tokens": pieces, "tokenizer.ggml.scores": scores,
            "tokenizer.ggml.token_type": types, "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.unknown_token_id": 0}
    cfg = tiny("llama", vocab_size=len(pieces))
    tok = load_gguf(convert(hf_model(cfg), cfg, tmp_path / "spm.gguf", meta=meta)).tokenizer
    enc = tok.encode("hello world!")
    assert enc.tokens == ["<s>", "\u2581hello", "\u2581world", "<0x21>"], enc.tokens
    assert tok.decode(enc.ids, skip_special_tokens=True) == "hello world!"


# ----------------------------------------------------------------------------- quantize
def hf_folder(tmp_path, cfg, with_tokenizer=True):
    folder = tmp_path / "hf"
    m = hf_model(cfg)
    m.save_pretrained(folder, safe_serialization=True)
    if with_tokenizer:
        tok = trained_bpe("gpt-2")
        tok.save(str(folder / "tokenizer.json"))
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}", "bos_token": "<|endoftext|>",
             "eos_token": "<|endoftext|>"}))
    return folder, m


def test_q4_k_blocks_dequantize_within_a_quantization_step():
    from meganeura.gguf_write import quantize_q4_k
    x = np.random.default_rng(0).standard_normal((4, 512)).astype(np.float32)
    x[1, :256] = np.abs(x[1, :256])                          # a block without negatives
    x[2, :32] = 0                                            # a zero group
    back = gguf.quants.dequantize(quantize_q4_k(x), Q.Q4_K)
    g = x.reshape(-1, 32)
    step = ((g.max(1) - np.minimum(g.min(1), 0)) / 15)[:, None]
    assert (np.abs(back.reshape(-1, 32) - g) <= 0.75 * step + 1e-7).all()
    assert rel(back, x) < 0.12, rel(back, x)


def expected_type(qt, shape):
    """What quantize makes of a weight of ``shape``: vectors f32, matrices ``qt`` or its fallbacks."""
    if len(shape) == 1:
        return "F32"
    for t in {"Q4_K": ("Q4_K", "Q5_0"), "Q8_0": ("Q8_0",)}[qt]:
        if shape[-1] % (256 if t == "Q4_K" else 32) == 0:
            return t
    return "F16"


@pytest.mark.parametrize("arch,kind", [("llama", "--q8_0"), ("llama", "--q4_k"), ("qwen2", "--q8_0"),
                                       ("gemma", "--q4_k")])
def test_quantize_cli_round_trip(tmp_path, arch, kind, capsys):
    from meganeura.cli import main
    # down_proj's rows of 544 (Q4_K: not a multiple of 256, so Q5_0) or 528 (not even of 32: F16)
    cfg = tiny(arch, hidden_size=256, intermediate_size=544 if kind == "--q4_k" else 528, num_hidden_layers=1,
               head_dim=64, tie_word_embeddings=arch != "llama")          # Qwen2-0.5B and Gemma tie theirs
    folder, m = hf_folder(tmp_path, cfg)
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(folder), kind, "--out", str(out), "--quiet"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []          # no temporary left
    got = load_gguf(out)
    qt = "Q4_K" if kind == "--q4_k" else "Q8_0"
    assert set(got.quant_types.values()) == {"F32", qt, "Q5_0" if qt == "Q4_K" else "F16"}
    sd = m.state_dict()
    for name, w in got.state.items():
        ref = sd[name].numpy()
        t = got.quant_types[name]
        assert t == expected_type(qt, ref.shape), (name, t)
        if t == "F32":
            assert np.allclose(w, ref, rtol=0, atol=1e-7 if arch == "gemma" else 0), name    # gemma: (1 + w) - 1
            continue
        if t == "F16":
            assert np.allclose(w, ref, rtol=2 ** -11, atol=1e-7), name
            continue
        g = ref.reshape(-1, 32)
        if t == "Q8_0":                # half a step (1/127 of the largest value), plus the f16 scale
            bound = np.abs(g).max(1) / 127 * 0.57 + 1e-6
        elif t == "Q5_0":              # steps of 1/16 of the largest value, which sits at -16: +16 clips to +15
            bound = np.abs(g).max(1) / 16 * 1.07 + 1e-6
        else:
            bound = (g.max(1) - np.minimum(g.min(1), 0)) / 15 * 0.75 + 1e-6
        assert (np.abs(w.reshape(-1, 32) - g) <= bound[:, None]).all(), name
        assert got.tensors[name].dtype == np.uint8
    # the file is laid out as llama.cpp's converter lays it out: q rows permuted
    raw = read_gguf(out).tensors
    q = sd["model.layers.0.self_attn.q_proj.weight"].numpy()
    if arch == "llama":
        assert rel(raw["blk.0.attn_q.weight"].dequantize(), convert_permute(q, 4, 4)) < 0.1 < \
            rel(raw["blk.0.attn_q.weight"].dequantize(), q)
    else:
        assert rel(raw["blk.0.attn_q.weight"].dequantize(), q) < 0.1
    norm = sd["model.norm.weight"].numpy()
    assert np.array_equal(raw["output_norm.weight"].dequantize(), norm + 1 if arch == "gemma" else norm)
    assert ("output.weight" in raw) == (not cfg.tie_word_embeddings)
    ids = np.arange(6, dtype=np.int32)[None] * 7 % cfg.vocab_size
    ours = logits(got.config, got.state, ids, "numpy")
    with torch.no_grad():
        ref = m(torch.tensor(ids, dtype=torch.long)).logits.numpy()
        m.load_state_dict({k: torch.tensor(v) for k, v in got.state.items()}, strict=False)
        ref_q = m(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    assert rel(ours, ref_q) < 1e-4, rel(ours, ref_q)          # the dequantized weights, run by transformers
    # quantization error alone (9 matrices of rel. error ~0.5% (Q8_0) or ~10% (Q4_K)): Llama measured 1.8% and 30%
    assert 1e-4 < rel(ours, ref) < (0.05 if qt == "Q8_0" else 0.6), rel(ours, ref)
    tok = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
    assert got.tokenizer.encode(CORPUS[1]).ids == tok.encode(CORPUS[1]).ids
    assert got.chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}"
    meta = got.metadata
    assert meta["tokenizer.ggml.model"] == "gpt2" and meta["tokenizer.ggml.pre"] == "gpt-2"
    assert len(meta["tokenizer.ggml.tokens"]) >= cfg.vocab_size
    assert meta["tokenizer.ggml.bos_token_id"] == tok.token_to_id("<|endoftext|>")


@pytest.mark.parametrize("arch,kind", [("llama", "--q4_k"), ("qwen2", "--q8_0")])
def test_quantized_file_reads_the_same_in_transformers(tmp_path, arch, kind):
    """transformers' own GGUF reader (gguf_file=) is a second, independent reader of what
    quantize writes: the same logits and token ids (it has no Gemma reader)."""
    from meganeura.cli import main
    cfg = tiny(arch, hidden_size=256, intermediate_size=544 if kind == "--q4_k" else 528, num_hidden_layers=1,
               head_dim=64, tie_word_embeddings=arch != "llama")          # with Q5_0 and F16 fallbacks
    folder, _ = hf_folder(tmp_path, cfg)
    assert main(["quantize", str(folder), kind, "--out", str(tmp_path / "q.gguf"), "--quiet"]) == 0
    got = load_gguf(tmp_path / "q.gguf")
    tm = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path), gguf_file="q.gguf").eval()
    ids = np.arange(6, dtype=np.int32)[None] * 7 % cfg.vocab_size
    with torch.no_grad():
        ref = tm(torch.tensor(ids, dtype=torch.long)).logits.float().numpy()
    assert rel(logits(got.config, got.state, ids, "numpy"), ref) < 1e-5
    tt = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file="q.gguf")
    for text in CORPUS[:4]:
        assert tt(text)["input_ids"] == got.tokenizer.encode(text).ids, text


def test_quantize_cli_mistakes_are_one_line(tmp_path, capsys):
    from meganeura.cli import main
    assert main(["quantize", str(tmp_path / "nope"), "--q8_0", "--out", str(tmp_path / "x.gguf")]) == 2
    assert "is not a folder" in capsys.readouterr().err
    assert main(["quantize", str(tmp_path), "--q8_0", "--out", str(tmp_path / "x.bin")]) == 2
    assert ".gguf" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["quantize", str(tmp_path), "--out", str(tmp_path / "x.gguf")])       # no --q8_0 / --q4_k
    assert main(["quantize", str(tmp_path), "--q4_k", "--out", str(tmp_path / "x.gguf")]) == 1
    assert "config.json" in capsys.readouterr().err
    assert not (tmp_path / "x.gguf").exists()


# ----------------------------------------------------------------------------- errors
def test_missing_file_and_bad_magic(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gguf"):
        load_gguf(tmp_path / "nope.gguf")
    bad = tmp_path / "model.gguf"
    bad.write_bytes(b"\x89PNG not a gguf file")
    with pytest.raises(ModelFileError, match=r"model.gguf: not a GGUF file: it starts with b'\\x89PNG'"):
        load_gguf(bad)
    cut = tmp_path / "cut.gguf"
    whole = write(tmp_path / "whole.gguf", "llama", [("t", np.ones((4, 64), np.float32), None)]).read_bytes()
    cut.write_bytes(whole[:-100])
    with pytest.raises(ModelFileError, match="cut.gguf: malformed or truncated"):
        load_gguf(cut)


@pytest.fixture(scope="module")
def llama_parts():
    cfg = tiny("llama", num_hidden_layers=1)
    return cfg, hf_model(cfg)


def test_unknown_architecture(tmp_path, llama_parts):
    f = write(tmp_path / "m.gguf", "mamba", [("token_embd.weight", np.ones((64, 32), np.float32), None)],
              {"mamba.block_count": 1})
    with pytest.raises(NotImplementedError, match=r"m.gguf: architecture 'mamba' is not supported; supported: "
                                                  r"\['gemma', 'llama', 'qwen2'\]"):
        load_gguf(f)


def _rewrite(path, src, change):
    """``src`` rewritten with ``change(tensors) -> tensors``."""
    got = read_gguf(src)
    meta = {k: v for k, v in got.metadata.items() if k != "general.architecture"}
    tensors = [(t.name, np.asarray(t.data), None if t.qtype in ("F32", "F16") else Q[t.qtype])
               for t in got.tensors.values()]
    return write(path, got.metadata["general.architecture"], change(tensors), meta)


def test_missing_unsupported_misshapen_and_extra_tensors(tmp_path, llama_parts):
    cfg, m = llama_parts
    src = convert(m, cfg, tmp_path / "src.gguf")
    f = _rewrite(tmp_path / "a.gguf", src, lambda ts: [t for t in ts if t[0] != "blk.0.ffn_down.weight"])
    with pytest.raises(ModelFileError, match=r"a.gguf: missing tensor 'blk.0.ffn_down.weight' "
                                             r"\(model.layers.0.mlp.down_proj.weight, shape \(32, 64\)\)"):
        load_gguf(f)
    f = _rewrite(tmp_path / "b.gguf", src, lambda ts: [(n, d.astype(np.int8), None) if n == "blk.0.attn_v.weight"
                                                        else (n, d, t) for n, d, t in ts])
    with pytest.raises(NotImplementedError, match=r"b.gguf: tensor 'blk.0.attn_v.weight' \(16, 32\) has type I8, "
                                                  r"which is not supported; supported: F32, F16, BF16, Q8_0"):
        load_gguf(f)
    f = _rewrite(tmp_path / "c.gguf", src, lambda ts: [(n, d[:, :16], t) if n == "blk.0.attn_q.weight"
                                                        else (n, d, t) for n, d, t in ts])
    with pytest.raises(ModelFileError, match=r"c.gguf: tensor 'blk.0.attn_q.weight' has shape \(32, 16\), the "
                                             r"metadata implies \(32, 32\)"):
        load_gguf(f)
    f = _rewrite(tmp_path / "e.gguf", src, lambda ts: ts + [("rope_freqs.weight", np.ones(4, np.float32), None)])
    with pytest.raises(NotImplementedError, match=r"e.gguf: tensor 'rope_freqs.weight' \(per-frequency RoPE"):
        load_gguf(f)
    f = _rewrite(tmp_path / "d.gguf", src, lambda ts: ts + [("blk.1.attn_q.weight", ts[1][1], None)])
    with pytest.raises(ModelFileError, match=r"d.gguf: 1 tensor\(s\) the model does not use, e.g. "
                                             r"\['blk.1.attn_q.weight'\]"):
        load_gguf(f)


def test_missing_metadata_is_named(tmp_path, llama_parts):
    cfg, m = llama_parts
    src = convert(m, cfg, tmp_path / "src.gguf")
    got = read_gguf(src)
    meta = {k: v for k, v in got.metadata.items() if k not in ("general.architecture", "llama.block_count")}
    f = write(tmp_path / "m.gguf", "llama", [(t.name, np.asarray(t.data), None) for t in got.tensors.values()], meta)
    with pytest.raises(ModelFileError, match="m.gguf: lacks the metadata field 'llama.block_count'"):
        load_gguf(f)


def test_gguf_stays_optional(tmp_path):
    code = ("import sys\nimport meganeura, meganeura.io, meganeura.gguf_io, meganeura.gguf_write, meganeura.cli\n"
            "assert 'gguf' not in sys.modules, 'gguf imported'\n"
            "sys.modules['gguf'] = None\n"
            "try:\n    meganeura.io.load_gguf(sys.argv[1])\nexcept ImportError as e:\n    print(e)\n")
    f = write(tmp_path / "x.gguf", "llama", [("t", np.ones(4, np.float32), None)])
    r = subprocess.run([sys.executable, "-c", code, str(f)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "pip install meganeura[gguf]" in r.stdout, r.stdout
    code = ("import sys\nsys.modules['gguf'] = None\nfrom meganeura.cli import main\n"
            f"sys.exit(main(['quantize', {str(tmp_path)!r}, '--q8_0', '--out', {str(tmp_path / 'q.gguf')!r}]))\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert "quantize needs the optional package 'gguf': pip install 'meganeura[gguf]'" in r.stderr, r.stderr


@pytest.mark.parametrize("backend", ["numpy", "gpu", "wgpu"])
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gemma"])
def test_a_quantized_file_generates_from_its_blocks_as_from_its_dequantized_weights(tmp_path, arch, backend, capsys):
    """LlamaGenerator.from_pretrained keeps a GGUF file's quantized matrices as blocks on the
    device (quantized kernels); its logits and greedy tokens are those of the same weights
    dequantized to f32 by the gguf package. Tied heads read the embedding's blocks."""
    from meganeura.cli import main
    from meganeura.models.generate import LlamaGenerator
    cfg = tiny(arch, hidden_size=64, intermediate_size=128, num_hidden_layers=2, head_dim=16,
               tie_word_embeddings=arch != "llama")
    folder, _ = hf_folder(tmp_path, cfg)
    out = tmp_path / "q.gguf"
    assert main(["quantize", str(folder), "--q8_0", "--out", str(out), "--quiet"]) == 0
    capsys.readouterr()
    blocks = LlamaGenerator.from_pretrained(out, backend, quantized=True)
    floats = LlamaGenerator.from_pretrained(out, backend, quantized=False)
    assert set(v for _, v in blocks.blocks.values()) == {"Q8_0"} and not floats.blocks
    assert "model.embed_tokens.weight" in blocks.blocks and "model.layers.0.mlp.down_proj.weight" in blocks.blocks
    ids = np.array([[1, 5, 9, 2, 7]], np.int32)
    a, b = blocks.forward(ids, 0, 32), floats.forward(ids, 0, 32)
    assert rel(a, b) < 1e-5, rel(a, b)
    assert not set(blocks.state) & set(blocks.blocks)          # no f32 copy of a quantized matrix
    prompt = [3, 1, 4, 1, 5]
    assert blocks.generate(prompt, 4, stop_at_eos=False) == floats.generate(prompt, 4, stop_at_eos=False)
