"""``from_onnx``: an ONNX model onto a meganeura graph.

The model is checked with ``onnx.checker`` and must use the default domain at opset 13 or
later. Its graph inputs become graph inputs at their static shapes (``input_shapes`` fixes
symbolic dimensions), floating-point initializers become parameters under their ONNX
names (batch normalization's running statistics frozen); integer and boolean ones, and
single floats (the epsilons, scales and exponents exporters store as initializers), are
import-time constants. Nodes are walked in order: a node whose inputs are all known at
import (``Shape`` of a tensor is: the shapes are static) is evaluated here with
``onnx.reference``, so shape arithmetic, masks and position ids fold away; every other
node maps through the op table (onnx_ops). Each mapped value is checked against ONNX's
own shape inference. Every node that cannot be mapped is collected, and the import fails
once with all of them.

External data (tensors stored beside the model) is read relative to the model's folder;
a location outside it, a missing file, or a file too short for its tensor is an error
naming the tensor and the file. Nothing is ever written.
"""
from __future__ import annotations

import os

import numpy as np

from .. import ops
from ..graph import Graph, Tensor, f16, f32, i32, u32
from .errors import ModelImportError, Unavailable, UnsupportedOpsError
from .imported import ImportedModel
from .onnx_ops import TABLE, mg_dtype

MIN_OPSET = 13
BN_STATISTICS = {("BatchNormalization", 3), ("BatchNormalization", 4)}
# inputs that set how an op works rather than values it computes on: kept known, never weights
SETTINGS = {("Resize", 1), ("Resize", 2)}
# ops whose value differs from call to call: never folded into a constant
RANDOM = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial", "Bernoulli"}


def _onnx():
    try:
        import onnx
    except ImportError:
        raise ImportError("from_onnx needs the onnx package: pip install 'meganeura[onnx]'") from None
    return onnx


def from_onnx(path_or_model, *, load_external=True, input_shapes=None) -> ImportedModel:
    """Import an ONNX model: a file path or an ``onnx.ModelProto`` (whose external data,
    if any, is read relative to ``os.getcwd()``; give the path to read it beside the
    file). ``input_shapes``: {input name: shape} for inputs with symbolic dimensions.
    ``load_external=False`` leaves the parameters stored as external data without imported
    values (load them later with ``Session.load_state_dict``); the integer and scalar
    tensors the graph's shapes need are read all the same."""
    onnx = _onnx()
    model, folder, name = _load(onnx, path_or_model)
    try:
        onnx.checker.check_model(_without_external_data(onnx, model))
    except onnx.checker.ValidationError as e:
        raise ModelImportError(f"from_onnx: {name} is not a valid ONNX model", [_first_lines(e)]) from None
    opset = _default_opset(model)
    if opset is None or opset < MIN_OPSET:
        raise ModelImportError(f"from_onnx: {name} uses opset {opset} of the default domain", [
            f"meganeura imports opset {MIN_OPSET} and later; convert it first "
            f"(onnx.version_converter.convert_version(model, {MIN_OPSET}))"])
    if model.functions:
        model = onnx.inliner.inline_local_functions(model)
    arrays = _initializers(onnx, model, folder, name, load_external)
    return _Translator(onnx, model, arrays, name, opset, dict(input_shapes or {})).run()


def _first_lines(e, n=6):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n    ".join(text[:n]) + (" ..." if len(text) > n else "")


def _load(onnx, src):
    """(model, folder of its external data, a name for messages)."""
    if isinstance(src, onnx.ModelProto):
        return src, os.getcwd(), f"model {src.graph.name or '(unnamed)'}"
    if not isinstance(src, (str, os.PathLike)):
        raise TypeError(f"from_onnx: expected a file path or an onnx.ModelProto, got {type(src).__name__}")
    path = os.fspath(src)
    if not os.path.isfile(path):
        raise ModelImportError(f"from_onnx: {path!r}", ["no such file" if not os.path.exists(path) else
                                                         "is not a file"])
    try:
        model = onnx.load(path, load_external_data=False)
    except Exception as e:          # a truncated or foreign file: protobuf's own message
        raise ModelImportError(f"from_onnx: {path!r} is not an ONNX model file", [_first_lines(e, 2)]) from None
    return model, os.path.dirname(os.path.abspath(path)), repr(os.path.basename(path))


def _without_external_data(onnx, model):
    """The model for the checker: external tensors as empty ones of their names and types
    (their files are checked here, relative to the model's folder, not the working one)."""
    if not any(t.data_location == onnx.TensorProto.EXTERNAL for t in model.graph.initializer):
        return model
    bare = onnx.ModelProto()
    bare.CopyFrom(model)
    for t in bare.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            del t.external_data[:]
            del t.dims[:]
            t.dims.append(0)
            t.data_location = onnx.TensorProto.DEFAULT
    return bare


def _default_opset(model):
    for op in model.opset_import:
        if op.domain in ("", "ai.onnx"):
            return int(op.version)
    return None


# ------------------------------------------------------------------ initializers and external data
def _initializers(onnx, model, folder, name, load_external) -> dict:
    """Every initializer as a NumPy array (None: external, not loaded), by name. External
    data is read here, so a bad file fails the import before any graph is built."""
    from onnx import numpy_helper
    out, problems = {}, []
    for t in model.graph.initializer:
        if t.data_location == onnx.TensorProto.EXTERNAL:
            if not load_external and mg_dtype(t.data_type).is_float and int(np.prod(t.dims)) > 1:
                out[t.name] = None          # a weight: loaded later (shapes and constants are read)
                continue
            try:
                out[t.name] = _external(onnx, t, folder)
            except ValueError as e:
                problems.append(f"initializer {t.name!r}: {e}")
            continue
        arr = numpy_helper.to_array(t)
        out[t.name] = arr.astype(np.float32) if t.data_type == onnx.TensorProto.BFLOAT16 else arr
    if problems:
        raise ModelImportError(f"from_onnx: {name}: external data could not be read", problems)
    return out


def _external(onnx, t, folder) -> np.ndarray:
    info = {e.key: e.value for e in t.external_data}
    loc = info.get("location", "")
    if not loc:
        raise ValueError("external data with no location")
    base = os.path.realpath(folder)
    path = os.path.realpath(os.path.join(base, loc))
    if os.path.isabs(loc) or os.path.commonpath([base, path]) != base:
        raise ValueError(f"external data location {loc!r} lies outside the model's folder {folder!r}")
    if not os.path.isfile(path):
        raise ValueError(f"external data file {loc!r} not found in {folder!r}")
    dims = tuple(int(d) for d in t.dims)
    bf16 = t.data_type == onnx.TensorProto.BFLOAT16
    dtype = np.dtype(np.uint16) if bf16 else np.dtype(onnx.helper.tensor_dtype_to_np_dtype(t.data_type))
    need = int(np.prod(dims)) * dtype.itemsize
    offset = int(info.get("offset", 0))
    length = int(info.get("length", need))
    size = os.path.getsize(path)
    if length != need:
        raise ValueError(f"external data in {loc!r} is {length} bytes long; shape {dims} of "
                         f"{dtype.name} needs {need}")
    if offset + length > size:
        raise ValueError(f"external data file {loc!r} is corrupt or truncated: {size} bytes, the tensor "
                         f"(shape {dims}, {dtype.name}) needs bytes {offset}..{offset + length}")
    with open(path, "rb") as f:
        f.seek(offset)
        raw = f.read(length)
    arr = np.frombuffer(raw, dtype=dtype).reshape(dims)
    if bf16:
        arr = (arr.astype(np.uint32) << 16).view(np.float32)
    return arr.copy()


# ------------------------------------------------------------------ the walk
class _Poisoned:
    """The value of a node that failed: nodes reading it fail without a second report."""


class _Translator:
    def __init__(self, onnx, model, arrays, name, opset, input_shapes):
        self.onnx, self.model, self.arrays, self.name, self.opset = onnx, model, arrays, name, opset
        self.input_shapes = input_shapes
        self.g = Graph()
        self.values: dict = {}
        self.problems: list[str] = []
        self.unsupported: dict = {}
        self._consts: dict = {}
        self.op_type, self.n_outputs = "", 0
        self.expected = self._inferred()

    # -------------------------------------------------------------- helpers for rules
    def dtype_of_array(self, arr):
        a = np.asarray(arr)
        return f16 if a.dtype == np.float16 else f32 if a.dtype.kind == "f" else u32 if a.dtype == bool else i32

    def t(self, value, like=None) -> Tensor:
        """An import-time array (or number) as a graph constant, in ``like``'s float dtype."""
        if isinstance(value, Tensor):
            return value
        hit = self._consts.get(id(value))
        if hit is not None and hit[0] is value:
            return hit[1]
        arr = np.asarray(value)
        dt = self.dtype_of_array(arr)
        if dt.is_float and like is not None and like.dtype.is_float:
            dt = like.dtype
        c = self.g.constant(arr.astype(np.uint32) if dt is u32 else arr, dt)
        self._consts[id(value)] = (value, c)
        return c

    # -------------------------------------------------------------- setup
    def _inferred(self) -> dict:
        """name -> (static shape or None, element type) from ONNX shape inference."""
        onnx = self.onnx
        m = self.model
        if self.input_shapes:                   # inferred at the sizes given
            m = onnx.ModelProto()
            m.CopyFrom(self.model)
            for vi in m.graph.input:
                shape = self.input_shapes.get(vi.name)
                if shape is not None and vi.type.HasField("tensor_type"):
                    dims = vi.type.tensor_type.shape.dim
                    del dims[:]
                    for s in shape:
                        dims.add().dim_value = int(s)
            del m.graph.value_info[:]
            for o in m.graph.output:           # outputs declared with symbolic sizes: inferred again
                if o.type.HasField("tensor_type"):
                    o.type.tensor_type.ClearField("shape")
        try:
            m = onnx.shape_inference.infer_shapes(m)
        except Exception:           # inference is a check, not a requirement
            pass
        out = {}
        for vi in list(m.graph.value_info) + list(m.graph.output):
            tt = vi.type.tensor_type
            if not vi.type.HasField("tensor_type"):
                continue
            shape = None
            if tt.HasField("shape") and all(d.HasField("dim_value") for d in tt.shape.dim):
                shape = tuple(int(d.dim_value) for d in tt.shape.dim)
            out[vi.name] = (shape, tt.elem_type)
        return out

    def _uses(self) -> dict:
        uses: dict = {}
        for node in self.model.graph.node:
            for k, i in enumerate(node.input):
                if i in self.arrays:
                    uses.setdefault(i, set()).add((node.op_type, k))
        return uses

    def _frozen(self) -> set:
        """Initializers read only as batch normalization's running statistics."""
        return {n for n, u in self._uses().items() if u <= BN_STATISTICS}

    def _settings(self) -> set:
        """Float initializers read only as settings known at import (Resize's roi and scales)."""
        return {n for n, u in self._uses().items() if u <= SETTINGS}

    def _inputs(self):
        inputs = {}
        for vi in self.model.graph.input:
            if vi.name in self.arrays:          # an initializer listed as an input (older exporters)
                continue
            tt = vi.type.tensor_type
            shape = self.input_shapes.get(vi.name)
            declared = len(tt.shape.dim) if tt.HasField("shape") else None
            if shape is not None and declared is not None and len(shape) != declared:
                self.problems.append(f"input {vi.name!r}: input_shapes gives {tuple(shape)}, the model declares "
                                     f"{declared} dimensions")
                self.values[vi.name] = _Poisoned()
                continue
            if shape is None:
                dims = list(tt.shape.dim)
                symbolic = [d.dim_param or "?" for d in dims if not d.HasField("dim_value")]
                if symbolic:
                    self.problems.append(f"input {vi.name!r}: dimensions {symbolic} are symbolic; give their sizes "
                                         f"with input_shapes={{{vi.name!r}: (...)}}")
                    self.values[vi.name] = _Poisoned()
                    continue
                shape = tuple(int(d.dim_value) for d in dims)
            inputs[vi.name] = self.values[vi.name] = self.g.input(vi.name, tuple(shape), mg_dtype(tt.elem_type))
        unknown = set(self.input_shapes) - {vi.name for vi in self.model.graph.input}
        if unknown:
            raise ModelImportError(f"from_onnx: {self.name}: input_shapes names no input of the model",
                                   [f"{n!r}: the inputs are {[v.name for v in self.model.graph.input]}"
                                    for n in sorted(unknown)])
        return inputs

    def _weights(self):
        frozen, settings = self._frozen(), self._settings()
        for t in self.model.graph.initializer:
            arr = self.arrays[t.name]
            dt = mg_dtype(t.data_type)
            if dt.is_float and (arr is None or arr.size > 1) and t.name not in settings:
                init = None if arr is None else np.array(arr, dtype=dt.np, order="C")
                self.values[t.name] = self.g.parameter(t.name, tuple(int(d) for d in t.dims), dt, init=init,
                                                       requires_grad=t.name not in frozen)
            else:
                self.values[t.name] = arr

    # -------------------------------------------------------------- the nodes
    def run(self) -> ImportedModel:
        self._weights()
        inputs = self._inputs()
        for i, node in enumerate(self.model.graph.node):
            self._node(i, node)
        outputs, names = [], []
        for vi in self.model.graph.output:
            v = self.values.get(vi.name)
            if isinstance(v, (_Poisoned, Unavailable)) or v is None:
                continue
            outputs.append(v if isinstance(v, Tensor) else self.t(v))
            names.append(vi.name)
        if self.unsupported:
            lines = [ln for op in self.unsupported for ln in self.unsupported[op]]
            raise UnsupportedOpsError(
                f"from_onnx: {self.name} uses {len(self.unsupported)} op(s) meganeura cannot import "
                f"({', '.join(self.unsupported)})", lines + self.problems)
        if self.problems:
            raise ModelImportError(f"from_onnx: {self.name} could not be imported", self.problems)
        return ImportedModel(self.g, inputs, outputs, names, f"onnx {self.name}")

    def _where(self, i, node) -> str:
        what = f"{_op_name(node)} (node {node.name or '#' + str(i)!r})"
        for p in node.metadata_props:           # torch's exporter records the model's source line
            if p.key == "pkg.torch.onnx.stack_trace" and p.value.strip():
                return f"{what}; at {p.value.strip().splitlines()[0].strip()}"
        return what

    def _node(self, i, node):
        ins = [self.values.get(n, _Missing(n)) if n else None for n in node.input]
        bad = [v for v in ins if isinstance(v, (_Poisoned, Unavailable, _Missing))]
        op = _op_name(node)
        fn = TABLE.get(op) if node.domain in ("", "ai.onnx") else None
        known = all(v is None or _is_known(v) for v in ins)
        shape_only = op in ("Shape", "Size") and fn is not None and isinstance(ins[0], Tensor)
        if fn is None and (not (known and not bad) or op in RANDOM):
            why = "random sampling is not supported" if op in RANDOM else "no meganeura mapping"
            self.unsupported.setdefault(op, []).append(f"{self._where(i, node)}: {why}")
            return self._poison(node)
        for b in bad:
            if isinstance(b, _Missing):
                self.problems.append(f"{self._where(i, node)}: reads {b.name!r}, which no node produces")
            elif isinstance(b, Unavailable):
                self.problems.append(f"{self._where(i, node)}: reads {b.why}, which meganeura does not compute")
            if not isinstance(b, _Poisoned):
                break
        if bad:
            return self._poison(node)
        attrs = {a.name: _attr(self.onnx, a) for a in node.attribute}
        try:
            if known and not shape_only:
                outs = self._fold(node, ins)
            else:
                self.op_type, self.n_outputs = op, len(node.output)
                outs = fn(self, ins, attrs)
                outs = list(outs) if isinstance(outs, tuple) else [outs]
            for name, v in zip(node.output, outs):
                if name:
                    self.values[name] = self._check(name, v)
        except Exception as e:
            self.problems.append(f"{self._where(i, node)}: {type(e).__name__}: {e}")
            self._poison(node)

    def _fold(self, node, ins):
        from onnx.reference import ReferenceEvaluator
        feeds = {n: v for n, v in zip(node.input, ins) if n}
        ev = ReferenceEvaluator(node, opsets={"": self.opset})
        return list(ev.run(None, feeds))

    def _poison(self, node):
        for name in node.output:
            self.values[name] = _Poisoned()

    def _check(self, name, v):
        """The mapped value against ONNX shape inference (casting to ONNX's element type where
        a rule's result differs: comparisons give u32, ONNX bool)."""
        want = self.expected.get(name)
        if want is None or isinstance(v, (Unavailable, list)):
            return v
        shape, elem = want
        got = tuple(v.shape) if isinstance(v, (Tensor, np.ndarray)) else None
        if shape is not None and got is not None and got != shape:
            raise ValueError(f"output {name!r} mapped to shape {got}, ONNX shape inference gives {shape}")
        if isinstance(v, Tensor) and elem:
            dt = mg_dtype(elem)
            if v.dtype is not dt:
                return ops.ne(v, 0) if dt is u32 else ops.cast(v, dt)
        return v


class _Missing:
    def __init__(self, name):
        self.name = name


def _is_known(v) -> bool:
    if isinstance(v, list):
        return all(_is_known(a) for a in v)
    return isinstance(v, np.ndarray)


def _op_name(node) -> str:
    return node.op_type if node.domain in ("", "ai.onnx") else f"{node.domain}::{node.op_type}"


def _attr(onnx, a):
    v = onnx.helper.get_attribute_value(a)
    if isinstance(v, bytes):
        return v.decode("utf-8", "replace")
    if isinstance(v, onnx.TensorProto):
        return onnx.numpy_helper.to_array(v)
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode("utf-8", "replace") for s in v]
    return v
