"""``from_pretrained``: a Hugging Face model folder, or a model id found in the local Hugging
Face cache, built by transformers from its own config and weights and imported through
``from_torch``. Any family transformers knows imports this way (Llama, Qwen2, Mistral, Gemma,
Phi-3, GPT-2, BERT, ViT, T5, Whisper, ...); nothing is downloaded.
"""
from __future__ import annotations

import json
import os

from .errors import ModelImportError
from .imported import ImportedModel

# model types whose first input is an image (pixel_values) or a spectrogram (input_features)
_IMAGE_TYPES = {"vit", "deit", "beit", "convnext", "convnextv2", "resnet", "swin", "dinov2", "mobilevit"}
_AUDIO_TYPES = {"whisper"}


def resolve_folder(name_or_path, revision=None) -> str:
    """The folder of ``name_or_path``: itself where it is a folder, else the snapshot of that
    model id in the local Hugging Face cache (``HF_HUB_CACHE`` / ``HF_HOME``, as huggingface_hub
    reads them)."""
    path = os.fspath(name_or_path)
    if os.path.isdir(path):
        return path
    if os.path.exists(path):
        raise ModelImportError(f"from_pretrained: {path} is a file, not a model folder or a model id")
    try:
        from huggingface_hub import snapshot_download
        from huggingface_hub.errors import LocalEntryNotFoundError
    except ImportError:
        raise ModelImportError(f"from_pretrained: {path} is not a folder, and looking up model ids needs "
                               "huggingface_hub (pip install meganeura[torch] transformers)") from None
    cache = os.environ.get("HF_HUB_CACHE") or (os.path.join(os.environ["HF_HOME"], "hub")
                                               if os.environ.get("HF_HOME") else None)
    try:
        return snapshot_download(path, revision=revision, cache_dir=cache, local_files_only=True)
    except (LocalEntryNotFoundError, ValueError, OSError) as e:
        where = cache or "the default Hugging Face cache"
        raise ModelImportError(f"from_pretrained: {path!r} is neither a folder nor a model in {where} "
                               f"(revision {revision or 'main'}); download it first, e.g. "
                               f"`hf download {path}`", [f"{type(e).__name__}: {e}"]) from None


def _read_config(folder) -> dict:
    file = os.path.join(folder, "config.json")
    if not os.path.isfile(file):
        raise ModelImportError(f"from_pretrained: {folder} has no config.json (not a Hugging Face model folder)")
    try:
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as e:
        raise ModelImportError(f"from_pretrained: {file} is not readable JSON", [str(e)]) from None


def _model_class(transformers, config: dict, folder):
    names = config.get("architectures") or []
    for name in names:
        cls = getattr(transformers, name, None)
        if cls is not None:
            return cls
    if not names:                 # no architecture named: the family's base model
        return transformers.AutoModel
    raise ModelImportError(f"from_pretrained: {folder}/config.json names architectures {names}, which "
                           f"transformers {transformers.__version__} does not have")


def example_inputs_for(config, batch=1, seq_len=8):
    """Zero inputs of the shape the model's first input takes: token ids for text models,
    an image for vision models, a log-mel spectrogram for Whisper."""
    import torch
    kind = getattr(config, "model_type", "")
    if kind in _IMAGE_TYPES:
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return (torch.zeros(batch, config.num_channels, size, size),)
    if kind in _AUDIO_TYPES:
        return (torch.zeros(batch, config.num_mel_bins, 2 * config.max_source_positions),)
    return (torch.zeros(batch, seq_len, dtype=torch.long),)


def from_pretrained(name_or_path, example_inputs=None, *, revision=None, training=False,
                    batch=1, seq_len=8) -> ImportedModel:
    folder = resolve_folder(name_or_path, revision)
    raw = _read_config(folder)
    try:
        import torch
        import transformers
    except ImportError:
        raise ModelImportError("from_pretrained: needs torch and transformers "
                               "(pip install meganeura[torch] transformers)") from None
    cls = _model_class(transformers, raw, folder)
    try:
        # f32 on the host: the imported graph's parameters are f32 (the plan narrows them where
        # its precision says so)
        model = cls.from_pretrained(folder, local_files_only=True, attn_implementation="eager",
                                    dtype=torch.float32)
    except Exception as e:
        raise ModelImportError(f"from_pretrained: transformers could not load {folder} as {cls.__name__}",
                               [f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"]) from None
    model.config.use_cache = False       # a cache object is no tensor output torch.export takes
    model.eval()
    args = example_inputs if example_inputs is not None else example_inputs_for(model.config, batch, seq_len)
    from .torch_export import from_torch
    imported = from_torch(model, args, training=training)
    imported.config = model.config
    return imported
