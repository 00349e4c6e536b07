"""Llama (tiny config) against transformers' LlamaForCausalLM: logits, loss, gradients,
Hugging Face folders (f32, bf16, f16, sharded), KV-cached greedy generation and text
generation through a tokenizer.json."""
import copy
import json

import numpy as np
import pytest
import torch

import meganeura as mg
from meganeura.bench.gates import backward_check, rel_l2 as rel
from meganeura.io import load_hf
from meganeura.models.generate import LlamaGenerator, generate, generate_text, sample
from meganeura.models.llama import (LlamaConfig, build_causal_lm, build_decoder, build_training, cache_names,
                                    decode_feeds, graph_state_dict)

transformers = pytest.importorskip("transformers")

BATCH, SEQ = 2, 8
BACKENDS = ["numpy", "gpu"]


def hf_model(cfg, seed=0, init=0.1):
    """transformers' model for ``cfg`` with random weights (f32, eager attention). A larger
    init than 0.02 spreads the logits, so greedy choices are not near ties."""
    d = {k: v for k, v in cfg.to_hf_dict().items() if k != "architectures"}
    hc = transformers.LlamaConfig(**d, initializer_range=init, attn_implementation="eager")
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(hc).eval()


@pytest.fixture(scope="module")
def model():
    return hf_model(LlamaConfig.tiny())


@pytest.fixture(scope="module")
def gen_model():
    """Weights whose greedy continuation of the test prompt does not repeat one token."""
    return hf_model(LlamaConfig.tiny(), init=0.3)


def batch_data(seed=0, vocab=64):
    rng = np.random.default_rng(seed)
    ids = rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32)
    labels = rng.integers(0, vocab, (BATCH, SEQ)).astype(np.int32)
    labels[0, 3] = labels[1, 6] = -100        # ignored tokens
    return ids, labels


def torch_forward(m, ids, labels):
    out = m(torch.tensor(ids, dtype=torch.long), labels=torch.tensor(labels, dtype=torch.long))
    return out.logits.detach().numpy(), out.loss


def check_forward(cfg, m, backend):
    ids, labels = batch_data()
    with torch.no_grad():
        ref_logits, ref_loss = torch_forward(m, ids, labels)
    g, _, logits = build_causal_lm(cfg, BATCH, SEQ)
    s = mg.compile(g, outputs=[logits], backend=backend)
    s.load_state_dict(graph_state_dict(g, m.state_dict()))
    ours = s.run({"input_ids": ids})[0]
    g, _, _, loss = build_training(cfg, BATCH, SEQ)
    t = mg.compile(g, loss=loss, backend=backend)
    t.load_state_dict(graph_state_dict(g, m.state_dict()))
    our_loss = float(t.run({"input_ids": ids, "labels": labels})[0])
    e_fwd, e_loss = rel(ours, ref_logits), abs(our_loss - ref_loss.item()) / abs(ref_loss.item())
    print(f"[{backend}] forward rel L2 {e_fwd:.2e}, loss {our_loss:.6f} vs {ref_loss.item():.6f} (rel {e_loss:.2e})")
    assert e_fwd < 1e-4 and e_loss < 1e-5


@pytest.mark.parametrize("backend", BACKENDS)
def test_forward_and_loss_match_transformers(model, backend):
    check_forward(LlamaConfig.tiny(), model, backend)


def test_tied_embeddings_forward_numpy():
    cfg = LlamaConfig.tiny()
    cfg.tie_word_embeddings = True
    m = hf_model(cfg, seed=1)
    assert "lm_head.weight" in m.state_dict()       # aliased key, dropped by graph_state_dict
    check_forward(cfg, m, "numpy")


@pytest.mark.parametrize("backend", BACKENDS)
def test_gradients_match_torch(model, backend):
    cfg = LlamaConfig.tiny()
    ids, labels = batch_data(1)
    m = model
    m.zero_grad()
    _, ref_loss = torch_forward(m, ids, labels)
    ref_loss.backward()
    ref = {n: p.grad.numpy().copy() for n, p in m.named_parameters()}
    g, _, _, loss = build_training(cfg, BATCH, SEQ)
    t = mg.compile(g, loss=loss, backend=backend)
    t.load_state_dict(graph_state_dict(g, m.state_dict()))
    t.compute_grads({"input_ids": ids, "labels": labels})
    ours = t.grads()
    assert set(ours) == set(ref)
    gate = backward_check(ours, ref)
    e_total, e_norms = gate["total_norm_err"], gate["norms_rel_l2"]
    full = {n: rel(ours[n], ref[n]) for n in ("model.embed_tokens.weight", "lm_head.weight",
                                              "model.layers.0.self_attn.q_proj.weight",
                                              "model.layers.0.self_attn.k_proj.weight",
                                              "model.layers.1.mlp.down_proj.weight", "model.norm.weight")}
    print(f"[{backend}] grad total-norm err {e_total:.2e}, per-param norms rel L2 {e_norms:.2e}, "
          f"worst full grad rel L2 {max(full.values()):.2e}")
    assert e_total < 1e-4 and e_norms < 1e-4
    for n, e in full.items():
        assert e < 1e-3, (n, e)


@pytest.mark.parametrize("dtype,shard", [(torch.float32, False), (torch.bfloat16, True), (torch.float16, False)],
                         ids=["f32", "bf16-sharded", "f16"])
def test_load_hf_folder(model, tmp_path, dtype, shard):
    m = copy.deepcopy(model).to(dtype)     # a copy: .to() also rounds the fixture's RoPE buffer
    m.save_pretrained(tmp_path, **({"max_shard_size": "20KB"} if shard else {}))
    expect = {n: v.float().numpy() for n, v in m.state_dict().items()}
    assert (tmp_path / "model.safetensors.index.json").exists() == shard
    cfg, state = load_hf(tmp_path)
    assert cfg == LlamaConfig.tiny()
    for n, v in state.items():
        assert v.dtype == np.float32
        np.testing.assert_array_equal(v, expect[n], err_msg=n)  # widening is exact
    # the loaded weights reproduce the reference run at that precision (weights widened to f32)
    ids, labels = batch_data(2)
    ref = hf_model(cfg)
    ref.load_state_dict({n: torch.tensor(v) for n, v in expect.items()})
    with torch.no_grad():
        ref_logits, _ = torch_forward(ref, ids, labels)
    g, _, logits = build_causal_lm(cfg, BATCH, SEQ)
    s = mg.compile(g, outputs=[logits], backend="numpy")
    s.load_state_dict(graph_state_dict(g, state))
    assert rel(s.run({"input_ids": ids})[0], ref_logits) < 1e-5


def test_config_from_hf_dict():
    c = LlamaConfig.smollm2_135m()
    hc = transformers.LlamaConfig(**{k: v for k, v in c.to_hf_dict().items() if k != "architectures"})
    assert LlamaConfig.from_hf_dict(json.loads(hc.to_json_string())) == c
    old_style = {**c.to_hf_dict(), "rope_scaling": None}      # transformers 4.x layout
    assert LlamaConfig.from_hf_dict(old_style).rope_theta == 1e5
    g, _, _ = build_causal_lm(c, 1, 4)
    assert "lm_head.weight" not in g.parameters
    assert sum(p.size for p in g.parameters.values()) == 134_515_008     # SmolLM2-135M
    with pytest.raises(NotImplementedError, match="rope type"):
        LlamaConfig.from_hf_dict({**c.to_hf_dict(), "rope_scaling": {"rope_type": "llama3", "factor": 8.0}})


def test_decoder_cache_matches_full_forward_numpy(model):
    """Prefill 5 tokens then 3 single-token steps: each step's logits equal the full
    forward's at that position, and the cache holds the rotated keys."""
    cfg, max_len = LlamaConfig.tiny(), 16
    ids, _ = batch_data(3)
    with torch.no_grad():
        out = model(torch.tensor(ids, dtype=torch.long), use_cache=True)
    ref = out.logits.numpy()
    sd = model.state_dict()
    sessions = {}
    for t in (5, 1):
        g, logits, cache = build_decoder(cfg, BATCH, t, max_len)
        sessions[t] = mg.compile(g, outputs=[logits] + cache, backend="numpy")
        sessions[t].load_state_dict(graph_state_dict(g, sd))
    cache = [np.zeros((BATCH, 2, max_len, 8), np.float32) for _ in cache_names(cfg)]
    pos = 0
    for t in (5, 1, 1, 1):
        feeds = {**decode_feeds(cfg, pos, t, max_len), "input_ids": ids[:, pos:pos + t],
                 **dict(zip(cache_names(cfg), cache))}
        res = sessions[t].run(feeds)
        cache = res[1:]
        pos += t
        assert rel(res[0], ref[:, pos - 1]) < 1e-5
    hf_k = out.cache.layers[1].keys.numpy()
    assert rel(cache[2][:, :, :8], hf_k) < 1e-5
    assert not cache[2][:, :, 8:].any()


@pytest.mark.parametrize("backend", ["gpu", "numpy"])
def test_greedy_generation_matches_transformers(gen_model, backend):
    prompt = [5, 9, 17, 33, 3]
    with torch.no_grad():
        ref = gen_model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                                 do_sample=False, max_new_tokens=8)[0, len(prompt):].tolist()
    streamed = []
    ours = generate((LlamaConfig.tiny(), gen_model.state_dict()), prompt, 8, backend=backend, stream=streamed.append)
    print(f"[{backend}] ours {ours} transformers {ref}")
    assert ours == ref and streamed == ours and len(set(ref)) > 4


def test_batched_generation_and_eos_numpy(gen_model):
    prompts = np.array([[5, 9, 17, 33], [1, 2, 3, 4]])
    gen = LlamaGenerator(LlamaConfig.tiny(), gen_model.state_dict(), backend="numpy")
    with torch.no_grad():
        refs = [gen_model.generate(torch.tensor(p[None]), attention_mask=torch.ones(1, 4, dtype=torch.long),
                               do_sample=False, max_new_tokens=5, eos_token_id=None)[0, 4:].tolist() for p in prompts]
    assert gen.generate(prompts, 5, stop_at_eos=False) == refs
    # stopping: take the second token of row 0 as the stop token
    out = gen.generate(prompts[:1], 5, eos_token_id=refs[0][1])
    assert out[0] == refs[0][:2]


def test_sampling_rules():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal((3, 10))
    best = logits.argmax(-1)
    assert (sample(logits) == best).all()
    assert (sample(logits, 1.0, top_k=1, rng=rng) == best).all()
    assert (sample(logits, 1.0, top_p=1e-6, rng=rng) == best).all()
    # top_p = 0.5 over probabilities (0.4, 0.3, 0.2, 0.1) keeps the first two
    row = np.log(np.array([[0.4, 0.3, 0.2, 0.1]]))
    seen = {int(sample(row, 1.0, top_p=0.5, rng=rng)[0]) for _ in range(200)}
    assert seen == {0, 1}
    a = [int(sample(logits, 0.7, top_k=5, rng=np.random.default_rng(3))[0]) for _ in range(3)]
    b = [int(sample(logits, 0.7, top_k=5, rng=np.random.default_rng(3))[0]) for _ in range(3)]
    assert a == b


@pytest.fixture
def tiny_folder(gen_model, tmp_path):
    """A model folder as transformers writes it, plus a word-level tokenizer.json."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()        # joins words with spaces
    sentences = ["the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat",
                 "birds sing songs in tall green trees near the river bank every morning before sunrise",
                 "old sailors tell stories about distant islands strange storms and hidden treasure",
                 "children laugh loudly when bright yellow kites dance above windy hills during spring",
                 "my neighbour bakes fresh bread with honey butter cinnamon raisins and walnuts"]
    tok.train_from_iterator(sentences, trainers.WordLevelTrainer(vocab_size=64, special_tokens=["[UNK]"]))
    assert tok.get_vocab_size() == 64      # every model id decodes to a word
    tok.save(str(tmp_path / "tokenizer.json"))
    gen_model.save_pretrained(tmp_path)
    ids = tok.encode("the quick brown fox").ids
    with torch.no_grad():
        ref = gen_model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                 do_sample=False, max_new_tokens=6)[0, len(ids):].tolist()
    return tmp_path, tok, tok.decode(ref)


def test_generate_text_with_tokenizer(tiny_folder):
    folder, tok, want = tiny_folder
    pieces = []
    text = generate_text(folder, "the quick brown fox", 6, backend="numpy", stream=pieces.append)
    assert text == want
    assert "".join(pieces) == text and len(pieces) > 1


def test_generate_cli_streams_greedy_tokens_on_gpu(tiny_folder, capsys):
    from meganeura.cli import main
    folder, _, want = tiny_folder
    main(["generate", "--model", str(folder), "--prompt", "the quick brown fox", "--max-new-tokens", "6"])
    assert capsys.readouterr().out.strip() == ("the quick brown fox" + want).strip()
