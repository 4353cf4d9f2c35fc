"""Structured pruning of a TransformerLM: whole attention heads and MLP channels, removed
physically so every matrix that touches them shrinks.

Attention is pruned in KV groups: a key/value head and the query heads that share it
(one head each in GPT-2's multi-head attention, `num_heads // num_kv_heads` in Llama's
grouped-query attention), so every remaining KV head keeps the same number of query heads and
the KV cache shrinks with the heads. Each layer loses the same number of groups (the config
holds one head count), the ones whose removal costs least.

Importance is measured on calibration windows:
  heads  the loss increase when a group's output rows of the attention out-projection are
         zeroed (the group masked), one forward pass per group;
  MLP    mean |activation| of each channel times the norm of its down-projection row (how
         much the channel writes into the residual stream), one pass for all channels.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.errors import ConfigError


@dataclass(frozen=True)
class PruneConfig:
    """What `prune_model` removes."""

    heads: float = 0.25
    """Fraction of KV groups (with their query heads) to remove from every layer."""
    mlp: float = 0.0
    """Fraction of MLP channels to remove from every layer."""

    def __post_init__(self) -> None:
        for name in ("heads", "mlp"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ConfigError(f"--{name} must be in [0, 1), got {value}")


@dataclass
class PruneReport:
    """What was kept, per layer, and the importance scores behind it."""

    kept_groups: list[list[int]]
    kept_channels: list[list[int]]
    head_scores: list[list[float]]
    base_loss: float
    parameters_before: int
    parameters_after: int

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


class _MaskedForward:
    """The model's forward pass with each query head's output scaled by a mask, compiled
    once: scoring every head group reuses one graph (`loss(windows, head_mask [L, H])`)."""

    def __init__(self, model):
        import tensorflow as tf

        self.model = model
        self._loss = tf.function(self._loss_fn, reduce_retracing=True)
        self.no_mask = np.ones([model.config.num_layers, model.config.num_heads], np.float32)

    def _loss_fn(self, ids, targets, head_mask):
        import tensorflow as tf

        from tokenserve.model.layers import attend

        c, model = self.model.config, self.model
        batch, length = tf.shape(ids)[0], tf.shape(ids)[1]
        positions = tf.broadcast_to(tf.range(length)[None], [batch, length])
        causal = tf.range(length)[None, :] <= tf.range(length)[:, None]
        mask = tf.broadcast_to(causal[None], [batch, length, length])
        x = model.embed(ids, positions)
        for layer, block in enumerate(model.blocks):
            heads = attend(*block.attn._project(block.attn_norm(x), positions), mask)
            heads *= tf.repeat(head_mask[layer], c.head_dim)[None, None]  # [B, T, H * Dh]
            x = x + block.attn.out(heads)
            x = x + block.mlp(block.mlp_norm(x))
        return tf.reduce_sum(tf.nn.sparse_softmax_cross_entropy_with_logits(
            labels=targets, logits=model.head_logits(x)))

    def loss(self, windows: np.ndarray, head_mask=None, batch_size: int = 8) -> float:
        """Mean next-token NLL over int32 `windows` [B, T + 1] with `head_mask` [L, H]."""
        head_mask = self.no_mask if head_mask is None else np.asarray(head_mask, np.float32)
        total = 0.0
        for start in range(0, len(windows), batch_size):
            chunk = windows[start:start + batch_size]
            total += float(self._loss(chunk[:, :-1], chunk[:, 1:], head_mask))
        return total / (windows.shape[0] * (windows.shape[1] - 1))


def head_importance(model, windows: np.ndarray, progress: bool = False) -> tuple[np.ndarray, float]:
    """(loss increase when each KV group is masked [num_layers, num_kv_heads], base loss)."""
    c = model.config
    per_group = c.num_heads // c.num_kv_heads
    forward = _MaskedForward(model)
    base = forward.loss(windows)
    scores = np.zeros([c.num_layers, c.num_kv_heads])
    pairs = [(layer, group) for layer in range(c.num_layers) for group in range(c.num_kv_heads)]
    if progress:
        from tqdm import tqdm

        pairs = tqdm(pairs, desc="score heads", unit="group", leave=False, dynamic_ncols=True)
    for layer, group in pairs:
        head_mask = np.ones([c.num_layers, c.num_heads], np.float32)
        head_mask[layer, group * per_group:(group + 1) * per_group] = 0.0
        scores[layer, group] = forward.loss(windows, head_mask) - base
    return scores, base


def mlp_importance(model, windows: np.ndarray) -> np.ndarray:
    """mean |activation| * ||down row|| per channel: [num_layers, intermediate_size]."""
    import tensorflow as tf

    from tokenserve.model.layers import linear

    c = model.config
    ids = tf.constant(windows[:, :-1], tf.int32)
    batch, length = ids.shape
    positions = tf.broadcast_to(tf.range(length)[None], [batch, length])
    causal = tf.range(length)[None, :] <= tf.range(length)[:, None]
    mask = tf.broadcast_to(causal[None], [batch, length, length])
    x = model.embed(ids, positions)
    scores = []
    for block in model.blocks:
        x = x + block.attn(block.attn_norm(x), positions, mask)
        h = linear(block.mlp_norm(x), block.mlp.up.weights_dict())
        if c.mlp == "swiglu":
            gate, h = tf.split(h, 2, axis=-1)
            h = tf.nn.silu(gate) * h
        else:
            h = tf.nn.gelu(h, approximate=True)
        activation = tf.reduce_mean(tf.abs(h), axis=[0, 1]).numpy()
        scores.append(activation * np.linalg.norm(block.mlp.down.kernel.numpy(), axis=1))
        x = x + block.mlp(block.mlp_norm(x))
    return np.stack(scores)


def _keep(scores: np.ndarray, fraction: float, what: str) -> list[list[int]]:
    """Per row, the sorted indices of the highest scores, dropping round(fraction * n)."""
    count = scores.shape[1]
    drop = int(round(fraction * count))
    if drop >= count:
        raise ConfigError(f"pruning {fraction:.0%} would remove every {what}")
    return [sorted(np.argsort(-row, kind="stable")[:count - drop].tolist()) for row in scores]


def prune_model(model, windows: np.ndarray, config: PruneConfig, progress: bool = False):
    """(a new, smaller TransformerLM, PruneReport): `model` less its least important heads and
    MLP channels, scored on int32 `windows` [B, T]."""
    from tokenserve.model import build_model

    c: TransformerConfig = model.config
    if not isinstance(c, TransformerConfig):
        raise ConfigError(f"pruning needs a Transformer, not the {c.family} family")
    if c.weight_format != "float":
        raise ConfigError("prune the float model, then quantize it")
    if c.num_experts:
        raise ConfigError("pruning a mixture of experts is not supported")
    windows = np.asarray(windows, np.int32)
    if config.heads > 0:
        head_scores, base = head_importance(model, windows, progress)
    else:
        head_scores = np.zeros([c.num_layers, c.num_kv_heads])
        base = _MaskedForward(model).loss(windows)
    kept_groups = _keep(head_scores, config.heads, "KV head")
    if any(len(k) == c.num_kv_heads for k in kept_groups) and config.heads > 0:
        raise ConfigError(f"--heads {config.heads} removes no KV group of {c.num_kv_heads}; "
                          f"the smallest step is {1 / c.num_kv_heads:.3f}")
    channel_scores = (mlp_importance(model, windows) if config.mlp > 0
                      else np.ones([c.num_layers, c.intermediate_size]))
    kept_channels = _keep(channel_scores, config.mlp, "MLP channel")

    groups = c.num_heads // c.num_kv_heads
    num_kv = len(kept_groups[0])
    pruned_config = dataclasses.replace(c, num_heads=num_kv * groups, num_kv_heads=num_kv,
                                        head_dim=c.head_dim,
                                        intermediate_size=len(kept_channels[0]))
    pruned = build_model(pruned_config, dtype=model.compute_dtype)
    source = {w.path: w.numpy() for w in model.weights}
    slicers = {}
    for layer in range(c.num_layers):
        qkv_cols = _qkv_columns(c, kept_groups[layer])
        head_rows = _head_rows(c, kept_groups[layer])
        channels = np.asarray(kept_channels[layer])
        up_cols = (np.concatenate([channels, c.intermediate_size + channels])
                   if c.mlp == "swiglu" else channels)
        prefix = f"{model.name}/block_{layer}/"
        slicers.update({
            prefix + "qkv/kernel": lambda w, i=qkv_cols: w[:, i],
            prefix + "qkv/bias": lambda w, i=qkv_cols: w[i],
            prefix + "out/kernel": lambda w, i=head_rows: w[i],
            prefix + "up/kernel": lambda w, i=up_cols: w[:, i],
            prefix + "up/bias": lambda w, i=up_cols: w[i],
            prefix + "down/kernel": lambda w, i=channels: w[i]})
    for weight in pruned.weights:
        value = source[weight.path]
        value = slicers.get(weight.path, lambda w: w)(value)
        weight.assign(value)
    report = PruneReport(kept_groups=kept_groups, kept_channels=kept_channels,
                         head_scores=head_scores.round(5).tolist(), base_loss=base,
                         parameters_before=_count(model), parameters_after=_count(pruned))
    return pruned, report


def _head_rows(c: TransformerConfig, kept_groups: list[int]) -> np.ndarray:
    """Rows of the out-projection (= columns of q) that belong to the kept groups' heads."""
    groups, dim = c.num_heads // c.num_kv_heads, c.head_dim
    heads = [g * groups + i for g in kept_groups for i in range(groups)]
    return np.concatenate([np.arange(h * dim, (h + 1) * dim) for h in heads])


def _qkv_columns(c: TransformerConfig, kept_groups: list[int]) -> np.ndarray:
    dim = c.head_dim
    q = _head_rows(c, kept_groups)
    k = np.concatenate([c.num_heads * dim + np.arange(g * dim, (g + 1) * dim)
                        for g in kept_groups])
    return np.concatenate([q, k, k + c.num_kv_heads * dim])


def _count(model) -> int:
    return int(sum(w.numpy().size for w in model.weights))
