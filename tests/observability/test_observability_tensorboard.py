"""TensorBoard summaries: percentiles and throughput from stats, written as event files."""

from __future__ import annotations

import glob

import pytest

from tokenserve.observability.tensorboard import (TensorBoardConfig, TensorBoardWriter,
                                                  WindowSummary)
from tokenserve.stats import RequestStats, StepStats


def request(ttft_s: float, token_gaps_s: tuple[float, ...]) -> RequestStats:
    times, now = [10.0 + ttft_s], 10.0 + ttft_s
    for gap in token_gaps_s:
        now += gap
        times.append(now)
    return RequestStats(request_id="r", model="m", version="1", arrival_time=10.0,
                        scheduled_time=10.0, first_token_time=10.0 + ttft_s, finish_time=now,
                        token_times=tuple(times), num_prompt_tokens=4,
                        num_generation_tokens=len(times))


def step(num_running: int) -> StepStats:
    return StepStats(model="m", version="1", time=0.0, duration_s=0.01, num_running=num_running,
                     num_waiting=2, num_batched_tokens=num_running, num_prefill_tokens=0,
                     num_decode_tokens=num_running, cache_usage=0.5)


def test_window_percentiles_and_throughput():
    window = WindowSummary()
    for ttft in (0.1, 0.2, 0.3, 0.4, 0.5):
        window.add_request(request(ttft, (0.05, 0.05)))
    window.add_step(step(3))
    scalars = window.scalars(elapsed_s=2.0)
    assert scalars["latency/ttft_p50_ms"] == pytest.approx(300)
    assert scalars["latency/ttft_p99_ms"] == pytest.approx(496)  # linear interpolation
    assert scalars["latency/itl_p95_ms"] == pytest.approx(50)
    assert scalars["throughput/generation_tokens_per_s"] == pytest.approx(15 / 2)
    assert scalars["throughput/requests_per_s"] == pytest.approx(5 / 2)
    assert scalars["scheduler/num_waiting"] == 2
    assert set(window.histograms()) == {"latency/ttft_ms", "latency/itl_ms", "latency/e2e_ms",
                                        "scheduler/batch_size"}


def test_empty_window_has_zero_throughput_and_no_percentiles():
    scalars = WindowSummary().scalars(elapsed_s=1.0)
    assert scalars == {"throughput/requests_per_s": 0.0, "throughput/prompt_tokens_per_s": 0.0,
                       "throughput/generation_tokens_per_s": 0.0}


def test_writer_writes_scalars_and_histograms_to_event_files(tmp_path):
    tf = pytest.importorskip("tensorflow")
    writer = TensorBoardWriter(TensorBoardConfig(logdir=str(tmp_path), interval_s=3600))
    writer.start()
    writer.on_request(request(0.25, (0.1,)))
    for running in (1, 4):
        writer.on_step(step(running))
    writer.close()  # writes the pending window
    tags, plugins = {}, {}
    for path in glob.glob(str(tmp_path / "events.out.tfevents.*")):
        for event in tf.compat.v1.train.summary_iterator(path):
            for summary_value in event.summary.value:
                tags[summary_value.tag] = tf.make_ndarray(summary_value.tensor)
                plugins[summary_value.tag] = summary_value.metadata.plugin_data.plugin_name
    assert float(tags["latency/ttft_p50_ms"]) == pytest.approx(250)
    assert float(tags["scheduler/num_running"]) == 4
    # a histogram is a [buckets, 3] tensor of (left, right, count); counts add to the samples
    assert tags["scheduler/batch_size"][:, 2].sum() == 2
    assert plugins["latency/ttft_p50_ms"] == "scalars"
    assert plugins["scheduler/batch_size"] == "histograms"


def test_config_is_validated():
    with pytest.raises(ValueError):
        TensorBoardConfig(logdir="", interval_s=1)
    with pytest.raises(ValueError):
        TensorBoardConfig(logdir="/tmp/x", interval_s=0)


def test_histogram_buckets_count_every_sample():
    from tokenserve.observability.tensorboard import histogram_buckets

    buckets = histogram_buckets([1.0, 2.0, 2.0, 9.0], num_buckets=4)
    assert buckets.shape == (4, 3)
    assert buckets[:, 2].tolist() == [3.0, 0.0, 0.0, 1.0]
    assert (buckets[0, 0], buckets[-1, 1]) == (1.0, 9.0)
    assert histogram_buckets([5.0, 5.0]).tolist() == [[4.5, 5.5, 2.0]]
