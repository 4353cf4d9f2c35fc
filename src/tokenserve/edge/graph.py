"""Batch-1 forward passes of tokenserve's model families, written for the TFLite converter.

The engine's graphs (model/layers.py) are shaped for batches and XLA: 5-D einsums, scatter
updates into the cache. The TFLite builtins want 2-D matmuls (FULLY_CONNECTED, which every
quantization mode handles), 3-D batch matmuls and DYNAMIC_UPDATE_SLICE for the cache. So the
same arithmetic is written again here, batch 1, from the model's weights; norms and the MLP
reuse the layers' functional helpers. `tests/edge/test_tflite_export.py` holds both to the same
greedy tokens.

Signatures (batch 1; T is dynamic, the cache length S static):
  prefill  token_ids int32 [1, T], positions int32 [1] (, caches) -> logits [1, V] (, kv)
  decode   token_ids int32 [1, 1], positions int32 [1] (, caches) -> logits [1, V] (, kv)
  score    token_ids int32 [1, T] -> logits [1, T, V]       (a causal full pass, for eval)

A Transformer's KV cache is one float32 [Hkv, S, Dh] tensor per layer and K/V (head-major, so
attention reads it without a transpose). With `state_mode="io"` (the default) the caches are
inputs the call only reads (`k_cache_0`, `v_cache_0`, ...; edge/cache.py) and `kv`
[L, 2, Hkv, T, Dh] returns the chunk's new entries for the caller to write in place: the
chunk attends to the cache rows before `positions` and causally to itself, so no op copies
the cache. With `state_mode="variable"` the caches are TFLite resource variables that each
call reads and assigns. docs/optimize.md has the measurements behind the default. An LSTM's
state is (h, c) float32 [num_layers, 2, 1, hidden], always explicit in and out (1 KiB per
layer).
"""

from __future__ import annotations

import math

import numpy as np
import tensorflow as tf
from tensorflow.compiler.tf2xla.ops import gen_xla_ops  # DYNAMIC_UPDATE_SLICE in TFLite

from tokenserve.config import LSTMConfig, TransformerConfig
from tokenserve.edge.cache import cache_names
from tokenserve.errors import ConfigError
from tokenserve.model.layers import mlp, norm
from tokenserve.model.rope import rope_inverse_frequencies

# exp(-1e4) is exactly 0 in float32, so masked keys drop out as with float32.min, while the
# score tensor's range stays small enough for int8 calibration to keep some resolution.
MASK_BIAS = -1e4
STATE_MODES = ("io", "variable")


def _family_features(c: TransformerConfig) -> list[str]:
    """The newer families' features this graph does not compute (by config field)."""
    checks = {"qk_norm": c.qk_norm, "sliding_windows": bool(c.sliding_windows),
              "local_rope_theta": bool(c.local_rope_theta),
              "rotary_dim": c.rotary_dim != c.head_dim,
              "rope_attention_factor": c.rope_attention_factor != 1.0,
              "rope_long_freq_factors": bool(c.rope_long_freq_factors),
              "attn_scale": bool(c.attn_scale), "attn_softcap": bool(c.attn_softcap),
              "final_softcap": bool(c.final_softcap),
              "embedding_multiplier": c.embedding_multiplier != 1.0,
              "post_norms": c.post_norms, "mlp=geglu": c.mlp == "geglu"}
    return [name for name, used in checks.items() if used]


def _float(value) -> np.ndarray:
    return np.asarray(value.numpy() if hasattr(value, "numpy") else value, np.float32)


def dense_weights(layer) -> dict:
    """A Dense layer's weights as float32 numpy {kernel [in, out], bias?}; int8 dequantized."""
    found = layer.weights_dict()
    if "q" in found:
        kernel = (_float(found["q"]) * _float(found["scale"])).T
    else:
        kernel = _float(found["kernel"])
    out = {"kernel": kernel}
    if "bias" in found:
        out["bias"] = _float(found["bias"])
    return out


def token_embedding(model) -> np.ndarray:
    """[vocab, D] float32, dequantized when the model holds int8 weights."""
    if getattr(model.config, "weight_format", "float") == "int8":
        return _float(model.token_embedding_q) * _float(model.token_embedding_scale)
    return _float(model.token_embedding)


def int8_rows(table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(int8 [V, D], float32 scale [V]): symmetric per-row int8, as TFLite quantizes a
    FULLY_CONNECTED weight per output channel (each row's largest |value| becomes 127)."""
    scale = np.maximum(np.abs(table).max(axis=1), 1e-30).astype(np.float64) / 127.0
    scaled = table / scale[:, None]
    rows = np.clip(np.sign(scaled) * np.floor(np.abs(scaled) + 0.5), -127, 127)
    return rows.astype(np.int8), scale.astype(np.float32)


def _length(x):
    """The leading dimension of `x`: a Python int when static, else a scalar tensor."""
    return x.shape[0] if x.shape[0] is not None else tf.shape(x)[0]


class _Weights(tf.Module):
    """Float32 tf.Variables by name; the converter freezes them into constants."""

    def __init__(self, arrays: dict):
        super().__init__(name="weights")
        self.table = {name: tf.Variable(value, trainable=False, name=name.replace("/", "_"))
                      for name, value in arrays.items()}

    def get(self, prefix: str) -> dict:
        start = prefix + "/"
        return {k[len(start):]: v for k, v in self.table.items() if k.startswith(start)}


class EdgeTransformer(tf.Module):
    """A TransformerLM as TFLite-convertible tf.functions (see the module docstring)."""

    def __init__(self, model, cache_len: int | None = None, state_mode: str = "io",
                 int8_embedding: bool = False):
        super().__init__(name="edge_transformer")
        if state_mode not in STATE_MODES:
            raise ValueError(f"state_mode must be one of {STATE_MODES}, got {state_mode!r}")
        c: TransformerConfig = model.config
        unsupported = _family_features(c)
        if unsupported:
            raise ConfigError(f"TFLite export does not take {', '.join(unsupported)} yet")
        self.config, self.state_mode = c, state_mode
        self.cache_len = min(cache_len or c.max_seq_len, c.max_seq_len)
        if int8_embedding:
            rows, scale = int8_rows(token_embedding(model))
            arrays = {"embedding_q": rows, "embedding_scale": scale}
            if model.head is None:
                # The tied head's FULLY_CONNECTED weights, as float constants equal to the
                # int8 rows times their scale: quantized per output channel they come back as
                # those same int8 rows, and the converter's duplicate-buffer pass stores them
                # once. Written as cast(rows) * scale instead, the converter does not fold
                # the [V, D] cast (folding would grow the constant fourfold), so every call
                # cast and re-quantized the whole table: GPT-2-small's int8 decode ran no
                # faster than float32 (docs/optimize.md).
                arrays["head_tied"] = rows.astype(np.float32) * scale[:, None]
        else:
            arrays = {"embedding": token_embedding(model)}
        if c.position == "learned":
            arrays["position"] = _float(model.position_embedding)
        for i, block in enumerate(model.blocks):
            for role, layer in (("attn_norm", block.attn_norm), ("mlp_norm", block.mlp_norm)):
                for key, value in layer.weights_dict().items():
                    arrays[f"{i}/{role}/{key}"] = _float(value)
            for role, layer in (("qkv", block.attn.qkv), ("out", block.attn.out),
                                ("up", block.mlp.up), ("down", block.mlp.down)):
                for key, value in dense_weights(layer).items():
                    arrays[f"{i}/{role}/{key}"] = value
        for key, value in model.final_norm.weights_dict().items():
            arrays[f"final_norm/{key}"] = _float(value)
        if model.head is not None:
            for key, value in dense_weights(model.head).items():
                arrays[f"head/{key}"] = value
        self.weights = _Weights(arrays)
        if c.position == "rope":  # cos/sin tables [max_len, Dh], gathered by position
            inv_freq = rope_inverse_frequencies(c.head_dim, c.rope_theta, c.rope_freq_factors)
            angles = np.arange(c.max_seq_len)[:, None] * inv_freq[None, :]
            angles = np.concatenate([angles, angles], axis=-1)
            self._cos = tf.constant(np.cos(angles), tf.float32)
            self._sin = tf.constant(np.sin(angles), tf.float32)
        if state_mode == "variable":  # one [Hkv, S, Dh] variable per layer and K/V
            self.caches = [tf.Variable(tf.zeros(self.layer_cache_shape()), trainable=False,
                                       name=name) for name in cache_names(c.num_layers)]

    def layer_cache_shape(self) -> list:
        c = self.config
        return [c.num_kv_heads, self.cache_len, c.head_dim]

    def state_shape(self) -> list:
        """The whole cache as the runner holds it: [layers, 2 (K, V), Hkv, S, Dh]."""
        return [self.config.num_layers, 2, *self.layer_cache_shape()]

    # -- the forward pass ------------------------------------------------------------------
    def _rope(self, x, positions):
        # x: [T, H, Dh]; positions: [T]
        cos = tf.gather(self._cos, positions)[:, None, :]
        sin = tf.gather(self._sin, positions)[:, None, :]
        x1, x2 = tf.split(x, 2, axis=-1)
        return x * cos + tf.concat([-x2, x1], axis=-1) * sin

    def _attention(self, layer: int, x, positions, start, keys, values):
        """x [T, D] at `positions` (from `start`) -> (out [T, D], k [Hkv, T, Dh], v).

        `keys`/`values` [Hkv, S, Dh] are this layer's cache, read only: its rows before
        `start` are visible, the rest masked. The chunk's own keys are attended causally
        beside it, so no op copies the cache. With `keys` None, only the chunk is attended.
        """
        c = self.config
        heads, kv_heads, dim = c.num_heads, c.num_kv_heads, c.head_dim
        groups = heads // kv_heads
        length = _length(x)  # a Python int in decode, so every shape below is static
        qkv = tf.matmul(x, self.weights.table[f"{layer}/qkv/kernel"])
        if f"{layer}/qkv/bias" in self.weights.table:
            qkv += self.weights.table[f"{layer}/qkv/bias"]
        q, k, v = tf.split(qkv, [heads * dim, kv_heads * dim, kv_heads * dim], axis=-1)
        q = tf.reshape(q, [length, heads, dim])
        k = tf.reshape(k, [length, kv_heads, dim])
        v = tf.reshape(v, [length, kv_heads, dim])
        if c.position == "rope":
            q, k = self._rope(q, positions), self._rope(k, positions)
        k = tf.transpose(k, [1, 0, 2])  # [Hkv, T, Dh]
        v = tf.transpose(v, [1, 0, 2])
        # q: [T, Hkv, G, Dh] -> [Hkv, G*T, Dh]; head h = kv * G + g, as in layers.attend
        q = tf.reshape(tf.transpose(tf.reshape(q, [length, kv_heads, groups, dim]), [1, 2, 0, 3]),
                       [kv_heads, groups * length, dim]) * (1.0 / math.sqrt(dim))
        local = tf.reshape(tf.matmul(q, k, transpose_b=True), [kv_heads, groups, length, length])
        causal = tf.range(length)[None, :] <= tf.range(length)[:, None]  # [T, T]
        local += tf.where(causal, 0.0, MASK_BIAS)
        if keys is None:
            probs = tf.nn.softmax(local, axis=-1)
            out = tf.matmul(tf.reshape(probs, [kv_heads, groups * length, length]), v)
        else:
            cached = tf.reshape(tf.matmul(q, keys, transpose_b=True),
                                [kv_heads, groups, length, self.cache_len])  # [Hkv, G, T, S]
            cached += tf.where(tf.range(self.cache_len) < start, 0.0, MASK_BIAS)
            probs = tf.nn.softmax(tf.concat([cached, local], axis=-1), axis=-1)
            probs = tf.reshape(probs, [kv_heads, groups * length, self.cache_len + length])
            probs_cached, probs_local = tf.split(probs, [self.cache_len, length], axis=-1)
            out = tf.matmul(probs_cached, values) + tf.matmul(probs_local, v)
        out = tf.reshape(out, [kv_heads, groups, length, dim])
        out = tf.reshape(tf.transpose(out, [2, 0, 1, 3]), [length, heads * dim])
        out = tf.matmul(out, self.weights.table[f"{layer}/out/kernel"])
        if f"{layer}/out/bias" in self.weights.table:
            out += self.weights.table[f"{layer}/out/bias"]
        return out, k, v

    def _hidden(self, token_ids, start, caches):
        """token_ids [1, T] from position `start`, `caches` a [Hkv, S, Dh] pair per layer or
        None -> (hidden [T, D], new entries [L, 2, Hkv, T, Dh])."""
        c = self.config
        ids = token_ids[0]
        positions = start + tf.range(_length(ids))
        x = self._embed(ids)
        if c.position == "learned":
            x += tf.gather(self.weights.table["position"], positions)
        entries = []
        for layer in range(c.num_layers):
            keys, values = caches[2 * layer:2 * layer + 2] if caches is not None else (None, None)
            h, k, v = self._attention(layer, norm(x, self.weights.get(f"{layer}/attn_norm"),
                                                  c.norm, c.norm_eps),
                                      positions, start, keys, values)
            entries.append(tf.stack([k, v]))
            x += h
            x += mlp(norm(x, self.weights.get(f"{layer}/mlp_norm"), c.norm, c.norm_eps),
                     self.weights.get(f"{layer}/up"), self.weights.get(f"{layer}/down"), c.mlp)
        return norm(x, self.weights.get("final_norm"), c.norm, c.norm_eps), tf.stack(entries)

    def _embed(self, ids):
        # ids: [T] -> [T, D]
        table = self.weights.table
        if "embedding_q" in table:  # int8 rows times their scale
            return (tf.cast(tf.gather(table["embedding_q"], ids), tf.float32)
                    * tf.gather(table["embedding_scale"], ids)[:, None])
        return tf.gather(table["embedding"], ids)

    def _logits(self, hidden):
        # hidden: [N, D] -> [N, V]; a tied head is FULLY_CONNECTED on the [V, D] embedding
        table = self.weights.table
        if "head/kernel" in table:
            logits = tf.matmul(hidden, table["head/kernel"])
            return logits + table["head/bias"] if "head/bias" in table else logits
        if "head_tied" in table:  # the int8 rows times their scale (see __init__)
            return tf.matmul(hidden, table["head_tied"], transpose_b=True)
        return tf.matmul(hidden, table["embedding"], transpose_b=True)

    # -- signatures --------------------------------------------------------------------------
    def signatures(self) -> dict:
        ids = tf.TensorSpec([1, None], tf.int32, name="token_ids")
        one = tf.TensorSpec([1, 1], tf.int32, name="token_ids")
        pos = tf.TensorSpec([1], tf.int32, name="positions")
        cache_specs = [tf.TensorSpec(self.layer_cache_shape(), tf.float32, name=name)
                       for name in cache_names(self.config.num_layers)]
        if self.state_mode == "io":
            def run(token_ids, positions, *caches):
                hidden, entries = self._hidden(token_ids, positions[0], caches)
                return {"logits": self._logits(hidden[-1:]), "kv": entries}
            prefill = tf.function(run, input_signature=[ids, pos, *cache_specs])
            decode = tf.function(run, input_signature=[one, pos, *cache_specs])
        else:
            def run(token_ids, positions):
                start = positions[0]
                caches = [cache.read_value() for cache in self.caches]
                hidden, entries = self._hidden(token_ids, start, caches)
                zero = tf.constant(0, tf.int32)
                for index, cache in enumerate(self.caches):  # [Hkv, T, Dh] rows at start
                    cache.assign(gen_xla_ops.xla_dynamic_update_slice(
                        caches[index], entries[index // 2, index % 2],
                        tf.stack([zero, start, zero])))
                return {"logits": self._logits(hidden[-1:])}
            prefill = tf.function(run, input_signature=[ids, pos])
            decode = tf.function(run, input_signature=[one, pos])

        def score(token_ids):
            hidden, _ = self._hidden(token_ids, tf.constant(0, tf.int32), None)
            # An identity gather, as decode's row slice: without it the converter folds the
            # final norm's scale into the LM head, a second copy of the [V, D] embedding.
            rows = tf.gather(hidden, tf.range(tf.shape(hidden)[0]))
            return {"logits": self._logits(rows)[None]}

        return {"prefill": prefill.get_concrete_function(),
                "decode": decode.get_concrete_function(),
                "score": tf.function(score, input_signature=[ids]).get_concrete_function()}


class EdgeLSTM(tf.Module):
    """An LSTMLM as TFLite-convertible tf.functions; its (h, c) state is explicit IO."""

    def __init__(self, model, cache_len: int | None = None, state_mode: str = "io"):
        super().__init__(name="edge_lstm")
        c: LSTMConfig = model.config
        self.config, self.state_mode, self.cache_len = c, "io", c.max_seq_len
        arrays = {"embedding": _float(model.token_embedding), "head/bias": _float(model.head_bias)}
        for i in range(c.num_layers):
            arrays[f"{i}/kernel"] = _float(model.kernels[i])
            arrays[f"{i}/bias"] = _float(model.biases[i])
        if not c.tie_embeddings:
            arrays["head/kernel"] = _float(model.head_kernel)
        self.weights = _Weights(arrays)

    def state_shape(self) -> list:
        return [self.config.num_layers, 2, 1, self.config.hidden_size]

    def _run(self, token_ids, state):
        """token_ids [1, T], state [L, 2, 1, H] -> (state, outputs [T, H])."""
        c, table = self.config, self.weights.table
        x = tf.gather(table["embedding"], token_ids[0])  # [T, H]
        length = tf.shape(x)[0]

        def body(t, state, outputs):
            x_t = x[t][None]  # [1, H]
            layers = []
            for layer in range(c.num_layers):
                h, cell = state[layer, 0], state[layer, 1]
                gates = tf.matmul(tf.concat([x_t, h], -1), table[f"{layer}/kernel"])
                i, f, g, o = tf.split(gates + table[f"{layer}/bias"], 4, axis=-1)
                cell = tf.sigmoid(f) * cell + tf.sigmoid(i) * tf.tanh(g)
                x_t = tf.sigmoid(o) * tf.tanh(cell)
                layers.append(tf.stack([x_t, cell]))
            outputs = gen_xla_ops.xla_dynamic_update_slice(
                outputs, x_t, tf.stack([t, tf.constant(0, tf.int32)]))
            return t + 1, tf.stack(layers), outputs

        outputs = tf.zeros([length, c.hidden_size])
        _, state, outputs = tf.while_loop(lambda t, *_: t < length, body,
                                          (tf.constant(0, tf.int32), state, outputs))
        return state, outputs

    def _logits(self, hidden):
        table = self.weights.table
        if "head/kernel" in table:
            logits = tf.matmul(hidden, table["head/kernel"])
        else:
            logits = tf.matmul(hidden, table["embedding"], transpose_b=True)
        return logits + table["head/bias"]

    def signatures(self) -> dict:
        ids = tf.TensorSpec([1, None], tf.int32, name="token_ids")
        one = tf.TensorSpec([1, 1], tf.int32, name="token_ids")
        state_spec = tf.TensorSpec(self.state_shape(), tf.float32, name="state")

        def run(token_ids, state):
            state, outputs = self._run(token_ids, state)
            return {"logits": self._logits(outputs[-1:]), "state": state}

        def score(token_ids):
            _, outputs = self._run(token_ids, tf.zeros(self.state_shape()))
            return {"logits": self._logits(outputs)[None]}

        return {"prefill": tf.function(run, input_signature=[ids, state_spec])
                .get_concrete_function(),
                "decode": tf.function(run, input_signature=[one, state_spec])
                .get_concrete_function(),
                "score": tf.function(score, input_signature=[ids]).get_concrete_function()}


def edge_module(model, cache_len: int | None = None, state_mode: str = "io",
                int8_embedding: bool = False):
    """The TFLite-convertible module of `model` (a TransformerLM or an LSTMLM).

    `int8_embedding`: a Transformer's token embedding as int8 rows and a scale per row, the
    lookup and a tied LM head reading the same rows (for the int8 quantization modes).
    """
    if isinstance(model.config, TransformerConfig):
        return EdgeTransformer(model, cache_len, state_mode, int8_embedding)
    return EdgeLSTM(model, cache_len, state_mode)
