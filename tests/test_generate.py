"""generate with transformers' common options (repetition_penalty, min_p, stop_strings,
num_beams) and batches of prompts of different lengths, against transformers."""
import numpy as np
import pytest
import torch

from meganeura.models.generate import LlamaGenerator, generate, generate_text, penalize_repetition, sample
from meganeura.models.llama import LlamaConfig

from .test_llama import gen_model, hf_model, tiny_folder  # noqa: F401  (fixtures)

transformers = pytest.importorskip("transformers")


def _hf_greedy(m, prompt, n, **kw):
    with torch.no_grad():
        out = m.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                         do_sample=False, max_new_tokens=n, eos_token_id=None, **kw)
    return out[0, len(prompt):].tolist()


def test_repetition_penalty_matches_transformers(gen_model):  # noqa: F811
    gen = LlamaGenerator(LlamaConfig.tiny(), gen_model.state_dict(), backend="numpy")
    prompt = [5, 9, 17, 33, 3]
    for penalty in (1.5, 0.7):
        ref = _hf_greedy(gen_model, prompt, 10, repetition_penalty=penalty)
        assert gen.generate(prompt, 10, stop_at_eos=False, repetition_penalty=penalty) == ref, penalty
    assert _hf_greedy(gen_model, prompt, 10, repetition_penalty=1.5) != _hf_greedy(gen_model, prompt, 10)


def test_repetition_penalty_and_min_p_rules():
    logits = np.array([[2.0, -1.0, 0.5, 3.0]])
    np.testing.assert_allclose(penalize_repetition(logits, np.array([[0, 1, 1]]), 2.0), [[1.0, -2.0, 0.5, 3.0]])
    # min_p = 0.5: tokens less than half as probable as the best never come
    row = np.log(np.array([[0.4, 0.25, 0.19, 0.16]]))
    rng = np.random.default_rng(0)
    seen = {int(sample(row, 1.0, rng=rng, min_p=0.5)[0]) for _ in range(300)}
    assert seen == {0, 1}
    with pytest.raises(ValueError, match="repetition_penalty must be > 0"):
        penalize_repetition(logits, np.array([[0]]), 0.0)


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_prompts_of_different_lengths_match_transformers_left_padding(gen_model, backend):  # noqa: F811
    prompts = [[5, 9, 17], [1, 2, 3, 4, 7], [11, 13, 21]]
    gen = LlamaGenerator(LlamaConfig.tiny(), gen_model.state_dict(), backend=backend)
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.no_grad():
        ref = gen_model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=6, eos_token_id=None,
                                 pad_token_id=0)[:, width:].tolist()
    assert gen.generate(prompts, 6, stop_at_eos=False) == ref
    if backend == "numpy":       # the padded array and its mask, as transformers takes them
        assert gen.generate(ids.numpy(), 6, stop_at_eos=False, attention_mask=mask.numpy()) == ref


def test_stop_strings_with_a_tokenizer(tiny_folder):  # noqa: F811
    folder, tok, want = tiny_folder
    words = want.split()
    stop = words[2]
    text = generate_text(folder, "the quick brown fox", 6, backend="numpy", stop_strings=[stop])
    assert text.split() == words[:3], (text, want)
    with pytest.raises(ValueError, match="stop_strings needs tokenizer"):
        generate(folder, tok.encode("the fox").ids, 3, backend="numpy", stop_strings=["x"])


def test_beams_and_unknown_options_are_refused_clearly(gen_model):  # noqa: F811
    weights = (LlamaConfig.tiny(), gen_model.state_dict())
    with pytest.raises(NotImplementedError, match="beam search \\(num_beams=4\\)"):
        generate(weights, [1, 2], 3, backend="numpy", num_beams=4)
    with pytest.raises(TypeError, match="unknown option\\(s\\) \\['length_penalty'\\]"):
        generate(weights, [1, 2], 3, backend="numpy", length_penalty=1.0)
    with pytest.raises(ValueError, match="stream= needs prompts of one length"):
        generate(weights, [[1, 2], [3]], 3, backend="numpy", stream=print)
