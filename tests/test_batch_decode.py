"""Batched decoding over a slot-based key/value cache (meganeura.serving.batch): prompts of
different lengths batched together, and requests joining and leaving between steps,
generate exactly what each prompt generates alone with LlamaGenerator."""
import json

import numpy as np
import pytest

from meganeura.checkpoint import write_safetensors
from meganeura.io import expected_weights
from meganeura.models.generate import LlamaGenerator
from meganeura.models.llama import LlamaConfig
from meganeura.serving.batch import BatchDecoder, ContextLengthError, Engine, SamplingParams, SlotCache

PROMPTS = [[5, 9, 17], [1, 2, 3, 4, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21, 22], [11, 13, 21, 30, 31]]
SENTENCES = ["the quick brown fox jumps over the lazy dog while a small cat sleeps on a warm mat",
             "birds sing songs in tall green trees near the river bank every morning before sunrise",
             "old sailors tell stories about distant islands strange storms and hidden treasure",
             "children laugh loudly when bright yellow kites dance above windy hills during spring",
             "my neighbour bakes fresh bread with honey butter cinnamon raisins and walnuts"]


def random_state(cfg, seed=0, std=0.3):
    """Random weights (std 0.3 spreads the logits, so greedy choices are not near ties)."""
    rng = np.random.default_rng(seed)
    return {n: (np.ones(s) if "norm" in n else rng.normal(0, std, s)).astype(np.float32)
            for n, s in expected_weights(cfg).items()}


def write_tiny_folder(path, eos_token_id=None, chat_template=None):
    """A Hugging Face folder: config.json, model.safetensors (random weights) and a
    word-level tokenizer.json of 64 words (every id decodes to a word)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    cfg = LlamaConfig.tiny()
    cfg.eos_token_id = eos_token_id
    (path / "config.json").write_text(json.dumps(cfg.to_hf_dict()))
    with open(path / "model.safetensors", "wb") as f:
        write_safetensors(f, random_state(cfg), {"format": "pt"})
    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()
    tok.train_from_iterator(SENTENCES, trainers.WordLevelTrainer(vocab_size=64, special_tokens=["[UNK]"]))
    assert tok.get_vocab_size() == 64
    tok.save(str(path / "tokenizer.json"))
    if chat_template is not None:
        (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": chat_template}))
    return cfg


@pytest.fixture(scope="module")
def weights():
    cfg = LlamaConfig.tiny()
    return cfg, random_state(cfg)


@pytest.mark.parametrize("backend", ["numpy", "gpu", pytest.param("wgpu", marks=pytest.mark.slow)])
def test_batched_greedy_equals_each_prompt_alone(weights, backend):
    cfg, state = weights
    gen = LlamaGenerator(cfg, state, backend=backend)
    alone = [gen.generate(p, 8, stop_at_eos=False) for p in PROMPTS]
    # 2 slots for 3 prompts: the third joins when the first leaves; the 20-token prompt takes 3 prefill
    # chunks; each prompt is prefilled alone, its slot selected by a fed one-hot
    cache = SlotCache(cfg, state, slots=2, max_len=64, chunk=8, backend=backend)
    dec = BatchDecoder(cache)
    lengths = [8, 3, 8]
    got = dec.generate(PROMPTS, [SamplingParams(max_tokens=n, stop_at_eos=False) for n in lengths])
    assert got == [a[:n] for a, n in zip(alone, lengths)]
    assert dec.active == 0 and dec.pending() == 0
    # all three at once, in a batch wider than the requests, prefilled together in one call of every slot
    wide = BatchDecoder(SlotCache.from_generator(gen, slots=4, max_len=64, chunk=8, prefill_rows="all"))
    assert wide.generate(PROMPTS, SamplingParams(max_tokens=8, stop_at_eos=False)) == alone
    cache.close()


def test_per_request_sampling_equals_generate_alone(weights):
    cfg, state = weights
    gen = LlamaGenerator(cfg, state, backend="numpy")
    opts = [dict(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.3, seed=3),
            dict(temperature=1.2, min_p=0.05, seed=7), dict()]
    alone = [gen.generate(p, 6, stop_at_eos=False, **o) for p, o in zip(PROMPTS, opts)]
    dec = BatchDecoder(SlotCache(cfg, state, slots=3, max_len=32, chunk=8, backend="numpy"))
    got = dec.generate(PROMPTS, [SamplingParams(max_tokens=6, stop_at_eos=False, **o) for o in opts])
    assert got == alone
    assert got[0] != gen.generate(PROMPTS[0], 6, stop_at_eos=False)     # sampling changed something


def test_eos_stop_strings_cancel_and_limits(weights, tmp_path):
    cfg, state = weights
    greedy = LlamaGenerator(cfg, state, backend="numpy").generate(PROMPTS[0], 8, stop_at_eos=False)
    dec = BatchDecoder(SlotCache(cfg, state, slots=2, max_len=32, chunk=8, backend="numpy"))
    # eos: the request stops after the eos token, finish_reason "stop"
    r = dec.submit(PROMPTS[0], SamplingParams(max_tokens=8, eos_token_id=greedy[2]))
    while dec.step():
        pass
    assert r.tokens == greedy[:3] and r.finish_reason == "stop"
    # stop strings: the text ends before the stop string
    from tokenizers import Tokenizer
    write_tiny_folder(tmp_path)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    dec.tokenizer = tok
    words = tok.decode(greedy).split()
    seen = []
    r = dec.submit(PROMPTS[0], SamplingParams(max_tokens=8, stop=[words[3]], stop_at_eos=False),
                   on_update=lambda req, toks, text: seen.append(text))
    while dec.step():
        pass
    assert r.finish_reason == "stop" and r.text == " ".join(words[:3]) + " "     # up to the stop string
    assert "".join(seen) == r.text
    r = dec.submit(PROMPTS[0], SamplingParams(max_tokens=4, stop_at_eos=False))
    dec.step()
    assert dec.active == 1
    dec.cancel(r)
    dec.step()
    assert r.finish_reason == "cancelled" and dec.active == 0 and len(r.tokens) == 2
    with pytest.raises(ContextLengthError, match="needs 40 positions; a slot has 32"):
        dec.submit(list(range(30)), SamplingParams(max_tokens=10))
    with pytest.raises(ValueError, match="top_p must be a number in \\(0, 1\\], got 1.5"):
        SamplingParams(top_p=1.5)
    with pytest.raises(ValueError, match="prompt ids must lie in \\[0, 64\\)"):
        dec.submit([70], SamplingParams())


def test_engine_thread_serves_concurrent_submitters(weights):
    cfg, state = weights
    gen = LlamaGenerator(cfg, state, backend="numpy")
    alone = [gen.generate(p, 5, stop_at_eos=False) for p in PROMPTS]
    eng = Engine(BatchDecoder(SlotCache(cfg, state, slots=2, max_len=32, chunk=8, backend="numpy"))).start()
    try:
        reqs = [eng.submit(p, SamplingParams(max_tokens=5, stop_at_eos=False)) for p in PROMPTS * 3]
        assert [r.wait(30) for r in reqs] == alone * 3
        assert all(r.finish_reason == "length" for r in reqs)
    finally:
        eng.stop()
    assert not eng.thread.is_alive() and eng.decoder.active == 0
