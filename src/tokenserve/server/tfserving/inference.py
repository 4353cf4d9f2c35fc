"""TF Serving's Predict/Classify/Regress on official protos, shared by the gRPC servicers,
the REST handlers, MultiInference (multi_inference.py) and warmup replay.

Every call resolves its ModelSpec through `ModelManager.acquire`, so a version that is
unloading finishes the calls already running on it. The rules and texts are TF Serving's
(predict_util.cc, classifier.cc, regressor.cc, util.cc):

- Classify and Regress take any signature whose input is named `inputs` and whose outputs
  fit (`classes`/`scores`, or `outputs`), whatever its method_name, as TF Serving 2.x does
  by default; `--enable_signature_method_name_check` restores the TF1 check.
- A `deadline` (time.monotonic() value) bounds the TensorFlow run: the servable cancels it
  when the deadline passes, so an expired request stops computing.
"""

from __future__ import annotations

import time

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow_serving.apis import classification_pb2, model_pb2, predict_pb2, regression_pb2

from tokenserve.errors import InvalidRequestError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.servable import (CLASSIFY_METHOD, DEFAULT_SIGNATURE, PREDICT_METHOD,
                                           REGRESS_METHOD, check_inputs_size, signature_def)
from tokenserve.server.tfserving.codec import array_to_tensor_proto, tensor_proto_to_array
from tokenserve.server.tfserving.tf_status import internal

CLASSIFY_INPUTS = "inputs"
CLASSIFY_CLASSES = "classes"
CLASSIFY_SCORES = "scores"
REGRESS_INPUTS = "inputs"
REGRESS_OUTPUTS = "outputs"

_method_name_check = False


def set_signature_method_name_check(enabled: bool) -> None:
    """--enable_signature_method_name_check (TF Serving's SetSignatureMethodNameCheckFeature):
    when on, Predict, Classify and Regress require the TF1 method_name of their API."""
    global _method_name_check
    _method_name_check = bool(enabled)


def remaining(deadline: float | None) -> float | None:
    """Seconds left before `deadline` (a time.monotonic() value), or None for no deadline."""
    return None if deadline is None else deadline - time.monotonic()


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

def predict_signature(servable, name: str):
    """The SignatureDef Predict runs, with predict_util's VerifySignature when the method
    name check is on (an INTERNAL error there, as in TF Serving)."""
    sig = signature_def(servable, name)
    if _method_name_check and sig.method_name not in (PREDICT_METHOD, CLASSIFY_METHOD,
                                                      REGRESS_METHOD):
        raise internal(f"Expected prediction signature method_name to be one of "
                       f"{{{PREDICT_METHOD}, {CLASSIFY_METHOD}, {REGRESS_METHOD}}}. Was: "
                       f"{sig.method_name}")
    return sig


def predict_on(servable, request: predict_pb2.PredictRequest,
               deadline: float | None = None) -> dict[str, np.ndarray]:
    """PreProcessPrediction's order: signature, method (with the check on), input count,
    then the tensors are decoded and run."""
    name = request.model_spec.signature_name or DEFAULT_SIGNATURE
    check_inputs_size(predict_signature(servable, name), request.inputs)
    inputs = {alias: tensor_proto_to_array(alias, proto)
              for alias, proto in request.inputs.items()}
    return servable.run(name, inputs, list(request.output_filter), remaining(deadline))


def predict_arrays(servable, signature_name: str, inputs: dict[str, np.ndarray],
                   deadline: float | None = None) -> dict[str, np.ndarray]:
    """Predict on inputs already decoded (the REST API's JSON)."""
    name = signature_name or DEFAULT_SIGNATURE
    predict_signature(servable, name)
    return servable.run(name, inputs, None, remaining(deadline))


def predict(manager: ModelManager, request: predict_pb2.PredictRequest,
            deadline: float | None = None) -> predict_pb2.PredictResponse:
    with manager.acquire(**spec_args(request.model_spec)) as version:
        outputs = predict_on(version.servable, request, deadline)
        response = predict_pb2.PredictResponse(model_spec=response_spec(
            version, request.model_spec.signature_name or DEFAULT_SIGNATURE))
    for name, array in outputs.items():
        response.outputs[name].CopyFrom(array_to_tensor_proto(array))
    return response


# ---- Classify / Regress -------------------------------------------------------------------

def serialized_examples(input_proto) -> np.ndarray:
    """util.cc InputToSerializedExampleTensor: serialized tf.Examples of an Input, the
    context's bytes prepended to each example's (a proto merge)."""
    kind = input_proto.WhichOneof("kind")
    if kind == "example_list":
        serialized = [example.SerializeToString()
                      for example in input_proto.example_list.examples]
    elif kind == "example_list_with_context":
        context = input_proto.example_list_with_context.context.SerializeToString()
        serialized = [context + example.SerializeToString()
                      for example in input_proto.example_list_with_context.examples]
    else:
        serialized = []
    if not serialized:
        raise InvalidRequestError("Input is empty.")
    array = np.empty(len(serialized), dtype=object)
    array[:] = serialized
    return array


def _named_signature(servable, signature_name: str, method: str, kind: str):
    """GetClassificationSignatureDef / GetRegressionSignatureDef."""
    name = signature_name or DEFAULT_SIGNATURE
    if name not in servable.signature_defs:
        raise InvalidRequestError(f"No signature was found with the name: {name}")
    sig = servable.signature_defs[name]
    if _method_name_check and sig.method_name != method:
        raise InvalidRequestError(f"Expected {kind} signature method_name to be {method}. "
                                  f"Was: {sig.method_name}")
    return name, sig


def classification_outputs(sig) -> list[str]:
    """PreProcessClassification: one `inputs`, and `classes` and/or `scores` out."""
    if len(sig.inputs) != 1:
        raise InvalidRequestError("Expected one input Tensor.")
    if len(sig.outputs) not in (1, 2):
        raise InvalidRequestError(f"Expected one or two output Tensors, found "
                                  f"{len(sig.outputs)}")
    if CLASSIFY_INPUTS not in sig.inputs:
        raise InvalidRequestError(f"No classification inputs found in SignatureDef: {sig}")
    wanted = [key for key in (CLASSIFY_CLASSES, CLASSIFY_SCORES) if key in sig.outputs]
    if not wanted:
        raise InvalidRequestError(f"Expected classification signature outputs to contain at "
                                  f"least one of \"{CLASSIFY_CLASSES}\" or "
                                  f"\"{CLASSIFY_SCORES}\". Signature was: {sig}")
    return wanted


def regression_outputs(sig) -> list[str]:
    """PreProcessRegression: one `inputs`, one `outputs`."""
    if len(sig.inputs) != 1:
        raise InvalidRequestError("Expected one input Tensor.")
    if len(sig.outputs) != 1:
        raise InvalidRequestError("Expected one output Tensor.")
    if REGRESS_INPUTS not in sig.inputs:
        raise InvalidRequestError(f"No regression inputs found in SignatureDef: {sig}")
    if REGRESS_OUTPUTS not in sig.outputs:
        raise InvalidRequestError(f"No regression outputs found in SignatureDef: {sig}")
    return [REGRESS_OUTPUTS]


def _shape(array: np.ndarray) -> str:
    return "[" + ",".join(str(d) for d in array.shape) + "]"


def _dtype_name(array: np.ndarray) -> str:
    dtype = tf.string if array.dtype == object else tf.dtypes.as_dtype(array.dtype)
    return types_pb2.DataType.Name(dtype.as_datatype_enum)


def classification_result(num_examples: int, outputs: dict[str, np.ndarray]
                          ) -> classification_pb2.ClassificationResult:
    """PostProcessClassificationResult, with its checks and texts."""
    classes, scores = outputs.get(CLASSIFY_CLASSES), outputs.get(CLASSIFY_SCORES)
    for key, tensor, dtype in ((CLASSIFY_CLASSES, classes, "DT_STRING"),
                               (CLASSIFY_SCORES, scores, "DT_FLOAT")):
        if tensor is None:
            continue
        if tensor.ndim != 2:
            raise InvalidRequestError(f"Expected Tensor shape: [batch_size num_classes] but "
                                      f"got {_shape(tensor)}")
        if _dtype_name(tensor) != dtype:
            raise InvalidRequestError(f"Expected {key} Tensor of {dtype}. Got: "
                                      f"{_dtype_name(tensor)}")
        if tensor.shape[0] != num_examples:
            raise InvalidRequestError(f"Expected {key} output batch size of {num_examples}. "
                                      f"Got: {tensor.shape[0]}")
    if classes is not None and scores is not None and classes.shape[1] != scores.shape[1]:
        raise InvalidRequestError(f"Tensors class and score should match in dim_size(1). Got "
                                  f"{classes.shape[1]} vs. {scores.shape[1]}")
    num_classes = (classes if classes is not None else scores).shape[1]
    result = classification_pb2.ClassificationResult()
    for row in range(num_examples):
        classifications = result.classifications.add()
        for column in range(num_classes):
            entry = classifications.classes.add()
            if classes is not None:
                entry.label = bytes(classes[row, column]).decode("utf-8", "replace")
            if scores is not None:
                entry.score = float(scores[row, column])
    return result


def regression_result(num_examples: int, values: np.ndarray
                      ) -> regression_pb2.RegressionResult:
    """PostProcessRegressionResult, with its checks and texts."""
    if not (values.ndim == 1 or (values.ndim == 2 and values.shape[1] == 1)):
        raise InvalidRequestError(f"Expected output Tensor shape to be either [batch_size] or "
                                  f"[batch_size, 1] but got {_shape(values)}")
    if values.shape[0] != num_examples:
        raise InvalidRequestError(f"Input batch size did not match output batch size: "
                                  f"{num_examples} vs. {values.shape[0]}")
    if _dtype_name(values) != "DT_FLOAT":
        raise InvalidRequestError(f"Expected output Tensor of DT_FLOAT.  Got: "
                                  f"{_dtype_name(values)}")
    result = regression_pb2.RegressionResult()
    for value in values.reshape(-1):
        result.regressions.add().value = float(value)
    return result


def classify_on(servable, signature_name: str, input_proto, deadline: float | None = None
                ) -> classification_pb2.ClassificationResult:
    name, sig = _named_signature(servable, signature_name, CLASSIFY_METHOD, "classification")
    wanted = classification_outputs(sig)
    examples = serialized_examples(input_proto)
    outputs = servable.run(name, {CLASSIFY_INPUTS: examples}, wanted, remaining(deadline))
    return classification_result(len(examples), outputs)


def regress_on(servable, signature_name: str, input_proto, deadline: float | None = None
               ) -> regression_pb2.RegressionResult:
    name, sig = _named_signature(servable, signature_name, REGRESS_METHOD, "regression")
    wanted = regression_outputs(sig)
    examples = serialized_examples(input_proto)
    outputs = servable.run(name, {REGRESS_INPUTS: examples}, wanted, remaining(deadline))
    return regression_result(len(examples), outputs[REGRESS_OUTPUTS])


def classify(manager: ModelManager, request: classification_pb2.ClassificationRequest,
             deadline: float | None = None) -> classification_pb2.ClassificationResponse:
    with manager.acquire(**spec_args(request.model_spec)) as version:
        result = classify_on(version.servable, request.model_spec.signature_name,
                             request.input, deadline)
        return classification_pb2.ClassificationResponse(
            model_spec=response_spec(version, request.model_spec.signature_name
                                     or DEFAULT_SIGNATURE), result=result)


def regress(manager: ModelManager, request: regression_pb2.RegressionRequest,
            deadline: float | None = None) -> regression_pb2.RegressionResponse:
    with manager.acquire(**spec_args(request.model_spec)) as version:
        result = regress_on(version.servable, request.model_spec.signature_name, request.input,
                            deadline)
        return regression_pb2.RegressionResponse(
            model_spec=response_spec(version, request.model_spec.signature_name
                                     or DEFAULT_SIGNATURE), result=result)
