"""The dense half of every block as the fused ops (kernels/dense.py), in graph mode.

One op per layer with its bias, activation and residual, one per norm. For float32 weights,
steps of a few tokens run them instead of XLA's programs (XLA's matmuls are as fast, but its
runtime spends milliseconds a step between the small fusions around them); int8 weights,
which XLA cannot take, run them at every size. bfloat16 weights run them too, for steps of a
few tokens: the ops widen each weight as they read it and compute in float32, so a batch-1
step streams half of float32's bytes, where oneDNN's bf16 matmuls at one row read far below
the memory's rate. Their activations are float32 whatever the weights.

The same four functions as graph_blocks.py: enter, between, exit and head.
"""

from __future__ import annotations

import tensorflow as tf

from tokenserve.kernels import dense as kdense
from tokenserve.engine.step.moe import fused_moe
from tokenserve.kernels.gguf_matmul import gguf_finish_block
from tokenserve.kernels.int8_matmul import int8_finish_block, int8_matmul
from tokenserve.model.gguf_linear import gguf_linear, gguf_parts
from tokenserve.model.layers import soft_cap
from tokenserve.model.transformer import TransformerLM


def fused_dense_supports(config) -> bool:
    """Whether the fused ops compute this config's dense half: per-head QK-norm and a partial
    rotary (split_rope), GeGLU, and post-norms when they are RMSNorms (the finish-block op's
    post-norm scales), as all the families' are; not OLMoE's QK-norm over the whole
    projection (graph_blocks.py)."""
    return not (config.post_norms and config.norm != "rmsnorm"
                or config.qk_norm and config.qk_norm_scope != "head")


_ACTIVATIONS = {"gelu": "gelu_tanh", "swiglu": "swiglu", "geglu": "geglu"}
"""The fused ops' activation for each config.mlp."""


def _float32_vector(t):
    """A norm's or bias's vector in float32 (what the fused ops take); matrices as they are."""
    return tf.cast(t, tf.float32) if t.shape.rank == 1 else t


class FusedBlocks:
    """enter, between, exit and head of a TransformerLM as the fused ops.

    weights: the blocks' weights by role (block_weights), one dict per layer: the matrices
    are read as stored, the vectors (norms, biases) in float32, cast once here rather than in
    every step."""

    def __init__(self, model: TransformerLM, weights: list[dict]):
        self.model = model
        self.weights = weights
        self.final_norm_weights = model.final_norm.weights_dict()
        self.head_weights = model.head.weights_dict() if model.head is not None else None
        if model.compute_dtype != "float32":
            self.weights = [tf.nest.map_structure(_float32_vector, w) for w in weights]
            self.final_norm_weights = tf.nest.map_structure(_float32_vector,
                                                            self.final_norm_weights)
            if self.head_weights is not None:
                self.head_weights = tf.nest.map_structure(_float32_vector, self.head_weights)

    def norm(self, x, w):
        return kdense.layer_norm(x, w["scale"], w.get("bias"), self.model.config.norm_eps)

    @staticmethod
    def linear(x, w, residual=None, activation="none"):
        if "q" in w:  # int8 weights: the int8 op, then the same epilogue
            return kdense.epilogue(int8_matmul(x, w["q"], w["scale"]), w.get("bias"), residual,
                                   activation)
        if parts := gguf_parts(w):  # GGUF blocks: the block op, then the same epilogue
            return kdense.epilogue(gguf_linear(x, parts), w.get("bias"), residual, activation)
        return kdense.dense(x, w["kernel"], w.get("bias"), residual, activation=activation)

    def enter(self, x, rotary, w):
        """The first block's QKV: x [N, D] -> q [N, H, Dh], k, v [N, Hkv*Dh]; rotary: (cos,
        sin) [N, rotary_dim] each or None."""
        return self._split_qkv(self.linear(self.norm(x, w["attn_norm"]), w["qkv"]), rotary, w)

    def between(self, x, attn, rotary, w, w_next):
        x, qkv = self._finish_block(x, attn, w, w_next)
        if qkv is None:
            return (x, *self.enter(x, rotary, w_next))
        return (x, *self._split_qkv(qkv, rotary, w_next))

    def exit(self, x, attn, w):
        return self._finish_block(x, attn, w)[0]

    def head(self, x):
        return soft_cap(self._head(x), self.model.config.final_softcap)

    def _head(self, x):
        m = self.model
        x = self.norm(x, self.final_norm_weights)
        if m.head is not None:
            return self.linear(x, self.head_weights)
        if m.embedding_blocks:  # tied: the token embedding's blocks, read once a step
            return self.linear(x, m.tied_head_weights())
        if m.embedding_format == "int8":  # tied: the token embedding [vocab, D]
            return int8_matmul(x, m.token_embedding_q, m.token_embedding_scale)
        return kdense.dense(x, m.token_embedding, layout="nk")

    def final_norm(self, x):
        """The head's norm alone (the screened head's input)."""
        return self.norm(x, self.final_norm_weights)

    def _split_qkv(self, qkv, rotary, w=None):
        """GraphBlocks._split_qkv in one op (kernels/dense.py split_rope), with the QK-norm
        of the block whose weights `w` are, where it has one."""
        c = self.model.config
        norms = {}
        if w is not None and "q_norm" in w:
            norms = dict(q_norm=w["q_norm"]["scale"], k_norm=w["k_norm"]["scale"],
                         eps=c.norm_eps)
        return kdense.split_rope(qkv, c.num_heads, c.num_kv_heads, c.head_dim, rotary, **norms)

    def _finish_block(self, x, attn, w, w_next=None):
        """The block's second half -> (x, the next block's QKV projection or None).

        With one weight format throughout, a single op takes the block's three matrices and,
        given w_next, the next block's norm and QKV matrix too, back to back; else the
        separate ops (None: the caller projects the next block's QKV itself)."""
        if "moe" in w:  # a mixture of experts: the router, then the grouped experts' op
            x = self.linear(attn, w["out"], residual=x)
            return fused_moe(self.norm(x, w["mlp_norm"]), x, w["moe"], self.model.config), None
        act = _ACTIVATIONS[self.model.config.mlp]
        eps = self.model.config.norm_eps
        if all(gguf_parts(w[name]) for name in ("out", "up", "down")):
            y = self._gguf_finish_block(x, attn, w, w_next, act, eps)
            if y is not None:
                return y
        post = {}  # Gemma's post-norms: the float op takes them, the int8 op does not
        if "post_attn_norm" in w:
            post = dict(post_attn_norm=w["post_attn_norm"], post_mlp_norm=w["post_mlp_norm"])
        for key, fused in (("q", int8_finish_block), ("kernel", kdense.finish_block)):
            if not all(key in w[name] for name in ("out", "up", "down")) or post and key == "q":
                continue
            following = {}
            if w_next is not None and key in w_next["qkv"]:
                following = dict(next_norm=w_next["attn_norm"], next_qkv=w_next["qkv"])
            y = fused(attn, x, w["out"], w["mlp_norm"], w["up"], w["down"], act, eps,
                      **following, **post)  # None: the op is not compiled
            if y is not None:
                return y if following else (y, None)
        x = self._add_branch(x, attn, w["out"], w.get("post_attn_norm"))
        h = self.linear(self.norm(x, w["mlp_norm"]), w["up"], activation=act)
        return self._add_branch(x, h, w["down"], w.get("post_mlp_norm")), None

    @staticmethod
    def _gguf_finish_block(x, attn, w, w_next, act, eps):
        """_finish_block as one GGUF op (kernels/gguf_finish_block.cc), the next block's norm
        and QKV included where they are GGUF blocks too; None without the compiled op."""
        def blocks(weights):
            return {"parts": gguf_parts(weights), "bias": weights.get("bias")}

        following = {}
        if w_next is not None and gguf_parts(w_next["qkv"]):
            following = dict(next_norm=w_next["attn_norm"], next_qkv=blocks(w_next["qkv"]))
        y = gguf_finish_block(attn, x, blocks(w["out"]), w["mlp_norm"], blocks(w["up"]),
                              blocks(w["down"]), act, eps, **following,
                              post_attn_norm=w.get("post_attn_norm"),
                              post_mlp_norm=w.get("post_mlp_norm"))
        if y is None:
            return None
        return y if following else (y, None)

    def _add_branch(self, x, h, w, post_norm):
        """x + h @ w (the residual inside the op), or x + post_norm(h @ w) where the block
        has post-norms."""
        if post_norm is None:
            return self.linear(h, w, residual=x)
        return x + self.norm(self.linear(h, w), post_norm)
