"""Benchmark metric definitions against hand-computed cases (vLLM bench serve's formulas)."""

from __future__ import annotations

import math
import random

import pytest

from tokenserve.bench.client import ClientConfig, RequestResult, request_body
from tokenserve.bench.dataset import (BenchRequest, file_dataset, load_tokenizer,
                                      random_dataset, sample_lengths, sharegpt_dataset)
from tokenserve.bench.load import LoadConfig, arrival_offsets
from tokenserve.bench.metrics import calculate_metrics, parse_goodput


def output(ttft, itl, latency, output_tokens=None, start=0.0, prompt_len=10, text=""):
    return RequestResult(success=True, prompt_len=prompt_len, output_tokens=output_tokens,
                         ttft=ttft, itl=list(itl), latency=latency, start_time=start,
                         generated_text=text)


def test_hand_computed_run():
    outputs = [
        # 5 tokens: TPOT = (1.0 - 0.2) / 4 = 0.2
        output(0.2, [0.2, 0.2, 0.2, 0.2], 1.0, output_tokens=5, start=0.0),
        # 3 tokens: TPOT = (0.9 - 0.5) / 2 = 0.2, from uneven gaps
        output(0.5, [0.1, 0.3], 0.9, output_tokens=3, start=0.5, prompt_len=20),
        # a single token: no TPOT sample, but a TTFT and an E2E sample
        output(0.3, [], 0.3, output_tokens=1, start=1.0, prompt_len=30),
        RequestResult(success=False, error="HTTP 500"),
    ]
    metrics = calculate_metrics(outputs, duration_s=2.0, percentiles=(50, 99))
    assert (metrics.completed, metrics.failed) == (3, 1)
    assert metrics.total_input == 60
    assert metrics.total_output == 9
    assert metrics.output_lens == [5, 3, 1, 0]
    assert metrics.request_throughput == pytest.approx(1.5)
    assert metrics.output_throughput == pytest.approx(4.5)
    assert metrics.total_token_throughput == pytest.approx(34.5)
    assert metrics.request_goodput is None
    ttft = metrics.latencies["ttft"]
    assert ttft.mean_ms == pytest.approx(1000 * (0.2 + 0.5 + 0.3) / 3)
    assert ttft.median_ms == pytest.approx(300)
    assert ttft.percentiles_ms[99] == pytest.approx(496)  # 300 + 0.98 * (500 - 300)
    tpot = metrics.latencies["tpot"]
    assert tpot.mean_ms == pytest.approx(200)
    itl = metrics.latencies["itl"]  # pooled gaps: 0.2 x4, 0.1, 0.3
    assert itl.mean_ms == pytest.approx(1000 * 1.2 / 6)
    assert itl.median_ms == pytest.approx(200)
    assert metrics.latencies["e2el"].percentiles_ms[50] == pytest.approx(900)
    # request 1 spans [0, 1.0), request 2 [0.5, 1.4), request 3 [1.0, 1.3): two at once at most
    assert metrics.max_concurrent_requests == 2


def test_goodput_counts_requests_within_every_slo():
    outputs = [output(0.2, [0.05] * 9, 0.65, output_tokens=10),  # tpot 50 ms
               output(0.6, [0.05] * 9, 1.05, output_tokens=10),  # ttft over 500 ms
               output(0.1, [0.1] * 9, 1.0, output_tokens=10),    # tpot 100 ms
               output(0.4, [], 0.4, output_tokens=1)]            # tpot counts as 0
    slos = parse_goodput(["ttft:500", "tpot:50"])
    metrics = calculate_metrics(outputs, duration_s=4.0, goodput_slos_ms=slos)
    assert metrics.request_goodput == pytest.approx(2 / 4)
    assert calculate_metrics(outputs, 4.0, goodput_slos_ms={"e2el": 700}).request_goodput == \
        pytest.approx(2 / 4)


def test_output_length_falls_back_to_the_tokenizer_then_one():
    outputs = [output(0.1, [0.1], 0.2, output_tokens=None, text="a b c d"),
               output(0.1, [], 0.1, output_tokens=None, text="x")]
    assert calculate_metrics(outputs, 1.0, count_tokens=lambda t: len(t.split())
                             ).output_lens == [4, 1]
    assert calculate_metrics(outputs, 1.0).output_lens == [1, 1]


def test_all_failed_reports_zeros():
    metrics = calculate_metrics([RequestResult(error="x")], duration_s=1.0)
    assert metrics.completed == 0 and metrics.latencies["ttft"].mean_ms == 0
    assert metrics.max_output_tokens_per_s == 0


@pytest.mark.parametrize("bad", ["ttft", "latency:5", "ttft:abc", "tpot:-1"])
def test_goodput_parsing_rejects(bad):
    with pytest.raises(ValueError):
        parse_goodput([bad])


def test_arrivals_average_the_rate_and_all_at_once_for_inf():
    offsets = arrival_offsets(200, LoadConfig(request_rate=20.0, seed=1))
    assert offsets[-1] == pytest.approx(200 / 20.0)  # normalised total duration
    assert all(later >= earlier for earlier, later in zip(offsets, offsets[1:]))
    assert arrival_offsets(3, LoadConfig()) == [0.0, 0.0, 0.0]
    even = arrival_offsets(4, LoadConfig(request_rate=2.0, burstiness=math.inf))
    assert even == pytest.approx([0.5, 1.0, 1.5, 2.0])
    # burstier arrivals have more spread-out gaps than Poisson at the same rate
    def gap_spread(burstiness):
        points = arrival_offsets(2000, LoadConfig(request_rate=10, burstiness=burstiness, seed=3))
        gaps = [b - a for a, b in zip(points, points[1:])]
        mean = sum(gaps) / len(gaps)
        return sum((g - mean) ** 2 for g in gaps) / len(gaps) / mean ** 2
    assert gap_spread(0.25) > gap_spread(1.0) > gap_spread(8.0)


def test_load_config_is_validated():
    for kwargs in ({"request_rate": 0}, {"burstiness": 0}, {"max_concurrency": 0}):
        with pytest.raises(ValueError):
            LoadConfig(**kwargs)


def test_datasets(tmp_path):
    tokenizer = load_tokenizer()
    assert sample_lengths(10, 0.0, 3, random.Random(0)) == [10, 10, 10]
    assert all(5 <= n <= 15 for n in sample_lengths(10, 0.5, 50, random.Random(0)))
    requests = random_dataset(4, 16, 8, 0.0, seed=0, tokenizer=tokenizer)
    for request in requests:
        assert request.output_len == 8
        assert len(tokenizer.encode(request.prompt, add_special_tokens=False).ids) == \
            request.prompt_len
    assert requests == random_dataset(4, 16, 8, 0.0, seed=0, tokenizer=tokenizer)

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("def add(a, b):\n\n{\"prompt\": \"import os\"}\n")
    chosen = file_dataset(prompts, 3, 5, seed=0, tokenizer=tokenizer)
    assert sorted({r.prompt for r in chosen}) == ["def add(a, b):", "import os"]
    assert len(chosen) == 3 and all(r.output_len == 5 for r in chosen)

    sharegpt = tmp_path / "sharegpt.json"
    long_reply = "word " * 40
    sharegpt.write_text(__import__("json").dumps([
        {"conversations": [{"from": "human", "value": "tell me about python please"},
                           {"from": "gpt", "value": long_reply}]},
        {"conversations": [{"from": "human", "value": "hi"},
                           {"from": "gpt", "value": "a"}]},          # too short: dropped
        {"conversations": [{"from": "human", "value": "only one turn"}]},
    ]))
    (only,) = sharegpt_dataset(sharegpt, 1, seed=0, tokenizer=tokenizer)
    assert only.prompt == "tell me about python please"
    assert only.output_len == len(tokenizer.encode(long_reply, add_special_tokens=False).ids)
    with pytest.raises(ValueError):
        sharegpt_dataset(sharegpt, 2, seed=0, tokenizer=tokenizer)
    assert len(sharegpt_dataset(sharegpt, 2, seed=0, tokenizer=tokenizer, output_len=7)) == 2


def test_payloads_for_completions_and_chat():
    request = BenchRequest("hello", 1, 16)
    completions = request_body(ClientConfig("http://x", "m"), request)
    assert completions["prompt"] == "hello" and completions["max_tokens"] == 16
    assert completions["stream"] and completions["stream_options"] == {"include_usage": True}
    chat = request_body(ClientConfig("http://x", "m", endpoint="/v1/chat/completions",
                                     ignore_eos=True), request)
    assert chat["messages"] == [{"role": "user", "content": "hello"}]
    assert chat["ignore_eos"] is True and "prompt" not in chat
    assert completions["temperature"] == 0.0  # greedy unless asked
    assert not {"top_p", "top_k", "min_p"} & set(completions)
    sampled = request_body(ClientConfig("http://x", "m", temperature=0.8, top_p=0.9, top_k=40,
                                        min_p=0.05), request)
    assert (sampled["temperature"], sampled["top_p"], sampled["top_k"],
            sampled["min_p"]) == (0.8, 0.9, 40, 0.05)
