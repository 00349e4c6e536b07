"""Every kind of ValueError / NotImplementedError that the ops raise for an argument they
refuse: the message names the op and the argument (so a PyTorch user knows what to change).
One row per message kind in src/meganeura/ops/*.py."""
import numpy as np
import pytest

import meganeura as mg

O = mg.ops


def _x(g, shape=(1, 2, 4, 4)):
    return g.input("x", shape)


CASES = [  # (id, build(g), exception, message pattern)
    # arguments we do not support (torch does): NotImplementedError naming the argument
    ("sdpa_dropout", lambda g: O.scaled_dot_product_attention(*(g.input(n, (1, 2, 3)) for n in "qkv"), dropout_p=0.1),
     NotImplementedError, r"scaled_dot_product_attention: dropout is not supported \(dropout_p=0.1\)"),
    ("max_pool2d_indices_plane", lambda g: O.max_pool2d(_x(g, (1, 1, 4097, 4097)), 1, return_indices=True),
     ValueError, r"max_pool2d: return_indices needs an input plane of at most 2\*\*24 elements, got 4097\*4097"),
    ("upsample_fractional_scale", lambda g: O.upsample_nearest2d(_x(g), 1.5),
     NotImplementedError, r"upsample_nearest2d: scale_factor must be a positive integer.*1\.5"),
    ("embedding_max_norm", lambda g: O.embedding(g.input("i", (2,), mg.i32), g.input("w", (3, 2)), max_norm=1.0),
     NotImplementedError, r"embedding: max_norm is not supported \(max_norm=1.0\)"),
    ("embedding_scale_grad_by_freq",
     lambda g: O.embedding(g.input("i", (2,), mg.i32), g.input("w", (3, 2)), scale_grad_by_freq=True),
     NotImplementedError, r"embedding: scale_grad_by_freq=True is not supported"),
    # arguments torch refuses too: ValueError naming the argument and the bad value
    ("conv2d_stride_triple", lambda g: O.conv2d(_x(g), g.input("w", (1, 2, 3, 3)), stride=(1, 2, 3)),
     ValueError, r"conv2d: stride must be an int or a pair of ints, got \(1, 2, 3\)"),
    ("conv2d_dilation_zero", lambda g: O.conv2d(_x(g), g.input("w", (1, 2, 3, 3)), dilation=0),
     ValueError, r"conv2d: dilation must be >= 1, got \(0, 0\)"),
    ("conv2d_same_strided", lambda g: O.conv2d(_x(g), g.input("w", (1, 2, 3, 3)), stride=2, padding="same"),
     ValueError, r"conv2d: padding='same' needs stride 1, got stride \(2, 2\)"),
    ("conv2d_padding_word", lambda g: O.conv2d(_x(g), g.input("w", (1, 2, 3, 3)), padding="full"),
     ValueError, r"conv2d: padding must be an int, a pair, 'same' or 'valid', got 'full'"),
    ("conv2d_groups_zero", lambda g: O.conv2d(_x(g), g.input("w", (1, 2, 3, 3)), groups=0),
     ValueError, r"conv2d: groups must be a positive int, got 0"),
    ("conv1d_stride_pair", lambda g: O.conv1d(_x(g, (1, 2, 5)), g.input("w", (1, 2, 3)), stride=(1, 2)),
     ValueError, r"conv1d: stride must be an int or a 1-tuple, got \(1, 2\)"),
    ("conv1d_dilation_zero", lambda g: O.conv1d(_x(g, (1, 2, 5)), g.input("w", (1, 2, 3)), dilation=0),
     ValueError, r"conv1d: dilation must be >= 1, got 0"),
    ("conv1d_negative_padding", lambda g: O.conv1d(_x(g, (1, 2, 5)), g.input("w", (1, 2, 3)), padding=-1),
     ValueError, r"conv1d: padding must be >= 0, got -1"),
    ("conv1d_same_strided", lambda g: O.conv1d(_x(g, (1, 2, 5)), g.input("w", (1, 2, 3)), stride=2, padding="same"),
     ValueError, r"conv1d: padding='same' needs stride 1, got stride 2"),
    ("conv1d_padding_word", lambda g: O.conv1d(_x(g, (1, 2, 5)), g.input("w", (1, 2, 3)), padding="full"),
     ValueError, r"conv1d: padding must be an int, a 1-tuple, 'same' or 'valid', got 'full'"),
    ("conv1d_groups_zero", lambda g: O.conv1d(_x(g, (1, 2, 5)), g.input("w", (1, 2, 3)), groups=0),
     ValueError, r"conv1d: groups must be a positive int, got 0"),
    ("unfold_kernel_zero", lambda g: O.unfold(_x(g), 0),
     ValueError, r"unfold: kernel_size must be >= 1, got \(0, 0\)"),
    ("fold_output_size_triple", lambda g: O.fold(g.input("c", (1, 8, 4)), (3, 3, 3), 2),
     ValueError, r"fold: output_size must be an int or a pair of ints, got \(3, 3, 3\)"),
    ("max_pool2d_negative_padding", lambda g: O.max_pool2d(_x(g), 2, padding=-1),
     ValueError, r"max_pool2d: padding must be >= 0, got \(-1, -1\)"),
    ("avg_pool2d_divisor_zero", lambda g: O.avg_pool2d(_x(g), 2, divisor_override=0),
     ValueError, r"avg_pool2d: divisor_override must be a nonzero int, got 0"),
    ("upsample_bilinear2d_size_and_scale", lambda g: O.upsample_bilinear2d(_x(g), 4, scale_factor=2),
     ValueError, r"upsample_bilinear2d: give exactly one of size and scale_factor, got size=4, scale_factor=2"),
    ("upsample_bilinear2d_empty_output", lambda g: O.upsample_bilinear2d(_x(g), scale_factor=0.2),
     ValueError, r"upsample_bilinear2d: the output size must be two positive ints, got \(0, 0\)"),
    ("adaptive_avg_pool2d_zero", lambda g: O.adaptive_avg_pool2d(_x(g), (0, 2)),
     ValueError, r"adaptive_avg_pool2d: output_size must be a positive int or pair, got \(0, 2\)"),
    ("gelu_approximate", lambda g: O.gelu(_x(g), approximate="fast"),
     ValueError, r"gelu: approximate must be 'none' or 'tanh', got 'fast'"),
    ("clamp_no_bounds", lambda g: O.clamp(_x(g)), ValueError, r"clamp: give min and/or max"),
    ("cross_entropy_smoothing", lambda g: O.cross_entropy(g.input("x", (2, 3)), g.input("y", (2,), mg.i32),
                                                          label_smoothing=1.5),
     ValueError, r"cross_entropy: label_smoothing must be in \[0, 1\], got 1.5"),
    ("cross_entropy_weighted_smoothing",
     lambda g: O.cross_entropy(g.input("x", (2, 3)), g.input("y", (2,), mg.i32), g.input("w", (3,)),
                               label_smoothing=-0.1),
     ValueError, r"cross_entropy: label_smoothing must be in \[0, 1\], got -0.1"),
    ("cross_entropy_reduction", lambda g: O.cross_entropy(g.input("x", (2, 3)), g.input("y", (2,), mg.i32),
                                                          reduction="avg"),
     ValueError, r"cross_entropy: reduction must be one of .*'mean'.*, got 'avg'"),
    ("mse_loss_reduction", lambda g: O.mse_loss(_x(g), g.input("y", (1, 2, 4, 4)), reduction="avg"),
     ValueError, r"mse_loss: reduction must be one of .*'mean'.*, got 'avg'"),
    ("batch_norm_eval_without_stats", lambda g: O.batch_norm(_x(g), None, None),
     ValueError, r"batch_norm: eval mode \(training=False\) needs running_mean and running_var"),
    ("div_rounding_mode", lambda g: O.div(_x(g), 2.0, rounding_mode="ceil"),
     ValueError, r"div: rounding_mode must be None, 'trunc' or 'floor', got 'ceil'"),
    ("pad_mode", lambda g: O.pad(_x(g), (1, 1), mode="wrap"),
     ValueError, r"pad: mode must be 'constant', 'reflect', 'replicate' or 'circular', got 'wrap'"),
    ("pad_value_with_reflect", lambda g: O.pad(_x(g), (1, 1), mode="reflect", value=2.0),
     ValueError, r"pad: value is for mode 'constant', not 'reflect'"),
    ("getitem_two_index_lists", lambda g: O.getitem(_x(g), ([0, 0], [1, 0])),
     NotImplementedError, r"getitem: 2 list/tensor indices in one subscript"),
    ("concat_nothing", lambda g: O.concat([]), ValueError, r"concat: needs at least one tensor"),
    ("stack_nothing", lambda g: O.stack([]), ValueError, r"stack: needs at least one tensor"),
    ("quantized_linear_qtype", lambda g: O.quantized_linear(g.input("x", (1, 32)), g.input("w", (9,), mg.u32), "IQ2_XS", 1, 32),
     ValueError, r"quantized_linear: qtype must be one of 'Q8_0', 'Q4_0', .*'Q6_K' \(GGUF block types\), got 'IQ2_XS'"),
    ("dequantize_features", lambda g: O.dequantize(g.input("w", (9,), mg.u32), "Q8_0", 0, 32),
     ValueError, r"dequantize: out_features must be a positive int, got 0"),
    # shape errors that name the argument (enable_gqa: each of key and value must divide the query heads)
    ("sdpa_gqa_value_heads", lambda g: O.scaled_dot_product_attention(
        g.input("q", (1, 6, 3, 4)), g.input("k", (1, 2, 5, 4)), g.input("v", (1, 4, 5, 4)), enable_gqa=True),
     mg.ShapeError, r"enable_gqa: query heads \(6\) must be a multiple of value heads \(4\).*'v'"),
    ("sdpa_gqa_key_heads", lambda g: O.scaled_dot_product_attention(
        g.input("q", (1, 6, 3, 4)), g.input("k", (1, 4, 5, 4)), g.input("v", (1, 2, 5, 4)), enable_gqa=True),
     mg.ShapeError, r"enable_gqa: query heads \(6\) must be a multiple of key heads \(4\).*'k'"),
    ("index_select_2d_index", lambda g: O.index_select(_x(g), 0, g.input("i", (1, 1), mg.i32)),
     mg.ShapeError, r"index_select: index must be 1-D \(or 0-d\)"),
]


@pytest.mark.parametrize("build,exc,pattern", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_refused_argument_is_named(build, exc, pattern):
    with pytest.raises(exc, match=pattern):
        build(mg.Graph())


def test_every_raise_in_ops_has_a_case():
    """Counts the ValueError / NotImplementedError raises in the op builders, so a new
    message kind comes with a row above (the 3 internal ones: registry misuse and a
    broadcast probe, are not user errors)."""
    import pathlib
    import re
    src = pathlib.Path(mg.ops.__file__).parent
    n = sum(len(re.findall(r"raise (?:ValueError|NotImplementedError)\(", p.read_text())) for p in src.glob("*.py"))
    # registry: registered twice, vjp missing, two graphs; attention and its gradient: the input count;
    # im2col's fold_batch form (a lowering, never built by a user)
    internal = 6
    kinds = sum(1 for c in CASES if c[2] in (ValueError, NotImplementedError))
    # one builder message kind can be raised from two places (cross_entropy's label_smoothing, the
    # _pair helper's two checks shared by every conv/pool/fold argument); rows cover each place
    assert n - internal <= kinds, f"{n - internal} raises in mg.ops, {kinds} rows: add a row for the new one"


def test_batch_norm_module_momentum_none_is_a_cumulative_average():
    """torch's momentum=None: the k-th training call weighs its batch statistics by 1/k."""
    torch = pytest.importorskip("torch")
    tb = torch.nn.BatchNorm1d(3, momentum=None)
    ob = mg.nn.BatchNorm1d(3, momentum=None)
    f = mg.jit(ob, backend="numpy")
    rng = np.random.default_rng(2)
    for i in range(3):
        x = (rng.standard_normal((4, 3)) * (i + 1) + i).astype(np.float32)
        np.testing.assert_allclose(f(x), tb(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
    st = f.state_dict()
    np.testing.assert_allclose(st["running_mean"], tb.running_mean.numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(st["running_var"], tb.running_var.numpy(), rtol=1e-5)
    assert int(st["num_batches_tracked"]) == int(tb.num_batches_tracked) == 3
    ob.eval()
    tb.eval()
    x = rng.standard_normal((2, 3)).astype(np.float32)
    np.testing.assert_allclose(f(x), tb(torch.tensor(x)).detach().numpy(), rtol=1e-4, atol=1e-5)
