"""A small CNN for scikit-learn's 8x8 digits, written with ``mg.nn`` (the style example).

Its torch twin is the same code with ``torch.nn`` in place of ``mg.nn``: the state dict
names and shapes are identical, so weights move across unchanged.
"""
from __future__ import annotations

from .. import nn


class DigitsCNN(nn.Module):
    """(N, 1, 8, 8) images -> (N, 10) logits: two conv blocks then a small classifier."""

    def __init__(self, channels=(8, 16), hidden=32, dropout=0.1):
        super().__init__()
        c1, c2 = channels
        self.features = nn.Sequential(
            nn.Conv2d(1, c1, 3, padding=1), nn.ReLU(), nn.MaxPool2d(2),        # 8x8 -> 4x4
            nn.Conv2d(c1, c2, 3, padding=1), nn.BatchNorm2d(c2), nn.ReLU(), nn.MaxPool2d(2))  # -> 2x2
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(c2 * 4, hidden), nn.ReLU(), nn.Dropout(dropout),
                                        nn.Linear(hidden, 10))

    def forward(self, x):
        return self.classifier(self.features(x))
