"""Writes docs/ops.md: every public function of ``mg.ops`` with its PyTorch equivalent.
Run ``python docs/ops_table.py``; tests/test_docs.py checks the page is current."""
import inspect
import pathlib

import meganeura as mg

# our name -> (PyTorch equivalent, note); anything exposed must be listed here
TORCH = {
    "abs": ("torch.abs", ""), "add": ("torch.add / +", ""), "sub": ("torch.sub / -", ""),
    "mul": ("torch.mul / *", ""), "div": ("torch.div / /", ""), "neg": ("torch.neg / unary -", ""),
    "pow": ("torch.pow / **", "tensor exponents need a positive base"), "square": ("torch.square", ""),
    "exp": ("torch.exp", ""), "log": ("torch.log", ""), "sqrt": ("torch.sqrt", ""), "rsqrt": ("torch.rsqrt", ""),
    "erf": ("torch.erf", ""), "sign": ("torch.sign", ""), "tanh": ("torch.tanh", ""),
    "sigmoid": ("torch.sigmoid", ""), "relu": ("F.relu", ""), "gelu": ("F.gelu", "approximate='none' or 'tanh'"),
    "silu": ("F.silu", ""), "maximum": ("torch.maximum", ""), "minimum": ("torch.minimum", ""),
    "clamp": ("torch.clamp", "number or tensor bounds"), "clip": ("torch.clip", ""),
    "eq": ("torch.eq / ==", "u32 result"), "ne": ("torch.ne", "u32 result"), "lt": ("torch.lt / <", "u32 result"),
    "le": ("torch.le / <=", "u32 result"), "gt": ("torch.gt / >", "u32 result"), "ge": ("torch.ge / >=", "u32 result"),
    "where": ("torch.where", "condition is an integer mask"), "cast": ("Tensor.to(dtype)", "f32, f16, i32, u32"),
    "stop_gradient": ("Tensor.detach", ""), "detach": ("Tensor.detach", ""),
    "ema": ("exp_avg.mul_(b).add_(g, alpha=c) in torch.optim", "x * b + g * c; no gradient"),
    "ema_sq": ("exp_avg_sq.mul_(b).addcmul_(g, g, value=c)", "v * b + g * g * c; no gradient"),
    "adam_step": ("p.addcdiv_(m, v.sqrt() * i + eps, value=-s)", "Adam's update; no gradient"),
    "sum": ("torch.sum", ""), "mean": ("torch.mean", ""), "reduce_sum": ("torch.sum", "sorted dim tuple"),
    "amax": ("torch.amax", ""), "amin": ("torch.amin", ""),
    "max": ("torch.max", "(values, indices) along a dim, i32 indices; elementwise with a tensor"),
    "min": ("torch.min", "(values, indices) along a dim, i32 indices; elementwise with a tensor"),
    "var": ("torch.var", "correction / unbiased"), "std": ("torch.std", "correction / unbiased"),
    "reshape": ("torch.reshape", ""), "flatten": ("torch.flatten", ""), "squeeze": ("torch.squeeze", ""),
    "unsqueeze": ("torch.unsqueeze", ""), "permute": ("torch.permute", ""), "transpose": ("torch.transpose", ""),
    "slice": ("x[..., a:b:s]", "positive steps"), "getitem": ("x[idx]", "ints, slices, None, Ellipsis"),
    "concat": ("torch.cat", ""), "cat": ("torch.cat", ""), "stack": ("torch.stack", ""),
    "split": ("torch.split", ""), "chunk": ("torch.chunk", ""), "broadcast_to": ("torch.broadcast_to", ""),
    "expand": ("Tensor.expand", ""), "broadcast_tensors": ("torch.broadcast_tensors", ""),
    "gather": ("torch.gather", "one-hot product: O(out x size of dim)"), "index_select": ("torch.index_select", "1-D or 0-d index"),
    "matmul": ("torch.matmul / @", ""), "mm": ("torch.mm", "with transpose flags ta / tb"),
    "linear": ("F.linear", ""), "softmax": ("F.softmax", ""), "safe_softmax": ("F.softmax", "rows of only -inf give 0, not nan"), "log_softmax": ("F.log_softmax", ""),
    "cross_entropy": ("F.cross_entropy", "class indices or probabilities, weights, ignore_index, label smoothing"),
    "mse_loss": ("F.mse_loss", ""), "one_hot": ("F.one_hot", "num_classes required; float result"),
    "embedding": ("F.embedding", "no max_norm or scale_grad_by_freq"), "embedding_grad": ("(the gradient of F.embedding)", ""),
    "layer_norm": ("F.layer_norm", ""), "rms_norm": ("F.rms_norm", ""), "group_norm": ("F.group_norm", ""),
    "batch_norm": ("F.batch_norm", "running statistics updated as graph state"),
    "batch_norm_stats": ("(batch mean and unbiased variance)", ""), "rope": ("(Llama rotary embedding)", ""),
    "rotate_half": ("(Llama's rotate_half: cat(-x2, x1))", ""),
    "scaled_dot_product_attention": ("F.scaled_dot_product_attention", "batch dims broadcast; enable_gqa (key and value heads may differ); no dropout"),
    "conv1d": ("F.conv1d", ""), "conv2d": ("F.conv2d", ""), "max_pool2d": ("F.max_pool2d", "ceil_mode; return_indices"),
    "avg_pool2d": ("F.avg_pool2d", "ceil_mode"), "adaptive_avg_pool2d": ("F.adaptive_avg_pool2d", "uneven windows too"),
    "upsample_nearest2d": ("F.interpolate(mode='nearest')", "integer scale factors"),
    "upsample_bilinear2d": ("F.interpolate(mode='bilinear')", "size or scale factor; align_corners"),
    "unfold": ("F.unfold", ""), "fold": ("F.fold", ""),
    "sin": ("torch.sin", ""), "cos": ("torch.cos", ""), "reciprocal": ("torch.reciprocal", ""),
    "log1p": ("torch.log1p", "a Taylor polynomial below |x| = 0.01 on the GPU"),
    "expm1": ("torch.expm1", "a Taylor polynomial below |x| = 0.01 on the GPU"),
    "floor": ("torch.floor", ""), "ceil": ("torch.ceil", ""), "trunc": ("torch.trunc", ""),
    "round": ("torch.round", "half to even; decimals"), "clamp_min": ("torch.clamp_min", ""),
    "clamp_max": ("torch.clamp_max", ""), "softplus": ("F.softplus", "beta, threshold"),
    "leaky_relu": ("F.leaky_relu", ""), "hardsigmoid": ("F.hardsigmoid", ""), "hardswish": ("F.hardswish", ""), "masked_fill": ("Tensor.masked_fill", "number or 0-d tensor value"),
    "tril": ("torch.tril", ""), "triu": ("torch.triu", ""), "flip": ("torch.flip", ""), "roll": ("torch.roll", ""),
    "repeat": ("Tensor.repeat", ""), "pad": ("F.pad", "constant, reflect, replicate, circular"),
    "cumsum": ("torch.cumsum", "log2(n) shifted adds"), "prod": ("torch.prod", "pairwise halving"),
    "logsumexp": ("torch.logsumexp", ""), "argmax": ("torch.argmax", "i32 indices"),
    "argmin": ("torch.argmin", "i32 indices"),
    "quantized_linear": ("F.linear(x, dequantized W, bias)", "W kept as GGUF Q8_0, Q4_0/1, Q5_0/1 or Q2_K .. Q6_K blocks in u32 words, "
                         "dequantized in the loads; gradient to x only"),
    "quantized_embedding": ("F.embedding(ids, dequantized W)", "W kept as GGUF Q8_0, Q4_0/1, Q5_0/1 or Q2_K .. Q6_K blocks in u32 words; "
                            "a bad id gives a zero row on the GPU; no gradient"),
    "dequantize": ("gguf.quants.dequantize", "Q8_0, Q4_0/1, Q5_0/1 or Q2_K .. Q6_K blocks in u32 words to the f32 weight; no gradient"),
}
INTERNAL = {"emit", "register"}


def public_ops():
    return sorted(n for n in dir(mg.ops) if not n.startswith("_") and inspect.isfunction(getattr(mg.ops, n))
                  and n not in INTERNAL)


def render():
    rows = []
    for n in public_ops():
        torch_name, note = TORCH[n]
        doc = (inspect.getdoc(getattr(mg.ops, n)) or "").split("\n")[0]
        rows.append(f"| `mg.ops.{n}` | `{torch_name}` | {note or doc} |")
    return ("# Ops and their PyTorch equivalents\n\n"
            "Every public function of `mg.ops` (`F` is `torch.nn.functional`). Each is checked against PyTorch\n"
            "on both backends by the sample table in `tests/samples_*.py`. Generated by `docs/ops_table.py`.\n\n"
            "| meganeura | PyTorch | notes |\n|---|---|---|\n" + "\n".join(rows) + "\n")


if __name__ == "__main__":
    out = pathlib.Path(__file__).with_name("ops.md")
    out.write_text(render())
    print(f"wrote {out} ({len(public_ops())} ops)")
