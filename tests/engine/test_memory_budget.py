"""The KV pool sized from a memory budget (bytes, or a fraction of the memory limit as vLLM's
gpu_memory_utilization), its dtype choice, the flags, and the runner allocating the plan;
what `tokenserve serve` does to its own footprint (start-up library pages, optional imports).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from support.tiny_models import tiny
from tokenserve.engine.config import EngineConfig
from tokenserve.engine.kv_budget import plan_kv_cache, resolve_kv_dtype
from tokenserve.errors import ConfigError

# GPT-2-small: 12 layers, 12 heads of 64 -> a K or V row of 768 values
GPT2 = dict(num_layers=12, kv_width=768, compute_dtype="float32", max_seq_len=1024)
F16_TOKEN = 12 * 2 * 768 * 2  # bytes per position in float16: 36,864


def test_auto_is_16_bits_under_any_compute_dtype():
    assert resolve_kv_dtype("auto", "float32") == "float16"
    assert resolve_kv_dtype("auto", "bfloat16") == "bfloat16"
    assert resolve_kv_dtype("float32", "float32") == "float32"
    with pytest.raises(ConfigError, match="bfloat16 compute"):
        resolve_kv_dtype("float16", "bfloat16")
    with pytest.raises(ConfigError):
        resolve_kv_dtype("int8", "float32")


def test_default_is_max_num_seqs_full_contexts_within_the_default_budget():
    plan = plan_kv_cache(EngineConfig(max_num_seqs=16), **GPT2, limit_bytes=64 << 30)
    assert plan.dtype == "float16" and plan.bytes_per_token == F16_TOKEN
    assert plan.num_tokens == 16 * 1024
    assert plan.num_bytes == (16 * 1024 + 16) * F16_TOKEN  # + the padding block
    # 32 full contexts would take 1,153 MiB (llama.cpp's f16 cache: 1,152 MiB): 768 MiB
    plan = plan_kv_cache(EngineConfig(max_num_seqs=32), **GPT2, limit_bytes=64 << 30)
    assert plan.num_bytes <= 768 << 20 < plan.num_bytes + 16 * F16_TOKEN
    assert "default budget" in plan.source
    # an eighth of a small machine, but never less than one full context
    plan = plan_kv_cache(EngineConfig(max_num_seqs=32), **GPT2, limit_bytes=2 << 30)
    assert plan.num_bytes <= 2 << 30 >> 3 and plan.num_tokens >= 4096
    plan = plan_kv_cache(EngineConfig(max_num_seqs=32), **GPT2, limit_bytes=64 << 20)
    assert plan.num_tokens == 1024


def test_capacity_from_a_byte_budget():
    budget = 600 * 2**20
    plan = plan_kv_cache(EngineConfig(kv_cache_memory_bytes=budget), **GPT2)
    block = 16 * F16_TOKEN
    assert plan.num_blocks == budget // block
    assert plan.num_bytes <= budget < plan.num_bytes + block  # fills the budget, never over
    assert plan.num_tokens == (budget // block - 1) * 16
    assert "600" in plan.source or f"{budget:,}" in plan.source
    wide = plan_kv_cache(EngineConfig(kv_cache_memory_bytes=budget, kv_cache_dtype="float32"),
                         **GPT2)
    assert wide.num_blocks == budget // (2 * block)  # float32: half the tokens
    assert "tokens" in plan.describe(1024) and "float16" in plan.describe(1024)


def test_capacity_from_a_memory_fraction():
    gib = 2**30
    config = EngineConfig(kv_cache_memory_fraction=0.5)
    plan = plan_kv_cache(config, **GPT2, used_bytes=1 * gib, limit_bytes=8 * gib)
    budget = 4 * gib - 1 * gib  # half of 8 GiB, less what the process already holds
    assert plan.num_blocks == budget // (16 * F16_TOKEN)
    assert plan.num_bytes <= budget
    with pytest.raises(ConfigError, match="at least one"):  # nothing left for the pool
        plan_kv_cache(config, **GPT2, used_bytes=5 * gib, limit_bytes=8 * gib)
    # memory the runner allocates after sizing the pool counts as in use
    head_copy = 77 * 2**20
    later = plan_kv_cache(config, **GPT2, used_bytes=1 * gib, limit_bytes=8 * gib,
                          reserved_bytes=head_copy)
    assert later.num_blocks == (budget - head_copy) // (16 * F16_TOKEN)


def test_explicit_tokens_win_and_sizes_exclude_each_other():
    plan = plan_kv_cache(EngineConfig(max_cache_tokens=100, block_size=16), **GPT2)
    assert plan.num_tokens == 112 and plan.source == "kv_cache_tokens"
    with pytest.raises(ConfigError, match="at most one"):
        EngineConfig(max_cache_tokens=1024, kv_cache_memory_bytes=2**30)
    with pytest.raises(ConfigError, match="at most one"):
        EngineConfig(kv_cache_memory_bytes=2**30, kv_cache_memory_fraction=0.5)


@pytest.mark.parametrize("options,match", [
    (dict(kv_cache_memory_fraction=0.0), "fraction"),
    (dict(kv_cache_memory_fraction=1.5), "fraction"),
    (dict(kv_cache_memory_bytes=0), "positive"),
    (dict(kv_cache_dtype="fp8"), "kv_cache_dtype"),
])
def test_bad_settings(options, match):
    with pytest.raises(ConfigError, match=match):
        EngineConfig(**options)


def test_a_budget_below_one_block_is_refused():
    with pytest.raises(ConfigError, match="at least one"):
        plan_kv_cache(EngineConfig(kv_cache_memory_bytes=16 * F16_TOKEN), **GPT2)


def test_flags_reach_the_engine_config():
    from tokenserve.cli.main import build_parser
    from tokenserve.cli.serve import llm_config_from_args

    args = build_parser().parse_args(["serve", "--kv_cache_dtype=bfloat16",
                                      "--kv_cache_memory_bytes=1000000000"])
    engine = llm_config_from_args(args).engine
    assert engine.kv_cache_dtype == "bfloat16" and engine.kv_cache_memory_bytes == 10**9
    args = build_parser().parse_args(["serve", "--kv_cache_memory_fraction", "0.8"])
    assert llm_config_from_args(args).engine.kv_cache_memory_fraction == 0.8
    assert llm_config_from_args(args).release_file_pages
    args = build_parser().parse_args(["serve", "--release_file_pages=false"])
    assert not llm_config_from_args(args).release_file_pages


def _run_python(code: str) -> dict:
    """Runs `code` in a fresh interpreter; returns the JSON it prints last."""
    done = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=600,
                          env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


def test_release_file_pages_keeps_anonymous_memory_and_working_code():
    result = _run_python("""
        import json
        import numpy as np
        import tensorflow as tf
        from tokenserve.observability.memory import release_file_pages

        def status():
            fields = dict(line.split(":", 1) for line in open("/proc/self/status"))
            return {k: int(fields[k].split()[0]) * 1024 for k in ("RssFile", "RssAnon")}

        x = np.arange(64, dtype=np.float32).reshape(8, 8)
        before_value = tf.linalg.matmul(x, x).numpy()
        before = status()
        released = release_file_pages()
        after = status()
        after_value = tf.linalg.matmul(x, x).numpy()  # TF's code pages come back on use
        print(json.dumps({"released": released, "before": before, "after": after,
                          "same": bool((before_value == after_value).all()),
                          "exact": bool((after_value == x.astype(np.float64) @ x).all())}))
    """)
    before, after = result["before"], result["after"]
    assert result["released"] > 100 * 2**20  # most of libtensorflow_cc.so's start-up pages
    assert after["RssFile"] < before["RssFile"] - 100 * 2**20
    assert abs(after["RssAnon"] - before["RssAnon"]) < 16 * 2**20  # no anonymous page goes
    assert result["same"] and result["exact"]


def test_cli_imports_tensorflow_without_its_optional_modules():
    result = _run_python("""
        import json, sys
        from tokenserve.cli.main import OPTIONAL_TENSORFLOW_IMPORTS, _load_tensorflow

        _load_tensorflow()
        import keras  # noqa: F401 - already imported by TensorFlow
        skipped = [name for name in OPTIONAL_TENSORFLOW_IMPORTS if name not in sys.modules]
        import h5py, matplotlib.pyplot  # noqa: E401, F401 - still importable afterwards
        print(json.dumps({"skipped": skipped, "names": list(OPTIONAL_TENSORFLOW_IMPORTS)}))
    """)
    assert result["skipped"] == result["names"] == ["matplotlib", "h5py"]


def test_runner_allocates_the_planned_pool(tokenizer):
    from tokenserve.engine.runner import ModelRunner

    model, config = tiny("tiny-llama", tokenizer)
    c = config.model
    token_bytes = c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    budget = 50 * 4 * token_bytes + 123  # 50 blocks of 4, and a little over
    runner = ModelRunner(model, config, EngineConfig(block_size=4, precision="float32",
                                                     kv_cache_memory_bytes=budget))
    assert runner.cache.capacity_tokens == 49 * 4  # the padding block is not usable
    caches = [v for pair in runner.step.caches for v in pair]
    assert {v.dtype.name for v in caches} == {"float16"}
    allocated = sum(v.shape.num_elements() * v.dtype.size for v in caches)
    assert allocated == runner.kv_plan.num_bytes <= budget


@pytest.mark.parametrize("screen_rows,screen", [(8, "int8"), (8, "float16"), (0, "int8")])
def test_a_memory_fraction_counts_the_lm_heads_screen_copy(tokenizer, monkeypatch,
                                                           screen_rows, screen):
    from tokenserve.engine import kv_budget
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.kernels import head_screen

    if screen_rows and not head_screen.is_compiled():
        pytest.skip(f"no screen without the op: {head_screen.kernel_status()}")
    model, config = tiny("tiny-llama", tokenizer)
    c = config.model
    block_bytes = 4 * c.num_layers * 2 * c.num_kv_heads * c.head_dim * 2
    gib = 2**30
    monkeypatch.setattr(kv_budget, "resident_bytes", lambda: gib)
    monkeypatch.setattr(kv_budget, "memory_limit_bytes", lambda: 2 * gib)
    runner = ModelRunner(model, config, EngineConfig(
        block_size=4, precision="float32", kv_cache_memory_fraction=0.5 + 2e-4,
        max_screened_head_rows=screen_rows, head_screen=screen))
    budget = int((0.5 + 2e-4) * 2 * gib) - gib  # about 430 kB
    head = runner.step.screened_head
    assert (head is not None) == bool(screen_rows)
    held = head.nbytes if head else 0
    # int8: a byte a weight, a scale and a bound per row; float16: two bytes, a bound
    per_weight, per_row = (1, 8) if screen == "int8" else (2, 4)
    assert held == (per_weight * c.vocab_size * c.hidden_size + per_row * c.vocab_size
                    if head else 0)
    assert runner.kv_plan.num_blocks == (budget - held) // block_bytes
