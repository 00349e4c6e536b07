"""Optimizers as graph ops: ``build`` emits the update of every parameter and its state,
so the same kernels machinery runs them on the GPU in the step's own submit.

Hyperparameters that change between steps (learning rate, Adam's bias corrections) are
scalar inputs fed by the session each step, so schedules never recompile.

``params`` (the first argument, as torch's) is optional: without it every parameter that
is not frozen trains with the optimizer's own hyperparameters. Given, only what it names
trains: a list of parameters (``mg.nn.Parameter`` objects, graph Tensors or names), or
torch's parameter groups, dicts of ``params`` and the hyperparameters they override
(``[{"params": decay}, {"params": norms_and_biases, "weight_decay": 0.0}]``). Each group's
learning rate is its own scalar input (``param_groups[k]["lr"]`` may change between steps).
"""
from __future__ import annotations

import math
import numbers

from . import ops
from .graph import Tensor

SCALAR_PREFIX = "optim."


def hyper(owner, name, value, lo=None, hi=None, lo_open=False, hi_open=False) -> float:
    """A hyper-parameter as a float, refused (naming it) unless it is a finite real number
    within [lo, hi] (open at an end where asked): NaN, infinity, bools and strings would
    otherwise poison every weight at the first step."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value):
        raise ValueError(f"{owner}: {name} must be a finite number, got {value!r}")
    v = float(value)
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"{owner}: {name} must be {'>' if lo_open else '>='} {lo}, got {value!r}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise ValueError(f"{owner}: {name} must be {'<' if hi_open else '<='} {hi}, got {value!r}")
    return v


class Optimizer:
    """Base: ``lr`` is the peak learning rate; ``schedule`` (optional) maps the 0-based
    update index to a factor of it (see ``cosine``, ``linear``, ``step``), fed to the
    compiled step as a scalar input: no recompiling. ``params``: see the module docstring."""
    _tag = ""               # a parameter group's scalar inputs are named optim.group<k>.<name>

    def __init__(self, lr, clip_grad_norm=None, schedule=None, params=None):
        owner = type(self).__name__
        if schedule is not None and not callable(schedule):
            raise TypeError(f"schedule must be a function of the update index, got {type(schedule).__name__}")
        self.lr = hyper(owner, "lr (learning rate)", lr, 0, lo_open=True)
        self.clip_grad_norm = None if clip_grad_norm is None else \
            hyper(owner, "clip_grad_norm", clip_grad_norm, 0, lo_open=True)
        self.schedule = schedule
        self._groups = None if params is None else _param_groups(owner, params, self.config())
        for k in range(len(self._groups or ())):
            self._for_group(k)          # a bad hyperparameter in a group is refused here

    def config(self) -> dict:
        """The hyperparameters a parameter group may override, as the constructor takes them."""
        return {"lr": self.lr}

    @property
    def param_groups(self) -> list:
        """torch's ``param_groups``: one dict per group (its ``params`` and every
        hyperparameter); a single group of everything trainable when ``params`` was not given."""
        if self._groups is None:
            return [{"params": None, **self.config()}]
        return self._groups

    def trains(self, p: Tensor) -> bool:
        """Whether the parameter ``p`` is updated (and so differentiated) by this optimizer."""
        return self._groups is None or self._group_index(p) is not None

    def _group_index(self, p):
        for k, grp in enumerate(self._groups):
            if p.name in grp["_names"]:
                return k
        return None

    def _for_group(self, k):
        """The optimizer that updates group ``k``'s parameters: this one's type with the
        group's hyperparameters (checked as the constructor checks them), its own scalars."""
        cache = self.__dict__.setdefault("_group_opts", {})
        grp = self._groups[k]
        cfg = {n: grp[n] for n in self.config()}
        if k not in cache or cache[k][0] != cfg:
            opt = type(self)(**cfg, schedule=self.schedule)
            opt._tag = f"group{k}."
            cache[k] = (cfg, opt)
        return cache[k][1]

    def lr_at(self, step: int) -> float:
        """The learning rate of update number ``step`` (1-based, as ``scalars``); checked
        each time, since a schedule (or code that sets ``lr``) could make it NaN."""
        base = hyper(type(self).__name__, "lr (learning rate)", self.lr, 0, lo_open=True)
        lr = base * (1.0 if self.schedule is None else self.schedule(step - 1))
        return hyper(type(self).__name__, f"learning rate of update {step}", lr, 0)

    def scalar(self, g, name):
        key = SCALAR_PREFIX + self._tag + name
        return g.inputs[key] if key in g.inputs else g.input(key, ())

    def scalars(self, step: int) -> dict:
        """Host-computed scalars for update number ``step`` (1-based)."""
        if self._groups is not None:
            out = {}
            for k in range(len(self._groups)):
                out.update(self._for_group(k).scalars(step))
            return out
        return self._own_scalars(step)

    def _own_scalars(self, step: int) -> dict:
        return {SCALAR_PREFIX + self._tag + "lr": self.lr_at(step)}

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
        opts = [self] if self._groups is None else [self._for_group(k) for k in range(len(self._groups))]
        for o in opts:
            o._shared = {}      # scalar expressions every parameter's update reads, built once
        try:
            for p, gr in zip(params, grads):
                k = None if self._groups is None else self._group_index(p)
                if self._groups is not None and k is None:
                    raise ValueError(f"{type(self).__name__}: parameter {p.name!r} is in no parameter group")
                updates.update((self if k is None else opts[k]).update(p, gr))
        finally:
            for o in opts:
                del o._shared
        return updates

    def shared(self, g, key, make):
        """``make()``, once per ``build``: a scalar expression (such as 1 - lr * weight
        decay) that every parameter's update reads."""
        memo = getattr(self, "_shared", None)
        if memo is None:
            return make()
        k = (id(g), key)
        if k not in memo:
            memo[k] = make()
        return memo[k]

    def update(self, p, gr) -> dict:
        raise NotImplementedError


def _lr_arg(owner, params, lr):
    """``lr``, refusing a number given where torch's first argument (``params``) goes."""
    if isinstance(params, numbers.Number):
        raise TypeError(f"{owner}: the first argument is params (as in torch); pass the learning rate as lr=")
    return lr


def _param_names(owner, where, params) -> list:
    """Graph parameter names of ``params``: mg.nn Parameters (named where a module put them
    in a graph, so resolved when the step is built), graph Tensors or names."""
    from .nn.module import Parameter
    out = []
    for p in (params,) if isinstance(params, (str, Tensor, Parameter)) else params:
        if isinstance(p, str):
            out.append(p)
        elif isinstance(p, Tensor):
            if p.op != "parameter":
                raise TypeError(f"{owner}: {where} holds {p.name!r}, a {p.op} tensor, not a parameter")
            out.append(p.name)
        elif isinstance(p, Parameter):
            out.append(p)
        else:
            raise TypeError(f"{owner}: {where} must hold mg.nn Parameters, graph parameter Tensors or their names, "
                            f"got {type(p).__name__}")
    return out


class _Names:
    """A group's parameters by graph name; mg.nn Parameter objects resolve to the name
    their module gave them in the graph being built (``Parameter.graph_names``)."""

    def __init__(self, items):
        self.items = items

    def __contains__(self, name):
        return any(name == p if isinstance(p, str) else name in p.graph_names for p in self.items)


def _param_groups(owner, params, defaults) -> list:
    """torch's parameter groups: dicts with every hyperparameter filled from ``defaults``."""
    params = list(params)
    if not params:
        raise ValueError(f"{owner}: params is empty (an optimizer needs something to train)")
    if not all(isinstance(p, dict) for p in params):
        if any(isinstance(p, dict) for p in params):
            raise TypeError(f"{owner}: params mixes parameter-group dicts with parameters")
        params = [{"params": params}]
    groups = []
    for k, grp in enumerate(params):
        if "params" not in grp:
            raise ValueError(f"{owner}: parameter group {k} has no 'params'")
        unknown = sorted(set(grp) - set(defaults) - {"params"})
        if unknown:
            raise ValueError(f"{owner}: parameter group {k} sets {unknown}; a group may set {sorted(defaults)}")
        items = _param_names(owner, f"parameter group {k}", grp["params"])
        groups.append({**defaults, **grp, "params": items, "_names": _Names(items)})
    return groups


def _state(g, name, like):
    """Optimizer state of ``like``'s shape, zero-initialised (reused if compiled again)."""
    if name in g.states:
        return g.states[name]
    t = g.state(name, like.shape, like.dtype, init=0.0)
    t.attrs["optimizer_state"] = True    # kept only by sessions whose optimizer uses it
    return t


def sum_all(xs):
    out = xs[0]
    for x in xs[1:]:
        out = out + x
    return out


class SGD(Optimizer):
    """torch.optim.SGD: momentum, dampening, nesterov, weight decay."""

    def __init__(self, params=None, lr=0.01, momentum=0.0, dampening=0.0, nesterov=False, weight_decay=0.0,
                 clip_grad_norm=None, schedule=None):
        momentum = hyper("SGD", "momentum", momentum, 0)
        dampening = hyper("SGD", "dampening", dampening)
        weight_decay = hyper("SGD", "weight_decay", weight_decay, 0)
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("nesterov needs momentum > 0 and dampening = 0")
        self.momentum, self.dampening, self.nesterov, self.weight_decay = momentum, dampening, bool(nesterov), weight_decay
        super().__init__(_lr_arg("SGD", params, lr), clip_grad_norm, schedule, params)

    def config(self):
        return {"lr": self.lr, "momentum": self.momentum, "dampening": self.dampening, "nesterov": self.nesterov,
                "weight_decay": self.weight_decay}

    def _own_scalars(self, step):
        s = super()._own_scalars(step)
        # torch sets the buffer to the first gradient (no dampening) on the first step
        s[SCALAR_PREFIX + self._tag + "damp"] = 1.0 if step == 1 else 1.0 - self.dampening
        return s

    def update(self, p, gr):
        g = p.graph
        lr = self.scalar(g, "lr")
        if self.weight_decay:
            gr = gr + p * self.weight_decay
        if not self.momentum:
            return {p: p - lr * gr}
        buf = _state(g, f"{p.name}.momentum_buffer", p)
        nb = ops.ema(buf, gr, self.momentum, self.scalar(g, "damp"))
        d = gr + nb * self.momentum if self.nesterov else nb
        return {buf: nb, p: p - lr * d}


class Adam(Optimizer):
    """torch.optim.Adam (L2 weight decay added to the gradient)."""
    decoupled = False

    def __init__(self, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0, clip_grad_norm=None,
                 schedule=None):
        owner = type(self).__name__
        try:
            b1, b2 = betas
        except (TypeError, ValueError):
            raise ValueError(f"{owner}: betas must be a pair (beta1, beta2), got {betas!r}") from None
        self.b1 = hyper(owner, "betas[0]", b1, 0, 1, hi_open=True)
        self.b2 = hyper(owner, "betas[1]", b2, 0, 1, hi_open=True)
        self.eps = hyper(owner, "eps", eps, 0)
        self.weight_decay = hyper(owner, "weight_decay", weight_decay, 0)
        super().__init__(_lr_arg(owner, params, lr), clip_grad_norm, schedule, params)

    def config(self):
        return {"lr": self.lr, "betas": (self.b1, self.b2), "eps": self.eps, "weight_decay": self.weight_decay}

    def _own_scalars(self, step):
        s = super()._own_scalars(step)
        s[SCALAR_PREFIX + self._tag + "step_size"] = self.lr_at(step) / (1 - self.b1 ** step)
        s[SCALAR_PREFIX + self._tag + "inv_sqrt_bc2"] = 1.0 / math.sqrt(1 - self.b2 ** step)
        return s

    def update(self, p, gr):
        g = p.graph
        out = {}
        if self.weight_decay and not self.decoupled:
            gr = gr + p * self.weight_decay
        m = _state(g, f"{p.name}.exp_avg", p)
        v = _state(g, f"{p.name}.exp_avg_sq", p)
        m2 = ops.ema(m, gr, self.b1, 1 - self.b1)
        v2 = ops.ema_sq(v, gr, self.b2, 1 - self.b2)
        base = p
        if self.weight_decay and self.decoupled:
            base = p * self.shared(g, "decay", lambda: 1.0 - self.scalar(g, "lr") * self.weight_decay)
        out[m], out[v] = m2, v2
        out[p] = ops.adam_step(base, m2, v2, self.scalar(g, "step_size"), self.scalar(g, "inv_sqrt_bc2"), self.eps)
        return out


class AdamW(Adam):
    """torch.optim.AdamW (decoupled weight decay, default 0.01)."""
    decoupled = True

    def __init__(self, params=None, lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01, clip_grad_norm=None,
                 schedule=None):
        super().__init__(params, lr, betas, eps, weight_decay, clip_grad_norm, schedule)


# ------------------------------------------------------------------ learning-rate schedules
# Each is a factor of the peak lr as a function of the 0-based update index t, with the
# conventions of transformers' get_*_schedule_with_warmup and torch's StepLR.
def cosine(total_steps, warmup_steps=0, min_factor=0.0, num_cycles=0.5):
    """Linear warm-up from 0 over ``warmup_steps``, then a cosine decay to ``min_factor``
    at ``total_steps`` (transformers' get_cosine_schedule_with_warmup when min_factor=0)."""
    _check_steps(total_steps, warmup_steps)

    def factor(t):
        if t < warmup_steps:
            return t / max(1, warmup_steps)
        progress = (t - warmup_steps) / max(1, total_steps - warmup_steps)
        c = max(0.0, 0.5 * (1.0 + math.cos(math.pi * num_cycles * 2.0 * progress)))
        return min_factor + (1.0 - min_factor) * c
    return factor


def linear(total_steps, warmup_steps=0, min_factor=0.0):
    """Linear warm-up, then a linear decay to ``min_factor`` at ``total_steps``
    (transformers' get_linear_schedule_with_warmup when min_factor=0)."""
    _check_steps(total_steps, warmup_steps)

    def factor(t):
        if t < warmup_steps:
            return t / max(1, warmup_steps)
        return min_factor + (1.0 - min_factor) * max(0.0, (total_steps - t) / max(1, total_steps - warmup_steps))
    return factor


def step_decay(step_size, gamma=0.1):
    """torch.optim.lr_scheduler.StepLR: multiply by ``gamma`` every ``step_size`` updates."""
    if int(step_size) < 1:
        raise ValueError(f"step_decay: step_size must be >= 1, got {step_size}")
    return lambda t: gamma ** (t // int(step_size))


def _check_steps(total, warmup):
    if int(total) < 1 or not 0 <= int(warmup) <= int(total):
        raise ValueError(f"schedule: need total_steps >= 1 and 0 <= warmup_steps <= total_steps, "
                         f"got total_steps={total}, warmup_steps={warmup}")
