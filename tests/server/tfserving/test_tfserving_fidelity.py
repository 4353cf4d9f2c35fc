"""`tokenserve serve` against TF Serving's own test models (rebuilt with tf.compat.v1 in
tests/support/tfserving_models.py), driven by the official tensorflow-serving-api stubs over
gRPC and by plain REST, expecting what tensorflow_model_server answers
(docs/migrating-from-tf-serving.md#apis)."""

from __future__ import annotations

import json
import time

import grpc
import httpx
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (classification_pb2, inference_pb2, model_pb2,
                                     predict_pb2, prediction_service_pb2_grpc, regression_pb2)

from support import servables as S
from support import tfserving_models as M
from support.tfserving_models import examples

MODELS = {"half_plus_two": "tensorflow", "half_plus_three": "tensorflow",
          "counter": "tensorflow", "tf2_classifier": "tensorflow",
          "keras_in_module": "tensorflow", "narrow_floats": "tensorflow", "lite": "tflite",
          "lite_sigdef": "tflite"}


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fidelity")
    M.write_half_plus_two(root / "half_plus_two", 123)
    M.write_half_plus_three(root / "half_plus_three", 123)
    M.write_counter(root / "counter", 123)
    M.write_tf2_classifier(root / "tf2_classifier", 1)
    M.write_keras_in_module(root / "keras_in_module", 1)
    M.write_narrow_floats(root / "narrow_floats", 1)
    M.write_tflite_half_plus_two(root / "lite", 1)
    M.write_tflite_with_sigdef(root / "lite_sigdef", 1)
    (root / "models.config").write_text(M.model_config(root, MODELS))
    with S.serving(root, "half_plus_two", f"--model_config_file={root / 'models.config'}",
                   "--max_num_load_retries=0") as process:
        yield process


@pytest.fixture(scope="module")
def stub(server):
    return prediction_service_pb2_grpc.PredictionServiceStub(server.channel)


def post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.rest}{path}", content=content, timeout=60)


def predict_request(model: str, signature: str = "", **inputs) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest(
        model_spec=model_pb2.ModelSpec(name=model, signature_name=signature))
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return request


def test_every_model_loaded(server):
    for name in MODELS:
        status = httpx.get(f"{server.rest}/v1/models/{name}").json()
        assert status["model_version_status"][0]["state"] == "AVAILABLE", (name, server.log())


# ---- item 1: TF1 models with reference variables ---------------------------------------------

def test_half_plus_three_answers_as_in_tf_servings_rest_guide(server):
    predicted = post(server, "/v1/models/half_plus_three:predict",
                     {"instances": [1.0, 2.0, 5.0]})
    assert predicted.text == '{\n    "predictions": [3.5, 4.0, 5.5\n    ]\n}'
    regressed = post(server, "/v1/models/half_plus_three:regress", {
        "signature_name": "tensorflow/serving/regress", "examples": [{"x": 1.0}, {"x": 2.0}]})
    assert regressed.text == '{\n    "results": [3.5, 4.0]\n}'


def test_counter_signatures_keep_state(stub):
    def call(signature, **inputs):
        reply = stub.Predict(predict_request("counter", signature, **inputs))
        return tf.make_ndarray(reply.outputs["output"]).item()

    assert call("reset_counter") == 0.0
    assert call("incr_counter") == 1.0
    assert call("incr_counter_by", delta=np.float32(2.0)) == 3.0
    assert call("get_counter") == 3.0


def test_keras_model_held_by_a_module(server):
    reply = post(server, "/v1/models/keras_in_module:predict", {"instances": [[1.0, 2.0, 3.0]]})
    assert reply.json() == {"predictions": [[6.0, 6.0]]}


# ---- item 2: tensors reach the model as sent -------------------------------------------------

def test_bfloat16_and_float16_outputs_keep_their_fractions_and_complex_is_refused(server,
                                                                                  stub):
    x = [3.75, -1.5, 0.1]  # 0.1 rounds differently in bfloat16 and float16
    bf16 = [float(v) for v in np.array(x, np.float32).astype(tf.bfloat16.as_numpy_dtype)]
    half = [float(v) for v in np.array(x, np.float16)]
    assert bf16[:2] == half[:2] == [3.75, -1.5] and bf16[2] != half[2]
    # written as float32 decimals are (shortest text that reads back as the same float32)
    columnar = post(server, "/v1/models/narrow_floats:predict", {"inputs": {"x": x}})
    assert columnar.status_code == 200, columnar.text
    outputs = columnar.json()["outputs"]
    assert np.array_equal(np.float32(outputs["bf16"]), np.float32(bf16))
    assert np.array_equal(np.float32(outputs["half"]), np.float32(half))
    rows = post(server, "/v1/models/narrow_floats:predict", {"instances": x}).json()
    assert [row["bf16"] for row in rows["predictions"]] == outputs["bf16"]
    assert [row["half"] for row in rows["predictions"]] == outputs["half"]
    # over gRPC the tensors travel as TF encodes them (half_val bits), dtypes kept
    response = stub.Predict(predict_request("narrow_floats", x=np.array(x, np.float32)), 30)
    assert response.outputs["bf16"].dtype == tf.bfloat16.as_datatype_enum
    assert [float(v) for v in tf.make_ndarray(response.outputs["bf16"])] == bf16
    assert [float(v) for v in tf.make_ndarray(response.outputs["half"])] == half

    refused = post(server, "/v1/models/narrow_floats:predict",
                   {"signature_name": "complex", "inputs": {"x": [1.0]}})
    assert refused.status_code == 400
    assert refused.json() == {"error": "Failed to write JSON value for tensor type: complex64"}
    response = stub.Predict(predict_request("narrow_floats", "complex",
                                            x=np.array([1.0], np.float32)), 30)
    assert tf.make_ndarray(response.outputs["z"]).tolist() == [1 + 2j]


def test_half_plus_two_takes_a_flat_batch_over_grpc_and_rest(server, stub):
    reply = stub.Predict(predict_request("half_plus_two", x=np.array([1.0, 2.0, 5.0],
                                                                     np.float32)))
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [2.5, 3.0, 4.5]
    assert reply.model_spec.version.value == 123
    rows = post(server, "/v1/models/half_plus_two:predict", {"instances": [1.0, 2.0, 5.0]})
    assert rows.json() == {"predictions": [2.5, 3.0, 4.5]}
    columns = post(server, "/v1/models/half_plus_two:predict", {"inputs": [1.0, 2.0, 5.0]})
    assert columns.json() == {"outputs": [2.5, 3.0, 4.5]}


def test_tflite_takes_a_tensor_of_another_shape(stub):
    reply = stub.Predict(predict_request("lite", x=np.array([1.0], np.float32)))  # model: [1,1]
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [2.5]


# ---- item 3: Classify, Regress, MultiInference -----------------------------------------------

def test_tf2_signatures_classify_regress_and_multi_inference(server, stub):
    classified = stub.Classify(classification_pb2.ClassificationRequest(
        model_spec=model_pb2.ModelSpec(name="tf2_classifier", signature_name="classify"),
        input=examples(1.0, 3.0)))
    assert [[(c.label, c.score) for c in row.classes]
            for row in classified.result.classifications] == [
        [("pos", 2.5), ("neg", -2.5)], [("pos", 3.5), ("neg", -3.5)]]
    regressed = stub.Regress(regression_pb2.RegressionRequest(
        model_spec=model_pb2.ModelSpec(name="tf2_classifier", signature_name="regress"),
        input=examples(1.0, 3.0)))
    assert [r.value for r in regressed.result.regressions] == [2.5, 3.5]
    multi = inference_pb2.MultiInferenceRequest(input=examples(2.0))
    for signature, method in (("classify", "tensorflow/serving/classify"),
                              ("regress", "tensorflow/serving/regress")):
        multi.tasks.add(model_spec=model_pb2.ModelSpec(name="tf2_classifier",
                                                       signature_name=signature),
                        method_name=method)
    # Each TF2 signature is its own function with its own input placeholder: each task runs
    # its signature on the same examples (test_tfserving_multi_inference.py in full).
    classes, regression = stub.MultiInference(multi).results
    assert [(c.label, c.score) for c in classes.classification_result.classifications[0]
            .classes] == [("pos", 3.0), ("neg", -3.0)]
    assert [r.value for r in regression.regression_result.regressions] == [3.0]
    assert [r.model_spec.signature_name for r in (classes, regression)] == ["classify",
                                                                              "regress"]
    rest = post(server, "/v1/models/tf2_classifier:classify", {
        "signature_name": "classify", "examples": [{"x": 1.0}]})
    assert rest.json() == {"results": [[["pos", 2.5], ["neg", -2.5]]]}


def test_tf1_classify_with_scores_only_multi_inference_and_errors(server, stub):
    classified = stub.Classify(classification_pb2.ClassificationRequest(
        model_spec=model_pb2.ModelSpec(name="half_plus_two", signature_name="classify_x_to_y"),
        input=examples(1.0)))
    assert [(c.label, c.score) for c in classified.result.classifications[0].classes] == [
        ("", 2.5)]
    multi = inference_pb2.MultiInferenceRequest(input=examples(2.0))
    for signature, method in (("classify_x_to_y", "tensorflow/serving/classify"),
                              ("regress_x_to_y2", "tensorflow/serving/regress")):
        multi.tasks.add(model_spec=model_pb2.ModelSpec(name="half_plus_two",
                                                       signature_name=signature),
                        method_name=method)
    results = stub.MultiInference(multi).results
    assert results[0].classification_result.classifications[0].classes[0].score == 3.0
    assert results[1].regression_result.regressions[0].value == 4.0
    assert [r.model_spec.signature_name for r in results] == ["classify_x_to_y",
                                                              "regress_x_to_y2"]
    # a TF1 graph is fed once: signatures reading different input tensors are refused
    multi = inference_pb2.MultiInferenceRequest(input=examples(2.0))
    for signature in ("regress_x_to_y", "regress_x2_to_y3"):
        multi.tasks.add(model_spec=model_pb2.ModelSpec(name="half_plus_two",
                                                       signature_name=signature),
                        method_name="tensorflow/serving/regress")
    with pytest.raises(grpc.RpcError) as raised:
        stub.MultiInference(multi)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "Input tensor must be the same for all Signatures."
    with pytest.raises(grpc.RpcError) as raised:  # its input is a float tensor, not Examples
        stub.Regress(regression_pb2.RegressionRequest(
            model_spec=model_pb2.ModelSpec(name="half_plus_two",
                                           signature_name="regress_x2_to_y3"),
            input=examples(1.0)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "Expects arg[0] to be float but string is provided" in raised.value.details()
    with pytest.raises(grpc.RpcError) as raised:
        stub.Regress(regression_pb2.RegressionRequest(
            model_spec=model_pb2.ModelSpec(name="half_plus_two", signature_name="nope"),
            input=examples(1.0)))
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == "No signature was found with the name: nope"
    multi = inference_pb2.MultiInferenceRequest(input=examples(1.0))
    multi.tasks.add(model_spec=model_pb2.ModelSpec(name="half_plus_two",
                                                   signature_name="regress_x_to_y"),
                    method_name="tensorflow/serving/predict")
    with pytest.raises(grpc.RpcError) as raised:
        stub.MultiInference(multi)
    assert raised.value.code() == grpc.StatusCode.UNIMPLEMENTED
    assert raised.value.details() == ("Unsupported signature method_name: "
                                      "tensorflow/serving/predict")


# ---- item 4: a .tflite model with a SignatureDef ---------------------------------------------

def test_tflite_signature_def_serves_its_aliases(server):
    reply = post(server, "/v1/models/lite_sigdef:predict", {"inputs": {"x": [1.0, 2.0, 3.0]}})
    assert reply.json() == {"outputs": [2.5, 3.0, 3.5]}, reply.text
    metadata = httpx.get(f"{server.rest}/v1/models/lite_sigdef/metadata").json()
    signature = metadata["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert signature["inputs"]["x"]["name"] == "tflite_input"
    assert signature["outputs"]["y"]["name"] == "y"


# ---- item 8: hostile requests get TF Serving's 4xx / INVALID_ARGUMENT, and no work -----------

def test_rest_version_beyond_int64(server):
    reply = post(server, "/v1/models/half_plus_two/versions/9223372036854775808:predict",
                 {"instances": [1.0]})
    assert reply.status_code == 400
    assert reply.text == ('{\n    "error": "Failed to convert version: 9223372036854775808 to '
                          'numeric."\n}')
    status = httpx.get(f"{server.rest}/v1/models/half_plus_two/versions/99999999999999999999")
    assert status.status_code == 400


def test_rest_json_nested_too_deep(server):
    body = '{"instances": ' + "[" * 5000 + "1.0" + "]" * 5000 + "}"
    reply = post(server, "/v1/models/half_plus_two:predict", body)
    assert reply.status_code == 400, reply.text
    assert reply.json() == {"error": "JSON Parse error: The document is nested too deeply"}
    instance = "[" * 900 + "1.0" + "]" * 900  # valid JSON, 900 dimensions
    reply = post(server, "/v1/models/half_plus_two:predict", '{"instances": [' + instance + "]}")
    assert reply.status_code == 400, reply.text
    assert reply.json()["error"].startswith("tensor parsing error: x")


def _peak_rss_kib(server) -> int:
    status = open(f"/proc/{server.process.pid}/status").read()
    return int(status.split("VmHWM:")[1].split()[0])


def test_grpc_tensor_declaring_more_elements_than_it_sends(server, stub):
    request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name="half_plus_two"))
    tensor = request.inputs["x"]
    tensor.dtype = tf.float32.as_datatype_enum
    tensor.tensor_shape.dim.add(size=1)
    tensor.tensor_shape.dim.add(size=2**26)
    tensor.float_val.append(1.0)
    assert request.ByteSize() < 50
    before = _peak_rss_kib(server)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Predict(request, timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("tensor parsing error: x (1 values for 67108864 "
                                             "elements")
    assert _peak_rss_kib(server) - before < 64 * 1024  # 2^26 floats would be 256 MiB


def test_grpc_garbage_bytes(server):
    predict = server.channel.unary_unary(
        "/tensorflow.serving.PredictionService/Predict",
        request_serializer=lambda raw: raw, response_deserializer=lambda raw: raw)
    with pytest.raises(grpc.RpcError) as raised:
        predict(b"\xff\xff\xff\xff\x0f garbage", timeout=30)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().startswith("Could not parse tensorflow.serving.PredictRequest")


def test_rest_other_methods_are_malformed_requests(server):
    for method in ("PUT", "DELETE", "PATCH"):
        reply = httpx.request(method, f"{server.rest}/v1/models/half_plus_two", timeout=30)
        assert reply.status_code == 400
        assert reply.text == ('{\n    "error": "Malformed request: ' + method
                              + ' /v1/models/half_plus_two"\n}')


def test_still_serving_after_hostile_requests(server, stub):
    started = time.monotonic()
    reply = stub.Predict(predict_request("half_plus_two", x=np.array([[1.0]], np.float32)))
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [[2.5]]
    assert time.monotonic() - started < 10
