"""Speech features through the Whisper encoder: log-mel spectrograms computed the way
Whisper does (16 kHz, 25 ms Hann window, 10 ms hop, Slaney mel filters, log10, clamped to
8 below the peak), encoded by a small Whisper encoder, mean-pooled and classified.

The task is synthetic and generated here: which of three pitch contours (rising, falling,
steady) a noisy tone follows. The encoder and its linear head train together with mg.jit.

    python examples/whisper_features.py            # short clips, a narrow encoder: a few minutes on lavapipe
    python examples/whisper_features.py --full     # the GPU size: 1 s clips, 80 mel bins, a wider encoder
"""
import argparse
import sys
import time

import numpy as np

import meganeura as mg
from meganeura import nn
from meganeura.cli import HelpFormatter
from meganeura.models.whisper import WhisperEncoderConfig, whisper_encoder

SAMPLE_RATE, N_FFT, HOP = 16000, 400, 160

# the default sizes finish in a few minutes on lavapipe (a CPU); --full gives the GPU sizes
SMALL = {"steps": 150, "batch": 8, "seconds": 0.32, "mels": 40, "d_model": 32}
FULL = {"steps": 150, "batch": 16, "seconds": 1.0, "mels": 80, "d_model": 64}


def sizes(d):
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items())


def mel_filters(n_mels, n_fft=N_FFT, sr=SAMPLE_RATE, fmax=8000.0):
    """(n_fft // 2 + 1, n_mels) triangular filters on the Slaney mel scale, area-normalised."""
    def hz_to_mel(f):
        f = np.asarray(f, np.float64)
        return np.where(f < 1000.0, 3.0 * f / 200.0, 15.0 + np.log(np.maximum(f, 1e-9) / 1000.0) * 27.0 / np.log(6.4))

    def mel_to_hz(m):
        m = np.asarray(m, np.float64)
        return np.where(m < 15.0, 200.0 * m / 3.0, 1000.0 * np.exp(np.log(6.4) * (m - 15.0) / 27.0))
    edges = mel_to_hz(np.linspace(hz_to_mel(0.0), hz_to_mel(fmax), n_mels + 2))
    freqs = np.linspace(0, sr / 2, n_fft // 2 + 1)
    lower = (freqs[:, None] - edges[None, :-2]) / (edges[1:-1] - edges[:-2])
    upper = (edges[None, 2:] - freqs[:, None]) / (edges[2:] - edges[1:-1])
    return np.maximum(0.0, np.minimum(lower, upper)) * (2.0 / (edges[2:] - edges[:-2]))


def log_mel(wave, n_mels=80):
    """Whisper's log-mel spectrogram (n_mels, len(wave) // HOP) of a 16 kHz waveform."""
    wave = np.asarray(wave, np.float64)
    padded = np.pad(wave, N_FFT // 2, mode="reflect")
    window = 0.5 - 0.5 * np.cos(2 * np.pi * np.arange(N_FFT) / N_FFT)         # periodic Hann
    n = 1 + (len(padded) - N_FFT) // HOP
    frames = np.lib.stride_tricks.sliding_window_view(padded, N_FFT)[::HOP][:n] * window
    power = np.abs(np.fft.rfft(frames, axis=1)) ** 2                          # (frames, bins)
    spec = np.log10(np.maximum(power @ mel_filters(n_mels), 1e-10)).T[:, :-1]
    spec = np.maximum(spec, spec.max() - 8.0)
    return ((spec + 4.0) / 4.0).astype(np.float32)


def tone(rng, kind, seconds):
    """A noisy tone whose pitch rises (0), falls (1) or stays (2)."""
    t = np.arange(int(seconds * SAMPLE_RATE)) / SAMPLE_RATE
    f0 = rng.uniform(300, 900)
    f1 = {0: f0 * 2.0, 1: f0 / 2.0, 2: f0}[kind]
    freq = f0 + (f1 - f0) * t / seconds
    phase = 2 * np.pi * np.cumsum(freq) / SAMPLE_RATE + rng.uniform(0, 2 * np.pi)
    return rng.uniform(0.2, 0.8) * np.sin(phase) + rng.normal(0, 0.05, t.shape)


class Classifier(nn.Module):
    """Whisper encoder (its builder, with transformers' parameter names) + a linear head."""

    def __init__(self, cfg, n_classes=3):
        super().__init__()
        self.cfg = cfg
        self.head = nn.Linear(cfg.d_model, n_classes)

    def forward(self, features):
        h = whisper_encoder(features.graph, features, self.cfg)               # (N, positions, d_model)
        return self.head(mg.ops.mean(h, 1))


def batch(rng, n, seconds, n_mels):
    kinds = rng.integers(0, 3, n)
    return np.stack([log_mel(tone(rng, k, seconds), n_mels) for k in kinds]), kinds.astype(np.int32)


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--full", action="store_true", help="the GPU sizes: " + sizes(FULL))
    p.add_argument("--steps", type=int, help="AdamW steps")
    p.add_argument("--batch", type=int, help="clips per step")
    p.add_argument("--seconds", type=float, help="clip length (Whisper itself uses 30 s)")
    p.add_argument("--mels", type=int, help="mel bins (Whisper: 80)")
    p.add_argument("--d-model", type=int, help="encoder width")
    p.add_argument("--layers", type=int, default=2, help="encoder layers")
    p.add_argument("--lr", type=float, default=2e-3, help="peak learning rate (cosine schedule)")
    p.add_argument("--backend", default="gpu", choices=["gpu", "numpy"], help="where to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initialisation")
    p.set_defaults(**(FULL if "--full" in argv else SMALL))
    args = p.parse_args(argv)

    frames = int(args.seconds * SAMPLE_RATE) // HOP
    if frames % 2:
        raise SystemExit(f"--seconds {args.seconds}: {frames} frames; pick a length with an even frame count")
    cfg = WhisperEncoderConfig(d_model=args.d_model, encoder_layers=args.layers, encoder_attention_heads=4,
                               encoder_ffn_dim=2 * args.d_model, num_mel_bins=args.mels,
                               max_source_positions=frames // 2)
    rng = np.random.default_rng(args.seed)
    mg.nn.init.manual_seed(args.seed)
    model = Classifier(cfg)
    opt = mg.optim.AdamW(lr=args.lr, schedule=mg.optim.cosine(args.steps, warmup_steps=max(1, args.steps // 10)))
    step = mg.jit(lambda features, labels: mg.ops.cross_entropy(model(features), labels), optimizer=opt,
                  backend=args.backend, seed=args.seed)
    predict = mg.jit(model, share_with=step, backend=args.backend)
    t0 = time.perf_counter()
    for k in range(args.steps):
        x, y = batch(rng, args.batch, args.seconds, args.mels)
        lv = step(x, y)
        if k % max(1, args.steps // 6) == 0 or k == args.steps - 1:
            print(f"step {k + 1}: loss {lv:.4f}")
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s; features {x.shape[1:]} -> "
          f"encoder states ({cfg.max_source_positions}, {cfg.d_model})")
    xt, yt = batch(np.random.default_rng(args.seed + 1), 60, args.seconds, args.mels)
    acc = float((predict(xt).argmax(1) == yt).mean())
    print(f"held-out accuracy: {acc * 100:.1f}% on {len(yt)} clips (chance 33%)")
    return acc


if __name__ == "__main__":
    main()
