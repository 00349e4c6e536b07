"""``from_torch``: a torch.nn.Module through ``torch.export`` onto a meganeura graph.

The module is exported (non-strict by default), decomposed to the core ATen op set, and
its nodes are walked in order: parameters and buffers become graph parameters under
their ``state_dict`` names, user inputs become graph inputs, and each call maps through
the ATen table (aten_ops). A node whose inputs are all constants (no model input or
weight reaches it: attention masks, position ids, rotary tables) is computed by torch
here and becomes a constant, as torch would compute it on every call. Every node that
cannot be mapped is collected, and the import fails once with all of them.
"""
from __future__ import annotations

import numpy as np

from .. import ops
from ..graph import Graph, Tensor, f16, f32, i32, u32
from .aten_ops import TABLE
from .errors import ModelImportError, Unavailable, UnsupportedOpsError
from .imported import ImportedModel

# nodes that check or annotate and compute nothing
SKIPPED = {"aten._assert_tensor_metadata.default", "aten._assert_scalar.default", "aten.sym_constrain_range.default",
           "aten.sym_constrain_range_for_size.default", "aten._assert_async.msg"}


def from_torch(module, example_inputs, example_kwargs=None, *, training=False, strict=False) -> ImportedModel:
    """Import ``module`` called on ``example_inputs`` (a tensor or a tuple of them; keyword
    inputs in ``example_kwargs``) at those shapes. ``training=True`` exports the module in
    training mode (batch norm normalises with the batch's statistics and the graph updates
    its running statistics on every training step); else eval mode. The module's own
    mode is restored afterwards."""
    import torch
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"from_torch: expected a torch.nn.Module, got {type(module).__name__}")
    args = tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else (example_inputs,)
    name = type(module).__name__
    was_training = module.training
    module.train(bool(training))
    try:
        try:
            ep = torch.export.export(module, args, dict(example_kwargs or {}), strict=strict)
        except Exception as e:          # torch's own message names the cause; its traceback is torch's
            raise ModelImportError(f"from_torch: torch.export could not export {name}", [_first_lines(e)]) from None
        try:
            ep = ep.run_decompositions()
        except Exception as e:
            raise ModelImportError(f"from_torch: torch could not decompose {name} to core ATen ops",
                                   [_first_lines(e)]) from None
    finally:
        module.train(was_training)
    return _Translator(ep, name).run()


def _first_lines(e, n=6):
    text = f"{type(e).__name__}: {e}".strip().splitlines()
    return "\n    ".join(text[:n]) + (" ..." if len(text) > n else "")


def _where(node) -> str:
    """The innermost frame of the node's stack trace: the model's own line."""
    st = node.meta.get("stack_trace") or ""
    lines = [ln.strip() for ln in st.strip().splitlines() if ln.strip()]
    frames = [i for i, ln in enumerate(lines) if ln.startswith("File ")]
    if not frames:
        return "no stack trace"
    i = frames[-1]
    return " ".join(lines[i:i + 2])


def mg_dtype(dt):
    import torch
    if dt in (torch.float16,):
        return f16
    if dt.is_floating_point:
        return f32
    if dt == torch.bool or dt == torch.uint8:
        return u32
    return i32


def to_numpy(t) -> np.ndarray:
    import torch
    t = t.detach().cpu()
    if t.dtype == torch.bfloat16:
        t = t.float()
    return t.numpy()


class _Poisoned:
    """The value of a node that failed: nodes reading it fail without a second report."""


class _Translator:
    def __init__(self, ep, name):
        self.ep, self.name = ep, name
        self.g = Graph()
        self.float_dtype = f32
        self.values: dict = {}
        self.problems: list[str] = []
        self.unsupported: dict = {}       # target -> [problem lines]
        self._consts: dict = {}

    # ------------------------------------------------------------------ helpers for rules
    def dtype(self, torch_dtype):
        return mg_dtype(torch_dtype)

    def t(self, value, like=None) -> Tensor:
        """A torch constant (or number) as a graph constant, in ``like``'s float dtype."""
        import torch
        if isinstance(value, Tensor):
            return value
        if not isinstance(value, torch.Tensor):
            value = torch.tensor(value)
        key = id(value)
        hit = self._consts.get(key)
        if hit is not None and hit[0] is value:
            return hit[1]
        dt = mg_dtype(value.dtype)
        if dt.is_float and like is not None and like.dtype.is_float:
            dt = like.dtype
        c = self.g.constant(to_numpy(value), dt)
        self._consts[key] = (value, c)
        return c

    # ------------------------------------------------------------------ the walk
    def run(self) -> ImportedModel:
        import torch
        from torch.export.graph_signature import InputKind, OutputKind
        ep, sig = self.ep, self.ep.graph_signature
        mutated = {spec.target for spec in sig.output_specs if spec.kind == OutputKind.BUFFER_MUTATION}
        kinds = {spec.arg.name: spec for spec in sig.input_specs if hasattr(spec.arg, "name")}
        inputs = {}
        for node in ep.graph.nodes:
            if node.op == "placeholder":
                spec = kinds[node.name]
                self.values[node] = v = self._placeholder(node, spec, mutated, InputKind)
                if spec.kind == InputKind.USER_INPUT and isinstance(v, Tensor):
                    inputs[v.name] = v
            elif node.op == "call_function":
                self.values[node] = self._call(node)
            elif node.op == "output":
                outputs, names = self._outputs(node, sig, OutputKind)
        if self.unsupported:
            lines = [ln for target in self.unsupported for ln in self.unsupported[target]]
            raise UnsupportedOpsError(
                f"from_torch: {self.name} uses {len(self.unsupported)} op(s) meganeura cannot import "
                f"({', '.join(self.unsupported)})", lines + self.problems)
        if self.problems:
            raise ModelImportError(f"from_torch: {self.name} could not be imported", self.problems)
        return ImportedModel(self.g, inputs, outputs, names, f"torch {self.name}")

    def _placeholder(self, node, spec, mutated, InputKind):
        import torch
        ep = self.ep
        if spec.kind == InputKind.USER_INPUT:
            val = node.meta.get("val")
            if not isinstance(val, torch.Tensor):
                return val          # a Python constant argument, as exported
            shape = self._static_shape(node, val)
            return self.g.input(node.name, shape, mg_dtype(val.dtype))
        fqn = spec.target
        if spec.kind == InputKind.PARAMETER:
            p = ep.state_dict[fqn]
            return self.g.parameter(fqn, tuple(p.shape), mg_dtype(p.dtype), init=to_numpy(p),
                                    requires_grad=bool(p.requires_grad))
        if spec.kind == InputKind.BUFFER and spec.persistent:
            b = ep.state_dict[fqn]
            arr = to_numpy(b).astype(mg_dtype(b.dtype).np)
            if fqn in mutated:              # updated by training steps (batch norm's running statistics)
                return self.g.state(fqn, tuple(b.shape), mg_dtype(b.dtype), init=arr)
            return self.g.parameter(fqn, tuple(b.shape), mg_dtype(b.dtype), init=arr, requires_grad=False)
        # non-persistent buffers and lifted constants: fixed values, folded where possible
        value = ep.constants.get(fqn)
        if value is None:
            value = ep.state_dict.get(fqn)
        return value

    def _static_shape(self, node, val):
        shape = []
        for s in val.shape:
            if not isinstance(s, int):
                self.problems.append(f"input {node.name!r}: dimension {s} is dynamic (torch.export.Dim); "
                                     "export at fixed shapes, one import per shape")
                return tuple(1 for _ in val.shape)
            shape.append(s)
        return tuple(shape)

    def _map_args(self, node):
        from torch.fx.node import map_aggregate
        bad = []

        def one(a):
            if hasattr(a, "op") and hasattr(a, "target"):      # an fx Node
                v = self.values[a]
                if isinstance(v, (_Poisoned, Unavailable)):
                    bad.append(v)
                return v
            return a
        args = map_aggregate(node.args, one)
        kwargs = map_aggregate(node.kwargs, one)
        return args, kwargs, bad

    def _call(self, node):
        import operator

        import torch
        target = str(node.target)
        args, kwargs, bad = self._map_args(node)
        if node.target is operator.getitem:
            if bad:
                return bad[0] if isinstance(bad[0], _Poisoned) else bad[0]
            return args[0][args[1]]
        if target in SKIPPED:
            return None
        fn = TABLE.get(target)
        flat = torch.utils._pytree.tree_leaves((args, kwargs))
        if fn is None and (bad or any(isinstance(a, Tensor) for a in flat)):
            # reported even where an input failed already: every unsupported node at once
            self.unsupported.setdefault(target, []).append(
                f"{target} (node {node.name}): no meganeura mapping; at {_where(node)}")
            return _Poisoned()
        if bad:
            for b in bad:
                if isinstance(b, Unavailable):
                    self.problems.append(f"{target} (node {node.name}): reads {b.why}, which meganeura does not "
                                         f"compute; at {_where(node)}")
                    break
            return _Poisoned()
        if not any(isinstance(a, Tensor) for a in flat):
            try:                    # every input is a constant: torch computes it here
                return node.target(*args, **kwargs)
            except Exception as e:
                self.problems.append(f"{target} (node {node.name}): folding its constant inputs failed: "
                                     f"{_first_lines(e, 2)}; at {_where(node)}")
                return _Poisoned()
        try:
            self.target, self.node = target, node
            out = fn(self, *args, **kwargs)
            return self._check(node, out)
        except Exception as e:
            self.problems.append(f"{target} (node {node.name}): {type(e).__name__}: {e}; at {_where(node)}")
            return _Poisoned()

    def _check(self, node, out):
        """The mapped value against torch's own shape and dtype for the node (casting to
        torch's dtype where a rule's result differs: comparisons, promotions)."""
        import torch
        val = node.meta.get("val")
        if isinstance(out, tuple) and isinstance(val, (tuple, list)):
            return tuple(self._check_one(node, o, v) for o, v in zip(out, val)) + out[len(val):]
        return self._check_one(node, out, val)

    def _check_one(self, node, out, val):
        import torch
        if not isinstance(out, Tensor) or not isinstance(val, torch.Tensor):
            return out
        if tuple(out.shape) != tuple(int(s) for s in val.shape):
            raise ValueError(f"mapped to shape {out.shape}, torch gives {tuple(val.shape)}")
        want = mg_dtype(val.dtype)
        return out if out.dtype is want else ops.cast(out, want)

    def _outputs(self, node, sig, OutputKind):
        import torch
        outs, names = [], []
        user_names = self._output_names(sum(1 for s in sig.output_specs if s.kind == OutputKind.USER_OUTPUT))
        k = 0
        for spec, arg in zip(sig.output_specs, node.args[0]):
            v = self.values[arg] if hasattr(arg, "op") else arg
            if isinstance(v, (_Poisoned, Unavailable)):
                continue
            if spec.kind == OutputKind.BUFFER_MUTATION:
                st = self.g.states.get(spec.target)
                if st is not None and isinstance(v, Tensor):
                    self.g.update(st, v if v.dtype is st.dtype else ops.cast(v, st.dtype))
                continue
            if spec.kind != OutputKind.USER_OUTPUT:
                self.problems.append(f"output {spec.arg.name!r}: {spec.kind.name} outputs are not supported")
                continue
            name = user_names[k]
            k += 1
            if v is None:
                continue
            if isinstance(v, torch.Tensor):
                v = self.t(v)
            if isinstance(v, Tensor):
                outs.append(v)
                names.append(name)
        return outs, names

    def _output_names(self, n):
        """Output names from the module's output structure (``last_hidden_state``, ``0``)."""
        import torch.utils._pytree as pytree
        try:
            tree = pytree.tree_unflatten(list(range(n)), self.ep.call_spec.out_spec)
            pairs = pytree.tree_flatten_with_path(tree)[0]
            return [pytree.keystr(path).strip(".[]'\"") or f"output_{i}" for i, (path, _) in enumerate(pairs)]
        except Exception:       # an output structure pytree cannot rebuild: positions
            return [f"output_{i}" for i in range(n)]
