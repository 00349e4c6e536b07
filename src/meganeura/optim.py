"""Optimizers as graph ops: ``build`` emits the update of every parameter and its state,
so the same kernels machinery runs them on the GPU in the step's own submit.

Hyperparameters that change between steps (learning rate, Adam's bias corrections) are
scalar inputs fed by the session each step, so schedules never recompile.
"""
from __future__ import annotations

import math

from . import ops
from .graph import Tensor

SCALAR_PREFIX = "optim."


class Optimizer:
    def __init__(self, lr, clip_grad_norm=None):
        if lr <= 0:
            raise ValueError(f"learning rate must be positive, got {lr}")
        self.lr = float(lr)
        self.clip_grad_norm = clip_grad_norm

    def scalar(self, g, name):
        key = SCALAR_PREFIX + name
        return g.inputs[key] if key in g.inputs else g.input(key, ())

    def scalars(self, step: int) -> dict:
        """Host-computed scalars for update number ``step`` (1-based)."""
        return {SCALAR_PREFIX + "lr": self.lr}

    def clip(self, grads):
        if self.clip_grad_norm is None:
            return grads
        g = grads[0].graph
        total = ops.sqrt(sum_all([ops.sum(x * x) for x in grads]))
        coef = ops.minimum(self.clip_grad_norm / (total + 1e-6), g.constant(1.0))
        return [x * coef for x in grads]

    def build(self, params: list[Tensor], grads: list[Tensor]) -> dict:
        """Returns {state or parameter tensor: its new value}."""
        grads = self.clip(grads)
        updates = {}
        for p, gr in zip(params, grads):
            updates.update(self.update(p, gr))
        return updates

    def update(self, p, gr) -> dict:
        raise NotImplementedError


def _state(g, name, like):
    """Optimizer state of ``like``'s shape, zero-initialised (reused if compiled again)."""
    return g.states[name] if name in g.states else g.state(name, like.shape, like.dtype, init=0.0)


def sum_all(xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


class SGD(Optimizer):
    """torch.optim.SGD: momentum, dampening, nesterov, weight decay."""

    def __init__(self, lr=0.01, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0, clip_grad_norm=None):
        super().__init__(lr, clip_grad_norm)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        self.momentum, self.dampening, self.nesterov, self.weight_decay = momentum, dampening, nesterov, weight_decay

    def scalars(self, step):
        s = super().scalars(step)
        # torch sets the buffer to the first gradient (no dampening) on the first step
        s[SCALAR_PREFIX + "damp"] = 1.0 if step == 1 else 1.0 - self.dampening
        return s

    def update(self, p, gr):
        g = p.graph
        lr = self.scalar(g, "lr")
        if self.weight_decay:
            gr = gr + p * self.weight_decay
        if not self.momentum:
            return {p: p - lr * gr}
        buf = _state(g, f"{p.name}.momentum_buffer", p)
        nb = buf * self.momentum + gr * self.scalar(g, "damp")
        d = gr + nb * self.momentum if self.nesterov else nb
        return {buf: nb, p: p - lr * d}


class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient)."""
    decoupled = False

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, clip_grad_norm=None):
        super().__init__(lr, clip_grad_norm)
        self.b1, self.b2 = betas
        self.eps, self.weight_decay = eps, weight_decay

    def scalars(self, step):
        s = super().scalars(step)
        s[SCALAR_PREFIX + "step_size"] = self.lr / (1 - self.b1 ** step)
        s[SCALAR_PREFIX + "inv_sqrt_bc2"] = 1.0 / math.sqrt(1 - self.b2 ** step)
        return s

    def update(self, p, gr):
        g = p.graph
        out = {}
        if self.weight_decay and not self.decoupled:
            gr = gr + p * self.weight_decay
        m = _state(g, f"{p.name}.exp_avg", p)
        v = _state(g, f"{p.name}.exp_avg_sq", p)
        m2 = m * self.b1 + gr * (1 - self.b1)
        v2 = v * self.b2 + gr * gr * (1 - self.b2)
        base = p
        if self.weight_decay and self.decoupled:
            base = p * (1.0 - self.scalar(g, "lr") * self.weight_decay)
        denom = ops.sqrt(v2) * self.scalar(g, "inv_sqrt_bc2") + self.eps
        out[m], out[v] = m2, v2
        out[p] = base - self.scalar(g, "step_size") * m2 / denom
        return out


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 0.01)."""
    decoupled = True

    def __init__(self, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip_grad_norm=None):
        super().__init__(lr, betas, eps, weight_decay, clip_grad_norm)
