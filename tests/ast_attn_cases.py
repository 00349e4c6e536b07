"""Kernels of the gather and attention archetypes (one-row attention, flash forward, its
split and combine, flash backward) from small graphs of many shapes and options, for the
tests that check the kernel AST's WGSL and GLSL against their golden digests (recorded as
the templates and the translator wrote them)."""
import contextlib
import os

import numpy as np

import meganeura as mg
from meganeura.compiler import CompileOptions, compile_plan

# (q shape, k shape, v width, mask kind, causal, gqa)
SDPA = {
    "decode_gqa_float_mask": ((1, 6, 1, 16), (1, 2, 40, 16), 16, "float", False, True),
    "prefill_causal": ((2, 3, 5, 8), (2, 3, 7, 8), 12, None, True, False),
    "int_mask_odd_dims": ((1, 2, 3, 5), (1, 2, 30, 5), 40, "int", False, False),
    "batch_dims_float_mask": ((2, 2, 2, 4, 8), (2, 2, 2, 9, 8), 8, "float", False, False),
    "d64_partial_tiles": ((1, 2, 70, 64), (1, 2, 130, 64), 64, None, False, False),
    "causal_lq_lt_lk_odd_d": ((2, 1, 40, 5), (2, 1, 150, 5), 7, None, True, False),
    "gqa_causal_odd_d": ((1, 4, 70, 33), (1, 2, 50, 33), 70, None, True, True),
    "wide_d130_dv200_mask": ((1, 1, 20, 130), (1, 1, 70, 130), 200, "float", False, False),
    "d256_int_mask": ((1, 1, 9, 256), (1, 1, 70, 256), 256, "int", False, False),
    "single_key": ((1, 1, 3, 4), (1, 1, 1, 4), 1, None, False, False),
}


@contextlib.contextmanager
def _env(**kv):
    old = {k: os.environ.get(k) for k in kv}
    os.environ.update({k: str(v) for k, v in kv.items() if v is not None})
    for k, v in kv.items():
        if v is None:
            os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _sdpa(name, epilogue=False):
    qs, ks, dv, mask, causal, gqa = SDPA[name]
    g = mg.Graph()
    q, k = g.input("q", qs), g.input("k", ks)
    v = g.input("v", ks[:-1] + (dv,))
    m = None
    if mask == "float":
        m = g.input("m", (qs[-2], ks[-2]))
    elif mask == "int":
        m = g.input("m", qs[:-1] + (ks[-2],), mg.i32)
    out = mg.ops.scaled_dot_product_attention(q, k, v, m, is_causal=causal, enable_gqa=gqa)
    if epilogue:
        out = out * 2.0
    return g, (q, k, v), out


def _plans(flash_only, split=None, smem=None):
    from meganeura.codegen import attention as attn
    saved = attn.MAX_ROW_WORK, attn.ACCELERATED_MAX_ROW_WORK
    env = {"MEGANEURA_FLASH_SPLIT": split, "MEGANEURA_FLASH_SMEM": smem}
    try:
        if flash_only:
            attn.MAX_ROW_WORK = attn.ACCELERATED_MAX_ROW_WORK = 0
        with _env(**env):
            for name in SDPA:
                for epi in (False, True):
                    g, (q, k, v), out = _sdpa(name, epi)
                    yield f"{name}{'+epi' if epi else ''}", compile_plan([out], options=CompileOptions(max_bindings=32))
                g, (q, k, v), out = _sdpa(name)
                grads = mg.grad(mg.ops.sum(out * out), [q, k, v])
                yield f"{name}+grad", compile_plan([out] + grads, n_forward=1, options=CompileOptions(max_bindings=32))
    finally:
        attn.MAX_ROW_WORK, attn.ACCELERATED_MAX_ROW_WORK = saved


def attention_kernels():
    """{label: kernel} of every distinct attention-archetype kernel of the SDPA cases: the
    one-row kernel, the flash forward (with its LSE, split over keys, 48 KiB tiles), the
    combine and the backward (dq, dkv, split, resident operands)."""
    found, seen = {}, set()
    configs = [("short", False, None, None), ("flash", True, None, None), ("split2", True, "2", None),
               ("split3", True, "3", None), ("smem48k", True, None, "49152"), ("smem48k_split2", True, "2", "49152")]
    for tag, flash_only, split, smem in configs:
        for label, kp in _plans(flash_only, split, smem):
            for j, d in enumerate(kp.dispatches):
                if d.kernel.archetype == "attention" and d.wgsl not in seen:
                    seen.add(d.wgsl)
                    if smem is not None:        # the tiles of that workgroup memory when rendered again
                        d.kernel.spec["smem"] = int(smem)
                    found[f"{tag}/{label}/{j}:{d.kernel.name}"] = d.kernel
    return found


def gather_kernels():
    """{label: kernel} of gather kernels: one_hot (labels i32 / u32, ignore_index), embedding
    (and its gradient), im2col (batch folded or not), col2im, with and without epilogues."""
    rng = np.random.default_rng(0)
    found = {}

    def add(tag, outs, **kw):
        kp = compile_plan(outs, options=CompileOptions(max_bindings=32), **kw)
        for j, d in enumerate(kp.dispatches):
            if d.kernel.archetype == "gather":
                found[f"{tag}/{j}:{d.kernel.name}"] = d.kernel

    for dt in (mg.i32, mg.u32):
        g = mg.Graph()
        lab = g.input("lab", (5,), dt)
        add(f"one_hot_{dt.name}", [mg.ops.one_hot(lab, 7)])
        add(f"one_hot_{dt.name}_i32_out", [mg.ops.one_hot(lab, 3, dtype=mg.i32)])
        add(f"one_hot_{dt.name}_epi", [mg.ops.one_hot(lab, 4) * 3.0 + 1.0])
        w = g.input("w", (11, 6))
        add(f"embedding_{dt.name}", [mg.ops.embedding(lab, w)])
        add(f"embedding_{dt.name}_epi", [mg.ops.tanh(mg.ops.embedding(lab, w))])
        ct = g.input("ct", (5, 6))
        add(f"embedding_grad_{dt.name}", [mg.ops.embedding_grad(lab, ct, 11)])
    g = mg.Graph()
    x = g.input("x", (4, 5))
    t = g.input("t", (4,), mg.i32)
    add("cross_entropy_ignore", [mg.ops.cross_entropy(x, t, ignore_index=2)])
    add("cross_entropy_ignore_neg", [mg.ops.cross_entropy(x, t)])
    for stride, pad, dil in ((1, 0, 1), (2, 1, 1), (1, 2, 2)):
        g = mg.Graph()
        x = g.input("x", (2, 3, 7, 6))
        w = g.parameter("w", (4, 3, 3, 2))
        out = mg.ops.conv2d(x, w, stride=stride, padding=pad, dilation=dil)
        tag = f"conv_s{stride}_p{pad}_d{dil}"
        add(tag, [out])
        gx, gw = mg.grad(mg.ops.sum(out * out), [x, w])
        add(tag + "_grad", [gx, gw])
    from meganeura.ops.conv import _im2col
    g = mg.Graph()
    x = g.input("x", (2, 3, 6, 5))
    add("im2col_fold_batch_fill", [_im2col(x, (3, 2), (2, 1), ((1, 1), (0, 1)), (1, 2), float("-inf"), fold_batch=True)])
    add("im2col_fill", [_im2col(x, (2, 2), (1, 1), ((1, 0), (1, 0)), (1, 1), -1.5) * 2.0])
    g = mg.Graph()
    lab, w = g.input("lab", (5,), mg.i32), g.input("w", (11, 6), mg.f16)
    add("embedding_f16", [mg.ops.embedding(lab, w)])
    add("one_hot_f16", [mg.ops.one_hot(lab, 4, dtype=mg.f16)])
    del rng
    return found
