"""Trains a model on a token stream, with progress, checkpoints and resume.

Reproducible from the seed: the batch at step i is drawn from an RNG seeded
with (seed, i), so a run resumed from a checkpoint sees the same batches as
one that never stopped.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import dataclass
from pathlib import Path

import keras
import numpy as np
import tensorflow as tf
from tqdm import tqdm

from tokenserve.config import TrainConfig
from tokenserve.model.base import DecoderLM
from tokenserve.model.weights import load_weights, save_weights


def batch_at(stream: np.ndarray, step: int, seed: int, batch_size: int, seq_len: int):
    """(inputs, targets), each int32 [batch_size, seq_len], for training step `step`."""
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(stream) - seq_len - 1, size=batch_size)
    window = np.stack([stream[s:s + seq_len + 1] for s in starts])
    return window[:, :-1], window[:, 1:]


def holdout_windows(stream: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Non-overlapping [n, seq_len + 1] windows covering the start of the held-out stream."""
    count = min(max_windows, (len(stream) - 1) // seq_len)
    return np.stack([stream[i * seq_len:i * seq_len + seq_len + 1] for i in range(count)])


def perplexity(model: DecoderLM, windows: np.ndarray, batch_size: int = 8) -> float:
    """exp(mean next-token negative log-likelihood) over `windows`."""
    total, count = 0.0, 0
    for i in range(0, len(windows), batch_size):
        chunk = windows[i:i + batch_size]
        logits = model(chunk[:, :-1])
        nll = tf.nn.sparse_softmax_cross_entropy_with_logits(labels=chunk[:, 1:], logits=logits)
        total += float(tf.reduce_sum(nll))
        count += nll.shape[0] * nll.shape[1]
    return math.exp(total / count)


def _learning_rate(config: TrainConfig):
    warmup = min(config.warmup_steps, config.num_steps // 2)
    return keras.optimizers.schedules.CosineDecay(
        initial_learning_rate=0.0, decay_steps=max(config.num_steps - warmup, 1),
        alpha=0.1, warmup_target=config.learning_rate, warmup_steps=warmup)


@dataclass
class TrainResult:
    steps: int
    seconds: float
    holdout_perplexity: float
    final_loss: float


class Trainer:
    """AdamW with warmup and cosine decay; one compiled train step."""

    def __init__(self, model: DecoderLM, config: TrainConfig, checkpoint_dir: str | Path):
        self.model, self.config = model, config
        self.checkpoint_dir = Path(checkpoint_dir)
        self.optimizer = keras.optimizers.AdamW(
            learning_rate=_learning_rate(config), weight_decay=config.weight_decay,
            beta_2=0.95, global_clipnorm=1.0)
        self.optimizer.build(model.trainable_variables)
        # XLA pays for float32 but makes bf16 matmuls ~6x slower than oneDNN (docs/engine.md).
        self._train_step = tf.function(self._step, jit_compile=config.precision == "fp32")

    def _step(self, inputs, targets):
        with tf.GradientTape() as tape:
            logits = self.model(inputs)
            loss = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=targets, logits=logits))
        variables = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss

    def _save(self, step: int, seconds: float, loss: float) -> None:
        self.checkpoint_dir.mkdir(parents=True, exist_ok=True)
        save_weights(self.model, self.checkpoint_dir / "model.safetensors")
        np.savez(self.checkpoint_dir / "optimizer.npz",
                 *[v.numpy() for v in self.optimizer.variables])
        state = {"step": step, "seconds": seconds, "loss": loss}
        (self.checkpoint_dir / "state.json").write_text(json.dumps(state))

    def _restore(self) -> tuple[int, float, float]:
        state_path = self.checkpoint_dir / "state.json"
        if not state_path.exists():
            return 0, 0.0, float("nan")
        state = json.loads(state_path.read_text())
        load_weights(self.model, self.checkpoint_dir / "model.safetensors")
        saved = np.load(self.checkpoint_dir / "optimizer.npz")
        for i, variable in enumerate(self.optimizer.variables):
            variable.assign(saved[f"arr_{i}"])
        return state["step"], state["seconds"], state.get("loss", float("nan"))

    def fit(self, stream: np.ndarray, holdout: np.ndarray, label: str = "train",
            stop_at: int | None = None) -> TrainResult | None:
        """Trains to `config.num_steps`, resuming from the checkpoint if there is one.

        `stop_at` ends this run early at that step (after a checkpoint), as an
        interruption would; it returns None then, and the next `fit` resumes.
        """
        c = self.config
        stop_at = min(stop_at or c.num_steps, c.num_steps)
        start, seconds, loss = self._restore()
        if start:
            print(f"resuming {label} from step {start}")
        began = time.perf_counter() - seconds
        with tqdm(total=c.num_steps, initial=start, desc=label, unit="step",
                  dynamic_ncols=True) as progress:
            for step in range(start, stop_at):
                inputs, targets = batch_at(stream, step, c.seed, c.batch_size, c.seq_len)
                loss = float(self._train_step(inputs, targets))
                progress.update(1)
                progress.set_postfix(loss=f"{loss:.3f}")
                if (step + 1) % c.checkpoint_every == 0 or step + 1 in (stop_at, c.num_steps):
                    self._save(step + 1, time.perf_counter() - began, loss)
        seconds = time.perf_counter() - began
        if stop_at < c.num_steps:
            return None
        windows = holdout_windows(holdout, c.seq_len, c.eval_batches * c.batch_size)
        return TrainResult(c.num_steps, seconds, perplexity(self.model, windows), loss)


class DistillTrainer(Trainer):
    """The trainer's loop on (1 - w) * cross-entropy + w * KL(teacher || student)."""

    def __init__(self, model, teacher, config, checkpoint_dir, distill_weight: float):
        self.teacher, self.distill_weight = teacher, distill_weight
        super().__init__(model, config, checkpoint_dir)

    def _step(self, inputs, targets):
        teacher = tf.nn.log_softmax(tf.stop_gradient(self.teacher(inputs)))  # [B, T, V]
        with tf.GradientTape() as tape:
            logits = self.model(inputs)
            lm = tf.reduce_mean(tf.nn.sparse_softmax_cross_entropy_with_logits(
                labels=targets, logits=logits))
            kl = tf.reduce_mean(tf.reduce_sum(
                tf.exp(teacher) * (teacher - tf.nn.log_softmax(logits)), axis=-1))
            loss = (1.0 - self.distill_weight) * lm + self.distill_weight * kl
        variables = self.model.trainable_variables
        self.optimizer.apply_gradients(zip(tape.gradient(loss, variables), variables))
        return loss
