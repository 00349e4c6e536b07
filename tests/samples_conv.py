"""Samples for convolution, pooling, unfold/fold and upsampling (NCHW, tiny shapes)."""
import warnings

from .opinfo import F, Sample

S = Sample


def _conv(**kw):
    return (lambda o, x, w: o.conv2d(x, w, **kw),
            lambda t, x, w: t.nn.functional.conv2d(x, w, **kw))


def _quiet(fn, *a, **kw):
    # torch warns that an even kernel with 'same' copies the input; asymmetric padding is the point here
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return fn(*a, **kw)


SAMPLES = [
    # conv2d
    S("conv2d_plain", *_conv(), [F((2, 3, 5, 5)), F((4, 3, 3, 3))]),
    S("conv2d_stride2", *_conv(stride=2), [F((1, 2, 6, 6)), F((3, 2, 3, 3))]),
    S("conv2d_pad1", *_conv(padding=1), [F((2, 2, 4, 4)), F((3, 2, 3, 3))]),
    S("conv2d_dilation2", *_conv(dilation=2, padding=1), [F((1, 2, 6, 6)), F((2, 2, 3, 3))]),
    S("conv2d_groups2", *_conv(groups=2, padding=1), [F((2, 4, 4, 4)), F((4, 2, 3, 3))]),
    S("conv2d_depthwise", *_conv(groups=3, stride=(1, 2)), [F((2, 3, 5, 5)), F((6, 1, 3, 3))]),
    S("conv2d_bias", lambda o, x, w, b: o.conv2d(x, w, b, padding=(1, 0)),
      lambda t, x, w, b: t.nn.functional.conv2d(x, w, b, padding=(1, 0)),
      [F((2, 2, 4, 5)), F((3, 2, 3, 2)), F((3,))]),
    S("conv2d_nonsquare_kernel", *_conv(stride=(2, 1)), [F((1, 2, 5, 6)), F((2, 2, 2, 3))]),
    S("conv2d_rect_input", *_conv(padding=(2, 1), dilation=(1, 2)), [F((2, 2, 3, 6)), F((2, 2, 3, 3))]),
    S("conv2d_same_even_kernel", _conv(padding="same")[0],
      lambda t, x, w: _quiet(t.nn.functional.conv2d, x, w, padding="same"), [F((1, 2, 5, 4)), F((2, 2, 2, 4))]),
    S("conv2d_valid_unbatched", *_conv(padding="valid"), [F((2, 4, 5)), F((3, 2, 2, 2))]),
    # pooling
    S("max_pool2d_2x2", lambda o, x: o.max_pool2d(x, 2), lambda t, x: t.nn.functional.max_pool2d(x, 2),
      [F((2, 3, 4, 5))]),
    S("max_pool2d_3x3_s2_p1", lambda o, x: o.max_pool2d(x, 3, 2, 1),
      lambda t, x: t.nn.functional.max_pool2d(x, 3, 2, 1), [F((2, 2, 5, 6))]),
    S("max_pool2d_dilated", lambda o, x: o.max_pool2d(x, 2, 1, 1, dilation=2),
      lambda t, x: t.nn.functional.max_pool2d(x, 2, 1, 1, dilation=2), [F((1, 2, 5, 5))]),
    S("avg_pool2d_pad_incl", lambda o, x: o.avg_pool2d(x, 3, 2, 1),
      lambda t, x: t.nn.functional.avg_pool2d(x, 3, 2, 1), [F((2, 2, 5, 6))]),
    S("avg_pool2d_pad_excl", lambda o, x: o.avg_pool2d(x, (3, 2), 1, (1, 1), count_include_pad=False),
      lambda t, x: t.nn.functional.avg_pool2d(x, (3, 2), 1, (1, 1), count_include_pad=False), [F((1, 3, 4, 5))]),
    S("avg_pool2d_2x2", lambda o, x: o.avg_pool2d(x, 2), lambda t, x: t.nn.functional.avg_pool2d(x, 2),
      [F((2, 2, 4, 6))]),
    S("avg_pool2d_divisor", lambda o, x: o.avg_pool2d(x, 2, 1, divisor_override=3),
      lambda t, x: t.nn.functional.avg_pool2d(x, 2, 1, divisor_override=3), [F((1, 2, 3, 4))]),
    S("adaptive_avg_pool2d_1", lambda o, x: o.adaptive_avg_pool2d(x, 1),
      lambda t, x: t.nn.functional.adaptive_avg_pool2d(x, 1), [F((2, 3, 4, 5))]),
    S("adaptive_avg_pool2d_2x3", lambda o, x: o.adaptive_avg_pool2d(x, (2, 3)),
      lambda t, x: t.nn.functional.adaptive_avg_pool2d(x, (2, 3)), [F((2, 2, 4, 6))]),
    S("adaptive_avg_pool2d_uneven", lambda o, x: o.adaptive_avg_pool2d(x, (3, 4)),
      lambda t, x: t.nn.functional.adaptive_avg_pool2d(x, (3, 4)), [F((2, 2, 7, 5))]),
    S("adaptive_avg_pool2d_upsampling_unbatched", lambda o, x: o.adaptive_avg_pool2d(x, (5, None)),
      lambda t, x: t.nn.functional.adaptive_avg_pool2d(x, (5, None)), [F((3, 4, 3))]),
    S("avg_pool2d_negative_divisor", lambda o, x: o.avg_pool2d(x, 2, 1, divisor_override=-2),
      lambda t, x: t.nn.functional.avg_pool2d(x, 2, 1, divisor_override=-2), [F((1, 2, 3, 4))]),
    # upsampling, unfold/fold
    S("upsample_nearest2d", lambda o, x: o.upsample_nearest2d(x, 2),
      lambda t, x: t.nn.functional.interpolate(x, scale_factor=2, mode="nearest"), [F((2, 2, 3, 4))]),
    S("upsample_nearest2d_3x2", lambda o, x: o.upsample_nearest2d(x, (3, 2)),
      lambda t, x: t.nn.functional.interpolate(x, scale_factor=(3, 2), mode="nearest"), [F((1, 2, 2, 3))]),
    S("upsample_bilinear2d_size", lambda o, x: o.upsample_bilinear2d(x, (5, 7)),
      lambda t, x: t.nn.functional.interpolate(x, size=(5, 7), mode="bilinear"), [F((2, 2, 3, 4))]),
    S("upsample_bilinear2d_align_corners", lambda o, x: o.upsample_bilinear2d(x, (4, 9), align_corners=True),
      lambda t, x: t.nn.functional.interpolate(x, size=(4, 9), mode="bilinear", align_corners=True),
      [F((1, 3, 3, 4))]),
    S("upsample_bilinear2d_scale_down_unbatched", lambda o, x: o.upsample_bilinear2d(x, scale_factor=(2.5, 0.5)),
      lambda t, x: t.nn.functional.interpolate(x[None], scale_factor=(2.5, 0.5), mode="bilinear")[0],
      [F((2, 3, 6))]),
    S("unfold", lambda o, x: o.unfold(x, (2, 3), dilation=1, padding=1, stride=2),
      lambda t, x: t.nn.functional.unfold(x, (2, 3), dilation=1, padding=1, stride=2), [F((2, 2, 5, 4))]),
    S("fold", lambda o, c: o.fold(c, (4, 5), 2, dilation=(1, 2), padding=1, stride=(2, 1)),
      lambda t, c: t.nn.functional.fold(c, (4, 5), 2, dilation=(1, 2), padding=1, stride=(2, 1)),
      [F((2, 8, 15))]),
    # composed
    S("conv_relu_max_pool", lambda o, x, w, b: o.max_pool2d(o.relu(o.conv2d(x, w, b, padding=1)), 2),
      lambda t, x, w, b: t.nn.functional.max_pool2d(t.relu(t.nn.functional.conv2d(x, w, b, padding=1)), 2),
      [F((2, 2, 4, 4)), F((3, 2, 3, 3)), F((3,))]),
]
