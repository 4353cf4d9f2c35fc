"""Weights on 2 MiB pages (huge_pages.py): the span arithmetic, the kernel really backing a
TF tensor's buffer with huge pages, and the runner's wiring (same tokens, every weight byte
asked for)."""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from tokenserve.huge_pages import HUGE_PAGE, huge_page_spans, thp_mode

MIB = 2**20


def test_spans_round_out_merge_and_stay_inside_their_mapping():
    base = 64 * HUGE_PAGE
    mappings = [(base - 5000, base + 10 * HUGE_PAGE + 123),   # aligned interior: base .. +10
                (base + 20 * HUGE_PAGE, base + 30 * HUGE_PAGE)]
    ranges = [(base + 100, base + 200),                        # page 0
              (base + HUGE_PAGE - 10, base + 2 * HUGE_PAGE + 1),  # pages 0-2: merges with it
              (base + 5 * HUGE_PAGE + 7, base + 6 * HUGE_PAGE),   # page 5 alone
              (base + 9 * HUGE_PAGE + 5, base + 11 * HUGE_PAGE),  # page 10 ends past the map
              (base + 15 * HUGE_PAGE, base + 16 * HUGE_PAGE),     # in no mapping
              (base + 25 * HUGE_PAGE, base + 25 * HUGE_PAGE)]     # empty
    assert huge_page_spans(ranges, mappings) == [
        (base, base + 3 * HUGE_PAGE), (base + 5 * HUGE_PAGE, base + 6 * HUGE_PAGE),
        (base + 9 * HUGE_PAGE, base + 10 * HUGE_PAGE)]


def test_buffer_span_is_the_tensors_own_bytes_not_a_copy():
    import tensorflow as tf

    from tokenserve.engine.runner import buffer_span

    values = np.arange(3 * 1000, dtype=np.int8).reshape(3, 1000)
    variable = tf.Variable(values)
    for dtype in ("float32", "int8", "float16", "bfloat16"):
        tensor = tf.cast(tf.reshape(tf.range(6000), [6, 1000]), dtype)
        start, end = buffer_span(tensor)
        assert end - start == 6000 * tensor.dtype.size
        assert ctypes.string_at(start, end - start) == tensor.numpy().tobytes()
    # two reads of a variable share its buffer (what the runner collapses is what steps read)
    first, second = buffer_span(tf.convert_to_tensor(variable)), buffer_span(variable.value())
    assert first == second
    assert ctypes.string_at(first[0], first[1] - first[0]) == values.tobytes()


@pytest.mark.skipif(thp_mode() in (None, "never"), reason=f"THP mode {thp_mode()}")
def test_a_tf_variable_ends_up_on_huge_pages_with_its_contents_unchanged():
    # a fresh interpreter: its AnonHugePages start from what it allocated itself
    done = subprocess.run([sys.executable, "-c", textwrap.dedent("""
        import json
        import numpy as np
        import tensorflow as tf
        from tokenserve.engine.runner import buffer_span
        from tokenserve.huge_pages import back_with_huge_pages

        values = np.random.default_rng(0).integers(-128, 128, (4096, 4096), dtype=np.int8)
        variable = tf.Variable(values)
        start, end = buffer_span(tf.convert_to_tensor(variable))
        report = back_with_huge_pages([(start, end)])
        huge = 0  # AnonHugePages of the mappings overlapping the variable (the advice
        overlaps = False  # splits a mapping where the 2 MiB pages begin and end)
        for line in open("/proc/self/smaps"):
            head = line.split()[0]
            if "-" in head and ":" not in head:
                low, high = (int(x, 16) for x in head.split("-"))
                overlaps = low < end and start < high
            elif overlaps and head == "AnonHugePages:":
                huge += int(line.split()[1]) * 1024
        print(json.dumps(dict(requested=report.requested_bytes, advised=report.advised_bytes,
                              grown=report.huge_bytes, mapping_huge=huge,
                              reason=report.reason,
                              same=bool(np.array_equal(variable.numpy(), values)))))
    """)], capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.splitlines()[-1])
    assert result["same"]
    # rounded out to 2 MiB pages, less those that stick out of the variable's own mapping
    assert result["requested"] == 16 * MIB and result["advised"] >= 12 * MIB
    if result["reason"] and "EINVAL" in result["reason"]:
        pytest.skip(f"no MADV_COLLAPSE in this kernel: {result['reason']}")
    # all but the partial 2 MiB pages at the two ends (at most 4 MiB)
    assert result["mapping_huge"] >= 12 * MIB, result
    assert result["grown"] >= 12 * MIB, result


def test_the_runner_asks_for_every_weight_and_decodes_the_same_tokens(tokenizer):
    from conftest import tiny
    from tokenserve.engine.config import EngineConfig
    from tokenserve.engine.core import LLMEngine
    from tokenserve.engine.runner import ModelRunner
    from tokenserve.sampling import SamplingParams

    model, config = tiny("tiny-gpt2", tokenizer)
    outputs = {}
    for huge in (False, True):
        runner = ModelRunner(model, config, EngineConfig(block_size=4, precision="float32",
                                                         huge_pages=huge))
        if huge:
            weight_bytes = sum(w.numpy().nbytes for w in model.weights)
            # every weight once (the steps' reads alias the variables), plus the float16
            # copy of the head where greedy steps screen it
            screen = runner.step.screened_head
            assert runner.huge_pages.requested_bytes == weight_bytes + (
                screen.halves.shape.num_elements() * 2 if screen is not None else 0)
        else:
            assert runner.huge_pages is None
        engine = LLMEngine(runner, tokenizer, runner.engine_config)
        engine.add_request(engine.make_request(tokenizer.encode("def add(a, b):"),
                                               SamplingParams(max_tokens=12, ignore_eos=True)))
        while engine.has_work:  # outputs are deltas
            for out in engine.step():
                outputs.setdefault(huge, []).extend(out.outputs[0].token_ids)
    assert len(outputs[True]) == 12 and outputs[True] == outputs[False]


def test_the_flag_reaches_the_engine_config():
    from tokenserve.cli.main import build_parser
    from tokenserve.cli.serve import llm_config_from_args

    assert llm_config_from_args(build_parser().parse_args(["serve"])).engine.huge_pages
    for flag in ("--nohuge_pages", "--huge_pages=false"):
        args = build_parser().parse_args(["serve", flag])
        assert not llm_config_from_args(args).engine.huge_pages
