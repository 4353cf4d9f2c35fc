"""Scheduler and engine control flow with a fake runner: plain Python, no TensorFlow."""

from __future__ import annotations

import sys

import numpy as np
import pytest

from tokenserve.config import GenerationConfig, preset
from tokenserve.engine.cache_accounting import BlockAllocator
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.llm import LLM
from tokenserve.engine.outputs import FinishReason
from tokenserve.engine.request import Request, SequenceStatus
from tokenserve.engine.scheduler import Scheduler
from tokenserve.errors import PromptTooLongError, QueueFullError
from tokenserve.sampling import SamplingParams

VOCAB = 512


class FakeRunner:
    """Stands in for the TF runner: logits always favour token (last token + 1) % 500 + 10."""

    def __init__(self, engine_config: EngineConfig, num_blocks: int = 64, block_size: int = 4):
        self.config = GenerationConfig(model=preset("tiny-gpt2"), bos_token_id=1, eos_token_id=2,
                                       pad_token_id=0)
        self.cache = BlockAllocator(num_blocks, block_size)
        self.executed: list[list[tuple[str, int]]] = []

    def execute(self, out):
        self.executed.append([(s.seq.request.request_id, s.num_new_tokens) for s in out.scheduled])
        logits = np.zeros([len(out.scheduled), VOCAB], np.float32)
        for row, s in enumerate(out.scheduled):
            last = s.seq.token_ids[s.seq.num_computed_tokens + s.num_new_tokens - 1]
            logits[row, (last + 1) % 500 + 10] = 1.0
        return logits


class FakeTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(f"<{i}>" for i in ids)


def engine(num_blocks=64, **options) -> LLMEngine:
    config = EngineConfig(block_size=4, **options)
    return LLMEngine(FakeRunner(config, num_blocks), FakeTokenizer(), config)


def run(eng: LLMEngine, max_steps: int = 200) -> dict:
    """Steps until idle; the full (accumulated) output of each finished request."""
    outputs = {}
    for _ in range(max_steps):
        if not eng.has_work:
            break
        for delta in eng.step():
            LLM._accumulate(outputs, delta)
    return {name: out for name, out in outputs.items() if out.finished}


def add(eng, request_id, prompt_len=4, max_tokens=4, priority=0, **params):
    request = eng.make_request(list(range(10, 10 + prompt_len)),
                               SamplingParams(max_tokens=max_tokens, **params), request_id,
                               priority=priority)
    eng.add_request(request)
    return request


def test_schedule_is_first_come_first_served_within_a_priority():
    eng = engine(max_num_seqs=2)
    for name in "abc":
        add(eng, name)
    eng.step()
    assert [r for r, _ in eng.runner.executed[0]] == ["a", "b"]
    assert set(run(eng)) == {"a", "b", "c"}


def test_higher_priority_is_admitted_first():
    eng = engine(max_num_seqs=1)
    add(eng, "low", priority=0)
    add(eng, "high", priority=5)
    eng.step()
    assert eng.runner.executed[0] == [("high", 4)]


def test_prefill_is_chunked_by_the_token_budget_and_decodes_go_first():
    eng = engine(max_num_batched_tokens=8, max_num_seqs=4)
    add(eng, "short", prompt_len=2, max_tokens=8)
    eng.step()  # short prefills (2 tokens) and samples its first token
    add(eng, "long", prompt_len=20)
    eng.step()
    # one decode token for "short", then 7 of long's 20 prompt tokens
    assert eng.runner.executed[1] == [("short", 1), ("long", 7)]
    eng.step()
    assert eng.runner.executed[2] == [("short", 1), ("long", 7)]


def test_abort_frees_the_cache_at_once():
    eng = engine(num_blocks=9)  # 8 usable blocks of 4
    add(eng, "a", prompt_len=12, max_tokens=8)
    eng.step()
    assert eng.scheduler.cache.num_free_blocks < 8
    final = eng.abort("a")
    assert final.finished and final.outputs[0].finish_reason is FinishReason.ABORT
    assert eng.scheduler.cache.num_free_blocks == 8
    assert not eng.has_work


def test_full_cache_preempts_the_latest_request_by_recompute_and_outputs_are_unchanged():
    alone = run(_two_requests(engine(num_blocks=64)))
    tight = _two_requests(engine(num_blocks=6))  # 5 usable blocks = 20 positions
    finished = run(tight)
    assert tight.scheduler.num_preemptions > 0
    for name in ("first", "second"):
        assert finished[name].outputs[0].token_ids == alone[name].outputs[0].token_ids
        assert len(finished[name].outputs[0].token_ids) == 8
    assert tight.scheduler.cache.num_free_blocks == 5


def _two_requests(eng):
    add(eng, "first", prompt_len=6, max_tokens=8)
    add(eng, "second", prompt_len=6, max_tokens=8)
    return eng


def test_priority_preemption_evicts_lower_priority_running_work():
    eng = engine(num_blocks=64, max_num_seqs=1, preempt_for_priority=True)
    add(eng, "low", max_tokens=20)
    eng.step()
    add(eng, "urgent", priority=10)
    eng.step()
    assert eng.runner.executed[1] == [("urgent", 4)]
    assert eng.scheduler.num_preemptions == 1
    finished = run(eng)
    assert finished["low"].outputs[0].finish_reason is FinishReason.LENGTH
    assert finished["low"].metrics["num_preemptions"] == 1


def test_without_priority_preemption_running_work_is_not_evicted():
    eng = engine(max_num_seqs=1)
    add(eng, "low", max_tokens=5)
    eng.step()
    add(eng, "urgent", priority=10)
    eng.step()
    assert eng.runner.executed[1] == [("low", 1)]


def test_queue_limit_by_requests_rejects_at_once():
    eng = engine(max_queue_requests=2)
    add(eng, "a")
    add(eng, "b")
    with pytest.raises(QueueFullError, match="queue is full"):
        add(eng, "c")
    eng.step()  # both admitted: the queue has room again
    add(eng, "c")


def test_queue_limit_by_tokens():
    eng = engine(max_queue_tokens=10)
    add(eng, "a", prompt_len=6)
    with pytest.raises(QueueFullError, match="prompt tokens"):
        add(eng, "b", prompt_len=6)


def test_deadline_aborts_a_request():
    eng = engine()
    request = add(eng, "slow", max_tokens=50)
    eng.step()
    request.deadline = 0.0  # already past
    outputs = eng.step()
    assert outputs[0].finished and outputs[0].outputs[0].finish_reason is FinishReason.ABORT
    assert not eng.has_work and eng.scheduler.cache.num_free_blocks == 63


def test_prompt_too_long_is_refused_before_queueing():
    eng = engine()
    with pytest.raises(PromptTooLongError, match="maximum context length is 128"):
        add(eng, "x", prompt_len=100, max_tokens=29)


def test_n_sequences_share_a_request_and_finish_together():
    eng = engine()
    add(eng, "multi", n=3, max_tokens=3)
    finished = run(eng)
    out = finished["multi"]
    assert sorted(c.index for c in out.outputs) == [0, 1, 2]
    assert out.num_generated_tokens == 9


def test_stop_token_ids_and_length_finish_reasons():
    eng = engine()
    add(eng, "stops", prompt_len=4, max_tokens=10, stop_token_ids=[35])  # 13 -> 24 -> 35
    add(eng, "runs", prompt_len=4, max_tokens=3)
    finished = run(eng)
    assert finished["stops"].outputs[0].finish_reason is FinishReason.STOP
    assert finished["stops"].outputs[0].stop_reason == 35
    assert finished["runs"].outputs[0].finish_reason is FinishReason.LENGTH


def test_block_allocator_never_hands_out_the_padding_block():
    cache = BlockAllocator(4, 2)
    eng_request = Request("r", [1, 2, 3], SamplingParams())
    seq = eng_request.seqs[0]
    assert cache.reserve(seq, 6)
    assert 0 not in seq.block_ids and sorted(seq.block_ids) == [1, 2, 3]
    assert not cache.reserve(seq, 8)  # 4 blocks needed, 3 usable
    cache.free(seq)
    assert cache.num_free_blocks == 3 and seq.status is SequenceStatus.WAITING


def test_the_scheduler_imports_no_tensorflow():
    import subprocess

    code = ("import sys, tokenserve.engine.core, tokenserve.engine.scheduler; "
            "assert 'tensorflow' not in sys.modules, 'tensorflow was imported'")
    subprocess.run([sys.executable, "-c", code], check=True)
