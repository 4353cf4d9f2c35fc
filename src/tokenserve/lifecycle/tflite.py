"""`model.tflite` in a version directory, served through the TFLite interpreter
(`--prefer_tflite_model`, or `model_platform: "tflite"`), with TF Serving's TfLiteSession
mapping:

- A model carrying a TF1 SignatureDef in its `signature_defs_metadata` (what
  `tflite::SetSignatureDefMap` writes; TF Serving's `saved_model_half_plus_two_tflite_with_sigdef`)
  is served as `serving_default` with that SignatureDef's aliases and method: the alias `x`
  names the TFLite tensor `tflite_input` when the SignatureDef says `tflite_input:0` (the
  converter drops the `:0`), and the TensorInfos carry the TFLite tensor names and shapes.
- A model with native TFLite signatures (TF2 conversion) is served by those signatures.
- Any other model is one `serving_default` keyed by its tensor names.

An input whose shape differs from the interpreter's is resized, as TfLiteSession does, so a
`[3]` tensor runs on a model converted with `[1,1]`. Calls are serialized (an interpreter is
not thread-safe).
"""

from __future__ import annotations

import threading
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import tensor_shape_pb2
from tensorflow.core.protobuf import meta_graph_pb2

from tokenserve.errors import InvalidRequestError, ModelLoadError
from tokenserve.lifecycle.repository import TFLITE_FILE
from tokenserve.lifecycle.savedmodel import dtype_string, load_error
from tokenserve.lifecycle.servable import (DEFAULT_SIGNATURE, PREDICT_METHOD,
                                           check_output_keys, resolve_inputs, signature_def)

SIGNATURE_DEFS_METADATA = "signature_defs_metadata"  # tflite/tools/signature/signature_def_util.h


def signature_def_metadata(model: bytes) -> dict[str, meta_graph_pb2.SignatureDef]:
    """The SignatureDefs stored in a .tflite model's metadata (a FlexBuffer map of key ->
    serialized SignatureDef), or {} when it has none."""
    from flatbuffers import flexbuffers
    from tensorflow.lite.python import schema_py_generated as schema

    root = schema.Model.GetRootAs(model, 0)
    for index in range(root.MetadataLength()):
        entry = root.Metadata(index)
        if entry.Name() != SIGNATURE_DEFS_METADATA.encode():
            continue
        data = root.Buffers(entry.Buffer()).DataAsNumpy()
        if not isinstance(data, np.ndarray) or data.size < 3:
            raise ModelLoadError(f"Invalid SignatureDefs found in TfLite model: "
                                 f"{SIGNATURE_DEFS_METADATA} holds no FlexBuffer")
        table = flexbuffers.GetRoot(bytearray(data.tobytes())).AsMap
        return {key.AsKey: meta_graph_pb2.SignatureDef.FromString(value.AsStringBytes)
                for key, value in zip(table.Keys, table.Values)}
    return {}


def _tensor_info(detail: dict, name: str | None = None, dynamic: bool = True
                 ) -> meta_graph_pb2.TensorInfo:
    shape = detail.get("shape_signature", detail["shape"]) if dynamic else detail["shape"]
    return meta_graph_pb2.TensorInfo(
        name=name or detail["name"], dtype=tf.dtypes.as_dtype(detail["dtype"]).as_datatype_enum,
        tensor_shape=tensor_shape_pb2.TensorShapeProto(
            dim=[tensor_shape_pb2.TensorShapeProto.Dim(size=int(d)) for d in shape]))


def _lite_name(tf_name: str) -> str:
    """TfToTfLiteTensorName: `x:0` -> `x`."""
    return tf_name.split(":", 1)[0]


class TFLiteServable:
    """One TFLite interpreter, served with TF Serving's rules (see the module docstring)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._lock = threading.Lock()
        try:
            model = (self.path / TFLITE_FILE).read_bytes()
            self._interpreter = tf.lite.Interpreter(model_content=model)
            self._interpreter.allocate_tensors()
            lite_signatures = signature_def_metadata(model)
        except ModelLoadError:
            raise
        except Exception as error:
            raise load_error(self.path, error) from error
        self.signature_defs: dict[str, meta_graph_pb2.SignatureDef] = {}
        self._runners = {}
        self._indices: dict[str, int] = {}  # TFLite tensor name -> index (tensor mode)
        if len(lite_signatures) > 1:
            raise ModelLoadError("Multiple SignatureDefs found in TfLite model")
        if lite_signatures:
            self._from_signature_def(next(iter(lite_signatures.values())))
        elif self._interpreter.get_signature_list():
            self._from_native_signatures()
        else:
            self._from_tensors({})
        if not self.signature_defs:
            raise ModelLoadError(f"{self.path / TFLITE_FILE} has no inputs")

    # ---- the three mappings ----------------------------------------------------------------

    def _from_signature_def(self, lite: meta_graph_pb2.SignatureDef) -> None:
        aliases = {_lite_name(info.name): alias
                   for infos in (lite.inputs, lite.outputs) for alias, info in infos.items()}
        self._from_tensors(aliases, lite.method_name or PREDICT_METHOD)

    def _from_tensors(self, aliases: dict[str, str], method: str = PREDICT_METHOD) -> None:
        sig = meta_graph_pb2.SignatureDef(method_name=method)
        for details, target in ((self._interpreter.get_input_details(), sig.inputs),
                                (self._interpreter.get_output_details(), sig.outputs)):
            for detail in details:
                name = detail["name"]
                if aliases and name not in aliases:
                    raise ModelLoadError(f"Cannot find signature def name from tflite tensor "
                                         f"{name}")
                target[aliases.get(name, name)].CopyFrom(_tensor_info(detail, dynamic=False))
                self._indices[name] = detail["index"]
        self.signature_defs[DEFAULT_SIGNATURE] = sig

    def _from_native_signatures(self) -> None:
        for key in self._interpreter.get_signature_list():
            runner = self._interpreter.get_signature_runner(key)
            inputs, outputs = runner.get_input_details(), runner.get_output_details()
            self._runners[key] = (runner, {d["name"]: alias for alias, d in inputs.items()})
            self.signature_defs[key] = meta_graph_pb2.SignatureDef(
                inputs={alias: _tensor_info(d) for alias, d in inputs.items()},
                outputs={alias: _tensor_info(d) for alias, d in outputs.items()},
                method_name=PREDICT_METHOD)

    # ---- running -----------------------------------------------------------------------------

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None,
            timeout_s: float | None = None) -> dict[str, np.ndarray]:
        """`timeout_s` is not enforced: an interpreter call cannot be cancelled."""
        name = signature_name or DEFAULT_SIGNATURE
        sig = signature_def(self, name)
        feeds = resolve_inputs(sig, inputs)
        outputs = check_output_keys(sig, output_keys)
        expected = {info.name: tf.dtypes.as_dtype(info.dtype) for info in sig.inputs.values()}
        for index, (tensor, value) in enumerate(sorted(feeds.items())):
            got = tf.string if value.dtype == object else tf.dtypes.as_dtype(value.dtype)
            if got != expected[tensor]:
                raise InvalidRequestError(f"Expects arg[{index}] to be "
                                          f"{dtype_string(expected[tensor])} but "
                                          f"{dtype_string(got)} is provided")
        with self._lock:
            try:
                if name in self._runners:
                    runner, aliases = self._runners[name]
                    result = runner(**{aliases[tensor]: value for tensor, value in feeds.items()})
                    return {key: np.array(result[key]) for key in outputs}
                return self._invoke(feeds, [sig.outputs[key].name for key in outputs], outputs)
            except (ValueError, RuntimeError) as error:
                raise InvalidRequestError(str(error).strip()) from error

    def _invoke(self, feeds: dict[str, np.ndarray], fetches: list[str],
                keys: list[str]) -> dict[str, np.ndarray]:
        interpreter = self._interpreter
        details = {d["name"]: d for d in interpreter.get_input_details()}
        resized = False
        for tensor, value in feeds.items():
            if tuple(details[tensor]["shape"]) != value.shape:
                interpreter.resize_tensor_input(self._indices[tensor], list(value.shape))
                resized = True
        if resized:
            interpreter.allocate_tensors()
        for tensor, value in feeds.items():
            interpreter.set_tensor(self._indices[tensor], value)
        interpreter.invoke()
        return {key: np.array(interpreter.get_tensor(self._indices[tensor]))
                for key, tensor in zip(keys, fetches)}

    def close(self) -> None:
        self._runners = {}
        self._interpreter = None
