"""Writes `assets.extra/tf_serving_warmup_requests` into an export: the PredictionLog records
that TF Serving (and `lifecycle/warmup_replay.py`) replay before a version is AVAILABLE."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

WARMUP_FILE = "tf_serving_warmup_requests"  # TF Serving's name: a wire contract, not a choice
MAX_WARMUP_RECORDS = 1000  # TF Serving reads at most this many


def _predict_log(model_name: str, signature: str, inputs: dict) -> prediction_log_pb2.PredictionLog:
    request = predict_pb2.PredictRequest(
        model_spec=model_pb2.ModelSpec(name=model_name, signature_name=signature))
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return prediction_log_pb2.PredictionLog(
        predict_log=prediction_log_pb2.PredictLog(request=request))


def warmup_records(model_name: str, prompt_ids: list[int], prompt_buckets: list[int],
                   pad_id: int) -> list[prediction_log_pb2.PredictionLog]:
    """One serving_default request per prompt bucket, plus a short `generate` call.

    Replaying them traces and compiles what the first real requests would hit.
    """
    records = []
    for size in prompt_buckets:
        ids = (prompt_ids * size)[:size]
        records.append(_predict_log(model_name, "serving_default",
                                    {"input_ids": np.array([ids], np.int32)}))
    short = (prompt_ids * prompt_buckets[0])[:prompt_buckets[0]]
    records.append(_predict_log(model_name, "generate", {
        "input_ids": np.array([short], np.int32),
        "max_new_tokens": np.int32(4), "temperature": np.float32(0.0),
        "top_k": np.int32(0), "top_p": np.float32(1.0), "seed": np.int32(0)}))
    return records[:MAX_WARMUP_RECORDS]


def write_warmup(version_dir: Path, records: list[prediction_log_pb2.PredictionLog]) -> Path:
    path = version_dir / "assets.extra" / WARMUP_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record.SerializeToString())
    return path
