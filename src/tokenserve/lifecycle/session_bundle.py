"""A SavedModel loaded into a TF1 Session, as TF Serving's `SavedModelBundle`.

tensorflow_model_server loads every SavedModel the same way (tensorflow/cc/saved_model
`LoadSavedModel`): pick the MetaGraph whose tag set equals `--saved_model_tags`, import its
graph into a fresh Session configured by the session flags, run the saver's restore op,
run the init op (feeding asset paths), then run signatures by tensor name. That one path
serves TF1 graphs with reference variables, TF2 `tf.saved_model.save` exports and Keras
exports alike, which `tf.saved_model.load` does not (it rebuilds Python functions and
refuses, e.g., reference-typed outputs or TensorInfos without shapes). One addition:
variables a TF2 model's functions read but its TF1 saver does not restore are restored
through the object graph (lifecycle/object_graph_restore.py).

A Session feeds the request's tensors as they are, with no shape check against the
SignatureDef (the C++ session has none), and takes a per-call timeout that cancels the
step, so a request that ran out of time stops computing.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import tensorflow as tf
from google.protobuf import text_format
from tensorflow.core.protobuf import config_pb2, saved_model_pb2
from tensorflow.python.client import pywrap_tf_session
from tensorflow.python.saved_model import loader_impl

from tokenserve.errors import DeadlineExceededError, ModelLoadError
from tokenserve.lifecycle import object_graph_restore

log = logging.getLogger("tokenserve.lifecycle")

SERVE_TAG = "serve"


@dataclass(frozen=True)
class SessionOptions:
    """The Session's thread pools: TF Serving's --tensorflow_session_parallelism (both pools)
    or --tensorflow_intra_op_parallelism / --tensorflow_inter_op_parallelism; 0 lets
    TensorFlow decide."""

    intra_op_threads: int = 0
    inter_op_threads: int = 0

    def config_proto(self) -> config_pb2.ConfigProto:
        return config_pb2.ConfigProto(intra_op_parallelism_threads=self.intra_op_threads,
                                      inter_op_parallelism_threads=self.inter_op_threads,
                                      allow_soft_placement=True)


def status_code_name(error: BaseException) -> str:
    """TF's status code name for an error (`NOT_FOUND` for tf.errors.NotFoundError)."""
    if isinstance(error, tf.errors.OpError):
        name = type(error).__name__.removesuffix("Error")
        return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()
    if isinstance(error, OSError):
        return "NOT_FOUND"
    return getattr(error, "error_code", "UNKNOWN")


def load_failure(message: str, code: str) -> ModelLoadError:
    failure = ModelLoadError(message)
    failure.error_code = code
    return failure


def read_saved_model(path: Path) -> saved_model_pb2.SavedModel:
    """saved_model.pb (or .pbtxt) of a version directory."""
    proto = saved_model_pb2.SavedModel()
    binary = path / "saved_model.pb"
    if binary.exists():
        proto.ParseFromString(binary.read_bytes())
    else:
        text_format.Parse((path / "saved_model.pbtxt").read_text(), proto)
    return proto


def check_tags(proto: saved_model_pb2.SavedModel, tags: tuple[str, ...]) -> None:
    """The MetaGraph must carry exactly the requested tag set (C++ loader's rule and text)."""
    wanted = set(tags)
    if not any(set(graph.meta_info_def.tags) == wanted for graph in proto.meta_graphs):
        raise load_failure(
            f"Could not find meta graph def matching supplied tags: {{ {' '.join(tags)} }}. "
            f"To inspect available tag-sets in the SavedModel, please use the SavedModel "
            f"CLI: `saved_model_cli`", "NOT_FOUND")


class SessionBundle:
    """One SavedModel in its own Graph and Session.

    Args:
        path: the version directory.
        tags: the MetaGraph's tag set (--saved_model_tags).
        options: thread pools for the Session.

    Raises:
        ModelLoadError: with `error_code` set to TF's status code name.
    """

    def __init__(self, path: str | Path, tags: tuple[str, ...] = (SERVE_TAG,),
                 options: SessionOptions = SessionOptions()):
        self.path = Path(path)
        self.graph = tf.Graph()
        self.session = tf.compat.v1.Session(graph=self.graph, config=options.config_proto())
        try:
            check_tags(read_saved_model(self.path), tuple(tags))
            loader = loader_impl.SavedModelLoader(str(self.path))
            self.meta_graph_def = loader.get_meta_graph_def_from_tags(list(tags))
            with self.graph.as_default():
                saver, _ = loader.load_graph(self.graph, list(tags))
                self._restore(saver, loader.variables_path)
                loader.run_init_ops(self.session, list(tags))
        except ModelLoadError:
            self.close()
            raise
        except Exception as error:  # corrupt protobuf, missing variables, unknown ops ...
            self.close()
            raise load_failure(f"Failed to load SavedModel from {self.path}: "
                               f"{_message(error)}", status_code_name(error)) from error
        self.graph.finalize()  # serving never adds ops; a stray one would be a bug
        self._handles: dict[str, object] = {}

    def _restore(self, saver, variables_path: str) -> None:
        """The saver's restore op (C++ RunRestore), and in the same step the variables it
        does not cover (see lifecycle/object_graph_restore.py)."""
        uncovered = object_graph_restore.restore_ops(self.graph, self.meta_graph_def,
                                                     self.path)
        if saver is None:
            if uncovered:
                self.session.run(uncovered)
            return
        saver_def = saver.saver_def
        self.session.run([self.graph.get_operation_by_name(saver_def.restore_op_name)]
                         + uncovered, {saver_def.filename_tensor_name: variables_path})

    def _handle(self, tensor_name: str):
        """The C API handle of a tensor, looked up once; a name the graph lacks (a
        SignatureDef naming no tensor) fails as the C++ session fails it."""
        handle = self._handles.get(tensor_name)
        if handle is None:
            try:
                tensor = self.graph.get_tensor_by_name(tensor_name)
            except (KeyError, ValueError):
                raise tf.errors.InvalidArgumentError(
                    None, None, f"Tensor {tensor_name}, specified in either feed_devices or "
                                f"fetch_devices was not found in the Graph") from None
            handle = self._handles[tensor_name] = tensor._as_tf_output()  # noqa: SLF001
        return handle

    def run(self, feeds: dict[str, np.ndarray], fetches: list[str],
            timeout_s: float | None = None) -> list[np.ndarray]:
        """Session::Run by tensor names. `timeout_s` becomes RunOptions.timeout_in_ms, so TF
        cancels the step when it passes (DeadlineExceededError). Other TF errors propagate
        as tf.errors.OpError."""
        options = None
        if timeout_s is not None:
            if timeout_s <= 0:
                raise DeadlineExceededError("Deadline exceeded before the run started")
            run_options = config_pb2.RunOptions(timeout_in_ms=max(1, math.ceil(timeout_s * 1000)))
            options = pywrap_tf_session.TF_NewBufferFromString(run_options.SerializeToString())
        try:
            # The C API call under Session.run, without its Python-side shape check (the
            # C++ session TF Serving uses has none).
            return self.session._call_tf_sessionrun(  # noqa: SLF001
                options, {self._handle(name): value for name, value in feeds.items()},
                [self._handle(name) for name in fetches], [], None)
        finally:
            if options is not None:
                pywrap_tf_session.TF_DeleteBuffer(options)

    def close(self) -> None:
        session, self.session = getattr(self, "session", None), None
        if session is not None:
            session.close()


def _message(error: BaseException) -> str:
    text = getattr(error, "message", None) or str(error)
    text = text.strip()
    return text.splitlines()[0] if text else type(error).__name__
