"""Small SavedModels for the TF Serving tests, each in TF Serving's `<base>/<version>/` layout.

- `write_tf2_model`: a tf.Module with several signatures (float, int, string in/out), plus a
  `wait` signature that blocks until a file exists (to hold a request in flight).
- `write_keras_model`: a Keras 3 model through `model.export`.
- `write_tf1_model`: TF1-style classify/regress/predict signatures over serialized
  tf.Examples, built with tf.compat.v1 and SavedModelBuilder (like TF Serving's half_plus_two).
- `write_tflite_model`: model.tflite converted from a TF2 SavedModel.
- `write_warmup`: a warmup file of PredictionLog records.
"""

from __future__ import annotations

import contextlib

import os
import shutil
import time
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.python.data.experimental.ops.testing import sleep  # the SleepDataset op
from tensorflow_serving.apis import model_pb2, predict_pb2, prediction_log_pb2

from tokenserve.host.ports import free_port  # noqa: F401  (the tests import it from here)


class _Module(tf.Module):
    def __init__(self, scale: float, offset: float):
        super().__init__()
        self.scale = tf.Variable(scale, dtype=tf.float32)
        self.offset = tf.Variable(offset, dtype=tf.float32)

    @tf.function(input_signature=[tf.TensorSpec([None], tf.float32, name="x")])
    def affine(self, x):
        # x: [B] -> y: [B]
        return {"y": x * self.scale + self.offset}

    @tf.function(input_signature=[tf.TensorSpec([None, None], tf.int32, name="a"),
                                  tf.TensorSpec([None, None], tf.int32, name="b")])
    def arith(self, a, b):
        return {"sum": a + b, "product": a * b}

    @tf.function(input_signature=[tf.TensorSpec([None], tf.string, name="text")])
    def strings(self, text):
        return {"length": tf.strings.length(text), "upper_bytes": tf.strings.upper(text)}

    @tf.function(input_signature=[tf.TensorSpec([], tf.string, name="gate"),
                                  tf.TensorSpec([None], tf.float32, name="x")])
    def wait(self, gate, x):
        """Writes `gate`.started, blocks until a file matching `gate` exists (writing the
        iteration count to `gate`.beat every 20 ms while it waits), then returns affine(x)."""
        tf.io.write_file(tf.strings.join([gate, ".started"]), "")
        def missing(_):
            return tf.equal(tf.size(tf.io.matching_files(gate)), 0)

        def nap(i):
            # 20 ms sleep inside the graph, so the wait does not spin a core.
            beat = tf.io.write_file(tf.strings.join([gate, ".beat"]), tf.strings.as_string(i))
            with tf.control_dependencies([beat]):
                slept = tf.data.Dataset.range(1).apply(sleep(20_000))
            return i + slept.reduce(tf.constant(1, tf.int64), lambda total, item: total + item)

        tf.while_loop(missing, nap, [tf.constant(0, tf.int64)])
        return {"y": x * self.scale + self.offset}


def write_tf2_model(base: Path, version: int, scale: float = 0.5, offset: float = 2.0,
                    atomic: bool = True) -> Path:
    """`serving_default` is y = scale * x + offset (the version is visible in the output)."""
    module = _Module(scale, offset)
    signatures = {"serving_default": module.affine, "arith": module.arith,
                  "strings": module.strings, "wait": module.wait}
    return _save(base, version, lambda path: tf.saved_model.save(module, str(path),
                                                                 signatures=signatures), atomic)


def _save(base: Path, version: int, save, atomic: bool) -> Path:
    base.mkdir(parents=True, exist_ok=True)
    final = base / str(version)
    staging = base / f".staging-{version}" if atomic else final
    save(staging)
    if atomic:
        os.rename(staging, final)
    return final


def write_keras_model(base: Path, version: int) -> Path:
    import keras

    inputs = keras.Input(shape=(3,), name="features")
    outputs = keras.layers.Dense(2, kernel_initializer="ones", bias_initializer="zeros",
                                 name="dense")(inputs)
    model = keras.Model(inputs, outputs)
    return _save(base, version, lambda path: model.export(str(path), verbose=False), True)


def write_tf1_model(base: Path, version: int) -> Path:
    """Signatures over serialized tf.Examples with one float feature `x` (y = 0.5x + 2):
    `classify_x_to_y` (classes/scores), `regress_x_to_y` (outputs), `serving_default`
    (predict: x -> y)."""
    v1 = tf.compat.v1

    def build(path: Path):
        graph = tf.Graph()
        with graph.as_default(), v1.Session(graph=graph) as session:
            serialized = v1.placeholder(tf.string, [None], name="tf_example")
            features = v1.parse_example(serialized, {"x": v1.FixedLenFeature([1], tf.float32)})
            x = tf.identity(features["x"], name="x")  # [N, 1]
            a = v1.Variable(0.5, name="a")
            b = v1.Variable(2.0, name="b")
            y = tf.add(a * x, b, name="y")  # [N, 1]
            scores = tf.concat([y, -y], axis=1, name="scores")  # [N, 2]
            classes = tf.tile(tf.constant([["pos", "neg"]]), [tf.shape(y)[0], 1],
                              name="classes")
            raw_x = v1.placeholder(tf.float32, [None], name="raw_x")
            raw_y = tf.add(a * raw_x, b, name="raw_y")
            session.run(v1.global_variables_initializer())
            info = v1.saved_model.utils.build_tensor_info
            builder = v1.saved_model.builder.SavedModelBuilder(str(path))
            builder.add_meta_graph_and_variables(session, [v1.saved_model.tag_constants.SERVING],
                                                 signature_def_map={
                "classify_x_to_y": v1.saved_model.classification_signature_def(
                    serialized, classes, scores),
                "regress_x_to_y": v1.saved_model.regression_signature_def(serialized, y),
                "regress_x_to_y2": v1.saved_model.regression_signature_def(
                    serialized, tf.identity(y * 2.0, name="y2")),
                "serving_default": v1.saved_model.signature_def_utils.build_signature_def(
                    inputs={"x": info(raw_x)}, outputs={"y": info(raw_y)},
                    method_name=v1.saved_model.signature_constants.PREDICT_METHOD_NAME),
            })
            builder.save()
    return _save(base, version, build, True)


def write_tflite_model(base: Path, version: int, scratch: Path) -> Path:
    """model.tflite (y = 0.5x + 2 on float32 [1]) with a serving_default signature."""
    saved = write_tf2_model(scratch, 1)
    converter = tf.lite.TFLiteConverter.from_saved_model(str(saved),
                                                         signature_keys=["serving_default"])
    flatbuffer = converter.convert()

    def write(path: Path):
        path.mkdir(parents=True)
        (path / "model.tflite").write_bytes(flatbuffer)
    return _save(base, version, write, True)


def write_warmup(version_dir: Path, model_name: str, signature: str, inputs: dict,
                 count: int = 1) -> Path:
    request = predict_pb2.PredictRequest(
        model_spec=model_pb2.ModelSpec(name=model_name, signature_name=signature))
    for key, value in inputs.items():
        request.inputs[key].CopyFrom(tf.make_tensor_proto(value))
    record = prediction_log_pb2.PredictionLog(
        predict_log=prediction_log_pb2.PredictLog(request=request))
    path = version_dir / "assets.extra" / "tf_serving_warmup_requests"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for _ in range(count):
            writer.write(record.SerializeToString())
    return path


def write_warmup_logs(version_dir: Path, records: list) -> Path:
    path = version_dir / "assets.extra" / "tf_serving_warmup_requests"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tf.io.TFRecordWriter(str(path)) as writer:
        for record in records:
            writer.write(record.SerializeToString())
    return path


def example_logs(model_name: str, classify_signature: str = "classify_x_to_y") -> list:
    """Classify, regress and multi-inference PredictionLogs over one tf.Example (x = 1)."""
    from tensorflow.core.example import example_pb2, feature_pb2
    from tensorflow_serving.apis import (classification_pb2, inference_pb2, input_pb2,
                                         regression_pb2)

    request_input = input_pb2.Input()
    request_input.example_list.examples.append(example_pb2.Example(
        features=feature_pb2.Features(feature={"x": feature_pb2.Feature(
            float_list=feature_pb2.FloatList(value=[1.0]))})))
    classify = classification_pb2.ClassificationRequest(
        model_spec=model_pb2.ModelSpec(name=model_name, signature_name=classify_signature),
        input=request_input)
    regress = regression_pb2.RegressionRequest(
        model_spec=model_pb2.ModelSpec(name=model_name, signature_name="regress_x_to_y"),
        input=request_input)
    multi = inference_pb2.MultiInferenceRequest(input=request_input)
    multi.tasks.add(model_spec=model_pb2.ModelSpec(name=model_name,
                                                   signature_name="regress_x_to_y2"),
                    method_name="tensorflow/serving/regress")
    return [prediction_log_pb2.PredictionLog(
                classify_log=prediction_log_pb2.ClassifyLog(request=classify)),
            prediction_log_pb2.PredictionLog(
                regress_log=prediction_log_pb2.RegressLog(request=regress)),
            prediction_log_pb2.PredictionLog(
                multi_inference_log=prediction_log_pb2.MultiInferenceLog(request=multi))]


def copy_half(source: Path, target: Path) -> None:
    """A half-copied version directory: saved_model.pb without its variables."""
    target.mkdir(parents=True)
    shutil.copy(source / "saved_model.pb", target / "saved_model.pb")


def wait_until_beat_stops(beat: Path, still_s: float = 1.0, timeout_s: float = 30.0) -> None:
    """Returns once `beat` (the `wait` signature's iteration count, rewritten every 20 ms while
    its loop runs) has kept one value for `still_s`: 50 missed beats at the default, so its
    loop has ended. Fails when it still changes after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    last, since = beat.read_text(), time.monotonic()
    while time.monotonic() < deadline:
        time.sleep(0.05)
        now = beat.read_text()
        if now != last:
            last, since = now, time.monotonic()
        elif time.monotonic() - since >= still_s:
            return
    raise AssertionError(f"{beat} still changes after {timeout_s} s: its loop is still running")


def float_input(values) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


# ---- running `tokenserve serve` as a subprocess -------------------------------------------

class ServerProcess:
    """`python -m tokenserve serve ARGS` on free ports; stderr goes to a file for asserts."""

    def __init__(self, tmp: Path, *args: str, rest: bool = True):
        import subprocess
        import sys

        self.grpc_port = free_port()
        self.rest_port = free_port() if rest else 0
        self.log_path = tmp / f"server-{self.rest_port}.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "tokenserve", "serve", f"--port={self.grpc_port}",
             f"--rest_api_port={self.rest_port}", "--openai_port=0", *args],
            stdout=self._log, stderr=subprocess.STDOUT, env=env)
        self.rest = f"http://127.0.0.1:{self.rest_port}"
        self.target = f"127.0.0.1:{self.grpc_port}"

    def wait_ready(self, model: str, timeout_s: float = 240.0) -> None:
        import time

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"server exited {self.process.returncode}:\n{self.log()}")
            if self._ready(model):
                return
            time.sleep(0.3)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log()}")

    def _ready(self, model: str) -> bool:
        import grpc
        import httpx
        from tensorflow_serving.apis import (get_model_status_pb2, model_pb2,
                                             model_service_pb2_grpc)

        if self.rest_port:
            try:
                return httpx.get(f"{self.rest}/v1/models/{model}", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        with grpc.insecure_channel(self.target) as channel:
            stub = model_service_pb2_grpc.ModelServiceStub(channel)
            try:
                stub.GetModelStatus(get_model_status_pb2.GetModelStatusRequest(
                    model_spec=model_pb2.ModelSpec(name=model)), timeout=2)
                return True
            except grpc.RpcError:
                return False

    def log(self) -> str:
        self._log.flush()
        return self.log_path.read_text()

    def stop(self) -> int:
        """SIGTERM, as Kubernetes sends; returns the exit code."""
        if self.process.poll() is not None:
            return self.process.returncode
        self.process.terminate()
        try:
            self.process.wait(30)
        except Exception:  # noqa: BLE001
            self.process.kill()
            self.process.wait(10)
        self._log.flush()
        return self.process.returncode


@contextlib.contextmanager
def serving(tmp: Path, model: str, *args: str, rest: bool = True):
    """A ServerProcess started with ARGS, ready to serve `model`, with `.channel` (a gRPC
    channel to it) open; the channel closes and the process stops on exit."""
    import grpc

    process = ServerProcess(tmp, *args, rest=rest)
    try:
        process.wait_ready(model)
        with grpc.insecure_channel(process.target) as process.channel:
            yield process
    finally:
        process.stop()

