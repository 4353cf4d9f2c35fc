"""Training is reproducible from its seed and resumes exactly where it stopped."""

import dataclasses

import numpy as np
import pytest

from support.tiny_models import TINY_TEXT
from tokenserve.config import TrainConfig, preset
from tokenserve.model import build_model
from tokenserve.train.corpus import is_holdout, stdlib_files, token_stream
from tokenserve.train.trainer import Trainer, batch_at

CONFIG = TrainConfig(seed=3, seq_len=16, batch_size=2, num_steps=6, warmup_steps=2,
                     checkpoint_every=100, precision="fp32", eval_batches=2)


def train(tokenizer, checkpoints, stops=(), seed=CONFIG.seed):
    stream = token_stream(TINY_TEXT, tokenizer)
    config = dataclasses.replace(CONFIG, seed=seed)
    result = None
    for stop in [*stops, None]:
        model = build_model(preset("tiny-llama"), seed=seed)
        result = Trainer(model, config, checkpoints).fit(stream, stream[:200], stop_at=stop)
    return model, result


def test_interrupted_and_resumed_run_equals_uninterrupted_run(tokenizer, tmp_path):
    straight, result = train(tokenizer, tmp_path / "a")
    resumed, _ = train(tokenizer, tmp_path / "b", stops=[2, 4])
    for a, b in zip(straight.weights, resumed.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    assert result.steps == 6 and np.isfinite(result.holdout_perplexity)


@pytest.mark.slow  # three training runs; resume-equals-uninterrupted checks determinism
def test_same_seed_same_weights_other_seed_other_weights(tokenizer, tmp_path):
    first, _ = train(tokenizer, tmp_path / "a")
    second, _ = train(tokenizer, tmp_path / "b")
    other, _ = train(tokenizer, tmp_path / "c", seed=CONFIG.seed + 1)
    for a, b in zip(first.weights, second.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy(), err_msg=a.path)
    # another seed: other initial weights and other batches, so other trained weights
    differing = [a.path for a, c in zip(first.weights, other.weights)
                 if not np.array_equal(a.numpy(), c.numpy())]
    assert len(differing) == len(first.weights)
    assert not np.array_equal(batch_at(np.arange(1000), 0, 1, 2, 16)[0],
                              batch_at(np.arange(1000), 0, 2, 2, 16)[0])


def test_loss_goes_down(tokenizer, tmp_path):
    stream = token_stream(TINY_TEXT, tokenizer)
    model = build_model(preset("tiny-llama"), seed=0)
    config = TrainConfig(seed=0, seq_len=32, batch_size=4, num_steps=40, warmup_steps=4,
                         learning_rate=3e-3, precision="fp32", checkpoint_every=100,
                         eval_batches=1)
    before = Trainer(model, config, tmp_path / "x")
    from tokenserve.train.trainer import holdout_windows, perplexity
    windows = holdout_windows(stream, 32, 4)
    start = perplexity(model, windows)
    before.fit(stream, stream)
    assert perplexity(model, windows) < start / 4


def test_corpus_is_the_stdlib_with_a_stable_holdout():
    files = stdlib_files()
    assert any(f.name == "json" or f.parent.name == "json" for f in files)
    assert not any("site-packages" in f.parts or "test" in f.parts for f in files)
    assert files == sorted(files)
    held = [f for f in files if is_holdout(f.name, 0.05)]
    assert 0 < len(held) < len(files) / 5
