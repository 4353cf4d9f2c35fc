"""Warmup replay: `assets.extra/tf_serving_warmup_requests` before a version is AVAILABLE."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

from tokenserve.errors import ModelLoadError

log = logging.getLogger("tokenserve.lifecycle")

WARMUP_PATH = Path("assets.extra") / "tf_serving_warmup_requests"
MAX_WARMUP_RECORDS = 1000  # TF Serving's limit


def warmup_file(version_dir: Path) -> Path | None:
    path = version_dir / WARMUP_PATH
    return path if path.is_file() else None


def make_warmup(replay_record: Callable[[object, object], None],
                num_iterations: int = 1) -> Callable[[object], None]:
    """A `warmup(version)` for ModelManager that replays each PredictionLog record.

    Args:
        replay_record: (servable, PredictionLog) -> None; runs one logged request and
            raises if it fails (a failing record fails the load, as in TF Serving).
        num_iterations: times each record runs (--num_request_iterations_for_warmup).
    """
    def warmup(version) -> None:
        path = warmup_file(version.path)
        if path is None:
            return
        try:
            records = read_warmup(path)
        except Exception as error:
            raise ModelLoadError(f"cannot read warmup records in {path}: {error}") from error
        if len(records) > MAX_WARMUP_RECORDS:
            log.warning("%s holds %d warmup records; replaying the first %d", path,
                        len(records), MAX_WARMUP_RECORDS)
            records = records[:MAX_WARMUP_RECORDS]
        for index, record in enumerate(records):
            for _ in range(num_iterations):
                try:
                    replay_record(version.servable, record)
                except Exception as error:
                    raise ModelLoadError(f"warmup record {index} of {path} failed: "
                                         f"{error}") from error
        log.info("replayed %d warmup records for %s version %d", len(records),
                 version.model_name, version.version)
    return warmup


def read_warmup(path: str | Path) -> list:
    """Parses a warmup file (TFRecords of PredictionLog); raises on a record that is not one."""
    import tensorflow as tf  # only when a version has warmup records
    from tensorflow_serving.apis import prediction_log_pb2

    return [prediction_log_pb2.PredictionLog.FromString(raw.numpy())
            for raw in tf.data.TFRecordDataset(str(path))]
