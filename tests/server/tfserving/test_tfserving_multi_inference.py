"""MultiInference on a TF2 SavedModel, as a user of tensorflow_model_server sends it.

A TF2 half_plus_two (TF Serving's `saved_model_half_plus_two_tf2_cpu`: classify and regress
signatures over serialized tf.Examples, each its own function) is built here, served by
`tokenserve serve --model_name=default --model_base_path=...` on a free port, and called
through the official tensorflow-serving-api stub. Each task's result must equal what the
same signature answers to Classify or Regress alone; the requests TF Serving refuses keep
its codes and texts (multi_inference.cc)."""

from __future__ import annotations

import grpc
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (classification_pb2, inference_pb2, input_pb2, model_pb2,
                                     prediction_log_pb2, prediction_service_pb2_grpc,
                                     regression_pb2)

from support import servables as S
from support.tfserving_models import examples

CLASSIFY = "tensorflow/serving/classify"
REGRESS = "tensorflow/serving/regress"
PREDICT = "tensorflow/serving/predict"


class _HalfPlusTwo(tf.Module):
    """y = 0.5x + 2 and y2 = 0.5x + 3 of the feature `x` of serialized tf.Examples."""

    def __init__(self):
        super().__init__()
        self.a = tf.Variable(0.5)
        self.b = tf.Variable(2.0)
        self.c = tf.Variable(3.0)

    @staticmethod
    def _x(serialized):
        # serialized: [N] -> x: [N, 1]
        return tf.io.parse_example(
            serialized, {"x": tf.io.FixedLenFeature([1], tf.float32)})["x"]

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress_x_to_y(self, inputs):
        return {"outputs": self.a * self._x(inputs) + self.b}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def regress_x_to_y2(self, inputs):
        return {"outputs": self.a * self._x(inputs) + self.c}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="inputs")])
    def classify_x_to_y(self, inputs):
        return {"scores": self.a * self._x(inputs) + self.b}  # [N, 1]: one unnamed class

    @tf.function(input_signature=[tf.TensorSpec([None, 1], tf.float32, name="x")])
    def predict(self, x):
        return {"y": self.a * x + self.b}


def _multi(request_input, *tasks: tuple[str, str, str]) -> inference_pb2.MultiInferenceRequest:
    """tasks: (model name, signature name, method name)."""
    request = inference_pb2.MultiInferenceRequest(input=request_input)
    for model, signature, method in tasks:
        request.tasks.add(model_spec=model_pb2.ModelSpec(name=model, signature_name=signature),
                          method_name=method)
    return request


@pytest.fixture(scope="module")
def stub(tmp_path_factory):
    root = tmp_path_factory.mktemp("tf2_half_plus_two")
    module = _HalfPlusTwo()
    version = root / "model" / "1"
    tf.saved_model.save(module, str(version), signatures={
        "regress_x_to_y": module.regress_x_to_y, "regress_x_to_y2": module.regress_x_to_y2,
        "classify_x_to_y": module.classify_x_to_y, "serving_default": module.predict})
    # a version is AVAILABLE only once its warmup records ran: this one is a MultiInference
    S.write_warmup_logs(version, [prediction_log_pb2.PredictionLog(
        multi_inference_log=prediction_log_pb2.MultiInferenceLog(request=_multi(
            examples(1.0), ("default", "classify_x_to_y", CLASSIFY),
            ("default", "regress_x_to_y", REGRESS))))])
    with S.serving(root, "default", "--model_name=default",
                   f"--model_base_path={root / 'model'}", rest=False) as server:
        yield prediction_service_pb2_grpc.PredictionServiceStub(server.channel)


def _spec(signature: str) -> model_pb2.ModelSpec:
    return model_pb2.ModelSpec(name="default", signature_name=signature)


def test_classify_and_regress_tasks_answer_as_each_signature_alone(stub):
    request_input = examples(1.0, 2.0, 5.0)
    response = stub.MultiInference(_multi(
        request_input, ("default", "regress_x_to_y", REGRESS),
        ("default", "classify_x_to_y", CLASSIFY), ("default", "regress_x_to_y2", REGRESS)),
        timeout=60)
    regressed = stub.Regress(regression_pb2.RegressionRequest(
        model_spec=_spec("regress_x_to_y"), input=request_input), timeout=60)
    classified = stub.Classify(classification_pb2.ClassificationRequest(
        model_spec=_spec("classify_x_to_y"), input=request_input), timeout=60)
    regressed_y2 = stub.Regress(regression_pb2.RegressionRequest(
        model_spec=_spec("regress_x_to_y2"), input=request_input), timeout=60)

    first, second, third = response.results
    assert first.regression_result == regressed.result
    assert second.classification_result == classified.result
    assert third.regression_result == regressed_y2.result
    assert [r.value for r in first.regression_result.regressions] == [2.5, 3.0, 4.5]
    assert [r.value for r in third.regression_result.regressions] == [3.5, 4.0, 5.5]
    assert [[(c.label, c.score) for c in row.classes]
            for row in second.classification_result.classifications] == [
        [("", 2.5)], [("", 3.0)], [("", 4.5)]]
    # results in task order, each with the task's model spec and the version that answered
    assert [(r.model_spec.name, r.model_spec.signature_name, r.model_spec.version.value)
            for r in response.results] == [("default", "regress_x_to_y", 1),
                                           ("default", "classify_x_to_y", 1),
                                           ("default", "regress_x_to_y2", 1)]
    assert regressed.model_spec == first.model_spec


def test_context_examples_reach_every_task(stub):
    request_input = input_pb2.Input()
    merged = request_input.example_list_with_context
    merged.context.features.feature["x"].float_list.value.append(4.0)
    merged.examples.add()
    merged.examples.add()
    results = stub.MultiInference(_multi(
        request_input, ("default", "classify_x_to_y", CLASSIFY),
        ("default", "regress_x_to_y2", REGRESS)), timeout=60).results
    assert [c.classes[0].score for c in results[0].classification_result.classifications] == [
        4.0, 4.0]
    assert [r.value for r in results[1].regression_result.regressions] == [5.0, 5.0]


@pytest.mark.parametrize("tasks, code, details", [
    ([("default", "regress_x_to_y", REGRESS), ("other", "classify_x_to_y", CLASSIFY)],
     grpc.StatusCode.INVALID_ARGUMENT,
     "All ModelSpecs in a MultiInferenceRequest must access the same model name."),
    ([("default", "regress_x_to_y", REGRESS), ("default", "regress_x_to_y", REGRESS)],
     grpc.StatusCode.INVALID_ARGUMENT, "Duplicate evaluation of signature: regress_x_to_y"),
    ([("default", "regress_x_to_y", REGRESS), ("default", "", PREDICT)],
     grpc.StatusCode.UNIMPLEMENTED, f"Unsupported signature method_name: {PREDICT}"),
    ([("default", "nope", REGRESS), ("default", "nope", REGRESS)],  # looked up before the
     grpc.StatusCode.INVALID_ARGUMENT,                              # second task's check
     "Requested signature not found in model graph: nope"),
    ([("default", "regress_x_to_y", REGRESS), ("default", "", "")],
     grpc.StatusCode.UNIMPLEMENTED, "Unsupported signature method_name: "),
    ([], grpc.StatusCode.INVALID_ARGUMENT, "Found no tasks in MultiInferenceRequest"),
])
def test_requests_tf_serving_refuses_stay_refused(stub, tasks, code, details):
    with pytest.raises(grpc.RpcError) as raised:
        stub.MultiInference(_multi(examples(1.0), *tasks), timeout=60)
    assert (raised.value.code(), raised.value.details()) == (code, details)


def test_an_empty_input_is_refused_after_the_tasks_are_checked(stub):
    with pytest.raises(grpc.RpcError) as raised:
        stub.MultiInference(_multi(input_pb2.Input(), ("default", "regress_x_to_y", REGRESS),
                                   ("default", "classify_x_to_y", CLASSIFY)), timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "Input is empty."
