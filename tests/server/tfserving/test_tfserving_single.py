"""One model from --model_name/--model_base_path, gRPC only (--rest_api_port=0): the default
`latest 1` policy serves only the highest version on disk."""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (get_model_status_pb2, model_pb2, model_service_pb2_grpc,
                                     predict_pb2, prediction_service_pb2_grpc)

from support import servables as S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("single")
    S.write_tf2_model(root / "half", 1, scale=0.5, offset=2.0)
    S.write_tf2_model(root / "half", 2, scale=0.5, offset=3.0)
    (root / "half" / "not-a-version").mkdir()
    process = S.ServerProcess(root, "--model_name=half", f"--model_base_path={root / 'half'}",
                              "--enable_model_warmup=false", rest=False)
    try:
        process.wait_ready("half")
        yield process
    finally:
        process.stop()


def test_latest_policy_serves_only_the_highest_version(server):
    with grpc.insecure_channel(server.target) as channel:
        status = model_service_pb2_grpc.ModelServiceStub(channel).GetModelStatus(
            get_model_status_pb2.GetModelStatusRequest(model_spec=model_pb2.ModelSpec(
                name="half")))
        assert [(s.version, s.state) for s in status.model_version_status] == [
            (2, get_model_status_pb2.ModelVersionStatus.AVAILABLE)]
        request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name="half"))
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([2.0], np.float32)))
        reply = prediction_service_pb2_grpc.PredictionServiceStub(channel).Predict(request)
    assert reply.model_spec.version.value == 2
    assert tf.make_ndarray(reply.outputs["y"]).tolist() == [4.0]


def test_no_rest_port_when_disabled(server):
    assert server.rest_port == 0
    assert "Exporting HTTP/REST API" not in server.log()
    assert f"Running gRPC ModelServer at 0.0.0.0:{server.grpc_port}" in server.log()


def test_sigterm_drains_unloads_and_exits_cleanly(server):
    assert server.stop() == 0
    assert "half version 2 reached END" in server.log()
