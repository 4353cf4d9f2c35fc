"""tokenserve:moe_expert_tokens: each step's rows per expert, one histogram per layer."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenserve.observability.llm_metrics import LLMMetrics
from tokenserve.stats import StepStats


def step(expert_tokens=()) -> StepStats:
    return StepStats(model="m", version="1", time=0.0, duration_s=0.01, num_running=2,
                     num_waiting=0, num_batched_tokens=3, num_prefill_tokens=0,
                     num_decode_tokens=3, cache_usage=0.1, expert_tokens=expert_tokens)


def histogram(registry) -> dict[tuple, float]:
    text = generate_latest(registry).decode()
    return {(s.name, s.labels.get("layer"), s.labels.get("le")): s.value
            for family in text_string_to_metric_families(text)
            if family.name == "tokenserve:moe_expert_tokens" for s in family.samples}


def test_each_expert_of_each_layer_is_one_observation_per_step():
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    metrics.on_step(step())  # a dense model's step: no series
    assert not any(key[1] is not None for key in histogram(registry))
    # 2 layers x 4 experts, top-2 of 3 rows: 6 rows routed per layer
    metrics.on_step(step(((3, 3, 0, 0), (6, 0, 0, 0))))
    metrics.on_step(step(((1, 2, 2, 1), (0, 0, 3, 3))))
    h = histogram(registry)
    assert h[("tokenserve:moe_expert_tokens_count", "0", None)] == 8  # 4 experts x 2 steps
    assert h[("tokenserve:moe_expert_tokens_sum", "0", None)] == 12
    assert h[("tokenserve:moe_expert_tokens_bucket", "0", "0.0")] == 2  # idle experts
    assert h[("tokenserve:moe_expert_tokens_bucket", "0", "1.0")] == 4
    assert h[("tokenserve:moe_expert_tokens_bucket", "0", "2.0")] == 6
    assert h[("tokenserve:moe_expert_tokens_bucket", "0", "4.0")] == 8
    # layer 1's first step: one hot expert (6 rows, bucket le=8) and three idle ones
    assert h[("tokenserve:moe_expert_tokens_bucket", "1", "0.0")] == 5
    assert h[("tokenserve:moe_expert_tokens_bucket", "1", "4.0")] == 7
    assert h[("tokenserve:moe_expert_tokens_bucket", "1", "8.0")] == 8
    assert h[("tokenserve:moe_expert_tokens_bucket", "1", "+Inf")] == 8


def test_a_dense_layer_among_moe_layers_has_no_series():
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    # layer 0 is dense (its row of the load stays zero), layer 1 routes top-1 of 3 rows
    metrics.on_step(step(((0, 0, 0, 0), (3, 0, 0, 0))))
    metrics.on_step(step(((0, 0, 0, 0), (1, 1, 1, 0))))
    h = histogram(registry)
    assert {key[1] for key in h} == {"1"}
    assert h[("tokenserve:moe_expert_tokens_count", "1", None)] == 8
    assert h[("tokenserve:moe_expert_tokens_bucket", "1", "0.0")] == 4
