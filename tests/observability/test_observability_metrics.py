"""LLMMetrics: values in the exposition after known stats, under vLLM's names."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from tokenserve.observability.llm_metrics import LLMMetrics, one_two_five_buckets
from tokenserve.stats import RejectionStats, RequestStats, StepStats, VersionState


def samples(registry: CollectorRegistry) -> dict[tuple, float]:
    """{(sample name, sorted label items): value} parsed from the text exposition."""
    text = generate_latest(registry).decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def value(registry, name: str, **labels) -> float:
    labels = {"model_name": "m", "model_version": "1", **labels}
    return samples(registry)[(name, tuple(sorted(labels.items())))]


def request(**overrides) -> RequestStats:
    fields = dict(request_id="r1", model="m", version="1", arrival_time=100.0,
                  scheduled_time=100.5, first_token_time=101.0, finish_time=103.0,
                  token_times=(101.0, 101.5, 102.5, 103.0), num_prompt_tokens=7,
                  num_generation_tokens=4, finish_reason="length")
    fields.update(overrides)
    return RequestStats(**fields)


def test_request_latencies_and_token_counters():
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    metrics.on_request(request())
    metrics.on_request(request(request_id="r2", num_prompt_tokens=3, num_generation_tokens=1,
                               token_times=(101.0,), finish_reason="stop"))

    assert value(registry, "vllm:prompt_tokens_total") == 10
    assert value(registry, "vllm:generation_tokens_total") == 5
    assert value(registry, "vllm:request_success_total", finished_reason="length") == 1
    assert value(registry, "vllm:request_success_total", finished_reason="stop") == 1
    assert value(registry, "vllm:time_to_first_token_seconds_sum") == pytest.approx(2.0)
    assert value(registry, "vllm:e2e_request_latency_seconds_sum") == pytest.approx(6.0)
    assert value(registry, "vllm:request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert value(registry, "vllm:request_prefill_time_seconds_sum") == pytest.approx(1.0)
    # decode: r1 from first (101.0) to last token (103.0), r2 has a single token
    assert value(registry, "vllm:request_decode_time_seconds_sum") == pytest.approx(2.0)
    # ITL gaps of r1: 0.5, 1.0, 0.5; r2 has none
    assert value(registry, "vllm:inter_token_latency_seconds_count") == 3
    assert value(registry, "vllm:inter_token_latency_seconds_sum") == pytest.approx(2.0)
    assert value(registry, "vllm:inter_token_latency_seconds_bucket", le="0.5") == 2
    assert value(registry, "vllm:time_per_output_token_seconds_count") == 3
    # per-request TPOT only for requests with more than one token: 2.0 / 3
    assert value(registry, "vllm:request_time_per_output_token_seconds_count") == 1
    assert value(registry, "vllm:request_time_per_output_token_seconds_sum") == \
        pytest.approx(2.0 / 3)
    assert value(registry, "vllm:request_prompt_tokens_bucket", le="5.0") == 1


def test_request_that_never_started_records_only_what_happened():
    registry = CollectorRegistry()
    LLMMetrics(registry).on_request(request(scheduled_time=None, first_token_time=None,
                                            token_times=(), num_generation_tokens=0,
                                            finish_reason="abort"))
    assert value(registry, "vllm:request_success_total", finished_reason="abort") == 1
    assert value(registry, "vllm:e2e_request_latency_seconds_count") == 1
    recorded = {name for name, _ in samples(registry)}
    assert "vllm:time_to_first_token_seconds_count" not in recorded
    assert "vllm:request_queue_time_seconds_count" not in recorded


def test_step_gauges_batch_size_and_preemptions():
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    for running, preempted in ((3, 0), (5, 2)):
        metrics.on_step(StepStats(model="m", version="1", time=1.0, duration_s=0.02,
                                  num_running=running, num_waiting=4, num_batched_tokens=40,
                                  num_prefill_tokens=35, num_decode_tokens=5,
                                  cache_usage=0.25, num_preemptions=preempted,
                                  num_draft_tokens=preempted * 4, num_accepted_tokens=preempted,
                                  num_nonfinite_logits=preempted * 3))
    assert value(registry, "vllm:num_requests_running") == 5
    assert value(registry, "tokenserve:nonfinite_logits_total") == 6
    assert value(registry, "vllm:spec_decode_num_draft_tokens_total") == 8
    assert value(registry, "vllm:spec_decode_num_accepted_tokens_total") == 2
    assert value(registry, "vllm:num_requests_waiting") == 4
    assert value(registry, "vllm:kv_cache_usage_perc") == 0.25
    assert value(registry, "vllm:num_preemptions_total") == 2
    assert value(registry, "tokenserve:batch_size_count") == 2
    assert value(registry, "tokenserve:batch_size_sum") == 8
    assert value(registry, "tokenserve:batch_size_bucket", le="4.0") == 1
    assert value(registry, "vllm:iteration_tokens_total_sum") == 80
    metrics.forget_version("m", "1")
    recorded = {name for name, _ in samples(registry)}
    assert "vllm:num_requests_running" not in recorded
    assert value(registry, "vllm:num_preemptions_total") == 2  # counters stay
    metrics.forget_version("m", "2")  # a version that never ran a step


def test_rejections_lifecycle_and_version_state():
    registry = CollectorRegistry()
    metrics = LLMMetrics(registry)
    for reason in ("queue_full", "queue_full", "too_long"):
        metrics.on_rejection(RejectionStats(model="m", version="1", reason=reason))
    metrics.record_version_state("m", "1", VersionState.LOADING)
    metrics.record_version_state("m", "1", "AVAILABLE")
    metrics.record_model_load("m", "1", 2.5)
    metrics.record_warmup("m", "1", 0.75)
    assert value(registry, "tokenserve:rejected_requests_total", reason="queue_full") == 2
    assert value(registry, "tokenserve:rejected_requests_total", reason="too_long") == 1
    assert value(registry, "tokenserve:model_version_state", state="AVAILABLE") == 1
    assert value(registry, "tokenserve:model_version_state", state="LOADING") == 0
    assert value(registry, "tokenserve:model_load_latency_seconds_sum") == 2.5
    assert value(registry, "tokenserve:model_warmup_latency_seconds_sum") == 0.75
    with pytest.raises(ValueError):
        metrics.record_version_state("m", "1", "LOADED")


def test_one_two_five_buckets():
    assert one_two_five_buckets(100) == (1, 2, 5, 10, 20, 50, 100)
    assert one_two_five_buckets(1) == (1,)


def test_shares_one_registry_with_tf_serving_metrics():
    """Both metric sets are served from the same /metrics, so their names must not clash."""
    tfserving = pytest.importorskip("tokenserve.observability.tfserving_metrics")
    registry = CollectorRegistry()
    LLMMetrics(registry)
    tfserving.TFServingMetrics(registry)  # raises on a duplicated series name
    names = {family.name for family in registry.collect()}
    assert "vllm:time_to_first_token_seconds" in names
    assert any(name.startswith(":tensorflow:serving:") for name in names)


def test_tf_serving_request_counters_label_only_configured_models():
    """The model name of a TF Serving request comes from its URL or ModelSpec: labelling
    every made-up one would let clients grow /metrics without bound."""
    from tokenserve.observability.tfserving_metrics import TFServingMetrics

    registry = CollectorRegistry()
    metrics = TFServingMetrics(registry)
    metrics.label_models(lambda: ["m"])
    metrics.request("m", "predict", "REST", "OK", 0.01)
    for i in range(20):
        metrics.request(f"evil-{i}\x00" + "x" * 8000, "predict", "REST", "NOT_FOUND", 0.01)
    text = generate_latest(registry).decode()
    assert "evil" not in text
    assert ':tensorflow:serving:request_count{model_name="(unknown)",status="NOT_FOUND"} 20.0' \
        in text
    assert ':tensorflow:serving:request_count{model_name="m",status="OK"} 1.0' in text
