"""Any TensorFlow SavedModel (TF1 SavedModelBuilder, TF2, Keras export) as a servable.

Loaded through a TF1 Session (lifecycle/session_bundle.py), as tensorflow_model_server does,
and run by tensor name with TF Serving's request rules (lifecycle/servable.py). TensorFlow
errors from the run keep their code: INVALID_ARGUMENT (e.g. `Expects arg[0] to be float but
int64 is provided`, or a shape the graph cannot take) is a bad request, FAILED_PRECONDITION
and DEADLINE_EXCEEDED keep theirs, anything else is the server's error.
"""

from __future__ import annotations

import logging
import threading
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

__all__ = ["SERVE_TAG", "LazySavedModelServable", "SavedModelServable", "dtype_string",
           "load_error", "run_error"]

log = logging.getLogger("tokenserve.lifecycle")


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


def undecodable_run_error(error: UnicodeDecodeError) -> InvalidRequestError:
    """TF's Python binding decodes a failed run's status message as UTF-8; a message that
    quotes input bytes which are not UTF-8 (`Could not parse example input, value: '\\xff...'`
    from a tf.Example parse) raises UnicodeDecodeError in place of the error. Such a message
    comes from the request's own bytes, as TF Serving's INVALID_ARGUMENT for it does; the
    bytes that are not UTF-8 are written as escapes."""
    return InvalidRequestError(error.object.decode("utf-8", "backslashreplace"))


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
        except UnicodeDecodeError as error:
            raise undecodable_run_error(error) from None
        return {key: np.asarray(value) for key, value in zip(outputs, values)}

    def close(self) -> None:
        self._bundle.close()


class LazySavedModelServable:
    """A SavedModelServable whose Session, and with it a full copy of the weights, is built
    on the first run, not at load.

    For a tokenserve language model the engine holds the weights it serves from; the
    SavedModel's Session is only the TF Serving path (Predict, `generate`), so it costs
    memory only once a client uses that path. Signatures (metadata, request checks) come from
    saved_model.pb, which is read at once, with no variables.
    """

    def __init__(self, path: str | Path, tags: tuple[str, ...] = (SERVE_TAG,),
                 options: SessionOptions = SessionOptions()):
        from tokenserve.lifecycle.session_bundle import check_tags, read_saved_model

        self.path = Path(path)
        self._tags, self._options = tuple(tags), options
        try:
            proto = read_saved_model(self.path)
        except Exception as error:  # noqa: BLE001 - a corrupt file fails the load, as before
            raise load_error(self.path, error) from error
        check_tags(proto, self._tags)
        graph = next(g for g in proto.meta_graphs if set(g.meta_info_def.tags) == set(tags))
        self.signature_defs = dict(graph.signature_def)
        self._servable: SavedModelServable | None = None
        self._lock = threading.Lock()

    @property
    def loaded(self) -> bool:
        return self._servable is not None

    @property
    def weights_bytes(self) -> int:
        """Bytes of the variables the Session holds (0 until it is built)."""
        if self._servable is None:
            return 0
        return sum(f.stat().st_size for f in (self.path / "variables").glob("variables.data-*"))

    def _session(self) -> SavedModelServable:
        with self._lock:
            if self._servable is None:
                log.info("%s: building the SavedModel session for its first TF Serving "
                         "request", self.path)
                self._servable = SavedModelServable(self.path, self._tags, self._options)
            return self._servable

    def run(self, signature_name: str, inputs: dict[str, np.ndarray],
            output_keys: list[str] | None = None,
            timeout_s: float | None = None) -> dict[str, np.ndarray]:
        return self._session().run(signature_name, inputs, output_keys, timeout_s)

    def close(self) -> None:
        with self._lock:
            servable, self._servable = self._servable, None
        if servable is not None:
            servable.close()
