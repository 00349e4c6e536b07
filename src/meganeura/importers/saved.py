"""An imported model saved as a folder, and what ``meganeura import`` / ``meganeura info
DIR`` do with one.

The folder holds ``model.json`` (what was imported: source, inputs, outputs, parameters,
op counts, the target and its dispatch count), ``weights.safetensors`` (the parameters by
their source names) and ``inference.executable`` (the inference program compiled for the
target with every kernel final: ``load_saved`` runs it with no compile step, and needs
neither onnx nor torch). It is written to a temporary folder beside ``DIR`` and renamed
into place, so a failed import leaves nothing behind.
"""
from __future__ import annotations

import collections
import json
import os
import shutil
import tempfile

import numpy as np

FORMAT = "meganeura-imported-model"
VERSION = 1
FILES = ("model.json", "weights.safetensors", "inference.executable")
TARGETS = ("device", "lavapipe", "h200")
LEAVES = {"input", "parameter", "state", "constant"}


class SavedModelError(ValueError):
    """A user mistake with a saved model's folder (the command line reports it as one line)."""


def _target(name):
    from ..compilation.target import Target
    if name == "lavapipe":
        return Target.lavapipe()
    if name == "h200":
        return Target.h200()
    if name == "device":
        from ..runtime.backends import get_runtime_device, resolve
        return get_runtime_device(resolve("gpu")).target()
    raise ValueError(f"target {name!r}: must be one of {TARGETS}")


def _shapes(x):
    return [int(s) for s in x.shape]


def manifest(imported, exe, target_name, onnx_ops=None) -> dict:
    g = imported.graph
    ops = collections.Counter(n.op for n in g.nodes if n.op not in LEAVES)
    params = [{"name": n, "shape": _shapes(t), "dtype": t.dtype.name,
               "trainable": t.attrs.get("requires_grad", True) is not False} for n, t in g.parameters.items()]
    return {"format": FORMAT, "version": VERSION, "source": imported.source,
            "inputs": [{"name": n, "shape": _shapes(t), "dtype": t.dtype.name} for n, t in imported.inputs.items()],
            "outputs": [{"name": n, "shape": _shapes(t), "dtype": t.dtype.name}
                        for n, t in zip(imported.output_names, imported.outputs)],
            "parameters": params, "ops": dict(sorted(ops.items())), "source_ops": dict(sorted((onnx_ops or {}).items())),
            "target": {"name": target_name, "api": exe.target.api, "adapter": exe.target.adapter.get("name", "")},
            "dispatches": int(exe.n_dispatches), "kernels": len({k.key for k in exe.kernels})}


def save_imported(imported, out_dir, target="device", onnx_ops=None) -> dict:
    """Compile ``imported`` for inference on ``target`` (device-free for 'lavapipe' and
    'h200') and write the folder ``out_dir`` (new, or an empty folder). Returns the manifest."""
    from ..checkpoint import write_safetensors
    from ..compiler import CompileOptions, compile_plan
    out_dir = os.path.abspath(os.fspath(out_dir))
    if os.path.exists(out_dir) and (not os.path.isdir(out_dir) or os.listdir(out_dir)):
        raise SavedModelError(f"--out {out_dir!r} exists and is not an empty folder")
    parent = os.path.dirname(out_dir)
    if not os.path.isdir(parent):
        raise SavedModelError(f"--out {out_dir!r}: folder {parent!r} does not exist")
    t = _target(target)
    exe = compile_plan(list(imported.outputs), n_forward=len(imported.outputs),
                       options=CompileOptions.for_target(t), target=t)
    info = manifest(imported, exe, target, onnx_ops)
    tmp = tempfile.mkdtemp(prefix=f".{os.path.basename(out_dir)}.", dir=parent)
    try:
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o777 & ~umask)           # as a folder made with mkdir
        with open(os.path.join(tmp, "weights.safetensors"), "wb") as f:
            write_safetensors(f, imported.state_dict(), {"content": FORMAT})
        exe.save(os.path.join(tmp, "inference.executable"))
        with open(os.path.join(tmp, "model.json"), "w") as f:
            json.dump(info, f, indent=1)
        if os.path.isdir(out_dir):
            os.rmdir(out_dir)
        os.replace(tmp, out_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return info


def read_manifest(folder) -> dict:
    folder = os.fspath(folder)
    if not os.path.isdir(folder):
        raise SavedModelError(f"{folder!r} is not a folder (meganeura import --out writes one)")
    missing = [f for f in FILES if not os.path.isfile(os.path.join(folder, f))]
    if missing:
        raise SavedModelError(f"{folder!r} has no {', '.join(missing)}: not a saved imported model "
                                "(meganeura import --out writes one)")
    try:
        with open(os.path.join(folder, "model.json")) as f:
            info = json.load(f)
    except ValueError as e:
        raise SavedModelError(f"{folder!r}: model.json is not JSON: {e}") from None
    if not isinstance(info, dict) or info.get("format") != FORMAT:
        raise SavedModelError(f"{folder!r}: model.json is not a saved imported model's manifest")
    if info.get("version", 0) > VERSION:
        raise SavedModelError(f"{folder!r}: format version {info['version']}, this meganeura reads {VERSION}")
    return info


class SavedModel:
    """A saved imported model, run from its executable (no compile step, no onnx or torch)."""

    def __init__(self, folder):
        from safetensors.numpy import load_file

        from ..compilation import executable
        from ..runtime.executor import ExecutableRunner
        self.folder, self.manifest = os.fspath(folder), read_manifest(folder)
        weights = load_file(os.path.join(self.folder, "weights.safetensors"))
        self.runner = ExecutableRunner(executable.load(os.path.join(self.folder, "inference.executable")), weights)

    def run(self, feeds: dict) -> list:
        from ..graph import DTYPES
        arrays = {}
        for spec in self.manifest["inputs"]:
            if spec["name"] not in feeds:
                raise KeyError(f"{self.folder}: no feed for input {spec['name']!r} (shape {tuple(spec['shape'])})")
            a = np.asarray(feeds[spec["name"]])
            if list(a.shape) != spec["shape"]:
                raise ValueError(f"input {spec['name']!r}: got shape {a.shape}, expected {tuple(spec['shape'])}")
            arrays[spec["name"]] = a.astype(DTYPES[spec["dtype"]].np)
        return self.runner.run(arrays)


def load_saved(folder) -> SavedModel:
    return SavedModel(folder)


def describe(folder) -> str:
    """``meganeura info DIR``: what a saved imported model holds."""
    m = read_manifest(folder)
    n = sum(int(np.prod(p["shape"])) for p in m["parameters"])
    frozen = sum(1 for p in m["parameters"] if not p["trainable"])
    lines = [f"imported model: {m['source']}",
             "inputs: " + ", ".join(f"{s['name']} {tuple(s['shape'])} {s['dtype']}" for s in m["inputs"]),
             "outputs: " + ", ".join(f"{s['name']} {tuple(s['shape'])} {s['dtype']}" for s in m["outputs"]),
             f"parameters: {len(m['parameters'])} tensors, {n:,} values" + (f" ({frozen} frozen)" if frozen else "")]
    lines += [f"  {p['name']} {tuple(p['shape'])} {p['dtype']}" for p in m["parameters"][:12]]
    if len(m["parameters"]) > 12:
        lines.append(f"  ... and {len(m['parameters']) - 12} more")
    if m.get("source_ops"):
        lines.append("source ops: " + ", ".join(f"{k} {v}" for k, v in m["source_ops"].items()))
    lines.append("ops: " + ", ".join(f"{k} {v}" for k, v in m["ops"].items()))
    t = m["target"]
    lines.append(f"inference: {m['dispatches']} dispatches ({m['kernels']} distinct kernels) compiled for "
                 f"{t['name']} ({t['api']}, {t['adapter'] or 'no adapter name'})")
    return "\n".join(lines)


def add_import_arguments(p) -> None:
    """The options of ``meganeura import``."""
    p.add_argument("model", help="the .onnx file (external data is read from its folder)")
    p.add_argument("--out", required=True, metavar="DIR", help="folder to write (new or empty)")
    p.add_argument("--target", default="device", choices=TARGETS,
                   help="what the executable is compiled for: this machine's GPU, or a device described device-free")
    p.add_argument("--input-shape", action="append", metavar="NAME=D0,D1,...",
                   help="the size of an input with symbolic dimensions (repeat for several)")


def cli_import(args) -> None:
    """``meganeura import MODEL.onnx --out DIR``."""
    from . import ModelImportError, from_onnx
    shapes = {}
    for spec in args.input_shape or ():
        name, _, dims = spec.partition("=")
        try:
            shapes[name] = tuple(int(d) for d in dims.split(","))
        except ValueError:
            raise SavedModelError(f"--input-shape {spec!r}: expected NAME=D0,D1,... (integers)") from None
    try:
        imported = from_onnx(args.model, input_shapes=shapes)
    except ModelImportError as e:
        raise SavedModelError(str(e)) from None
    import onnx
    counts = collections.Counter(n.op_type for n in onnx.load(args.model, load_external_data=False).graph.node)
    info = save_imported(imported, args.out, args.target, counts)
    print(f"imported {args.model}: {len(info['parameters'])} parameters, {sum(info['ops'].values())} ops, "
          f"{info['dispatches']} dispatches on {info['target']['name']}; saved to {args.out}")


def cli_info(folder) -> None:
    """``meganeura info DIR``."""
    print(describe(folder))
