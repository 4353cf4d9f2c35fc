"""`tokenserve serve` as a subprocess, driven by the official tensorflow-serving-api stubs and
plain HTTP: several models from one --model_config_file (TF2 multi-signature, Keras export,
TF1 classify/regress over tf.Example, our tiny LM, TFLite, a corrupt one, one whose warmup
fails), the bad-input matrix, metadata, status, health, Unix socket, Prometheus."""

from __future__ import annotations

import json

import grpc
import httpx
import numpy as np
import pytest
import tensorflow as tf
from grpc_health.v1 import health_pb2, health_pb2_grpc
from tensorflow_serving.apis import (classification_pb2, get_model_metadata_pb2,
                                     get_model_status_pb2, inference_pb2,
                                     model_pb2, model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc, regression_pb2)

from support import servables as S
from support.tfserving_models import examples
from support.tiny_models import tiny

MODELS = ("tf2", "keras", "tf1", "lm", "lite", "broken", "badwarmup", "badclassify")


@pytest.fixture(scope="module")
def server(tmp_path_factory, tokenizer):
    from tokenserve.export.exporter import export_model

    root = tmp_path_factory.mktemp("tfserving")
    tf2 = S.write_tf2_model(root / "tf2", 1)
    S.write_warmup(tf2, "tf2", "serving_default", {"x": S.float_input([1.0, 2.0])}, count=3)
    S.write_keras_model(root / "keras", 1)
    S.write_warmup_logs(S.write_tf1_model(root / "tf1", 1), S.example_logs("tf1"))
    S.write_warmup_logs(S.write_tf1_model(root / "badclassify", 1),
                        S.example_logs("badclassify", classify_signature="nope"))
    model, config = tiny("tiny-gpt2", tokenizer)
    lm_dir = export_model(model, tokenizer, config, root / "lm", jit_compile=False)
    S.write_tflite_model(root / "lite", 1, root / "scratch")
    (root / "broken" / "1").mkdir(parents=True)
    (root / "broken" / "1" / "saved_model.pb").write_bytes(b"not a protobuf")
    bad = S.write_tf2_model(root / "badwarmup", 1)
    S.write_warmup(bad, "badwarmup", "serving_default", {"nope": S.float_input([1.0])})
    config_file = root / "models.config"
    config_file.write_text("model_config_list {\n" + "".join(
        f'  config {{ name: "{name}" base_path: "{root / name}" model_platform: "tensorflow"'
        + (' version_labels { key: "stable" value: 1 }' if name == "tf2" else "") + " }\n"
        for name in MODELS) + "}\n")
    (root / "monitoring.config").write_text(
        'prometheus_config { enable: true, path: "/monitoring/prometheus/metrics" }\n')
    (root / "batching.config").write_text("max_batch_size { value: 8 }\n")
    socket_path = root / "grpc.sock"
    with S.serving(
        root, "tf2", f"--model_config_file={root / 'models.config'}",
        f"--monitoring_config_file={root / 'monitoring.config'}",
        "--enable_batching=true", f"--batching_parameters_file={root / 'batching.config'}",
        f"--grpc_socket_path={socket_path}", "--prefer_tflite_model=true",
        "--max_num_load_retries=0", "--platform_config_file=/nonexistent.cfg",
        "--tensorflow_session_parallelism=2", "--rest_api_enable_cors_support=true",
        "--allow_version_labels_for_unavailable_models=true") as process:
        process.socket_path = socket_path
        process.lm_dir = lm_dir
        yield process


@pytest.fixture(scope="module")
def predictions(server):
    return prediction_service_pb2_grpc.PredictionServiceStub(server.channel)


@pytest.fixture(scope="module")
def models(server):
    return model_service_pb2_grpc.ModelServiceStub(server.channel)


def rest_post(server, path: str, body) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(f"{server.rest}{path}", content=content, timeout=60)


def predict_request(name: str, signature: str = "", version: int | None = None,
                    label: str = "", **inputs) -> predict_pb2.PredictRequest:
    request = predict_pb2.PredictRequest()
    request.model_spec.name = name
    request.model_spec.signature_name = signature
    if version is not None:
        request.model_spec.version.value = version
    if label:
        request.model_spec.version_label = label
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    return request


def int8_tensor_proto(values: list[int]):
    """An int8 TensorProto holding `values` in int_val as sent, in range or not."""
    proto = tf.make_tensor_proto(np.zeros(len(values), np.int8))
    proto.ClearField("tensor_content")
    proto.int_val[:] = values
    return proto


# ---- status, metadata, health ---------------------------------------------------------------

def test_status_rest_matches_tf_serving_json(server):
    response = httpx.get(f"{server.rest}/v1/models/tf2")
    assert response.status_code == 200
    assert response.text == ('{\n "model_version_status": [\n  {\n   "version": "1",\n'
                             '   "state": "AVAILABLE",\n   "status": {\n    "error_code": "OK",\n'
                             '    "error_message": ""\n   }\n  }\n ]\n}\n')
    assert httpx.get(f"{server.rest}/v1/models/tf2/versions/1").json() == response.json()
    assert httpx.get(f"{server.rest}/v1/models/tf2/labels/stable").json() == response.json()
    missing = httpx.get(f"{server.rest}/v1/models")
    assert (missing.status_code, missing.json()) == (400, {"error": "Missing model name in "
                                                                    "request."})
    unknown = httpx.get(f"{server.rest}/v1/models/tf2/versions/9")
    assert (unknown.status_code, unknown.json()) == (404, {"error": "Could not find version 9 "
                                                                    "of model tf2"})


def test_status_grpc_and_broken_models_do_not_disturb_others(server, models, predictions):
    status = models.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(
        model_spec=model_pb2.ModelSpec(name="tf1")))
    assert [(s.version, s.state) for s in status.model_version_status] == [
        (1, get_model_status_pb2.ModelVersionStatus.AVAILABLE)]
    for name, text in (("broken", "Failed to load SavedModel"),
                       ("badwarmup", "warmup record 0"),
                       ("badclassify", "No signature was found with the name: nope")):
        [broken] = models.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(
            model_spec=model_pb2.ModelSpec(name=name))).model_version_status
        assert broken.state == get_model_status_pb2.ModelVersionStatus.END
        assert broken.status.error_code != 0 and text in broken.status.error_message
        response = rest_post(server, f"/v1/models/{name}:predict", {"instances": [1.0]})
        assert response.status_code == 404
        assert response.text == ('{\n    "error": "Servable not found for request: '
                                 f'Latest({name})"\n}}')
    assert "y" in predictions.Predict(predict_request("tf2", x=S.float_input([1.0]))).outputs


def test_metadata_grpc_and_rest(server, predictions):
    request = get_model_metadata_pb2.GetModelMetadataRequest(
        model_spec=model_pb2.ModelSpec(name="tf1"), metadata_field=["signature_def"])
    response = predictions.GetModelMetadata(request)
    assert response.model_spec.version.value == 1
    signatures = get_model_metadata_pb2.SignatureDefMap()
    response.metadata["signature_def"].Unpack(signatures)
    assert signatures.signature_def["classify_x_to_y"].method_name == "tensorflow/serving/classify"
    assert set(signatures.signature_def) == {"classify_x_to_y", "regress_x_to_y",
                                             "regress_x_to_y2", "serving_default"}
    body = httpx.get(f"{server.rest}/v1/models/tf2/metadata")
    assert body.status_code == 200 and body.text.startswith('{\n"model_spec":{\n "name": "tf2",')
    parsed = body.json()
    assert parsed["model_spec"] == {"name": "tf2", "signature_name": "", "version": "1"}
    sig = parsed["metadata"]["signature_def"]["signature_def"]["serving_default"]
    assert sig["inputs"]["x"]["dtype"] == "DT_FLOAT"
    assert sig["method_name"] == "tensorflow/serving/predict"


def test_health_and_unix_socket(server):
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == \
        health_pb2.HealthCheckResponse.SERVING
    with grpc.insecure_channel(f"unix:{server.socket_path}") as channel:
        stub = prediction_service_pb2_grpc.PredictionServiceStub(channel)
        response = stub.Predict(predict_request("tf2", x=S.float_input([4.0])))
    assert tf.make_ndarray(response.outputs["y"]).tolist() == [4.0]


# ---- Predict ------------------------------------------------------------------------------

def test_predict_rest_row_and_columnar(server):
    row = rest_post(server, "/v1/models/tf2:predict", {"instances": [1.0, 2.0, 5.0]})
    assert row.status_code == 200
    assert row.text == '{\n    "predictions": [2.5, 3.0, 4.5\n    ]\n}'
    columnar = rest_post(server, "/V1/Models/tf2/Versions/1:Predict",
                         {"inputs": {"x": [1.0, 2.0]}})
    assert columnar.json() == {"outputs": [2.5, 3.0]}
    objects = rest_post(server, "/v1/models/tf2/labels/stable:predict", {
        "signature_name": "arith", "instances": [{"a": [1, 2], "b": [3, 4]},
                                                 {"a": [5, 6], "b": [7, 8]}]})
    assert objects.json() == {"predictions": [{"product": [3, 8], "sum": [4, 6]},
                                              {"product": [35, 48], "sum": [12, 14]}]}
    strings = rest_post(server, "/v1/models/tf2:predict", {
        "signature_name": "strings", "inputs": {"text": [{"b64": "aGk="}, "yo"]}})
    assert strings.json() == {"outputs": {"length": [2, 2],
                                          "upper_bytes": [{"b64": "SEk="}, {"b64": "WU8="}]}}


def test_predict_grpc_with_output_filter(predictions):
    request = predict_request("tf2", "arith", version=1, a=np.array([[2]], np.int32),
                              b=np.array([[5]], np.int32))
    request.output_filter.append("product")
    response = predictions.Predict(request)
    assert list(response.outputs) == ["product"]
    assert tf.make_ndarray(response.outputs["product"]).tolist() == [[10]]
    # Values in the typed field, as TF Serving answers (clients read .int_val directly).
    assert list(response.outputs["product"].int_val) == [10]
    assert not response.outputs["product"].tensor_content
    floats = predictions.Predict(predict_request("tf2", x=S.float_input([1.0, 2.0])))
    assert list(floats.outputs["y"].float_val) == [2.5, 3.0]
    texts = predictions.Predict(predict_request(
        "tf2", "strings", text=np.array([b"ab", b"c"], dtype=object)))
    assert list(texts.outputs["upper_bytes"].string_val) == [b"AB", b"C"]
    assert [d.size for d in texts.outputs["upper_bytes"].tensor_shape.dim] == [2]
    assert (response.model_spec.name, response.model_spec.version.value,
            response.model_spec.signature_name) == ("tf2", 1, "arith")


def test_keras_export(server):
    response = rest_post(server, "/v1/models/keras:predict",
                         {"instances": [[1.0, 2.0, 3.0], [0.0, 0.0, 1.0]]})
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": [[6.0, 6.0], [1.0, 1.0]]}


def test_tflite_with_prefer_tflite_model(server, predictions):
    response = rest_post(server, "/v1/models/lite:predict", {"instances": [2.0, 4.0]})
    assert response.json() == {"predictions": [3.0, 4.0]}
    metadata = httpx.get(f"{server.rest}/v1/models/lite/metadata").json()
    assert "serving_default" in metadata["metadata"]["signature_def"]["signature_def"]


# ---- Classify, Regress, MultiInference on a TF1-style model -----------------------------------

def test_classify_and_regress_grpc(predictions):
    classified = predictions.Classify(classification_pb2.ClassificationRequest(
        model_spec=model_pb2.ModelSpec(name="tf1", signature_name="classify_x_to_y"),
        input=examples(1.0, 3.0)))
    assert [[(c.label, round(c.score, 4)) for c in row.classes]
            for row in classified.result.classifications] == [
        [("pos", 2.5), ("neg", -2.5)], [("pos", 3.5), ("neg", -3.5)]]
    regressed = predictions.Regress(regression_pb2.RegressionRequest(
        model_spec=model_pb2.ModelSpec(name="tf1", signature_name="regress_x_to_y"),
        input=examples(1.0, 3.0)))
    assert [r.value for r in regressed.result.regressions] == [2.5, 3.5]
    assert regressed.model_spec.version.value == 1


def test_multi_inference_grpc(predictions):
    request = inference_pb2.MultiInferenceRequest(input=examples(2.0))
    for signature, method in (("classify_x_to_y", "tensorflow/serving/classify"),
                              ("regress_x_to_y2", "tensorflow/serving/regress")):
        request.tasks.add(model_spec=model_pb2.ModelSpec(name="tf1", signature_name=signature),
                          method_name=method)
    response = predictions.MultiInference(request)
    classes, regression = response.results
    assert classes.classification_result.classifications[0].classes[0].score == 3.0
    assert regression.regression_result.regressions[0].value == 6.0
    assert regression.model_spec.signature_name == "regress_x_to_y2"


def test_classify_and_regress_rest(server):
    classified = rest_post(server, "/v1/models/tf1:classify", {
        "signature_name": "classify_x_to_y", "examples": [{"x": 1.0}, {"x": 3.0}]})
    assert classified.status_code == 200, classified.text
    assert classified.json() == {"results": [[["pos", 2.5], ["neg", -2.5]],
                                             [["pos", 3.5], ["neg", -3.5]]]}
    regressed = rest_post(server, "/v1/models/tf1/versions/1:regress", {
        "signature_name": "regress_x_to_y", "context": {"x": 1.0}, "examples": [{}, {}]})
    assert regressed.text == '{\n    "results": [2.5, 2.5]\n}'


# ---- our language model ---------------------------------------------------------------------

def test_language_model_serving_default_and_generate(server, predictions):
    exported = tf.saved_model.load(str(server.lm_dir))
    prompt = np.array([[5, 17, 42, 7]], np.int32)
    expected = exported.signatures["serving_default"](input_ids=tf.constant(prompt))
    response = rest_post(server, "/v1/models/lm:predict", {"instances": prompt.tolist()})
    assert response.status_code == 200, response.text
    assert response.json() == {"predictions": expected["predicted_id"].numpy().tolist()}

    inputs = {"input_ids": prompt, "max_new_tokens": np.int32(6),
              "temperature": np.float32(0.0), "top_k": np.int32(0), "top_p": np.float32(1.0),
              "seed": np.int32(0)}
    direct = exported.signatures["generate"](**{k: tf.constant(v) for k, v in inputs.items()})
    generated = predictions.Predict(predict_request("lm", "generate", **inputs))
    assert (tf.make_ndarray(generated.outputs["output_ids"]).tolist()
            == direct["output_ids"].numpy().tolist())


# ---- bad input: TF Serving's codes and messages; the server keeps serving -------------------

REST_ERRORS = [
    ("/v1/models/nope:predict", {"instances": [1.0]}, 404,
     "Servable not found for request: Latest(nope)"),
    ("/v1/models/tf2/versions/99:predict", {"instances": [1.0]}, 404,
     "Servable not found for request: Specific(tf2, 99)"),
    ("/v1/models/tf2/labels/beta:predict", {"instances": [1.0]}, 400,
     "Unrecognized servable version label: beta"),
    ("/v1/models/tf2:predict", {"signature_name": "arith", "instances": [
        {"a": [1, 2], "b": [1, 2]}, {"a": [1], "b": [1, 2]}]}, 400,
     "Failed to process element: 1 key: a of 'instances' list. Error: INVALID_ARGUMENT: "
     "Expecting tensor size: 2 but got: 1"),
    ("/v1/models/tf2:predict", {"instances": ["one"]}, 400,
     "Failed to process element: 0 of 'instances' list. Error: INVALID_ARGUMENT: JSON Value: "
     "\"one\" Type: String is not of expected type: float"),
    ("/v1/models/tf2:predict", {"instances": [1.0], "inputs": [1.0]}, 400,
     "JSON Value: {\"instances\":[1.0],\"inputs\":[1.0]} Not formatted correctly expecting "
     "only one of 'inputs' or 'instances' keys to exist "),
    ("/v1/models/tf2:predict", {"signature_name": "nope", "instances": [1.0]}, 400,
     "Serving signature name: \"nope\" not found in signature def"),
    ("/v1/models/tf2:predict", {"x": 1}, 400, "Missing 'inputs' or 'instances' key"),
    # two scalars asking for a million rows of cache: refused by the signature, not allocated
    ("/v1/models/lm:predict", {"signature_name": "init_state",
                               "inputs": {"batch_size": 1000000, "max_len": 16}}, 400,
     "would be over 1073741824 bytes"),
    ("/v1/models/tf2:predict", "{not json", 400, "JSON Parse error: "),
    # JSON's \u escapes for half a UTF-16 surrogate pair: RapidJSON refuses them, at the
    # escape (json.loads takes them, and the signature name then broke the error reply)
    ("/v1/models/tf2:predict", r'{"signature_name": "\ud800", "instances": [1.0]}', 400,
     "JSON Parse error: The surrogate pair in string is invalid. at offset: 20"),
    ("/v1/models/tf2:predict", r'{"instances": ["a\udc00"]}', 400,
     "JSON Parse error: The surrogate pair in string is invalid. at offset: 17"),
    ("/v1/models/tf2:predict", r'{"instances": ["\ud83d\u0041"]}', 400,
     "JSON Parse error: The surrogate pair in string is invalid. at offset: 16"),
    # a whole pair, and an escaped backslash before "ud800", are text, not errors
    ("/v1/models/tf2:predict", r'{"signature_name": "\ud83d\ude00", "instances": [1.0]}',
     400, "Serving signature name: \"\U0001F600\" not found in signature def"),
    ("/v1/models/tf2:predict", r'{"signature_name": "\\ud800", "instances": [1.0]}', 400,
     "Serving signature name: \"\\ud800\" not found in signature def"),
    # an integer literal longer than Python's int() reads (4,300 digits) was a 500; RapidJSON
    # reads it as a double, out of range: its error, at the number (not at the string of
    # digits before it)
    ("/v1/models/tf2:predict", '{"signature_name": "' + "1" * 5000 + '", "instances": [' +
     "9" * 5000 + "]}", 400,
     "JSON Parse error: Number too big to be stored in double. at offset: 5037"),
    ("/v1/models/tf2:explain", {"instances": [1.0]}, 400,
     "Malformed request: POST /v1/models/tf2:explain"),
    ("/v2/models/tf2/infer", {"instances": [1.0]}, 400,
     "Malformed request: POST /v2/models/tf2/infer"),
    # serving_default's input is `x`, not `inputs` (TF Serving 2.x checks the signature's
    # shape, not its method_name)
    # an integer feature past int64 (protobuf's append raised ValueError: a 500)
    ("/v1/models/tf1:regress", {"signature_name": "regress_x_to_y",
                                "examples": [{"x": 1.0, "n": 2**63}]}, 400,
     "Feature: n has an integer outside int64's range: 9223372036854775808"),
    ("/v1/models/tf1:classify", {"examples": [{"x": 1.0}]}, 400,
     "No classification inputs found in SignatureDef: inputs {\n  key: \"x\""),
]


@pytest.mark.parametrize("path, body, status, message", REST_ERRORS,
                         ids=[f"{i}" for i in range(len(REST_ERRORS))])
def test_rest_errors(server, path, body, status, message):
    response = rest_post(server, path, body)
    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    assert response.text.startswith('{\n    "error": "') and response.text.endswith('"\n}')
    assert message in response.json()["error"]


GRPC_ERRORS = [
    (predict_request("nope", x=S.float_input([1.0])), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request: Latest(nope)"),
    # cut at 2,048 characters: clients drop a grpc-message trailer over 16 KiB, code and all
    (predict_request("n" * 10_000, x=S.float_input([1.0])), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request: Latest(nnn"),
    (predict_request("n" * 10_000, x=S.float_input([1.0])), grpc.StatusCode.NOT_FOUND,
     "nnn... (7992 more characters)"),
    (predict_request("tf2", version=7, x=S.float_input([1.0])), grpc.StatusCode.NOT_FOUND,
     "Servable not found for request: Specific(tf2, 7)"),
    (predict_request("tf2", label="beta", x=S.float_input([1.0])),
     grpc.StatusCode.INVALID_ARGUMENT, "Unrecognized servable version label: beta"),
    (predict_request("tf2", "nope", x=S.float_input([1.0])), grpc.StatusCode.FAILED_PRECONDITION,
     'Serving signature key "nope" not found.'),
    (predict_request("tf2", x=np.array([1, 2], np.int64)), grpc.StatusCode.INVALID_ARGUMENT,
     "Expects arg[0] to be float but int64 is provided"),
    # TF's message quotes the bytes, which are not UTF-8 (TF's Python binding then raised
    # UnicodeDecodeError in place of the error: INTERNAL)
    (predict_request("tf1", "regress_x_to_y", inputs=np.array([b"\xff\xfe"], object)),
     grpc.StatusCode.INVALID_ARGUMENT, "Could not parse example input, value: '\\xff\\xfe'"),
    # int_val out of int8's range: TensorFlow casts it (300 is 44), then the dtype is checked
    (predict_request("tf2", x=int8_tensor_proto([300, -1000])), grpc.StatusCode.INVALID_ARGUMENT,
     "Expects arg[0] to be float but int8 is provided"),
    # As predict_util.cc: the count matches, so the unknown name is reported by GetInputValues
    (predict_request("tf2", y=S.float_input([1.0])), grpc.StatusCode.INVALID_ARGUMENT,
     "Signature input alias: x(feed name: serving_default_x:0) not found in request and no "
     "default value provided. Inputs expected to be in the request {y}, or default input "
     "alias set: "),
    (predict_request("tf2", x=S.float_input([1.0]), y=S.float_input([1.0])),
     grpc.StatusCode.INVALID_ARGUMENT,
     "input size does not match signature: 2!=1 len({x,y}) != len({x}). Sent extra: {y}. "
     "Missing but required: {}."),
    (predict_request("tf2", "arith", a=np.array([[1]], np.int32)),
     grpc.StatusCode.INVALID_ARGUMENT,
     "input size does not match signature: 1!=2 len({a}) != len({a,b}). Sent extra: {}. "
     "Missing but required: {b}."),
]


@pytest.mark.parametrize("request_proto, code, message", GRPC_ERRORS,
                         ids=[f"{i}" for i in range(len(GRPC_ERRORS))])
def test_grpc_errors(predictions, request_proto, code, message):
    with pytest.raises(grpc.RpcError) as raised:
        predictions.Predict(request_proto)
    assert raised.value.code() == code
    assert message in raised.value.details()


def test_still_serving_after_errors_and_metrics(server, predictions):
    assert predictions.Predict(predict_request("tf2", x=S.float_input([0.0]))).outputs["y"]
    metrics = httpx.get(f"{server.rest}/monitoring/prometheus/metrics")
    assert metrics.status_code == 200
    text = metrics.text
    assert '\n:tensorflow:serving:request_count{model_name="tf2",status="OK"} ' in text
    # names that are not configured models are counted under one label (docs/metrics.md#prometheus)
    assert ':tensorflow:serving:request_count{model_name="(unknown)",status="NOT_FOUND"}' in text
    assert '_total' not in text.split(":tensorflow:serving:request_count", 1)[1].split("\n")[0]
    assert ':tensorflow:serving:request_latency_bucket{API="Predict",entrypoint="GRPC"' in text
    assert ':tensorflow:serving:request_latency_bucket{API="predict",entrypoint="REST"' in text
    assert ':tensorflow:cc:saved_model:load_attempt_count{model_path="' in text
    assert 'broken/1",status="fail"} 1.0' in text
    assert ':tensorflow:cc:saved_model:load_latency{model_path=' in text
    assert ':tensorflow:serving:runtime_latency_count{API="predict",model_name="tf2"' in text
    for name in ("tf2", "tf1"):  # predict logs; classify, regress and multi-inference logs
        assert (':tensorflow:serving:model_warmup_latency_count{model_path="'
                + str(server.lm_dir.parent.parent / name / "1") + '",status="OK"} 1.0') in text


def test_unknown_tf_serving_flags_warn(server):
    assert ("warning: --platform_config_file is a tensorflow_model_server flag"
            in server.log())


def test_cors_headers(server):
    reply = httpx.get(f"{server.rest}/v1/models/tf2")
    assert reply.headers["access-control-allow-origin"] == "*"
    assert reply.headers["access-control-allow-methods"] == "POST, GET"
    preflight = httpx.options(f"{server.rest}/v1/models/tf2:predict")
    assert preflight.status_code == 200
    assert preflight.headers["access-control-allow-headers"] == "Content-Type"


# ---- breadth: mutated Predict requests against every model's signatures ---------------------

def _mutated(proto, rng):
    """One mutation of a TensorProto: its dtype, a dimension, its rank, or its values."""
    proto = type(proto).FromString(proto.SerializeToString())
    kind = rng.randrange(9)
    if kind == 8:  # a narrow dtype whose values travel in a wider field, out of its range
        proto.dtype = rng.choice([4, 6, 5, 17, 19, 14])  # uint8 int8 int16 uint16 half bf16
        proto.ClearField("tensor_content")
        field = proto.half_val if proto.dtype in (19, 14) else proto.int_val
        field[:] = [rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(1, 4))]
    elif kind == 0:
        proto.dtype = rng.choice([1, 3, 6, 7, 9, 10, 14, 19, 20, 21, 0, 99, 101])
    elif kind == 1 and proto.tensor_shape.dim:
        rng.choice(proto.tensor_shape.dim).size = rng.choice([-1, 0, 7, 2**31, 2**40])
    elif kind == 2:
        proto.tensor_shape.dim.add().size = rng.choice([0, 2, 100_000])
    elif kind == 3:
        proto.tensor_content = bytes(rng.randrange(40))
    elif kind == 4:
        proto.ClearField("tensor_content")
        proto.int_val[:] = [rng.randrange(-2**31, 2**31) for _ in range(rng.randrange(12))]
    elif kind == 5:
        proto.ClearField("tensor_content")
        proto.float_val[:] = [rng.choice([0.5, float("nan"), float("inf"), -3e38])] * 3
    elif kind == 6:
        proto.ClearField("tensor_content")
        proto.string_val[:] = [b"\xff" * rng.randrange(3)] * rng.randrange(5)
        proto.half_val[:] = [rng.randrange(-2**20, 2**20)]
    else:
        proto.tensor_shape.unknown_rank = True
    return proto


def test_no_mutated_predict_request_fails_internally(server, predictions):
    """Seeded mutations of good Predict requests for every signature of the TF, Keras, LM and
    TFLite models (wrong dtypes, shapes and value fields, out-of-range values, ids outside
    the vocabulary): each is answered OK or with a client status, never INTERNAL or UNKNOWN
    (how out-of-range int8 values were found), and the server still serves afterwards."""
    import random
    from collections import Counter

    rng = random.Random(20261204)
    signatures = {}
    for name in ("tf2", "keras", "tf1", "lm", "lite"):
        request = get_model_metadata_pb2.GetModelMetadataRequest(metadata_field=["signature_def"])
        request.model_spec.name = name
        reply = predictions.GetModelMetadata(request, timeout=60)
        defs = get_model_metadata_pb2.SignatureDefMap()
        reply.metadata["signature_def"].Unpack(defs)
        for key, signature in defs.signature_def.items():
            # not init_state (its own row checks its bound), nor the test servables' `wait`,
            # which writes files named by its input and blocks until one appears
            if signature.inputs and key not in ("init_state", "wait"):
                signatures[(name, key)] = signature
    codes, internal = Counter(), []
    for _ in range(300):
        (name, key), signature = rng.choice(sorted(signatures.items()))
        request = predict_pb2.PredictRequest()
        request.model_spec.name, request.model_spec.signature_name = name, key
        for alias, info in signature.inputs.items():
            dims = [2 if d.size < 0 else d.size for d in info.tensor_shape.dim]
            dtype = tf.dtypes.as_dtype(info.dtype)
            value = (np.full(dims, b"x", object) if dtype == tf.string
                     else np.ones(dims, dtype.as_numpy_dtype))
            proto = tf.make_tensor_proto(value)
            for _ in range(rng.choice([0, 1, 1, 2])):
                proto = _mutated(proto, rng)
            request.inputs[alias].CopyFrom(proto)
        try:
            predictions.Predict(request, timeout=60)
            codes["OK"] += 1
        except grpc.RpcError as error:
            codes[error.code().name] += 1
            if error.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
                internal.append((name, key, error.details()[:200], str(request)[:300]))
    assert not internal, internal[:3]
    assert codes["OK"] > 30 and codes["INVALID_ARGUMENT"] > 100, codes  # not vacuous
    good = predictions.Predict(predict_request("tf2", x=S.float_input([1.0])), timeout=60)
    assert tf.make_ndarray(good.outputs["y"]).tolist() == [2.5]
