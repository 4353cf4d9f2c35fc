"""A model whose every layer has a sliding window gives back the KV blocks all its layers
have left behind: the blocks a sequence holds stay flat however long it runs, the prefix
cache stays exact, and the engine's tokens do not change. Accounting first (no TF), then a
tiny all-windowed Mistral on the engine."""

from __future__ import annotations

import pytest

from support.engines import BLOCK
from tokenserve.engine.cache_accounting import BlockAllocator
from tokenserve.engine.prefix_cache import PrefixCachingAllocator, hash_namespace
from tokenserve.engine.request import Request
from tokenserve.sampling import SamplingParams

WINDOW = 6


def grow(cache, seq, num_steps: int) -> list[int]:
    """Decodes `seq` one token at a time; the blocks it holds after each step."""
    held = []
    for step in range(num_steps):
        assert cache.reserve(seq, 1)
        seq.num_computed_tokens += 1
        seq.token_ids.append(1000 + step)
        held.append(sum(1 for block in seq.block_ids if block))
    return held


@pytest.mark.parametrize("kind", [BlockAllocator, PrefixCachingAllocator])
def test_blocks_behind_the_window_are_given_back_and_none_twice(kind):
    cache = kind(32, BLOCK)
    cache.window = WINDOW
    seq = Request("r", [5, 6, 7], SamplingParams()).seqs[0]
    held = grow(cache, seq, 60)
    # the query at p reads p - 5 .. p: at most two blocks of 4 cover them, plus the new one
    assert max(held[10:]) <= -(-WINDOW // BLOCK) + 1
    assert seq.block_ids[0] == 0 and len(seq.block_ids) == -(-seq.num_computed_tokens // BLOCK)
    live = [block for block in seq.block_ids if block]
    first_live = seq.block_ids.index(live[0])
    assert (first_live + 1) * BLOCK > seq.num_computed_tokens - WINDOW  # still in the window
    cache.free(seq)
    assert cache.num_free_blocks == 31  # every block back once, block 0 never handed out


def test_without_a_window_nothing_is_given_back():
    cache = BlockAllocator(32, BLOCK)
    seq = Request("r", [5, 6, 7], SamplingParams()).seqs[0]
    assert grow(cache, seq, 40)[-1] == 40 // BLOCK


def test_released_blocks_stay_findable_in_the_prefix_cache():
    cache = PrefixCachingAllocator(64, BLOCK, hash_namespace("m", "1", "float", "f32"))
    cache.window = WINDOW
    prompt = list(range(40))
    first = Request("a", prompt, SamplingParams()).seqs[0]
    assert cache.reserve(first, 20)  # a first chunk of the prompt
    first.num_computed_tokens = 20
    assert cache.reserve(first, 20)  # the second: blocks wholly before 15 are released
    assert first.block_ids[:3] == [0, 0, 0]
    first.num_computed_tokens = 40
    cache.free(first)
    again = Request("b", prompt + [7], SamplingParams()).seqs[0]
    assert cache.match_prefix(again) == 40  # the released blocks were cached, not lost
    assert 0 not in again.block_ids


def test_all_windowed_engine_holds_flat_memory_and_keeps_its_tokens(tokenizer, tmp_path):
    """A tiny Mistral (every layer windowed) on a KV pool far smaller than its sequences:
    without giving blocks back it could not finish them; the tokens equal a full forward
    pass's, with and without the prefix cache."""
    import dataclasses

    from support.engines import engine_config
    from support.tiny_models import reference_greedy
    from tokenserve.config import GenerationConfig, llama_config
    from tokenserve.engine.llm import LLM
    from tokenserve.export.exporter import export_model
    from tokenserve.model import build_model

    architecture = dataclasses.replace(
        llama_config(vocab_size=400, max_seq_len=256, hidden_size=32, num_layers=2,
                     num_heads=2, num_kv_heads=1, intermediate_size=48),
        sliding_windows=(WINDOW, WINDOW))
    model = build_model(architecture, seed=0)
    config = GenerationConfig(model=architecture, bos_token_id=tokenizer.bos_token_id,
                              eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=tokenizer.pad_token_id, name="windowed")
    version = export_model(model, tokenizer, config, tmp_path, jit_compile=False)
    prompts = [list(range(3, 30)), list(range(100, 120))]
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = [reference_greedy(model, p, 40, eos=-1) for p in prompts]
    # 12 blocks of 4 positions: 48 rows for two sequences of 60 and 67 positions; the
    # prefix cache on, so released blocks are also registered and later evicted
    llm = LLM(version, engine_config(max_cache_tokens=12 * BLOCK, enable_prefix_caching=True))
    cache = llm.engine.runner.cache
    assert cache.window == WINDOW
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert cache.num_free_blocks == cache.num_usable_blocks
    again = llm.generate(prompts[:1], params, use_tqdm=False)[0]  # its blocks found again
    assert again.outputs[0].token_ids == expected[0]
