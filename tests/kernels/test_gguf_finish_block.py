"""The GGUF finish-block op (a block's second half, and the next block's norm and QKV, on
weights kept as GGUF blocks) against the separate ops it replaces: gguf_matmul, then the
dense library's epilogue and norm. Equal bit for bit, so the engine's tokens do not move."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf
from gguf import GGMLQuantizationType
from gguf import quants as gguf_quants

from support.compiled_ops import compiled_op_module
from tokenserve.kernels import dense as kdense
from tokenserve.kernels import gguf_matmul as gm


@pytest.fixture(scope="module")
def compiled():
    compiled_op_module(kdense.LIBRARY)
    return compiled_op_module(gm.LIBRARY)


KQUANT_HALVES = {"q4_k": [0, 2], "q5_k": [0, 2], "q6_k": [208]}  # their fp16 fields' bytes
KQUANT_BYTES = {"q4_k": 144, "q5_k": 176, "q6_k": 210}


def blocks(name: str, n: int, k: int, seed: int) -> tf.Tensor:
    """uint8 [N, row bytes]: the 32-value types quantized by the gguf package; the K-quants
    (which it cannot quantize) random bytes with finite fp16 scales of trained weights' size."""
    rng = np.random.default_rng(seed)
    if name not in KQUANT_BYTES:
        w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
        return tf.constant(gguf_quants.quantize(w, GGMLQuantizationType[name.upper()]))
    b = rng.integers(0, 256, (n, k // 256, KQUANT_BYTES[name]), dtype=np.uint8)
    for at in KQUANT_HALVES[name]:
        scale = (rng.standard_normal((n, k // 256)) * 0.01).astype(np.float16)
        b[..., at:at + 2] = scale.view(np.uint8).reshape(n, k // 256, 2)
    return tf.constant(b.reshape(n, -1))


def vector(n: int, seed: int, around: float = 0.0) -> tf.Tensor:
    return tf.constant(around + 0.1 * np.random.default_rng(seed).standard_normal(n)
                       .astype(np.float32))


def layer(types: list[str], rows: list[int], k: int, seed: int, bias: bool) -> dict:
    parts = [(t, blocks(t, n, k, seed + i)) for i, (t, n) in enumerate(zip(types, rows))]
    return {"parts": parts, "bias": vector(sum(rows), seed + 50) if bias else None}


def separate(x, w, isa, residual=None, activation="none"):
    """What fused_blocks composes without the op: the matmul of each part, then the epilogue."""
    ys = [gm.compiled_gguf_matmul(x, b, t, isa=isa) for t, b in w["parts"]]
    z = ys[0] if len(ys) == 1 else tf.concat(ys, -1)
    return kdense.epilogue(z, w["bias"], residual, activation, isa=_rows_isa(isa))


def _rows_isa(isa):
    return "scalar" if isa == "scalar" else "auto"


def norm(x, w, eps, isa):
    return kdense.layer_norm(x, w["scale"], w.get("bias"), eps, isa=_rows_isa(isa))


def reference(attn, x, out, n1, up, down, act, eps, isa, post=None, next_norm=None,
              next_qkv=None):
    def branch(h, w, residual, post_norm):
        if post_norm is None:
            return separate(h, w, isa, residual=residual)
        return residual + norm(separate(h, w, isa), post_norm, eps, isa)

    x1 = branch(attn, out, x, post and post[0])
    u = separate(norm(x1, n1, eps, isa), up, isa, activation=act)
    y = branch(u, down, x1, post and post[1])
    if next_qkv is None:
        return y, None
    return y, separate(norm(y, next_norm, eps, isa), next_qkv, isa)


CASES = {
    # SmolLM2's Q4_1 file: one type throughout, RMSNorm, SwiGLU, no biases
    "q4_1": dict(d=64, da=64, inner=96, types=dict(out=["q4_1"], up=["q4_1"], down=["q4_1"],
                                                  next=["q4_1"]),
                 act="swiglu", layernorm=False, bias=False, post=False),
    # a Q4_K_M file's mixes (K-quant parts beside Q6_K ones), Gemma's post-norms, GeGLU
    "k-quants": dict(d=256, da=512, inner=256,
                     types=dict(out=["q4_k"], up=["q4_k", "q5_k"], down=["q6_k"],
                                next=["q4_k", "q8_0", "q6_k"]),
                     act="geglu", layernorm=False, bias=False, post=True),
    # biases and LayerNorms everywhere, GELU, no next block
    "biases": dict(d=96, da=64, inner=64, types=dict(out=["q8_0"], up=["q4_0"], down=["q5_0"],
                                                    next=[]),
                   act="gelu_tanh", layernorm=True, bias=True, post=False),
}


@pytest.mark.parametrize("m", [1, 3, 9])
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("isa", ["auto", "scalar"])
def test_equals_the_separate_ops(compiled, case, m, isa):
    c = CASES[case]
    d, da, inner, types = c["d"], c["da"], c["inner"], c["types"]
    f = 2 * inner if c["act"] != "gelu_tanh" else inner

    def split(total, count):  # rows of `count` parts, the first ones a multiple of 32 each
        return [total // count // 32 * 32] * (count - 1) + [total - total // count // 32 * 32
                                                            * (count - 1)]

    def norm_w(seed):
        w = {"scale": vector(d, seed, around=1.0)}
        if c["layernorm"]:
            w["bias"] = vector(d, seed + 1)
        return w

    out = layer(types["out"], split(d, len(types["out"])), da, 10, c["bias"])
    up = layer(types["up"], split(f, len(types["up"])), d, 20, c["bias"])
    down = layer(types["down"], split(d, len(types["down"])), inner, 30, c["bias"])
    following = {}
    if types["next"]:
        following = dict(next_norm=norm_w(40), next_qkv=layer(
            types["next"], split(d + 64, len(types["next"])), d, 60, c["bias"]))
    post = (norm_w(70), norm_w(80)) if c["post"] else None
    rng = np.random.default_rng(m)
    attn = tf.constant(rng.standard_normal((m, da)).astype(np.float32))
    x = tf.constant(rng.standard_normal((m, d)).astype(np.float32))
    eps = 1e-6
    got = gm.gguf_finish_block(attn, x, out, norm_w(90), up, down, c["act"], eps, isa=isa,
                               post_attn_norm=post and post[0],
                               post_mlp_norm=post and post[1], **following)
    want_y, want_next = reference(attn, x, out, norm_w(90), up, down, c["act"], eps, isa,
                                  post, **following)
    if following:
        np.testing.assert_array_equal(got[0].numpy(), want_y.numpy())
        np.testing.assert_array_equal(got[1].numpy(), want_next.numpy())
    else:
        np.testing.assert_array_equal(got.numpy(), want_y.numpy())


def test_blocks_that_do_not_fit_are_refused(compiled):
    d = 64
    out = layer(["q4_1"], [d], 64, 1, False)
    up = layer(["q4_k"], [128], d, 2, False)  # K = 64 is no multiple of a K-quant's 256
    down = layer(["q4_1"], [d], 64, 3, False)
    x = tf.zeros([1, d])
    with pytest.raises(tf.errors.InvalidArgumentError, match=r"up_blocks\[0\].*256"):
        gm.gguf_finish_block(x, x, out, {"scale": tf.ones([d])}, up, down, "swiglu")
