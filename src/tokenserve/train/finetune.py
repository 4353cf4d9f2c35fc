"""A brief fine-tune after a model was changed (pruned), and the data it and pruning read.

`tokenserve prune` and `tokenserve optimize` score heads and channels on `calibration_windows`
and fine-tune on `training_streams` with the trainer's loop. With a teacher (the model before
pruning) the fine-tune distils: the loss mixes the next-token cross-entropy with the KL
divergence from the teacher's next-token distribution, which carries far more signal per
token than the one-hot target and pulls the pruned model back towards what it was.
"""

from __future__ import annotations

import numpy as np

DISTILL_WEIGHT = 0.5  # share of the KL term in the loss; the rest is the LM loss
# About where the built-in model's own schedule ended (1.5e-3 decayed to a tenth): a peak of
# 1e-3 undid more than it recovered (+24 % perplexity after 150 steps, against +13 %).
FINETUNE_LEARNING_RATE = 3e-4
DATA_HELDOUT_SHARE = 0.1  # the tail of --data text held out from scoring and fine-tuning


def training_streams(tokenizer, data_files=None):
    """(train stream, held-out stream) of token ids: the files in `data_files` (the last
    DATA_HELDOUT_SHARE held out), or the built-in models' stdlib training and held-out
    splits (disjoint by file)."""
    from tokenserve.tools.evaluate import heldout_fraction, read_texts
    from tokenserve.train.corpus import Corpus, token_stream

    if data_files:
        stream = token_stream(read_texts(data_files), tokenizer)
        cut = int(len(stream) * (1.0 - DATA_HELDOUT_SHARE))
        return stream[:cut], stream[cut:]
    corpus = Corpus.from_stdlib(heldout_fraction())
    return (token_stream(corpus.train_texts, tokenizer),
            token_stream(corpus.holdout_texts, tokenizer))


def calibration_windows(stream, count: int, length: int, seed: int = 0) -> np.ndarray:
    """int32 [count, length + 1]: windows of `stream` at seeded random starts."""
    length = min(length, len(stream) - 2)
    starts = np.random.default_rng(seed).integers(0, len(stream) - length - 1, count)
    return np.stack([stream[s:s + length + 1] for s in starts]).astype(np.int32)


def finetune(model, stream: np.ndarray, holdout: np.ndarray, num_steps: int, workdir,
             learning_rate: float = FINETUNE_LEARNING_RATE, batch_size: int = 4,
             seq_len: int = 512, seed: int = 0, teacher=None,
             distill_weight: float = DISTILL_WEIGHT, warmup_steps: int | None = None,
             trainer_class=None):
    """A brief AdamW fine-tune on `stream` (warmup, then cosine decay to a tenth); with
    `teacher`, distilled from it; `trainer_class`: another Trainer for `model` (LoRA's,
    train/lora.py). Returns the trainer's TrainResult.

    Windows are as long as the model's context (up to `seq_len`): fine-tuned on 256-token
    windows, the pruned built-in model came back to +1.9 % perplexity on 256-token held-out
    windows but stayed +5.6 % on 512-token ones; 4 x 512 tokens a step fixes both at the same
    cost per step."""
    from tokenserve.config import TrainConfig
    from tokenserve.train.trainer import DistillTrainer, Trainer

    seq_len = min(seq_len, model.config.max_seq_len, len(stream) - 2)
    warmup = max(1, num_steps // 10) if warmup_steps is None else warmup_steps
    config = TrainConfig(seed=seed, seq_len=seq_len, batch_size=batch_size,
                         num_steps=num_steps, learning_rate=learning_rate,
                         warmup_steps=warmup, weight_decay=0.0,
                         eval_batches=1, checkpoint_every=max(num_steps, 1), precision="fp32")
    if trainer_class is not None:
        trainer = trainer_class(model, config, workdir)
    elif teacher is None:
        trainer = Trainer(model, config, workdir)
    else:
        trainer = DistillTrainer(model, teacher, config, workdir, distill_weight)
    return trainer.fit(stream, holdout, label="fine-tune")
