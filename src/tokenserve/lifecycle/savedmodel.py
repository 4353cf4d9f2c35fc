"""Any TensorFlow SavedModel (TF2, Keras export, TF1 SavedModelBuilder) as a servable."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2
from tensorflow.core.protobuf import saved_model_pb2

from tokenserve.errors import InvalidRequestError, ModelLoadError
from tokenserve.lifecycle.servable import (check_input_keys, check_input_shapes,
                                           check_output_keys, signature_def)

SERVE_TAG = "serve"
_INTERNAL_SIGNATURES = ("__saved_model_init_op", "__saved_model_train_op")


def dtype_string(dtype: tf.DType) -> str:
    """TF's DataTypeString (`float`, `int64`, `string`), the name TF Serving's messages use."""
    return types_pb2.DataType.Name(tf.dtypes.as_dtype(dtype).as_datatype_enum)[3:].lower()


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def load_error(path: Path, error: BaseException) -> ModelLoadError:
    """A ModelLoadError carrying TF's status code name (shown in GetModelStatus)."""
    failure = ModelLoadError(f"Failed to load SavedModel from {path}: {_first_line(error)}")
    failure.error_code = _code_name(error)
    return failure


def _code_name(error: BaseException) -> str:
    if isinstance(error, tf.errors.OpError):
        # tf.errors.NotFoundError -> NOT_FOUND, the name TF Serving prints.
        name = type(error).__name__.removesuffix("Error")
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
    if isinstance(error, (FileNotFoundError, OSError)):
        return "NOT_FOUND"
    return "UNKNOWN"


def read_signature_defs(path: Path, tags: tuple[str, ...] = (SERVE_TAG,)) -> dict:
    """SignatureDefs of the MetaGraph tagged `serve`, read straight from saved_model.pb."""
    proto = saved_model_pb2.SavedModel()
    pb = path / "saved_model.pb"
    if pb.exists():
        proto.ParseFromString(pb.read_bytes())
    else:
        from google.protobuf import text_format
        text_format.Parse((path / "saved_model.pbtxt").read_text(), proto)
    for meta_graph in proto.meta_graphs:
        if set(tags) <= set(meta_graph.meta_info_def.tags):
            return {name: sig for name, sig in meta_graph.signature_def.items()
                    if name not in _INTERNAL_SIGNATURES}
    raise ModelLoadError(f"SavedModel at {path} has no MetaGraph with tags {list(tags)}")


class SavedModelServable:
    """A SavedModel loaded with `tf.saved_model.load`, run through its signatures."""

    def __init__(self, path: str | Path, tags: tuple[str, ...] = (SERVE_TAG,)):
        self.path = Path(path)
        try:
            self.signature_defs = read_signature_defs(self.path, tags)
            self._model = tf.saved_model.load(str(self.path), tags=list(tags))
            self._functions = dict(self._model.signatures)
        except ModelLoadError:
            raise
        except Exception as error:  # corrupt protobuf, missing variables, unknown ops ...
            raise load_error(self.path, error) from error
        missing = set(self.signature_defs) - set(self._functions)
        if missing:
            raise ModelLoadError(f"SavedModel at {self.path}: signatures {sorted(missing)} "
                                 f"are in the MetaGraph but not loadable")

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None) -> dict[str, np.ndarray]:
        sig = signature_def(self, signature_name)
        check_input_keys(sig, inputs)
        check_input_shapes(sig, inputs)
        outputs = check_output_keys(sig, output_keys)
        function = self._functions[signature_name or "serving_default"]
        tensors = {}
        for index, key in enumerate(sorted(inputs)):
            expected = tf.dtypes.as_dtype(sig.inputs[key].dtype)
            value = inputs[key]
            got = tf.dtypes.as_dtype(value.dtype) if value.dtype != object else tf.string
            if got != expected:
                raise InvalidRequestError(f"Expects arg[{index}] to be {dtype_string(expected)} "
                                          f"but {dtype_string(got)} is provided")
            tensors[key] = tf.constant(value, dtype=expected)
        try:
            result = function(**tensors)
        except (tf.errors.InvalidArgumentError, TypeError, ValueError) as error:
            raise InvalidRequestError(_first_line(error)) from error
        return {key: result[key].numpy() for key in outputs}

    def close(self) -> None:
        self._functions = {}
        self._model = None
