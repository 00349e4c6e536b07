"""mg.from_torch on transformers' own model families, random-initialised at tiny sizes from
their own packages (no downloads, seeded): encoders (BERT, T5, ViT, Whisper's encoder),
decoders (GPT-2, Qwen2, Mistral, Gemma, Phi-3, Whisper's decoder over encoder states).
Outputs match torch to 1e-4 relative on the interpreter and on lavapipe through both GPU
backends; the training graphs of BERT and ViT give torch's gradients."""
import numpy as np
import pytest
import torch

transformers = pytest.importorskip("transformers")

import meganeura as mg  # noqa: E402
from meganeura.bench.gates import rel_l2  # noqa: E402

BACKENDS = ["numpy", "gpu", "wgpu"]
SMALL = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, vocab_size=64)
NO_DROPOUT = dict(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)


def _model(config_cls, model_cls, **kw):
    config = config_cls(**kw)
    config.use_cache = False                # a cache object is not a tensor output torch.export takes
    config._attn_implementation = "eager"
    torch.manual_seed(0)
    return model_cls(config).eval()


def _ids(n=7, vocab=64, batch=1):
    return torch.randint(0, vocab, (batch, n), generator=torch.Generator().manual_seed(1))


def _whisper(**extra):
    return _model(transformers.WhisperConfig, transformers.WhisperForConditionalGeneration, d_model=32,
                  encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
                  encoder_ffn_dim=64, decoder_ffn_dim=64, num_mel_bins=8, max_source_positions=16,
                  max_target_positions=16, vocab_size=64, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                  decoder_start_token_id=1, **extra).model


class WhisperDecoderOverStates(torch.nn.Module):
    """Whisper's decoder as a model of its own: token ids and encoder states in, states out."""

    def __init__(self):
        super().__init__()
        self.decoder = _whisper().decoder

    def forward(self, input_ids, encoder_hidden_states):
        return self.decoder(input_ids=input_ids, encoder_hidden_states=encoder_hidden_states).last_hidden_state


FAMILIES = {
    "bert": lambda: (_model(transformers.BertConfig, transformers.BertModel, max_position_embeddings=32,
                            **NO_DROPOUT, **SMALL), (_ids(),)),
    "t5_encoder": lambda: (_model(transformers.T5Config, transformers.T5EncoderModel, d_model=32, d_ff=64,
                                  num_heads=4, num_layers=2, d_kv=8, vocab_size=64), (_ids(),)),
    "vit": lambda: (_model(transformers.ViTConfig, transformers.ViTModel, image_size=16, patch_size=4,
                           num_channels=3, **NO_DROPOUT,
                           **{k: v for k, v in SMALL.items() if k != "vocab_size"}),
                    (torch.randn(1, 3, 16, 16, generator=torch.Generator().manual_seed(2)),)),
    "whisper_encoder": lambda: (_whisper().encoder, (torch.randn(1, 8, 32, generator=torch.Generator().manual_seed(3)),)),
    "whisper_decoder": lambda: (WhisperDecoderOverStates().eval(),
                                (_ids(5), torch.randn(1, 16, 32, generator=torch.Generator().manual_seed(4)))),
    "gpt2": lambda: (_model(transformers.GPT2Config, transformers.GPT2LMHeadModel, n_embd=32, n_layer=2, n_head=4,
                            vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0), (_ids(),)),
    "qwen2": lambda: (_model(transformers.Qwen2Config, transformers.Qwen2ForCausalLM, num_key_value_heads=2,
                             max_position_embeddings=32, **SMALL), (_ids(),)),
    "mistral": lambda: (_model(transformers.MistralConfig, transformers.MistralForCausalLM, num_key_value_heads=2,
                               head_dim=8, max_position_embeddings=32, **SMALL), (_ids(),)),
    "gemma": lambda: (_model(transformers.GemmaConfig, transformers.GemmaForCausalLM, num_key_value_heads=2,
                             head_dim=8, max_position_embeddings=32, **SMALL), (_ids(),)),
    "phi3": lambda: (_model(transformers.Phi3Config, transformers.Phi3ForCausalLM, num_key_value_heads=2,
                            max_position_embeddings=32, pad_token_id=0, bos_token_id=1, eos_token_id=2,
                            **SMALL), (_ids(),)),
}


def _first(ref):
    if isinstance(ref, torch.Tensor):
        return ref
    return next(iter(ref.values())) if hasattr(ref, "values") else ref[0]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_family_outputs_match_torch(family, backend):
    module, args = FAMILIES[family]()
    imported = mg.from_torch(module, args)
    with torch.no_grad():
        ref = _first(module(*args)).numpy()
    out = imported.compile(backend=backend).run(imported.feeds(*args))[0]
    err = rel_l2(out, ref)
    print(f"[{backend}] {family}: {len(imported.graph.nodes)} nodes, rel L2 {err:.2e}")
    assert out.shape == ref.shape
    assert err < 1e-4, err


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
@pytest.mark.parametrize("family", ["bert", "vit"])
def test_family_training_gradients_match_torch(family, backend):
    """A mean-square loss on the first output: the loss and every parameter's gradient are
    torch's; a gradient that is zero but for rounding (attention's key bias, which the softmax
    cancels) is that small in ours too."""
    module, args = FAMILIES[family]()
    imported = mg.from_torch(module, args, training=True)
    target = np.random.default_rng(5).standard_normal(tuple(imported.output.shape)).astype(np.float32)
    t = imported.graph.input("target", tuple(imported.output.shape))
    loss = mg.ops.mse_loss(imported.output, t)
    s = imported.compile(loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    ours_loss = s.compute_grads({**imported.feeds(*args), "target": target})
    grads = s.grads()
    module.train()
    ref_loss = torch.nn.functional.mse_loss(_first(module(*args)), torch.from_numpy(target))
    ref_loss.backward()
    assert abs(ours_loss - ref_loss.item()) <= 1e-5 * abs(ref_loss.item())
    scale = max(np.linalg.norm(p.grad.numpy()) for p in module.parameters() if p.grad is not None)
    checked = 0
    for name, p in module.named_parameters():
        if p.grad is None:
            continue
        if np.linalg.norm(p.grad.numpy()) < 1e-5 * scale:   # the key bias: softmax cancels it, rounding is left
            assert np.linalg.norm(grads[name]) < 1e-5 * scale, name
            continue
        err = rel_l2(grads[name], p.grad.numpy())
        assert err < 1e-4, (name, err)
        checked += 1
    assert checked > 20
