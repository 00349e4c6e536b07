"""LoRA over quantized layers (QLoRA's arrangement): the GGUF blocks stay frozen on the device
and the adapters train. Three AdamW steps equal those of LoRA over the same weights
dequantized to f32 (LoraLinear, itself checked against peft in test_lora.py), on the
interpreter and lavapipe through both backends; the adapters save under peft's names; a
merge into blocks is refused."""
import numpy as np
import pytest

gguf = pytest.importorskip("gguf")

import meganeura as mg  # noqa: E402
from meganeura import nn  # noqa: E402
from meganeura.ops.quantized import dequantize_words, weight_words  # noqa: E402


def _model(blocks=None, deq=None):
    nn.init.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 32, bias=True), nn.Tanh(), nn.Linear(32, 5))
    if deq is not None:
        m[0].weight.data = deq.copy()
    if blocks is not None:
        nn.quantize_weights(m, {"0.weight": (blocks, "Q8_0")})
    return m


def _blocks():
    w = (np.random.default_rng(3).standard_normal((32, 64)) * 0.1).astype(np.float32)
    raw = gguf.quants.quantize(w, gguf.GGMLQuantizationType.Q8_0)
    return raw, dequantize_words(weight_words(raw), "Q8_0", 32, 64)


@pytest.mark.parametrize("backend", ["numpy", "gpu", "wgpu"])
def test_lora_over_q8_0_trains_as_over_its_dequantized_weights(backend):
    raw, deq = _blocks()
    quant = nn.lora.apply(_model(blocks=raw), r=4, alpha=8, target_modules=["0"])
    plain = nn.lora.apply(_model(deq=deq), r=4, alpha=8, target_modules=["0"])
    assert type(quant[0]).__name__ == "LoraQuantizedLinear" and type(plain[0]).__name__ == "LoraLinear"
    for part in ("lora_A", "lora_B"):            # the same adapters to start from
        getattr(quant[0], part).weight.data = getattr(plain[0], part).weight.data.copy()
    rng = np.random.default_rng(4)
    x, y = rng.standard_normal((6, 64)).astype(np.float32), rng.integers(0, 5, 6).astype(np.int32)
    losses = []
    for m in (quant, plain):
        step = mg.jit(lambda a, b, m=m: mg.ops.cross_entropy(m(a), b), optimizer=mg.optim.AdamW(lr=0.05),
                      backend=backend)
        losses.append([float(step(x, y)) for _ in range(3)])
        m.trained = step.state_dict()
    np.testing.assert_allclose(losses[0], losses[1], rtol=1e-5)
    assert losses[0][2] < losses[0][0]
    for name in ("0.lora_A.weight", "0.lora_B.weight", "2.weight"):
        if name == "2.weight":                   # frozen by lora.apply: unchanged in both
            assert np.array_equal(quant.trained[name], plain.trained[name])
            continue
        np.testing.assert_allclose(quant.trained[name], plain.trained[name], rtol=1e-4, atol=1e-6)
    saved = nn.lora.adapter_state_dict(quant)
    assert sorted(saved) == ["base_model.model.0.lora_A.weight", "base_model.model.0.lora_B.weight"]


def test_a_quantized_adapter_is_not_merged_into_its_blocks():
    raw, _ = _blocks()
    m = nn.lora.apply(_model(blocks=raw), r=2, target_modules=["0"])
    with pytest.raises(TypeError, match="Q8_0 weight cannot be merged"):
        nn.lora.merge(m)
