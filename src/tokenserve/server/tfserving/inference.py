"""TF Serving's Predict/Classify/Regress/MultiInference on official protos, shared by the
gRPC servicers, the REST handlers and warmup replay.

Every call resolves its ModelSpec through `ModelManager.acquire`, so a version that is
unloading finishes the calls already running on it.
"""

from __future__ import annotations

import numpy as np
from tensorflow.core.example import example_pb2
from tensorflow_serving.apis import (classification_pb2, inference_pb2, model_pb2, predict_pb2,
                                     regression_pb2)

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.servable import (CLASSIFY_METHOD, DEFAULT_SIGNATURE, REGRESS_METHOD,
                                           signature_def)
from tokenserve.server.tfserving.codec import array_to_tensor_proto, tensor_proto_to_array

CLASSIFY_INPUTS = "inputs"
CLASSIFY_CLASSES = "classes"
CLASSIFY_SCORES = "scores"
REGRESS_INPUTS = "inputs"
REGRESS_OUTPUTS = "outputs"


def spec_args(model_spec: model_pb2.ModelSpec) -> dict:
    """acquire() keyword arguments from a ModelSpec (version, label or latest)."""
    choice = model_spec.WhichOneof("version_choice")
    return {"model_name": model_spec.name,
            "version": model_spec.version.value if choice == "version" else None,
            "label": model_spec.version_label if choice == "version_label" else None}


def response_spec(version, signature_name: str) -> model_pb2.ModelSpec:
    spec = model_pb2.ModelSpec(name=version.model_name, signature_name=signature_name)
    spec.version.value = version.version
    return spec


# ---- Predict ------------------------------------------------------------------------------

def predict_on(servable, request: predict_pb2.PredictRequest) -> dict[str, np.ndarray]:
    inputs = {name: tensor_proto_to_array(name, proto) for name, proto in request.inputs.items()}
    return servable.run(request.model_spec.signature_name or DEFAULT_SIGNATURE, inputs,
                        list(request.output_filter))


def predict(manager: ModelManager, request: predict_pb2.PredictRequest
            ) -> predict_pb2.PredictResponse:
    with manager.acquire(**spec_args(request.model_spec)) as version:
        outputs = predict_on(version.servable, request)
        response = predict_pb2.PredictResponse(model_spec=response_spec(
            version, request.model_spec.signature_name or DEFAULT_SIGNATURE))
    for name, array in outputs.items():
        response.outputs[name].CopyFrom(array_to_tensor_proto(array))
    return response


# ---- Classify / Regress -------------------------------------------------------------------

def serialized_examples(input_proto) -> np.ndarray:
    """Serialized tf.Examples of an Input (context features merged into every example)."""
    kind = input_proto.WhichOneof("kind")
    if kind == "example_list":
        examples = list(input_proto.example_list.examples)
    elif kind == "example_list_with_context":
        context = input_proto.example_list_with_context.context
        examples = []
        for example in input_proto.example_list_with_context.examples:
            merged = example_pb2.Example()
            merged.CopyFrom(context)
            merged.MergeFrom(example)
            examples.append(merged)
    else:
        raise InvalidRequestError("Input is empty.")
    if not examples:
        raise InvalidRequestError("Input is empty.")
    array = np.empty(len(examples), dtype=object)
    array[:] = [example.SerializeToString() for example in examples]
    return array


def _checked_signature(servable, signature_name: str, method: str, kind: str):
    name = signature_name or DEFAULT_SIGNATURE
    sig = signature_def(servable, name)
    if sig.method_name != method:
        raise InvalidRequestError(f"Expected {kind} signature method_name to be {method}. "
                                  f"Was: {sig.method_name}")
    if len(sig.inputs) != 1:
        raise InvalidRequestError("Expected one input Tensor.")
    return name, sig


def classify_on(servable, signature_name: str, input_proto
                ) -> classification_pb2.ClassificationResult:
    name, sig = _checked_signature(servable, signature_name, CLASSIFY_METHOD, "classification")
    wanted = [key for key in (CLASSIFY_CLASSES, CLASSIFY_SCORES) if key in sig.outputs]
    if not wanted:
        raise InvalidRequestError(f"Expected classification signature outputs to contain "
                                  f"{CLASSIFY_CLASSES} or {CLASSIFY_SCORES}")
    examples = serialized_examples(input_proto)
    outputs = servable.run(name, {next(iter(sig.inputs)): examples}, wanted)
    classes, scores = outputs.get(CLASSIFY_CLASSES), outputs.get(CLASSIFY_SCORES)
    num_examples = len(examples)
    for key, array in outputs.items():
        if array.ndim != 2 or array.shape[0] != num_examples:
            raise InvalidRequestError(f"Expected tensor {key} to have shape "
                                      f"[{num_examples}, num_classes], got {list(array.shape)}")
    result = classification_pb2.ClassificationResult()
    num_classes = (classes if classes is not None else scores).shape[1]
    for row in range(num_examples):
        classifications = result.classifications.add()
        for column in range(num_classes):
            entry = classifications.classes.add()
            if classes is not None:
                entry.label = bytes(classes[row, column]).decode("utf-8", "replace")
            if scores is not None:
                entry.score = float(scores[row, column])
    return result


def regress_on(servable, signature_name: str, input_proto) -> regression_pb2.RegressionResult:
    name, sig = _checked_signature(servable, signature_name, REGRESS_METHOD, "regression")
    if REGRESS_OUTPUTS not in sig.outputs:
        raise InvalidRequestError(f"No output Tensor named {REGRESS_OUTPUTS} found in "
                                  f"signature.")
    examples = serialized_examples(input_proto)
    values = servable.run(name, {next(iter(sig.inputs)): examples}, [REGRESS_OUTPUTS])
    values = values[REGRESS_OUTPUTS]
    if values.ndim == 2 and values.shape[1] == 1:
        values = values[:, 0]
    if values.shape != (len(examples),):
        raise InvalidRequestError(f"Expected output Tensor shape to be [{len(examples)}] or "
                                  f"[{len(examples)}, 1] but got {list(values.shape)}")
    result = regression_pb2.RegressionResult()
    for value in values:
        result.regressions.add().value = float(value)
    return result


def classify(manager: ModelManager, request: classification_pb2.ClassificationRequest
             ) -> classification_pb2.ClassificationResponse:
    with manager.acquire(**spec_args(request.model_spec)) as version:
        result = classify_on(version.servable, request.model_spec.signature_name,
                             request.input)
        return classification_pb2.ClassificationResponse(
            model_spec=response_spec(version, request.model_spec.signature_name
                                     or DEFAULT_SIGNATURE), result=result)


def regress(manager: ModelManager, request: regression_pb2.RegressionRequest
            ) -> regression_pb2.RegressionResponse:
    with manager.acquire(**spec_args(request.model_spec)) as version:
        result = regress_on(version.servable, request.model_spec.signature_name, request.input)
        return regression_pb2.RegressionResponse(
            model_spec=response_spec(version, request.model_spec.signature_name
                                     or DEFAULT_SIGNATURE), result=result)


def multi_inference(manager: ModelManager, request: inference_pb2.MultiInferenceRequest
                    ) -> inference_pb2.MultiInferenceResponse:
    """Several classify/regress signatures of one model over one shared Input."""
    if not request.tasks:
        raise InvalidRequestError("Found no tasks in MultiInferenceRequest")
    names = {task.model_spec.name for task in request.tasks}
    if len(names) != 1:
        raise InvalidRequestError("All ModelSpecs in a MultiInferenceRequest must access the "
                                  "same model name.")
    signatures = [task.model_spec.signature_name or DEFAULT_SIGNATURE for task in request.tasks]
    for signature in signatures:
        if signatures.count(signature) > 1:
            raise InvalidRequestError(f"Duplicate evaluation of signature: {signature}")
    response = inference_pb2.MultiInferenceResponse()
    with manager.acquire(**spec_args(request.tasks[0].model_spec)) as version:
        for task, signature in zip(request.tasks, signatures):
            result = response.results.add(model_spec=response_spec(version, signature))
            if task.method_name == CLASSIFY_METHOD:
                result.classification_result.CopyFrom(
                    classify_on(version.servable, signature, request.input))
            elif task.method_name == REGRESS_METHOD:
                result.regression_result.CopyFrom(
                    regress_on(version.servable, signature, request.input))
            else:
                raise InvalidRequestError(f"Unsupported signature method_name: "
                                          f"{task.method_name}")
    return response


def replay_warmup_record(servable, record) -> None:
    """Runs one PredictionLog from assets.extra (the lifecycle's warmup callback)."""
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
        request = record.multi_inference_log.request
        for task in request.tasks:
            if task.method_name == CLASSIFY_METHOD:
                classify_on(servable, task.model_spec.signature_name, request.input)
            else:
                regress_on(servable, task.model_spec.signature_name, request.input)
    else:
        raise InvalidRequestError(f"Unsupported log_type for warmup: {kind}")
