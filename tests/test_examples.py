"""Every example in examples/ runs end to end at a tiny size on the GPU backend (lavapipe
in CI), and learns something: each returns its metrics."""
import pathlib
import sys

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)


def test_digits_cnn_trains_saves_and_deploys(tmp_path):
    import digits_cnn
    acc = digits_cnn.main(["--epochs", "2", "--out", str(tmp_path / "cnn.safetensors")])
    assert (tmp_path / "cnn.safetensors").exists()
    assert acc > 0.6, acc                   # chance is 0.1; 8 epochs reach about 0.98


def test_finetune_lm_trains_tokenizer_and_model_then_generates(tmp_path):
    import finetune_lm
    out = tmp_path / "lm"
    first, last, text = finetune_lm.main(["--steps", "12", "--batch", "4", "--seq", "32", "--hidden", "32",
                                          "--out", str(out), "--new-tokens", "6"])
    assert last < first - 0.3, (first, last)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert text.strip(), "generated nothing"
    # the folder is a Hugging Face folder: fine-tuning it again starts from the trained weights
    first2, _, _ = finetune_lm.main(["--model", str(out), "--steps", "2", "--batch", "4", "--seq", "32",
                                     "--out", str(tmp_path / "lm2"), "--new-tokens", "2"])
    assert first2 < first - 0.3, (first, first2)


def test_unet_denoiser_improves_psnr():
    import unet_denoiser
    before, after = unet_denoiser.main(["--steps", "25", "--size", "16", "--channels", "8", "--batch", "4"])
    assert after > before + 1.0, (before, after)


def test_whisper_features_match_transformers_and_the_encoder_trains():
    import whisper_features
    from transformers import WhisperFeatureExtractor
    wave = whisper_features.tone(np.random.default_rng(0), 0, 1.0)
    ref = WhisperFeatureExtractor(feature_size=80, chunk_length=1)(wave, sampling_rate=16000,
                                                                    return_tensors="np").input_features[0]
    ours = whisper_features.log_mel(wave)
    assert ours.shape == ref.shape == (80, 100)
    np.testing.assert_allclose(ours, ref, atol=1e-4)
    acc = whisper_features.main(["--steps", "6", "--batch", "4", "--seconds", "0.32", "--mels", "16",
                                 "--d-model", "32", "--layers", "1"])
    assert 0.0 <= acc <= 1.0           # (tiny: a smoke run; 150 steps at full size learn the task)


def test_examples_are_listed_in_the_readme():
    readme = (EXAMPLES.parent / "README.md").read_text()
    for f in EXAMPLES.glob("*.py"):
        assert f"examples/{f.name}" in readme, f"{f.name} is not documented in README.md"
        assert f.stem in {"digits_cnn", "finetune_lm", "unet_denoiser", "whisper_features"}, \
            f"{f.name} has no test here"
    _ = sys
