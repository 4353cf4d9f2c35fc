"""The encoder family: a BERT encoder (learned positions, token types, post-norm blocks with
a GELU MLP), its pooling into one vector per input, and a classifier head for cross-encoder
scores. Read top to bottom: norm, embeddings, attention, block, pooling, heads.

Weights are named after their role (`layer_3/qkv/kernel`), stored [in, out] with q/k/v fused
into one kernel, as the decoder's are. Shapes: B inputs of T tokens (padded on the right),
D = hidden_size, H heads of Dh = D / H.
"""

from __future__ import annotations

import numpy as np
import tensorflow as tf

from tokenserve.encoder_config import EncoderConfig, Pooling

_MASKED = -1e9  # added to the scores of padded keys: exp() of it is 0 in float32
_INIT_STD = 0.02  # BERT's initializer_range
_NORM_EPS = 1e-12  # torch F.normalize's floor on the norm


def weight_shapes(config: EncoderConfig) -> dict[str, tuple[int, ...]]:
    """Every weight's name and shape; the classifier's only for num_labels > 0."""
    d, inner = config.hidden_size, config.intermediate_size
    shapes = {"word_embedding": (config.vocab_size, d),
              "position_embedding": (config.max_position_embeddings, d),
              "type_embedding": (config.type_vocab_size, d),
              "embedding_norm/scale": (d,), "embedding_norm/bias": (d,)}
    for i in range(config.num_layers):
        p = f"layer_{i}/"
        shapes.update({p + "qkv/kernel": (d, 3 * d), p + "qkv/bias": (3 * d,),
                       p + "out/kernel": (d, d), p + "out/bias": (d,),
                       p + "attn_norm/scale": (d,), p + "attn_norm/bias": (d,),
                       p + "up/kernel": (d, inner), p + "up/bias": (inner,),
                       p + "down/kernel": (inner, d), p + "down/bias": (d,),
                       p + "mlp_norm/scale": (d,), p + "mlp_norm/bias": (d,)})
    if config.num_labels:
        shapes.update({"pooler/kernel": (d, d), "pooler/bias": (d,),
                       "classifier/kernel": (d, config.num_labels),
                       "classifier/bias": (config.num_labels,)})
    return shapes


def _initial_value(name: str, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if name.endswith("/scale"):
        return np.ones(shape, np.float32)
    if name.endswith("/bias"):
        return np.zeros(shape, np.float32)
    return rng.normal(0.0, _INIT_STD, shape).astype(np.float32)


def layer_norm(x: tf.Tensor, scale: tf.Variable, bias: tf.Variable, eps: float) -> tf.Tensor:
    mean = tf.reduce_mean(x, axis=-1, keepdims=True)
    variance = tf.reduce_mean(tf.square(x - mean), axis=-1, keepdims=True)
    return (x - mean) * tf.math.rsqrt(variance + eps) * scale + bias


class BertEncoder(tf.Module):
    """A BERT encoder with its pooling and, for cross-encoders, its classifier.

    Example:
        >>> encoder = BertEncoder(config, seed=0)
        >>> vectors = encoder.embed(ids, mask)            # [B, D], pooled (and normalized)
        >>> logits = encoder.classify(ids, mask, types)   # [B, num_labels]
    """

    def __init__(self, config: EncoderConfig, seed: int = 0):
        super().__init__(name="encoder")
        self.config = config
        rng = np.random.default_rng(seed)
        self.weights = {name: tf.Variable(_initial_value(name, shape, rng), name=name)
                        for name, shape in weight_shapes(config).items()}

    def _norm(self, x: tf.Tensor, name: str) -> tf.Tensor:
        w = self.weights
        return layer_norm(x, w[name + "/scale"], w[name + "/bias"], self.config.norm_eps)

    def _dense(self, x: tf.Tensor, name: str) -> tf.Tensor:
        # x: [B, T, in] -> [B, T, out]
        return tf.matmul(x, self.weights[name + "/kernel"]) + self.weights[name + "/bias"]

    def _embeddings(self, input_ids, token_type_ids) -> tf.Tensor:
        w, length = self.weights, tf.shape(input_ids)[1]
        x = (tf.gather(w["word_embedding"], input_ids)
             + w["position_embedding"][tf.newaxis, :length]
             + tf.gather(w["type_embedding"], token_type_ids))  # [B, T, D]
        return self._norm(x, "embedding_norm")

    def _attention(self, x: tf.Tensor, key_bias: tf.Tensor, p: str) -> tf.Tensor:
        c = self.config
        batch, length = tf.shape(x)[0], tf.shape(x)[1]
        qkv = tf.reshape(self._dense(x, p + "qkv"), [batch, length, 3, c.num_heads, c.head_dim])
        q, k, v = (tf.transpose(qkv[:, :, i], [0, 2, 1, 3]) for i in range(3))  # [B, H, T, Dh]
        scores = tf.matmul(q, k, transpose_b=True) * (c.head_dim ** -0.5) + key_bias
        context = tf.matmul(tf.nn.softmax(scores, axis=-1), v)  # [B, H, T, Dh]
        context = tf.reshape(tf.transpose(context, [0, 2, 1, 3]), [batch, length, c.hidden_size])
        return self._dense(context, p + "out")

    def _block(self, x: tf.Tensor, key_bias: tf.Tensor, i: int) -> tf.Tensor:
        p = f"layer_{i}/"
        x = self._norm(x + self._attention(x, key_bias, p), p + "attn_norm")  # post-norm
        hidden = tf.nn.gelu(self._dense(x, p + "up"),
                            approximate=self.config.activation == "gelu_new")
        return self._norm(x + self._dense(hidden, p + "down"), p + "mlp_norm")

    def hidden_states(self, input_ids, attention_mask, token_type_ids=None) -> tf.Tensor:
        """[B, T] int32 ids, mask (1 real, 0 padding) and types -> [B, T, D] final states."""
        if token_type_ids is None:
            token_type_ids = tf.zeros_like(input_ids)
        mask = tf.cast(attention_mask, tf.float32)
        key_bias = (1.0 - mask)[:, tf.newaxis, tf.newaxis, :] * _MASKED  # [B, 1, 1, T]
        x = self._embeddings(input_ids, token_type_ids)
        for i in range(self.config.num_layers):
            x = self._block(x, key_bias, i)
        return x

    def embed(self, input_ids, attention_mask) -> tf.Tensor:
        """[B, T] ids and mask -> [B, D] pooled (and, if the config says so, unit) vectors."""
        states = self.hidden_states(input_ids, attention_mask)
        pooled = pool(states, attention_mask, self.config.pooling)
        if self.config.normalize:
            norm = tf.norm(pooled, axis=-1, keepdims=True)
            pooled = pooled / tf.maximum(norm, _NORM_EPS)
        return pooled

    def classify(self, input_ids, attention_mask, token_type_ids) -> tf.Tensor:
        """[B, T] ids, mask and types -> [B, num_labels] logits: classifier(tanh(pooler(CLS)))."""
        w = self.weights
        first = self.hidden_states(input_ids, attention_mask, token_type_ids)[:, 0]  # [B, D]
        pooled = tf.tanh(tf.matmul(first, w["pooler/kernel"]) + w["pooler/bias"])
        return tf.matmul(pooled, w["classifier/kernel"]) + w["classifier/bias"]


def pool(states: tf.Tensor, attention_mask: tf.Tensor, pooling: Pooling) -> tf.Tensor:
    """[B, T, D] states -> [B, D], over the tokens the mask marks real (right padding)."""
    mask = tf.cast(attention_mask, states.dtype)[:, :, tf.newaxis]  # [B, T, 1]
    if pooling is Pooling.CLS:
        return states[:, 0]
    if pooling is Pooling.LAST:
        last = tf.maximum(tf.reduce_sum(tf.cast(attention_mask, tf.int32), axis=1) - 1, 0)
        return tf.gather(states, last, axis=1, batch_dims=1)
    if pooling is Pooling.MAX:
        return tf.reduce_max(states + (1.0 - mask) * _MASKED, axis=1)
    # sentence-transformers clamps the token count at 1e-9 (an all-padding row gives zeros)
    return tf.reduce_sum(states * mask, axis=1) / tf.maximum(tf.reduce_sum(mask, axis=1), 1e-9)


def relevance_scores(logits: tf.Tensor) -> tf.Tensor:
    """[B, num_labels] logits -> [B] scores in 0..1: the sigmoid of a single logit (as
    sentence-transformers' CrossEncoder and vLLM's score), else the last label's softmax."""
    if logits.shape[-1] == 1:
        return tf.sigmoid(logits[:, 0])
    return tf.nn.softmax(logits, axis=-1)[:, -1]
