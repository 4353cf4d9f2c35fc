"""Warmup replay: the PredictionLog records of a version's assets.extra run on it before it
serves (TF Serving's saved_model_warmup), through the same code as live requests."""

from __future__ import annotations

from tokenserve.errors import InvalidRequestError
from tokenserve.server.tfserving.inference import classify_on, predict_on, regress_on
from tokenserve.server.tfserving.multi_inference import multi_inference_on


def replay_warmup_record(servable, record) -> None:
    """Runs one PredictionLog (the lifecycle's warmup callback); its response is dropped."""
    kind = record.WhichOneof("log_type")
    if kind == "predict_log":
        predict_on(servable, record.predict_log.request)
    elif kind == "classify_log":
        request = record.classify_log.request
        classify_on(servable, request.model_spec.signature_name, request.input)
    elif kind == "regress_log":
        request = record.regress_log.request
        regress_on(servable, request.model_spec.signature_name, request.input)
    elif kind == "multi_inference_log":
        multi_inference_on(servable, record.multi_inference_log.request)
    else:
        raise InvalidRequestError(f"Unsupported log_type for warmup: {kind}")
