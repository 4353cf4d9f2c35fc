"""AsyncEncoder: many callers' inputs run in shared batches with the same numbers as alone;
admission refuses by the queue's limits (QueueFullError: 429) and bad inputs by name; a
cancelled caller leaves the queue; shutdown fails what waits; no TensorFlow above the
runner."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import numpy as np
import pytest

from tokenserve.encoder_config import EncodedInput
from tokenserve.engine.encoder_batch_config import EncoderBatchConfig
from tokenserve.engine.encoder_batcher import AsyncEncoder
from tokenserve.errors import (EngineDeadError, InvalidRequestError, PromptTooLongError,
                               QueueFullError)
from tokenserve.stats import StatsSink

TEXTS = ["def add(a, b):", "return a + b", "class Point:", "x", "for item in items:",
         "import os", "print(item) " * 8, "ünïcödé 日本語"]


class Recorder(StatsSink):
    def __init__(self):
        self.steps, self.requests = [], []

    def on_step(self, stats) -> None:
        self.steps.append(stats)

    def on_request(self, stats) -> None:
        self.requests.append(stats)


def make(path, **batch) -> tuple[AsyncEncoder, Recorder]:
    recorder = Recorder()
    # shapes compile when first met: a test compiles the few it uses, not the warm-up's set
    return AsyncEncoder.from_model_dir(path, EncoderBatchConfig(warm_up=False, **batch),
                                       stats=recorder,
                                       model_name="embed", version="1"), recorder


def test_concurrent_requests_share_batches_and_equal_single_runs(tiny_encoders):
    encoder, recorder = make(tiny_encoders["embed"], batch_wait_s=0.05, max_batch_inputs=8)
    try:
        inputs = [encoder.tokenizer.encode(t) for t in TEXTS]
        alone = [encoder.runner.run(np.asarray([x.token_ids], np.int32),
                                    np.ones((1, len(x.token_ids)), np.int32),
                                    np.zeros((1, len(x.token_ids)), np.int32))[0]
                 for x in inputs]

        async def many():
            return await asyncio.gather(*(encoder.encode([x]) for x in inputs),
                                        encoder.encode(inputs))
        *singles, together = asyncio.run(many())
        np.testing.assert_allclose(np.concatenate(singles), np.stack(alone), atol=1e-5)
        np.testing.assert_allclose(together, np.stack(alone), atol=1e-5)
        assert len(recorder.requests) == len(TEXTS) + 1
        assert sum(s.num_running for s in recorder.steps) == 2 * len(TEXTS)
        assert max(s.num_running for s in recorder.steps) > 1  # shared, not one by one
        assert sorted(r.num_prompt_tokens for r in recorder.requests)[-1] == sum(
            len(x.token_ids) for x in inputs)
        assert all(r.scheduled_time is not None and r.first_token_time is None
                   for r in recorder.requests)
        # one program per padded (rows, length) shape, traced once; a repeat reuses it
        programs = dict(encoder.runner.programs)
        assert programs and all(shape[1] in (16, 24, 32, 48) and shape[0] in (1, 4, 8)
                                for shape in programs)
        ids = np.full((1, 5), 7, np.int32)  # the (1, 16) shape the single runs compiled
        again = encoder.runner.run(ids, np.ones_like(ids), np.zeros_like(ids))
        assert encoder.runner.programs == programs and again.shape == (1, 32)
    finally:
        encoder.shutdown()


def test_admission_refuses_by_queue_limits_and_bad_inputs_by_name(tiny_encoders):
    encoder, recorder = make(tiny_encoders["embed"], max_queue_tokens=8)
    try:
        def encode(inputs):
            return asyncio.run(encoder.encode(inputs))

        with pytest.raises(QueueFullError):
            encode([EncodedInput.from_ids([5] * 9)])
        with pytest.raises(PromptTooLongError, match="at most 48"):
            encode([EncodedInput.from_ids([5] * 49)])
        with pytest.raises(InvalidRequestError, match="outside the vocabulary"):
            encode([EncodedInput.from_ids([5, 10_000])])
        with pytest.raises(InvalidRequestError, match="no tokens"):
            encode([EncodedInput.from_ids([])])
        with pytest.raises(InvalidRequestError, match="empty"):
            encode([])
        assert encode([EncodedInput.from_ids([5] * 8)]).shape == (1, 32)  # still serving
        assert len(recorder.requests) == 1
    finally:
        encoder.shutdown()


def test_a_cancelled_caller_leaves_the_queue_and_shutdown_fails_the_rest(tiny_encoders):
    # a long batch wait keeps the loop from taking the inputs before the cancel
    encoder, _ = make(tiny_encoders["embed"], batch_wait_s=30.0)

    async def scenario():
        first = asyncio.ensure_future(encoder.encode([EncodedInput.from_ids([5, 6])]))
        await asyncio.sleep(0)
        assert encoder.num_unfinished == 1
        first.cancel()
        await asyncio.gather(first, return_exceptions=True)
        assert encoder.num_unfinished == 0
        second = asyncio.ensure_future(encoder.encode([EncodedInput.from_ids([5, 6])]))
        await asyncio.sleep(0)
        await asyncio.to_thread(encoder.shutdown)
        with pytest.raises(EngineDeadError):
            await second
        with pytest.raises(EngineDeadError):
            await encoder.encode([EncodedInput.from_ids([5])])
    asyncio.run(scenario())


def test_the_batcher_and_the_encoder_routes_import_no_tensorflow():
    code = ("import sys, tokenserve.engine.encoder_batcher, "
            "tokenserve.server.openai.routes_embeddings; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
