"""A small U-Net (mg.nn) that learns to remove Gaussian noise from synthetic images of
discs and boxes, generated on the fly; reports the PSNR before and after on held-out images.

    python examples/unet_denoiser.py            # 16x16 images, a few minutes on lavapipe
    python examples/unet_denoiser.py --full     # the GPU size: 32x32 images, a wider net, more steps
"""
import argparse
import sys
import time

import numpy as np

import meganeura as mg
from meganeura import nn
from meganeura.cli import HelpFormatter

# the default sizes finish in a few minutes on lavapipe (a CPU); --full gives the GPU sizes
SMALL = {"steps": 300, "batch": 8, "size": 16, "channels": 8}
FULL = {"steps": 400, "batch": 16, "size": 32, "channels": 16}


def sizes(d):
    return ", ".join(f"--{k.replace('_', '-')} {v}" for k, v in d.items())


class Block(nn.Module):
    """Two 3x3 convolutions, each followed by GroupNorm and SiLU."""

    def __init__(self, c_in, c_out, groups=4):
        super().__init__()
        self.conv1, self.norm1 = nn.Conv2d(c_in, c_out, 3, padding=1), nn.GroupNorm(groups, c_out)
        self.conv2, self.norm2 = nn.Conv2d(c_out, c_out, 3, padding=1), nn.GroupNorm(groups, c_out)
        self.act = nn.SiLU()

    def forward(self, x):
        return self.act(self.norm2(self.conv2(self.act(self.norm1(self.conv1(x))))))


class UNet(nn.Module):
    """Two levels: encode, downsample (stride-2 conv), a middle block, upsample (nearest +
    conv), concatenate the skip, decode. Predicts the noise; the clean estimate is x - noise."""

    def __init__(self, channels=16):
        super().__init__()
        c = channels
        self.enc = Block(1, c)
        self.down = nn.Conv2d(c, 2 * c, 3, stride=2, padding=1)
        self.mid = Block(2 * c, 2 * c)
        self.up = nn.Sequential(nn.Upsample(scale_factor=2), nn.Conv2d(2 * c, c, 3, padding=1))
        self.dec = Block(2 * c, c)
        self.out = nn.Conv2d(c, 1, 1)

    def forward(self, x):
        skip = self.enc(x)
        h = self.up(self.mid(self.down(skip)))
        return self.out(self.dec(mg.ops.concat([h, skip], 1)))


def images(rng, n, size):
    """n (1, size, size) images in [0, 1]: a few discs and boxes of random brightness."""
    yy, xx = np.mgrid[0:size, 0:size]
    out = np.zeros((n, 1, size, size), np.float32)
    for img in out:
        for _ in range(rng.integers(1, 4)):
            cy, cx, r = rng.uniform(0, size, 2).tolist() + [rng.uniform(size / 8, size / 3)]
            shape = ((yy - cy) ** 2 + (xx - cx) ** 2 < r * r) if rng.random() < 0.5 else \
                ((abs(yy - cy) < r) & (abs(xx - cx) < r * rng.uniform(0.3, 1.0)))
            img[0][shape] = rng.uniform(0.3, 1.0)
    return out


def psnr(a, b):
    return float(10 * np.log10(1.0 / np.mean((a - b) ** 2)))


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=HelpFormatter)
    p.add_argument("--full", action="store_true", help="the GPU sizes: " + sizes(FULL))
    p.add_argument("--steps", type=int, help="AdamW steps")
    p.add_argument("--batch", type=int, help="images per step")
    p.add_argument("--size", type=int, help="image side (even)")
    p.add_argument("--channels", type=int, help="channels of the first level (multiple of 4)")
    p.add_argument("--sigma", type=float, default=0.2, help="noise standard deviation")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (cosine schedule)")
    p.add_argument("--backend", default="gpu", choices=["gpu", "numpy"], help="where to run")
    p.add_argument("--seed", type=int, default=0, help="seed of the data and the initialisation")
    p.set_defaults(**(FULL if "--full" in argv else SMALL))
    args = p.parse_args(argv)

    rng = np.random.default_rng(args.seed)
    mg.nn.init.manual_seed(args.seed)
    model = UNet(args.channels)
    opt = mg.optim.AdamW(lr=args.lr, schedule=mg.optim.cosine(args.steps, warmup_steps=max(1, args.steps // 20)))
    step = mg.jit(lambda noisy, noise: mg.ops.mse_loss(model(noisy), noise), optimizer=opt, backend=args.backend)
    denoise = mg.jit(lambda noisy: noisy - model(noisy), share_with=step, backend=args.backend)

    t0 = time.perf_counter()
    for k in range(args.steps):
        clean = images(rng, args.batch, args.size)
        noise = (rng.standard_normal(clean.shape) * args.sigma).astype(np.float32)
        lv = step(clean + noise, noise)
        if k % max(1, args.steps // 8) == 0 or k == args.steps - 1:
            print(f"step {k + 1}: loss {lv:.5f}")
    print(f"{args.steps} steps in {time.perf_counter() - t0:.1f} s")

    test = images(np.random.default_rng(args.seed + 1), 10, args.size)
    noisy = test + (np.random.default_rng(args.seed + 2).standard_normal(test.shape) * args.sigma).astype(np.float32)
    out = np.clip(denoise(noisy), 0, 1)
    before, after = psnr(noisy, test), psnr(out, test)
    print(f"held-out PSNR: noisy {before:.2f} dB -> denoised {after:.2f} dB")
    return before, after


if __name__ == "__main__":
    main()
