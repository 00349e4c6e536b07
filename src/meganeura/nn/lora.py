"""LoRA (low-rank adapters, Hu et al. 2021) on ``mg.nn.Linear`` layers, as Hugging Face
``peft`` does it, with its file format:

    lora.apply(model, r=8, alpha=16, target_modules=["q_proj", "v_proj"])
    step = mg.jit(loss_fn, optimizer=mg.optim.AdamW(lr=1e-3))    # only the adapters train
    lora.save(model, "adapter/")       # adapter_model.safetensors + adapter_config.json

A wrapped layer computes ``base(x) + B(A(dropout(x))) * alpha / r``: the base weight stays
where it was (its state-dict name is unchanged, so base checkpoints still load) and is
frozen; ``lora_A`` (r, in) starts as peft's kaiming-uniform (a = sqrt(5)), ``lora_B``
(out, r) at zeros, so training starts from the base model. ``merge`` folds B A into the
base weight (inference without the extra matmuls), ``unmerge`` takes it out again.

In the files, ``<path>.lora_A.weight`` is ``base_model.model.<path>.lora_A.weight`` (peft's
names once it drops the adapter name), and adapter_config.json holds peft's LoraConfig
fields: ``peft.PeftModel.from_pretrained`` loads what ``save`` writes, and ``load`` reads
what peft saves.
"""
from __future__ import annotations

import json
import math
import os
import re

import numpy as np

from .. import ops
from . import init
from .layers import Dropout, Identity, Linear
from .module import Module, Parameter
from .quantized import QuantizedLinear

ADAPTER_WEIGHTS = "adapter_model.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."


def _add_adapters(layer, r, alpha, dropout, use_rslora):
    """``layer``'s ``lora_A`` (Kaiming-uniform) and ``lora_B`` (zeros), its scaling (alpha / r,
    alpha / sqrt(r) with rsLoRA) and dropout, as peft sets them up; ``in_features`` and
    ``out_features`` are set first."""
    if not isinstance(r, int) or isinstance(r, bool) or r < 1:
        raise ValueError(f"lora: r must be a positive int, got {r!r}")
    layer.r, layer.lora_alpha, layer.use_rslora = r, float(alpha), bool(use_rslora)
    layer.scaling = layer.lora_alpha / (math.sqrt(r) if use_rslora else r)
    layer.lora_dropout = Dropout(dropout) if dropout else Identity()
    layer.lora_A = Linear(layer.in_features, r, bias=False)
    layer.lora_B = Linear(r, layer.out_features, bias=False)
    init.kaiming_uniform_(layer.lora_A._parameters["weight"], a=math.sqrt(5))
    init.zeros_(layer.lora_B._parameters["weight"])
    layer.merged = False


class LoraLinear(Linear):
    """A Linear whose (frozen) weight and bias are the wrapped layer's own Parameters, plus
    ``lora_A`` and ``lora_B``. ``scaling`` is alpha / r (alpha / sqrt(r) with rsLoRA)."""

    def __init__(self, base: Linear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        Module.__init__(self)
        self.in_features, self.out_features = base.in_features, base.out_features
        self.weight = base._parameters["weight"].requires_grad_(False)
        self.bias = base._parameters.get("bias")
        if self.bias is not None:
            self.bias.requires_grad_(False)
        _add_adapters(self, r, alpha, dropout, use_rslora)

    @property
    def trace_variant(self):
        """A merged layer builds another graph (``mg.jit`` traces again)."""
        return self.merged

    def delta(self) -> np.ndarray:
        """B A * scaling, the update ``merge`` adds to the base weight."""
        a, b = self.lora_A._parameters["weight"].data, self.lora_B._parameters["weight"].data
        return (b.astype(np.float64) @ a.astype(np.float64) * self.scaling).astype(np.float32)

    def merge(self):
        if not self.merged:
            w = self._parameters["weight"]
            w.data = w.data + self.delta()
            self.merged = True

    def unmerge(self):
        if self.merged:
            w = self._parameters["weight"]
            w.data = w.data - self.delta()
            self.merged = False

    def forward(self, x):
        y = ops.linear(x, self.weight, self.bias)
        if self.merged:
            return y
        return y + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self):
        return super().extra_repr() + f", r={self.r}, alpha={self.lora_alpha:g}{', merged' if self.merged else ''}"


class LoraQuantizedLinear(Module):
    """LoRA over a ``QuantizedLinear`` (QLoRA's arrangement): the GGUF blocks stay as they
    are, read by the quantized kernels (``base_layer``, frozen), and ``lora_A`` / ``lora_B``
    train in f32. The adapters save and load as ``LoraLinear``'s; a quantized weight cannot
    take a merge (``merge`` refuses: dequantize the base first)."""

    def __init__(self, base: QuantizedLinear, r: int, alpha: float, dropout: float = 0.0, use_rslora: bool = False):
        super().__init__()
        self.in_features, self.out_features = base.in_features, base.out_features
        self.base_layer = base
        _add_adapters(self, r, alpha, dropout, use_rslora)

    def merge(self):
        raise TypeError(f"lora: a LoRA over a {self.base_layer.qtype} weight cannot be merged into its blocks; "
                        "load the model with dequantized weights to merge")

    unmerge = merge

    def forward(self, x):
        return self.base_layer(x) + self.lora_B(self.lora_A(self.lora_dropout(x))) * self.scaling

    def extra_repr(self):
        return f"{self.base_layer.qtype}, r={self.r}, alpha={self.lora_alpha:g}"


def _matches(name: str, target_modules) -> bool:
    """peft's rule: a string is a regular expression the full name must match; a list
    names modules by their last dotted components."""
    if isinstance(target_modules, str):
        return re.fullmatch(target_modules, name) is not None
    return any(name == t or name.endswith("." + t) for t in target_modules)


def apply(model: Module, r: int = 8, alpha: float = 8, target_modules=("q_proj", "v_proj"), dropout: float = 0.0,
          use_rslora: bool = False) -> Module:
    """Wrap every Linear of ``model`` that ``target_modules`` names in a ``LoraLinear`` and
    freeze everything else (peft's ``get_peft_model`` with ``bias="none"``). Returns
    ``model`` (changed in place); ``adapters(model)`` lists the wrapped layers."""
    if isinstance(target_modules, (list, tuple, set)):
        target_modules = sorted(set(target_modules))
    elif not isinstance(target_modules, str):
        raise TypeError(f"lora.apply: target_modules must be a list of module names or a regex string, "
                        f"got {type(target_modules).__name__}")
    found = [(n, m) for n, m in model.named_modules()
             if n and isinstance(m, (Linear, QuantizedLinear)) and not isinstance(m, LoraLinear)
             and _matches(n, target_modules) and not re.search(r"(^|\.)(lora_[AB]|base_layer)$", n)]
    if not found:
        linears = [n for n, m in model.named_modules() if isinstance(m, Linear)][:8]
        raise ValueError(f"lora.apply: target_modules {target_modules!r} names no Linear of "
                         f"{type(model).__name__}; its Linear layers include {linears}")
    model.requires_grad_(False)
    for name, lin in found:
        parent, _, leaf = name.rpartition(".")
        owner = model.get_submodule(parent) if parent else model
        wrap = LoraQuantizedLinear if isinstance(lin, QuantizedLinear) else LoraLinear
        owner._modules[leaf] = wrap(lin, r, alpha, dropout, use_rslora)
    object.__setattr__(model, "lora_config", {"r": r, "lora_alpha": alpha, "lora_dropout": float(dropout),
                                              "target_modules": target_modules, "use_rslora": bool(use_rslora)})
    return model


def adapters(model: Module) -> dict:
    """{path: LoraLinear or LoraQuantizedLinear} of ``model``."""
    return {n: m for n, m in model.named_modules() if isinstance(m, (LoraLinear, LoraQuantizedLinear))}


def _need(model):
    found = adapters(model)
    if not found:
        raise ValueError(f"lora: {type(model).__name__} has no LoRA layers (call lora.apply first)")
    return found


def merge(model: Module) -> Module:
    for m in _need(model).values():
        m.merge()
    return model


def unmerge(model: Module) -> Module:
    for m in _need(model).values():
        m.unmerge()
    return model


def merge_and_unload(model: Module) -> Module:
    """Fold every adapter into its base weight and put plain Linear layers back (peft's
    ``merge_and_unload``)."""
    for name, m in _need(model).items():
        m.merge()
        lin = Linear.__new__(Linear)
        Module.__init__(lin)
        lin.in_features, lin.out_features = m.in_features, m.out_features
        lin.weight = m._parameters["weight"]
        lin.bias = m._parameters.get("bias")
        parent, _, leaf = name.rpartition(".")
        (model.get_submodule(parent) if parent else model)._modules[leaf] = lin
    return model


def adapter_state_dict(model: Module) -> dict:
    """The adapters' weights under peft's file names."""
    out = {}
    for name, m in _need(model).items():
        for part in ("lora_A", "lora_B"):
            out[f"{PEFT_PREFIX}{name}.{part}.weight"] = m._modules[part]._parameters["weight"].data.copy()
    return out


def peft_config(model: Module, base_model_name_or_path=None, task_type="CAUSAL_LM") -> dict:
    """adapter_config.json's fields (peft's LoraConfig) for ``model``'s adapters."""
    cfg = getattr(model, "lora_config", None)
    if cfg is None:
        raise ValueError("lora: this model's adapters were not made by lora.apply (no lora_config)")
    tm = cfg["target_modules"]
    return {"peft_type": "LORA", "task_type": task_type, "base_model_name_or_path": base_model_name_or_path,
            "r": cfg["r"], "lora_alpha": cfg["lora_alpha"], "lora_dropout": cfg["lora_dropout"],
            "target_modules": tm if isinstance(tm, str) else list(tm), "bias": "none", "fan_in_fan_out": False,
            "use_rslora": cfg["use_rslora"], "use_dora": False, "init_lora_weights": True, "inference_mode": True,
            "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
            "rank_pattern": {}, "alpha_pattern": {}}


def save(model: Module, folder, base_model_name_or_path=None, task_type="CAUSAL_LM") -> str:
    """Write the adapters (only) as peft does: ``folder``/adapter_model.safetensors and
    adapter_config.json. Returns the folder."""
    from safetensors.numpy import save
    from ..disk import write_atomic     # (a failed save leaves the previous files whole)
    folder = os.fspath(folder)
    weights = save(adapter_state_dict(model), metadata={"format": "pt"})
    config = json.dumps(peft_config(model, base_model_name_or_path, task_type), indent=2).encode()
    write_atomic(os.path.join(folder, ADAPTER_WEIGHTS), weights)
    write_atomic(os.path.join(folder, ADAPTER_CONFIG), config)
    return folder


def load(model: Module, folder, strict: bool = True) -> Module:
    """Load adapters that ``save`` or peft's ``save_pretrained`` wrote into ``model``,
    applying LoRA first (with the file's r, alpha, target modules) if it has none."""
    from safetensors.numpy import load_file
    folder = os.fspath(folder)
    paths = [os.path.join(folder, n) for n in (ADAPTER_CONFIG, ADAPTER_WEIGHTS)]
    for p in paths:
        if not os.path.isfile(p):
            raise FileNotFoundError(f"lora.load: {p!r} does not exist (a peft adapter folder has "
                                    f"{ADAPTER_CONFIG} and {ADAPTER_WEIGHTS})")
    with open(paths[0]) as f:
        cfg = json.load(f)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"lora.load: {paths[0]!r} is a {cfg.get('peft_type')} adapter, not LORA")
    unsupported = {k: cfg[k] for k in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern",
                                       "alpha_pattern", "layers_to_transform") if cfg.get(k)}
    if cfg.get("bias", "none") != "none":
        unsupported["bias"] = cfg["bias"]
    if unsupported:
        raise NotImplementedError(f"lora.load: {paths[0]!r} uses {unsupported}, which meganeura's LoRA does not support")
    if not adapters(model):
        apply(model, r=int(cfg["r"]), alpha=cfg["lora_alpha"], target_modules=cfg["target_modules"],
              dropout=cfg.get("lora_dropout", 0.0), use_rslora=cfg.get("use_rslora", False))
    tensors = load_file(paths[1])
    mine = adapter_state_dict(model)
    missing = [k for k in mine if k not in tensors]
    unexpected = [k for k in tensors if k not in mine]
    if strict and (missing or unexpected):
        from ..api import describe_key_mismatch
        raise ValueError(f"lora.load: {paths[1]!r}: " + describe_key_mismatch(missing, unexpected))
    found = adapters(model)
    for k, v in tensors.items():
        if k not in mine:
            continue
        name, part = k[len(PEFT_PREFIX):].rsplit(".", 2)[:2]
        p: Parameter = found[name]._modules[part]._parameters["weight"]
        if tuple(v.shape) != tuple(p.shape):
            raise ValueError(f"lora.load: {k!r} has shape {tuple(v.shape)}, this model's is {tuple(p.shape)}")
        p.data = v.astype(np.float32)
    return model
