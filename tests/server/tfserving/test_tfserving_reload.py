"""Hot reload under load against a `tokenserve serve` subprocess: a new version directory
appears, a half-copied one appears and completes, the config file changes, and a
HandleReloadConfigRequest replaces the config, while clients send requests continuously.

Every version of model `m` answers y = x + 100 * version, so each reply names its version.
"""

from __future__ import annotations

import shutil
import threading
import time

import grpc
import httpx
import numpy as np
import pytest
import tensorflow as tf
from tensorflow_serving.apis import (get_model_status_pb2, model_management_pb2, model_pb2,
                                     model_service_pb2_grpc, predict_pb2,
                                     prediction_service_pb2_grpc)

from support import servables as S
from support.file_reads import FileReads

State = get_model_status_pb2.ModelVersionStatus


def write_version(base, version: int, **kwargs):
    return S.write_tf2_model(base, version, scale=1.0, offset=100.0 * version, **kwargs)


def config_text(models: dict[str, str], labels: dict[str, dict[str, int]] | None = None) -> str:
    entries = []
    for name, base in models.items():
        label_text = "".join(f' version_labels {{ key: "{k}" value: {v} }}'
                             for k, v in (labels or {}).get(name, {}).items())
        entries.append(f'  config {{ name: "{name}" base_path: "{base}" '
                       f'model_platform: "tensorflow"{label_text} }}\n')
    return "model_config_list {\n" + "".join(entries) + "}\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("reload")
    write_version(root / "m", 1)
    S.write_tf2_model(root / "n", 1, scale=1.0, offset=-1.0)
    config = root / "models.config"
    config.write_text(config_text({"m": str(root / "m")}))
    with S.serving(root, "m", f"--model_config_file={config}",
                   "--model_config_file_poll_wait_seconds=1", "--file_system_poll_wait_seconds=1",
                   "--max_num_load_retries=1", "--load_retry_interval_micros=200000",
                   "--rest_api_timeout_in_ms=5000") as process:
        process.root = root
        process.config = config
        yield process


class Load:
    """Clients sending Predict to `m` (gRPC and REST) until stopped; records every reply."""

    def __init__(self, server, model: str = "m", path: str = "/v1/models/m:predict"):
        self.server = server
        self.model = model
        self.path = path
        self.results: list[tuple[float, int]] = []  # (start time, version)
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._grpc, daemon=True),
                         threading.Thread(target=self._rest, daemon=True)]

    def __enter__(self):
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        for thread in self._threads:
            thread.join(30)

    def _record(self, started: float, y: float) -> None:
        self.results.append((started, round((y - 1.0) / 100)))

    def _grpc(self):
        stub = prediction_service_pb2_grpc.PredictionServiceStub(self.server.channel)
        request = predict_pb2.PredictRequest(model_spec=model_pb2.ModelSpec(name=self.model))
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0], np.float32)))
        while not self._stop.is_set():
            started = time.monotonic()
            try:
                reply = stub.Predict(request, timeout=30)
                y = tf.make_ndarray(reply.outputs["y"])[0]
                assert reply.model_spec.version.value == round((y - 1.0) / 100)
                self._record(started, y)
            except Exception as error:  # noqa: BLE001 - every failure is counted
                self.failures.append(f"grpc: {error}")
            time.sleep(0.02)

    def _rest(self):
        with httpx.Client(base_url=self.server.rest, timeout=30) as client:
            while not self._stop.is_set():
                started = time.monotonic()
                try:
                    reply = client.post(self.path, json={"instances": [1.0]})
                    assert reply.status_code == 200, reply.text
                    self._record(started, reply.json()["predictions"][0])
                except Exception as error:  # noqa: BLE001
                    self.failures.append(f"rest: {error}")
                time.sleep(0.02)

    def versions_since(self, moment: float) -> set[int]:
        return {version for started, version in self.results if started >= moment}


def statuses(server, name: str) -> dict[int, int]:
    stub = model_service_pb2_grpc.ModelServiceStub(server.channel)
    try:
        reply = stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(
            model_spec=model_pb2.ModelSpec(name=name)))
    except grpc.RpcError:
        return {}
    return {s.version: s.state for s in reply.model_version_status}


def wait_for(condition, timeout_s: float = 120.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def test_new_version_under_load_zero_failures_and_drain(server):
    gate = server.root / "gate"
    slow: dict = {}

    def slow_request():
        stub = prediction_service_pb2_grpc.PredictionServiceStub(server.channel)
        request = predict_pb2.PredictRequest(
            model_spec=model_pb2.ModelSpec(name="m", signature_name="wait"))
        request.inputs["gate"].CopyFrom(tf.make_tensor_proto(str(gate)))
        request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0], np.float32)))
        slow["reply"] = stub.Predict(request, timeout=120)

    with Load(server) as load:
        wait_for(lambda: len(load.results) > 10, what="first replies")
        waiting = threading.Thread(target=slow_request)
        waiting.start()
        wait_for(lambda: (server.root / "gate.started").exists(), what="slow request on v1")
        write_version(server.root / "m", 2)
        wait_for(lambda: statuses(server, "m").get(2) == State.AVAILABLE, what="v2 AVAILABLE")
        switched = time.monotonic()
        # Version 1 holds an in-flight request, so it must still be UNLOADING, not END.
        assert statuses(server, "m")[1] == State.UNLOADING
        wait_for(lambda: len(load.versions_since(switched)) and
                 len([1 for t, _ in load.results if t >= switched]) > 10, what="replies on v2")
        assert statuses(server, "m")[1] == State.UNLOADING
        gate.write_text("open")
        waiting.join(60)
        wait_for(lambda: statuses(server, "m").get(1) == State.END, what="v1 END")
    assert not load.failures, load.failures[:5]
    assert slow["reply"].model_spec.version.value == 1  # started on v1, completed on v1
    assert tf.make_ndarray(slow["reply"].outputs["y"]).tolist() == [101.0]
    assert 1 in {version for _, version in load.results}
    assert load.versions_since(switched) == {2}


def test_half_copied_version_does_not_disturb_then_loads_when_complete(server):
    base = server.root / "m"
    source = write_version(server.root / "staging-m", 3)
    with Load(server) as load:
        S.copy_half(source, base / "3")
        wait_for(lambda: statuses(server, "m").get(3) == State.END, what="v3 failed")
        assert statuses(server, "m")[2] == State.AVAILABLE
        stub = model_service_pb2_grpc.ModelServiceStub(server.channel)
        [failed] = stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(
            model_spec=model_pb2.ModelSpec(name="m", version={"value": 3}))
        ).model_version_status
        assert failed.status.error_code != 0 and failed.status.error_message
        shutil.copytree(source / "variables", base / "3" / "variables")
        wait_for(lambda: statuses(server, "m").get(3) == State.AVAILABLE, what="v3 loaded")
        switched = time.monotonic()
        wait_for(lambda: len([1 for t, _ in load.results if t >= switched]) > 10,
                 what="replies on v3")
        wait_for(lambda: statuses(server, "m").get(2) == State.END, what="v2 END")
    assert not load.failures, load.failures[:5]
    assert load.versions_since(switched) == {3}


def test_config_file_change_and_reload_request_under_load(server):
    models = {"m": str(server.root / "m"), "n": str(server.root / "n")}
    with Load(server) as load:
        server.config.write_text("model_config_list { config { name: ")  # a bad edit
        wait_for(lambda: "Error parsing text-format tensorflow.serving.ModelServerConfig"
                 in server.log(), what="bad config logged")
        assert statuses(server, "m")[3] == State.AVAILABLE
        server.config.write_text(config_text(models, {"m": {"stable": 3}}))
        wait_for(lambda: statuses(server, "n").get(1) == State.AVAILABLE, what="n loaded")
        labelled = httpx.post(f"{server.rest}/v1/models/m/labels/stable:predict",
                              json={"instances": [1.0]}, timeout=30)
        assert labelled.json() == {"predictions": [301.0]}
        assert httpx.post(f"{server.rest}/v1/models/n:predict", json={"instances": [1.0]},
                          timeout=30).json() == {"predictions": [0.0]}

        # Full replacement: a config without `n` unloads it.
        request = model_management_pb2.ReloadConfigRequest()
        request.config.model_config_list.config.add(name="m", base_path=models["m"],
                                                     model_platform="tensorflow")
        stub = model_service_pb2_grpc.ModelServiceStub(server.channel)
        reply = stub.HandleReloadConfigRequest(request, timeout=120)
        assert reply.status.error_code == 0
        wait_for(lambda: statuses(server, "n").get(1) == State.END, what="n END")
        gone = httpx.post(f"{server.rest}/v1/models/n:predict", json={"instances": [1.0]})
        assert gone.status_code == 404
        assert gone.json() == {"error": "Servable not found for request: Latest(n)"}
        # two config polls: an unchanged file does not undo the request (the first poll's
        # apply ends before the second poll reads the file)
        with FileReads(server.config) as reads:
            wait_for(lambda: reads.count() >= 2, 30, "two reads of the config file")
        assert statuses(server, "n").get(1) == State.END

        bad = model_management_pb2.ReloadConfigRequest()
        bad.config.model_config_list.config.add(name="m", base_path=models["m"])
        bad.config.model_config_list.config.add(name="m", base_path=models["n"])
        with pytest.raises(grpc.RpcError) as raised:
            stub.HandleReloadConfigRequest(bad, timeout=60)
        assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not load.failures, load.failures[:5]
    assert {version for _, version in load.results} == {3}


def test_rest_timeout_is_504_and_the_run_stops(server):
    """--rest_api_timeout_in_ms bounds the TensorFlow run itself (RunOptions.timeout_in_ms,
    as TF Serving sets it): the answer is the session's DEADLINE_EXCEEDED, and the run is
    cancelled, not left computing for whoever comes next."""
    gate = server.root / "never"
    beat = server.root / "never.beat"
    reply = httpx.post(f"{server.rest}/v1/models/m:predict", timeout=60, json={
        "signature_name": "wait", "inputs": {"gate": str(gate), "x": [1.0]}})
    try:
        assert reply.status_code == 504
        assert reply.json() == {"error": "Timed out waiting for notification"}
        assert beat.exists()  # the wait loop did run
        S.wait_until_beat_stops(beat)  # and stopped with the answer
        fine = httpx.post(f"{server.rest}/v1/models/m:predict", json={"instances": [1.0]})
        assert fine.status_code == 200
    finally:
        gate.write_text("open")  # lets a run that was not cancelled finish


def test_grpc_deadline_stops_the_run(server):
    """The call's deadline bounds the TensorFlow run (TF Serving's
    enforce_session_run_timeout): the run is cancelled when the client gives up."""
    gate = server.root / "never-grpc"
    beat = server.root / "never-grpc.beat"
    stub = prediction_service_pb2_grpc.PredictionServiceStub(server.channel)
    request = predict_pb2.PredictRequest(
        model_spec=model_pb2.ModelSpec(name="m", signature_name="wait"))
    request.inputs["gate"].CopyFrom(tf.make_tensor_proto(str(gate)))
    request.inputs["x"].CopyFrom(tf.make_tensor_proto(np.array([1.0], np.float32)))
    try:
        with pytest.raises(grpc.RpcError) as raised:
            stub.Predict(request, timeout=1.5)
        assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        wait_for(beat.exists, 10, "the run started")
        S.wait_until_beat_stops(beat)
    finally:
        gate.write_text("open")


def test_empty_reload_request_changes_nothing(server):
    stub = model_service_pb2_grpc.ModelServiceStub(server.channel)
    before = statuses(server, "m")
    with pytest.raises(grpc.RpcError) as raised:
        stub.HandleReloadConfigRequest(model_management_pb2.ReloadConfigRequest(), timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details() == ("ServerModelConfig type not supported by "
                                      "HandleReloadConfigRequest. Only ModelConfigList is "
                                      "currently supported")
    assert statuses(server, "m") == before
    assert State.AVAILABLE in before.values()
    reply = httpx.post(f"{server.rest}/v1/models/m:predict", json={"instances": [1.0]})
    assert reply.status_code == 200


def test_reload_to_a_base_path_with_a_nul_is_refused_and_changes_nothing(server):
    """No path holds a NUL (the OS calls raised ValueError inside the reload: INTERNAL)."""
    stub = model_service_pb2_grpc.ModelServiceStub(server.channel)
    before = statuses(server, "m")
    request = model_management_pb2.ReloadConfigRequest()
    request.config.model_config_list.config.add(name="m", base_path=str(server.root / "m\0"),
                                                model_platform="tensorflow")
    with pytest.raises(grpc.RpcError) as raised:
        stub.HandleReloadConfigRequest(request, timeout=60)
    assert raised.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert raised.value.details().endswith("contains a NUL character")
    assert statuses(server, "m") == before
    reply = httpx.post(f"{server.rest}/v1/models/m:predict", json={"instances": [1.0]})
    assert reply.status_code == 200


def test_reload_to_a_missing_base_path_reports_and_keeps_serving(server):
    stub = model_service_pb2_grpc.ModelServiceStub(server.channel)
    ghost = model_management_pb2.ReloadConfigRequest()
    ghost.config.model_config_list.config.add(name="ghost", base_path=str(server.root / "nope"),
                                              model_platform="tensorflow")
    with Load(server) as load:
        wait_for(lambda: len(load.results) > 5, what="first replies")
        with pytest.raises(grpc.RpcError) as raised:
            stub.HandleReloadConfigRequest(ghost, timeout=60)
        assert raised.value.code() == grpc.StatusCode.UNAVAILABLE
        assert raised.value.details().startswith(
            "1 model(s) did not become available: {{name: ghost} Could not find base path "
            f"{server.root / 'nope'} for servable ghost}}")
        moment = time.monotonic()
        wait_for(lambda: len([1 for t, _ in load.results if t > moment]) > 10,
                 what="replies after the refused reload")
        assert State.AVAILABLE in statuses(server, "m").values()
        back = model_management_pb2.ReloadConfigRequest()
        back.config.model_config_list.config.add(name="m", base_path=str(server.root / "m"),
                                                 model_platform="tensorflow")
        assert stub.HandleReloadConfigRequest(back, timeout=120).status.error_code == 0
        gone = httpx.post(f"{server.rest}/v1/models/ghost:predict", json={"instances": [1.0]})
        assert gone.status_code == 404
    assert not load.failures, load.failures[:5]
