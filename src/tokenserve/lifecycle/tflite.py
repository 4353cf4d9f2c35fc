"""`model.tflite` in a version directory, served through the TFLite interpreter
(`--prefer_tflite_model`): the seeds' edge path, with the same Predict API."""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_shape_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from tokenserve.errors import InvalidRequestError, ModelLoadError
from tokenserve.lifecycle.repository import TFLITE_FILE
from tokenserve.lifecycle.savedmodel import _first_line, dtype_string, load_error
from tokenserve.lifecycle.servable import (DEFAULT_SIGNATURE, PREDICT_METHOD, check_input_keys,
                                           check_input_shapes, check_output_keys, signature_def)


def _tensor_info(detail: dict) -> meta_graph_pb2.TensorInfo:
    shape = detail.get("shape_signature", detail["shape"])
    return meta_graph_pb2.TensorInfo(
        name=detail["name"], dtype=tf.dtypes.as_dtype(detail["dtype"]).as_datatype_enum,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in shape]))


class TFLiteServable:
    """One TFLite interpreter; its signature defs when the model has them, else one
    `serving_default` over the model's input and output tensors. Calls are serialized
    (an interpreter is not thread-safe)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            self._interpreter = tf.lite.Interpreter(model_path=str(self.path / TFLITE_FILE))
            self._interpreter.allocate_tensors()
        except Exception as error:
            raise load_error(self.path, error) from error
        self.signature_defs = {}
        self._runners = {}
        for name in self._interpreter.get_signature_list():
            runner = self._interpreter.get_signature_runner(name)
            self._runners[name] = runner
            self.signature_defs[name] = meta_graph_pb2.SignatureDef(
                inputs={k: _tensor_info(v) for k, v in runner.get_input_details().items()},
                outputs={k: _tensor_info(v) for k, v in runner.get_output_details().items()},
                method_name=PREDICT_METHOD)
        if not self.signature_defs:
            self.signature_defs[DEFAULT_SIGNATURE] = meta_graph_pb2.SignatureDef(
                inputs={d["name"]: _tensor_info(d) for d in self._interpreter.get_input_details()},
                outputs={d["name"]: _tensor_info(d)
                         for d in self._interpreter.get_output_details()},
                method_name=PREDICT_METHOD)
        if not self.signature_defs:
            raise ModelLoadError(f"{self.path / TFLITE_FILE} has no inputs")

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None) -> dict[str, np.ndarray]:
        name = signature_name or DEFAULT_SIGNATURE
        sig = signature_def(self, name)
        check_input_keys(sig, inputs)
        check_input_shapes(sig, inputs)
        outputs = check_output_keys(sig, output_keys)
        for index, key in enumerate(sorted(inputs)):
            expected = tf.dtypes.as_dtype(sig.inputs[key].dtype)
            if inputs[key].dtype != expected.as_numpy_dtype:
                got = tf.dtypes.as_dtype(inputs[key].dtype) if inputs[key].dtype != object \
                    else tf.string
                raise InvalidRequestError(f"Expects arg[{index}] to be {dtype_string(expected)} "
                                          f"but {dtype_string(got)} is provided")
        with self._lock:
            try:
                if name in self._runners:
                    result = self._runners[name](**inputs)
                else:
                    result = self._invoke(inputs)
            except (ValueError, RuntimeError) as error:
                raise InvalidRequestError(_first_line(error)) from error
        return {key: np.array(result[key]) for key in outputs}

    def _invoke(self, inputs: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        interpreter = self._interpreter
        details = {d["name"]: d for d in interpreter.get_input_details()}
        for key, value in inputs.items():
            if tuple(details[key]["shape"]) != value.shape:
                interpreter.resize_tensor_input(details[key]["index"], value.shape)
        interpreter.allocate_tensors()
        for key, value in inputs.items():
            interpreter.set_tensor(details[key]["index"], value)
        interpreter.invoke()
        return {d["name"]: interpreter.get_tensor(d["index"])
                for d in interpreter.get_output_details()}

    def close(self) -> None:
        self._runners = {}
        self._interpreter = None
