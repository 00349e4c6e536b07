"""The paper's five workloads, each behind one interface for the gates and the timing harness.

``make(name, size, seed, device)`` gives a ``Workload``: a torch reference module (f32, on
``device``), its weights moved to our graphs by name, deterministic inputs, our graphs for
the phases ``inference`` (full shape), ``minimal`` (SmolLM2: one new token through the
KV-cached decoder; the others: batch 1) and ``train`` (forward + loss, for forward+backward
and AdamW steps), and the torch equivalent of every phase as a closure.

Weights are built once on the CPU from ``torch.manual_seed(seed)`` (then moved to the
device), so both sides and every device see the same values; norms and biases are moved
off their 1/0 initialisation, as in the model tests, so they are really exercised.
Inputs come from ``numpy.random.default_rng(seed)``.

torch is imported lazily: importing ``meganeura.bench`` does not import it.
"""
from __future__ import annotations

import copy
import importlib.util
import inspect
import pathlib
from dataclasses import dataclass, field

import numpy as np

WORKLOADS = ("smollm2", "smolvla", "unet", "resnet50", "whisper")
SIZES = ("tiny", "real")
GRAPHS = ("inference", "minimal", "train")


def _torch():
    import torch
    return torch


def default_device() -> str:
    torch = _torch()
    return "cuda" if torch.cuda.is_available() else "cpu"


def _np(t) -> np.ndarray:
    return t.detach().float().cpu().numpy()


@dataclass
class Built:
    """One of our graphs with what compiling and feeding it needs."""
    graph: object
    outputs: list
    loss: object = None
    state_updates: dict = field(default_factory=dict)    # applied by every run (KV cache)


class Workload:
    """Base class; see the module docstring. Subclasses fill in the model specifics."""
    name = ""
    objective = ""

    def __init__(self, size="tiny", seed=0, device=None):
        if size not in SIZES:
            raise ValueError(f"size must be one of {SIZES}, got {size!r}")
        self.size, self.seed = size, seed
        self.device = device or default_device()
        self.cfg = self.config()
        self._ref = None
        self._inputs = {}

    # ---------------------------------------------------------------- to fill in
    def config(self):
        raise NotImplementedError

    def batch(self, graph: str) -> int:
        raise NotImplementedError

    def make_reference(self):
        """The torch module (f32, CPU), deterministically initialised."""
        raise NotImplementedError

    def make_inputs(self, batch: int) -> dict:
        """Numpy inputs of our graphs, targets included."""
        raise NotImplementedError

    def build(self, graph: str) -> Built:
        raise NotImplementedError

    def torch_output(self, model, graph: str, tin: dict):
        """The reference output tensor of ``graph`` ("inference"/"minimal")."""
        raise NotImplementedError

    def torch_loss(self, model, tin: dict):
        raise NotImplementedError

    # ---------------------------------------------------------------- shared
    def describe(self) -> dict:
        from dataclasses import asdict, is_dataclass
        cfg = asdict(self.cfg) if is_dataclass(self.cfg) else dict(vars(self.cfg))
        return {"name": self.name, "size": self.size, "objective": self.objective, "device": self.device,
                "config": {k: (list(v) if isinstance(v, tuple) else v) for k, v in cfg.items()},
                "batch": {g: self.batch(g) for g in GRAPHS},
                "parameters": int(sum(p.numel() for p in self.reference.parameters()))}

    @property
    def reference(self):
        """The eval-mode reference on ``self.device`` (built once)."""
        if self._ref is None:
            self._ref = self.make_reference().float().to(self.device).eval()
        return self._ref

    def inputs(self, graph: str) -> dict:
        b = self.batch(graph)
        if b not in self._inputs:
            self._inputs[b] = self.make_inputs(b)
        return self._inputs[b]

    def feeds(self, graph: str, built: Built) -> dict:
        """The inputs ``built`` reads (its graph's input names)."""
        src = self.inputs(graph)
        return {n: src[n] for n in built.graph.inputs if n in src}

    def torch_inputs(self, graph: str) -> dict:
        torch = _torch()
        return {k: torch.as_tensor(v).to(self.device) for k, v in self.inputs(graph).items()}

    def our_state(self, graph: str, built: Built) -> dict:
        """The reference's state dict as f32 arrays, keyed as our graph names them."""
        sd = {k: _np(v) for k, v in self.reference.state_dict().items() if v.is_floating_point()}
        kept = set(built.graph.parameters) | set(built.graph.states)
        return {k: v for k, v in sd.items() if k in kept}

    def train_copy(self):
        """A separate reference for training (train mode; updates never touch ``reference``)."""
        return copy.deepcopy(self.reference).train()

    @staticmethod
    def trainable(model) -> dict:
        return {n: p for n, p in model.named_parameters() if p.requires_grad}

    def session(self, graph: str, backend="gpu", precision="strict", optimizer=None, timings=None):
        """(session, feeds) for one of our graphs with the reference weights loaded. With
        ``optimizer`` (train graph), each step also updates what the graph records with
        ``Graph.update`` (batch norm's running statistics).
        ``timings``: a dict that receives build_s, compile_s and load_s."""
        import time

        import meganeura as mg
        t0 = time.perf_counter()
        b = self.build(graph)
        t1 = time.perf_counter()
        kw = dict(backend=backend, precision=precision, seed=self.seed)
        if graph == "train":
            s = mg.compile(b.graph, loss=b.loss, optimizer=optimizer, **kw)
        else:
            s = mg.compile(b.graph, outputs=b.outputs, state_updates=b.state_updates or None, **kw)
        t2 = time.perf_counter()
        s.load_state_dict(self.our_state(graph, b))
        if timings is not None:
            timings.update(build_s=t1 - t0, compile_s=t2 - t1, load_s=time.perf_counter() - t2)
        return s, self.feeds(graph, b)

    def torch_fn(self, phase: str, model, optimizer=None):
        """A closure running ``phase`` once on ``model`` (eager or compiled) and returning
        the result tensor. Phases: inference, minimal, flb, train_step."""
        torch = _torch()
        if phase in ("inference", "minimal"):
            tin = self.torch_inputs(phase)

            def fwd():
                with torch.no_grad():
                    return self.torch_output(model, phase, tin)
            return fwd
        tin = self.torch_inputs("train")
        params = list(self.trainable(model).values()) if phase == "train_step" else None

        def flb():
            for p in model.parameters():
                p.grad = None
            loss = self.torch_loss(model, tin)
            loss.backward()
            return loss
        if phase == "flb":
            return flb
        if phase != "train_step":
            raise ValueError(f"unknown phase {phase!r}")
        opt = optimizer or torch.optim.AdamW(params, lr=1e-3)

        def train_step():
            loss = flb()
            opt.step()
            return loss
        return train_step


def _perturb(model, pred, scale, rng_seed):
    """Add scale * N(0, 1) to the parameters whose name matches ``pred`` (deterministic)."""
    torch = _torch()
    gen = torch.Generator().manual_seed(rng_seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if pred(n, p):
                p.add_(scale * torch.randn(p.shape, generator=gen, dtype=p.dtype))


# ============================================================================ SmolLM2
class SmolLM2(Workload):
    """SmolLM2-135M (Llama): token cross-entropy, batch 1 x seq 128; minimal = one new
    token decoded at the last position of a 128-slot cache filled by the reference's prefill.
    The tied head: transformers' state_dict lists ``lm_head.weight`` too; our graph has only
    ``model.embed_tokens.weight`` and takes that."""
    name, objective = "smollm2", "token cross-entropy"

    def config(self):
        from ..models.llama import LlamaConfig
        self.seq = 128 if self.size == "real" else 8
        return LlamaConfig.smollm2_135m() if self.size == "real" else LlamaConfig.tiny()

    def batch(self, graph):
        return 1

    def make_reference(self):
        transformers = __import__("transformers")
        d = {k: v for k, v in self.cfg.to_hf_dict().items() if k != "architectures"}
        _torch().manual_seed(self.seed)
        hc = transformers.LlamaConfig(**d, initializer_range=0.02 if self.size == "real" else 0.1)
        return transformers.LlamaForCausalLM(hc)

    def make_inputs(self, batch):
        rng = np.random.default_rng(self.seed)
        v = self.cfg.vocab_size
        ids = rng.integers(0, v, (batch, self.seq)).astype(np.int32)
        labels = rng.integers(0, v, (batch, self.seq)).astype(np.int32)
        return {"input_ids": ids, "labels": labels}

    @property
    def prompt_len(self):
        return self.seq - 1

    def decode_feeds(self):
        from ..models.llama import decode_feeds
        ids = self.inputs("inference")["input_ids"]
        f = decode_feeds(self.cfg, self.prompt_len, 1, self.seq)
        f["input_ids"] = ids[:, self.prompt_len:]
        return f

    def build(self, graph):
        from ..models import llama
        if graph == "inference":
            g, _, logits = llama.build_causal_lm(self.cfg, 1, self.seq)
            return Built(g, [logits])
        if graph == "train":
            g, _, _, loss = llama.build_training(self.cfg, 1, self.seq)
            return Built(g, [], loss)
        g, logits, updates = build_cached_decoder(self.cfg, 1, self.seq)
        return Built(g, [logits], state_updates=updates)

    def feeds(self, graph, built):
        if graph == "minimal":
            return self.decode_feeds()
        return super().feeds(graph, built)

    def our_state(self, graph, built):
        from ..models.llama import graph_state_dict
        state = graph_state_dict(built.graph, self.reference.state_dict())
        if graph == "minimal":
            state.update(self.prefill_cache())
        return state

    def prefill_cache(self) -> dict:
        """Our cache states filled from the reference's prefill of the prompt."""
        cache, _ = self._static_cache(self.reference)
        from ..models.llama import cache_names
        names = cache_names(self.cfg)
        out = {}
        for i, layer in enumerate(cache.layers):
            out[names[2 * i]] = _np(layer.keys)
            out[names[2 * i + 1]] = _np(layer.values)
        return out

    def _static_cache(self, model):
        """A StaticCache of ``seq`` slots holding the prompt's keys/values (positions
        0 .. prompt_len-1), and the decode step's inputs."""
        torch = _torch()
        transformers = __import__("transformers")
        ids = torch.as_tensor(self.inputs("inference")["input_ids"], dtype=torch.long, device=self.device)
        cache = transformers.StaticCache(config=self.reference.config, max_cache_len=self.seq)
        # transformers 5.x renamed past_key_values to cache
        key = "cache" if "cache" in inspect.signature(type(self.reference).forward).parameters else "past_key_values"
        with torch.no_grad():
            model(ids[:, :self.prompt_len], use_cache=True, **{key: cache},
                  cache_position=torch.arange(self.prompt_len, device=self.device))
        step = {"input_ids": ids[:, self.prompt_len:], key: cache, "use_cache": True,
                "cache_position": torch.tensor([self.prompt_len], device=self.device)}
        return cache, step

    def torch_output(self, model, graph, tin):
        return model(tin["input_ids"].long()).logits

    def torch_fn(self, phase, model, optimizer=None):
        if phase != "minimal":
            return super().torch_fn(phase, model, optimizer)
        torch = _torch()
        cache, step = self._static_cache(self.reference)

        def decode():
            with torch.no_grad():
                return model(**step).logits[:, -1]

        def rewind():
            # StaticCache advances its own write position on every call: rewinding it makes
            # each call decode the same token into the same slot, as ours does
            for layer in cache.layers:
                layer.cumulative_length.fill_(self.prompt_len)
        decode.prepare = rewind      # run untimed before every timed call
        return decode

    def torch_loss(self, model, tin):
        return model(tin["input_ids"].long(), labels=tin["labels"].long()).loss


def build_cached_decoder(cfg, batch: int, max_len: int):
    """One-token ``llama.build_decoder`` with the key/value cache as device state, so a
    decode step moves no cache through the host. Returns (graph, logits (batch, vocab),
    {cache state: new value}); the states are named ``cache_names(cfg)``."""
    from ..models import llama as L
    g, logits, new = L.build_decoder(cfg, batch, 1, max_len, cache_as_state=True)
    return g, logits, dict(zip((g.states[n] for n in L.cache_names(cfg)), new))


# ============================================================================ SmolVLA
def _smolvla_reference_module():
    path = pathlib.Path(__file__).resolve().parents[3] / "bench" / "smolvla_reference.py"
    if not path.exists():
        raise FileNotFoundError(f"the SmolVLA reference module is not at {path} (run from a source checkout)")
    spec = importlib.util.spec_from_file_location("smolvla_reference", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


class SmolVLA(Workload):
    """SmolVLA action expert (bench/smolvla_reference.py): output MSE, batch 1."""
    name, objective = "smolvla", "output MSE"

    def config(self):
        from ..models.smolvla import SmolVLAConfig
        return SmolVLAConfig.real() if self.size == "real" else SmolVLAConfig.tiny()

    def batch(self, graph):
        return 1 if self.size == "real" or graph == "minimal" else 2

    def make_reference(self):
        _torch().manual_seed(self.seed)
        m = _smolvla_reference_module().SmolVLAExpert(self.cfg)
        _perturb(m, lambda n, p: "norm" in n, 0.2, self.seed + 1)
        return m

    def make_inputs(self, batch):
        c = self.cfg
        rng = np.random.default_rng(self.seed)
        return {"action_tokens": rng.standard_normal((batch, c.chunk_size, c.hidden_size)).astype(np.float32),
                "vlm_features": rng.standard_normal((batch, c.vlm_len, c.vlm_kv_dim)).astype(np.float32),
                "target": rng.standard_normal((batch, c.chunk_size, c.hidden_size)).astype(np.float32)}

    def build(self, graph):
        from ..models.smolvla import build_smolvla_expert
        b = build_smolvla_expert(self.cfg, self.batch(graph), training=graph == "train")
        return Built(b.graph, [b.output], b.loss)

    def torch_output(self, model, graph, tin):
        return model(tin["action_tokens"], tin["vlm_features"])

    def torch_loss(self, model, tin):
        torch = _torch()
        return torch.nn.functional.mse_loss(model(tin["action_tokens"], tin["vlm_features"]), tin["target"])


# ============================================================================ U-Net
class UNet(Workload):
    """Scaled SD 1.x U-Net (diffusers UNet2DConditionModel): noise MSE, batch 1, 4x32x32
    latent, 77x768 context. Our graph takes the host-computed sinusoidal timestep features,
    torch the raw timesteps."""
    name, objective = "unet", "noise MSE"

    def config(self):
        from ..models.unet import UNetConfig
        return UNetConfig.sd_scaled() if self.size == "real" else UNetConfig.tiny()

    def batch(self, graph):
        return 1 if self.size == "real" or graph == "minimal" else 2

    def make_reference(self):
        diffusers = __import__("diffusers")
        _torch().manual_seed(self.seed)
        m = diffusers.UNet2DConditionModel(**self.cfg.diffusers_kwargs())
        _perturb(m, lambda n, p: n.endswith("bias") or "norm" in n, 0.1, self.seed + 1)
        return m

    def make_inputs(self, batch):
        from ..models.unet import timestep_features
        c = self.cfg
        rng = np.random.default_rng(self.seed)
        s = c.sample_size
        t = np.linspace(17.0, 981.0, batch).astype(np.float32)
        return {"sample": rng.standard_normal((batch, c.in_channels, s, s)).astype(np.float32),
                "timestep": timestep_features(t, c), "timesteps": t,
                "context": rng.standard_normal((batch, c.context_len, c.cross_attention_dim)).astype(np.float32),
                "noise": rng.standard_normal((batch, c.out_channels, s, s)).astype(np.float32)}

    def build(self, graph):
        from ..models.unet import build_unet
        b = build_unet(self.cfg, self.batch(graph), training=graph == "train")
        return Built(b.graph, [b.output], b.loss)

    def torch_output(self, model, graph, tin):
        return model(tin["sample"], tin["timesteps"], tin["context"]).sample

    def torch_loss(self, model, tin):
        torch = _torch()
        out = model(tin["sample"], tin["timesteps"], tin["context"]).sample
        return torch.nn.functional.mse_loss(out, tin["noise"])


# ============================================================================ ResNet-50
def resnet_reference(cfg, seed=0):
    """transformers' ResNetForImageClassification for ``cfg`` with seeded weights; batch norm
    gets non-trivial weights and running statistics (the default init is the identity)."""
    transformers = __import__("transformers")
    torch = _torch()
    torch.manual_seed(seed)
    m = transformers.ResNetForImageClassification(transformers.ResNetConfig(**cfg.hf_kwargs()))
    with torch.no_grad():
        for mod in m.modules():
            if isinstance(mod, torch.nn.BatchNorm2d):
                mod.weight.uniform_(0.5, 1.5)
                mod.bias.uniform_(-0.5, 0.5)
                mod.running_mean.uniform_(-0.5, 0.5)
                mod.running_var.uniform_(0.5, 2.0)
    return m


class ResNet50(Workload):
    """ResNet-50 (transformers ResNetForImageClassification): class cross-entropy, batch 4
    at 224x224. Inference folds batch norm into the convs; training uses batch statistics
    and every step applies torch's running-statistic updates (recorded in the graph)."""
    name, objective = "resnet50", "class cross-entropy"

    def config(self):
        from ..models.resnet import ResNetConfig
        return ResNetConfig.resnet50() if self.size == "real" else ResNetConfig.tiny()

    def batch(self, graph):
        return 1 if graph == "minimal" else 4

    def make_reference(self):
        return resnet_reference(self.cfg, self.seed)

    def make_inputs(self, batch):
        c = self.cfg
        rng = np.random.default_rng(self.seed)
        return {"pixel_values": rng.standard_normal((batch, c.num_channels, c.image_size, c.image_size))
                .astype(np.float32),
                "labels": rng.integers(0, c.num_labels, batch).astype(np.int32)}

    def build(self, graph):
        from ..models.resnet import build_resnet
        if graph == "train":
            m = build_resnet(self.cfg, self.batch(graph), bn="train", with_loss=True)
            return Built(m.graph, [m.logits], m.loss)
        m = build_resnet(self.cfg, self.batch(graph), bn="folded")
        return Built(m.graph, [m.logits])

    def our_state(self, graph, built):
        from ..models.resnet import fold_batch_norm, torch_state_dict
        sd = self.reference.state_dict()
        return fold_batch_norm(sd, self.cfg.bn_eps) if graph != "train" else torch_state_dict(sd)

    def torch_output(self, model, graph, tin):
        return model(tin["pixel_values"]).logits

    def torch_loss(self, model, tin):
        torch = _torch()
        return torch.nn.functional.cross_entropy(model(tin["pixel_values"]).logits, tin["labels"].long())


# ============================================================================ Whisper
class Whisper(Workload):
    """Whisper-tiny encoder (transformers WhisperEncoder): output MSE, batch 1 x 80x3000
    mel. The position embedding is frozen on both sides (graph state on ours)."""
    name, objective = "whisper", "output MSE"

    def config(self):
        from ..models.whisper import WhisperEncoderConfig
        return WhisperEncoderConfig.tiny_real() if self.size == "real" else WhisperEncoderConfig.tiny()

    def batch(self, graph):
        return 1 if self.size == "real" or graph == "minimal" else 2

    def make_reference(self):
        transformers = __import__("transformers")
        from transformers.models.whisper.modeling_whisper import WhisperEncoder
        _torch().manual_seed(self.seed)
        m = WhisperEncoder(transformers.WhisperConfig(**self.cfg.hf_kwargs()))
        _perturb(m, lambda n, p: p.ndim == 1, 0.1, self.seed + 1)
        return m

    def make_inputs(self, batch):
        c = self.cfg
        rng = np.random.default_rng(self.seed)
        return {"input_features": rng.standard_normal((batch, c.num_mel_bins, c.input_length)).astype(np.float32),
                "target": rng.standard_normal((batch, c.max_source_positions, c.d_model)).astype(np.float32)}

    def build(self, graph):
        from ..models import whisper
        if graph == "train":
            g, _, _, out, loss = whisper.build_whisper_encoder_training(self.cfg, self.batch(graph))
            return Built(g, [out], loss)
        g, _, out = whisper.build_whisper_encoder(self.cfg, self.batch(graph))
        return Built(g, [out])

    def torch_output(self, model, graph, tin):
        return model(tin["input_features"]).last_hidden_state

    def torch_loss(self, model, tin):
        torch = _torch()
        return torch.nn.functional.mse_loss(model(tin["input_features"]).last_hidden_state, tin["target"])


REGISTRY = {"smollm2": SmolLM2, "smolvla": SmolVLA, "unet": UNet, "resnet50": ResNet50, "whisper": Whisper}


def make(name: str, size="tiny", seed=0, device=None) -> Workload:
    if name not in REGISTRY:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOADS)}")
    return REGISTRY[name](size, seed, device)


def parse_list(value, allowed, what) -> list:
    """A comma-separated option ("all" = every allowed value), checked."""
    if value in (None, "", "all"):
        return list(allowed)
    items = [v.strip() for v in value.split(",") if v.strip()]
    bad = [v for v in items if v not in allowed]
    if bad:
        raise SystemExit(f"unknown {what} {bad}; choose from {', '.join(allowed)}")
    return items
