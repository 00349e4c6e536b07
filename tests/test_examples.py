"""Every example in examples/ runs end to end at a tiny size on the GPU backend (lavapipe
in CI), and learns something: each returns its metrics."""
import importlib
import os
import pathlib
import re
import stat

import numpy as np
import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[1] / "examples"
NAMES = ("digits_cnn", "finetune_lm", "lora_finetune", "unet_denoiser", "whisper_features")


@pytest.fixture(autouse=True)
def _examples_on_path(monkeypatch, tmp_path):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    monkeypatch.chdir(tmp_path)


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path):
    return stat.S_IMODE(os.stat(path).st_mode)


def test_digits_cnn_trains_saves_and_deploys(tmp_path, umask_022):
    import digits_cnn
    from meganeura.checkpoint import read
    acc = digits_cnn.main(["--epochs", "2", "--out", str(tmp_path / "cnn.safetensors")])
    assert acc > 0.6, acc                   # chance is 0.1; 8 epochs reach about 0.98
    # the package's checkpoint writer: the mode open() gives (0644 here), metadata, AdamW's moments
    assert _mode(tmp_path / "cnn.safetensors") == 0o644
    tensors, meta = read(tmp_path / "cnn.safetensors")
    assert meta["format"] == "meganeura-checkpoint" and int(meta["step"]) > 0
    assert "features.0.weight.exp_avg" in tensors and "features.4.running_mean" in tensors


def test_finetune_lm_trains_tokenizer_and_model_then_generates(tmp_path, umask_022):
    import finetune_lm
    out = tmp_path / "lm"
    first, last, text = finetune_lm.main(["--steps", "12", "--batch", "4", "--seq", "32", "--hidden", "32",
                                          "--out", str(out), "--new-tokens", "6"])
    assert last < first - 0.3, (first, last)
    assert {p.name for p in out.iterdir()} >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert _mode(out / "model.safetensors") == 0o644
    assert text.strip(), "generated nothing"
    # the folder is a Hugging Face folder: fine-tuning it again starts from the trained weights
    first2, _, _ = finetune_lm.main(["--model", str(out), "--steps", "2", "--batch", "4", "--seq", "32",
                                     "--out", str(tmp_path / "lm2"), "--new-tokens", "2"])
    assert first2 < first - 0.3, (first, first2)


def test_lora_finetune_trains_the_adapters_and_saves_only_them(tmp_path, umask_022):
    import lora_finetune
    out = tmp_path / "ad"
    first, last = lora_finetune.main(["--steps", "30", "--batch", "2", "--seq", "16", "--out", str(out)])
    assert last < first - 0.1, (first, last)
    assert {p.name for p in out.iterdir()} == {"adapter_config.json", "adapter_model.safetensors"}
    assert _mode(out / "adapter_model.safetensors") == 0o644


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
        assert f.stem in NAMES, f"{f.name} has no test here"


@pytest.mark.parametrize("name", NAMES)
def test_help_shows_the_lavapipe_defaults_and_full_the_gpu_sizes(name, capsys):
    """Each option's default is in --help; the defaults are the small sizes, --full switches to the
    GPU sizes, and an option given explicitly wins over either."""
    mod = importlib.import_module(name)
    for argv, sizes in ((["--help"], mod.SMALL), (["--full", "--help"], mod.FULL)):
        with pytest.raises(SystemExit):
            mod.main(argv)
        text = " ".join(capsys.readouterr().out.split())
        assert "(default: gpu)" in text and "--full the GPU sizes:" in text, text
        for key, value in sizes.items():
            opt = "--" + key.replace("_", "-")   # its help words (no other option between), then its default
            assert re.search(rf"{opt} \S+ (?:(?!--)\S+ )*?\(default: {re.escape(str(value))}\)", text), (opt, text)
    assert mod.SMALL.keys() == mod.FULL.keys() and mod.SMALL != mod.FULL
