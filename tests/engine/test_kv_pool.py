"""The KV pool's pages stay with the OS until blocks are written: resident memory grows with
use, every row still reads as zeros until written, and the engine's output is unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import tensorflow as tf

from support.tiny_models import tiny
from tokenserve.engine.cache_accounting import BlockAllocator
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.core import LLMEngine
from tokenserve.engine.llm import LLM
from tokenserve.engine.prefix_cache import PrefixCachingAllocator, hash_namespace
from tokenserve.engine.request import Request
from tokenserve.engine.runner import ModelRunner
from tokenserve.engine.step.kv_pool import make_kv_pool
from tokenserve.sampling import SamplingParams

MIB = 2**20


def status(field: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(f"{field}:"):
            return int(line.split()[1]) * 1024
    pytest.skip("no /proc/self/status")


def rss_anon() -> int:
    return status("RssAnon")


@pytest.mark.parametrize("lazy", [True, False])
def test_pool_pages_become_resident_only_as_rows_are_written(lazy):
    rows, width = 32768, 512  # 32 MiB per variable in float16, 128 MiB in all
    before, peak_before = rss_anon(), status("VmHWM")
    pool = make_kv_pool(2, rows, width, tf.float16, lazy_pages=lazy)
    grown = rss_anon() - before
    if lazy:
        assert grown < 16 * MIB, grown
        # each variable's fill is given back before the next is made: the peak holds one
        assert status("VmHWM") - peak_before < 48 * MIB
    else:
        assert grown > 120 * MIB, grown
    key = pool[0][0]
    # a block written: its rows hold the values, every other row still reads zeros
    written = np.arange(64, 128)
    values = np.random.default_rng(0).standard_normal([64, width]).astype(np.float16)
    key.scatter_nd_update(written[:, None], values)
    after = rss_anon() - before
    got = key.numpy()
    np.testing.assert_array_equal(got[written], values)
    got[written] = 0
    assert not got.any()
    assert not any(v.numpy().any() for pair in pool for v in pair if v is not key)
    if lazy:
        assert after - grown < 8 * MIB  # the written pages, not the variable


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_blocks_written_are_the_lowest_ids_ever_handed_out(prefix_caching):
    cache = (PrefixCachingAllocator(64, 4, hash_namespace("m", "1", "float", "f16"))
             if prefix_caching else BlockAllocator(64, 4))
    assert cache.num_blocks_written == 1  # the padding block
    rng = np.random.default_rng(0)
    live, taken = [], {0}
    for step in range(200):
        if live and (rng.random() < 0.45 or cache.num_free_blocks < 8):
            seq = live.pop(int(rng.integers(len(live))))
            seq.num_computed_tokens = seq.num_tokens
            cache.free(seq)
            continue
        prompt = rng.integers(0, 50, int(rng.integers(1, 24))).tolist()
        seq = Request(f"r{step}", prompt, SamplingParams()).seqs[0]
        if prefix_caching:
            cache.match_prefix(seq)
        assert cache.reserve(seq, seq.num_pending_tokens)
        taken.update(seq.block_ids)
        live.append(seq)
        # freed blocks are handed out again before fresh ones: the ids used stay 0 .. n-1
        assert taken == set(range(cache.num_blocks_written))
    # with prefix caching freed full blocks stay cached, so fresh ones go first: all get used
    assert cache.num_blocks_written == 64 if prefix_caching else cache.num_blocks_written < 64


PROMPTS = ["the cat sat on", "a dog ran", "hello world and more words here"]


def engine_tokens(model, config, tokenizer, lazy: bool) -> list[list[int]]:
    engine_config = EngineConfig(max_num_seqs=4, block_size=4, precision="float32",
                                 kv_cache_memory_bytes=16 * MIB, kv_cache_lazy_pages=lazy)
    llm = LLM.__new__(LLM)
    llm.engine = LLMEngine(ModelRunner(model, config, engine_config), tokenizer,
                           engine_config)
    llm.tokenizer, llm._num_requests = tokenizer, 0
    runner = llm.engine.runner
    pool_bytes = runner.kv_plan.num_bytes
    assert runner.memory_bytes()["kv_cache"] == (pool_bytes // runner.kv_plan.num_blocks
                                                 if lazy else pool_bytes)
    outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=12, ignore_eos=True),
                           use_tqdm=False)
    held = runner.memory_bytes()["kv_cache"]  # a lazy pool: the blocks written, at most
    assert (0 < held < pool_bytes / 4) if lazy else held == pool_bytes
    return [o.outputs[0].token_ids for o in outputs]


def test_the_engine_generates_the_same_tokens_over_a_lazy_pool(tokenizer):
    model, config = tiny("tiny-llama", tokenizer)
    assert (engine_tokens(model, config, tokenizer, lazy=True)
            == engine_tokens(model, config, tokenizer, lazy=False))


def test_the_flag_reaches_the_engine_config():
    from tokenserve.cli.main import build_parser
    from tokenserve.cli.serve import llm_config_from_args

    args = build_parser().parse_args(["serve"])
    assert llm_config_from_args(args).engine.kv_cache_lazy_pages
    args = build_parser().parse_args(["serve", "--kv_cache_lazy_pages=false"])
    assert not llm_config_from_args(args).engine.kv_cache_lazy_pages
