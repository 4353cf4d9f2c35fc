"""Any TensorFlow SavedModel (TF1 SavedModelBuilder, TF2, Keras export) as a servable.

Loaded through a TF1 Session (lifecycle/session_bundle.py), as tensorflow_model_server does,
and run by tensor name with TF Serving's request rules (lifecycle/servable.py). TensorFlow
errors from the run keep their code: INVALID_ARGUMENT (e.g. `Expects arg[0] to be float but
int64 is provided`, or a shape the graph cannot take) is a bad request, FAILED_PRECONDITION
and DEADLINE_EXCEEDED keep theirs, anything else is the server's error.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import tensorflow as tf
from tensorflow.core.framework import types_pb2

from tokenserve.errors import (DeadlineExceededError, FailedPreconditionError,
                               InvalidRequestError, ModelLoadError, RequestAbortedError)
from tokenserve.lifecycle.servable import (DEFAULT_SIGNATURE, check_output_keys,
                                           resolve_inputs, signature_def)
from tokenserve.lifecycle.session_bundle import (SERVE_TAG, SessionBundle, SessionOptions,
                                                 load_failure, status_code_name)

__all__ = ["SERVE_TAG", "SavedModelServable", "dtype_string", "load_error", "run_error"]


def dtype_string(dtype) -> str:
    """TF's DataTypeString (`float`, `int64`, `string`), the name TF Serving's messages use."""
    return types_pb2.DataType.Name(tf.dtypes.as_dtype(dtype).as_datatype_enum)[3:].lower()


def load_error(path: Path, error: BaseException) -> ModelLoadError:
    """A ModelLoadError carrying TF's status code name (shown in GetModelStatus)."""
    text = (getattr(error, "message", None) or str(error)).strip()
    text = text.splitlines()[0] if text else type(error).__name__
    return load_failure(f"Failed to load SavedModel from {path}: {text}",
                        status_code_name(error))


# TF status of a failed run -> the tokenserve error carrying the same gRPC code (server/status.py)
_RUN_ERRORS = ((tf.errors.InvalidArgumentError, InvalidRequestError),
               (tf.errors.FailedPreconditionError, FailedPreconditionError),
               (tf.errors.DeadlineExceededError, DeadlineExceededError),
               (tf.errors.CancelledError, RequestAbortedError))


def run_error(error: tf.errors.OpError) -> Exception:
    """The tokenserve error for a TF run error, with TF's full message (TF Serving returns
    the session's status as it is); errors of other codes stay TF's own, and the TF Serving
    frontends answer with their code (server/tfserving/tf_status.py)."""
    for tf_type, ours in _RUN_ERRORS:
        if isinstance(error, tf_type):
            return ours(error.message)
    return error


class SavedModelServable:
    """A SavedModel in a Session; every SignatureDef of its MetaGraph is served (TF2 models
    show `__saved_model_init_op` too, as in TF Serving's metadata).

    Args:
        path: the version directory.
        tags: --saved_model_tags.
        options: --tensorflow_*_parallelism.
    """

    def __init__(self, path: str | Path, tags: tuple[str, ...] = (SERVE_TAG,),
                 options: SessionOptions = SessionOptions()):
        self.path = Path(path)
        self._bundle = SessionBundle(self.path, tuple(tags), options)
        self.signature_defs = dict(self._bundle.meta_graph_def.signature_def)
        self._defaults = {
            name: {alias: tf.make_ndarray(proto) for alias, proto in sig.defaults.items()}
            for name, sig in self.signature_defs.items()}

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None,
            timeout_s: float | None = None) -> dict[str, np.ndarray]:
        sig = signature_def(self, signature_name)
        feeds = resolve_inputs(sig, inputs,
                               self._defaults.get(signature_name or DEFAULT_SIGNATURE))
        outputs = check_output_keys(sig, output_keys)
        try:
            values = self._bundle.run(feeds, [sig.outputs[key].name for key in outputs],
                                      timeout_s)
        except tf.errors.OpError as error:
            mapped = run_error(error)
            if mapped is error:
                raise
            raise mapped from error
        return {key: np.asarray(value) for key, value in zip(outputs, values)}

    def close(self) -> None:
        self._bundle.close()
