"""`tensorflow.ProfilerService` on the server's own gRPC port, as tensorflow_model_server has.

TensorBoard's "Capture profile" button and `tf.profiler.experimental.client.trace(
"grpc://HOST:8500", logdir, duration_ms)` send a `Profile` RPC; the server runs TensorFlow's
in-process profiler for the requested time and writes the XSpace to
`<repository_root>/<session_id>/<host_name>.xplane.pb`, the file TensorBoard's profile
plugin reads (the client sets repository_root to `<logdir>/plugins/profile`).

The TF wheel ships no Python stubs for profiler_service.proto, so its messages are rebuilt
here from the field numbers of `tsl/profiler/protobuf/profiler_service.proto`, in a private
descriptor pool (ProfileOptions comes from the wheel's own pb2 module).

Example:
    >>> server = grpc.server(ThreadPoolExecutor(8))            # doctest: +SKIP
    >>> add_profiler_service(server)
    >>> server.add_insecure_port("[::]:8500"); server.start()
"""

from __future__ import annotations

import asyncio
import glob
import os
import re
import socket
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

SERVICE_NAME = "tensorflow.ProfilerService"
CAPTURE_EVENT = "ProfilerService::Profile"
"""The host-plane event spanning each capture."""
_FIELD = descriptor_pb2.FieldDescriptorProto


@dataclass(frozen=True)
class ProfilerServiceConfig:
    """Limits on remote profile captures."""

    max_duration_ms: int = 60_000
    """Longest capture one request may ask for; longer requests are cut to this."""
    default_duration_ms: int = 1_000
    """Capture length when the request gives none."""
    allowed_roots: tuple[str, ...] = ()
    """If not empty, traces are written only under these directories (the client names
    the directory; tensorflow_model_server writes wherever it is told, the default here)."""

    def __post_init__(self) -> None:
        if not 0 < self.default_duration_ms <= self.max_duration_ms:
            raise ValueError("need 0 < default_duration_ms <= max_duration_ms")


def _add_with_dependencies(pool: descriptor_pool.DescriptorPool, file_descriptor,
                           added: set[str]) -> None:
    for dependency in file_descriptor.dependencies:
        _add_with_dependencies(pool, dependency, added)
    if file_descriptor.name not in added:
        proto = descriptor_pb2.FileDescriptorProto()
        file_descriptor.CopyToProto(proto)
        pool.Add(proto)
        added.add(file_descriptor.name)


def _field(name: str, number: int, field_type: int, repeated: bool = False,
           type_name: str | None = None) -> descriptor_pb2.FieldDescriptorProto:
    field = _FIELD(name=name, number=number, type=field_type,
                   label=_FIELD.LABEL_REPEATED if repeated else _FIELD.LABEL_OPTIONAL)
    if type_name:
        field.type_name = type_name
    return field


def _build_messages() -> dict[str, Any]:
    """Message classes for the ProfilerService RPCs we serve (Profile, Terminate)."""
    from tensorflow.tsl.profiler.protobuf import profiler_options_pb2

    pool = descriptor_pool.DescriptorPool()
    _add_with_dependencies(pool, profiler_options_pb2.DESCRIPTOR, set())
    service_file = descriptor_pb2.FileDescriptorProto(
        name="tokenserve/profiler_service.proto", package="tensorflow", syntax="proto3",
        dependency=[profiler_options_pb2.DESCRIPTOR.name])
    uint64, string, boolean, message, raw = (_FIELD.TYPE_UINT64, _FIELD.TYPE_STRING,
                                             _FIELD.TYPE_BOOL, _FIELD.TYPE_MESSAGE,
                                             _FIELD.TYPE_BYTES)
    fields = {
        # tool_options (8), a map, is left out: proto3 parsing keeps it as an unknown field.
        "ProfileRequest": [_field("duration_ms", 1, uint64), _field("max_events", 2, uint64),
                           _field("tools", 3, string, repeated=True),
                           _field("opts", 4, message, type_name=".tensorflow.ProfileOptions"),
                           _field("repository_root", 5, string),
                           _field("session_id", 6, string), _field("host_name", 7, string),
                           _field("emit_xspace", 9, boolean)],
        "ProfileToolData": [_field("name", 1, string), _field("data", 2, raw)],
        # xspace (8) is a tensorflow.profiler.XSpace on the wire; carried as the serialized
        # bytes TF's profiler returns (a length-delimited field either way).
        "ProfileResponse": [_field("tool_data", 6, message, repeated=True,
                                   type_name=".tensorflow.ProfileToolData"),
                            _field("empty_trace", 7, boolean), _field("xspace", 8, raw)],
        "TerminateRequest": [_field("session_id", 1, string)],
        "TerminateResponse": [],
    }
    for name, message_fields in fields.items():
        service_file.message_type.add(name=name, field=message_fields)
    pool.Add(service_file)
    find = pool.FindMessageTypeByName
    return {name: message_factory.GetMessageClass(find(f"tensorflow.{name}")) for name in fields}


class ProfilerServicer:
    """Serves Profile by running TF's in-process profiler; Terminate ends a capture early.

    One capture runs at a time per process (TF's profiler is process-wide); a second
    concurrent request fails with UNAVAILABLE.
    """

    def __init__(self, config: ProfilerServiceConfig | None = None) -> None:
        self.config = config or ProfilerServiceConfig()
        self.messages = _build_messages()
        self._busy = threading.Lock()
        self._stop = threading.Event()

    def _profiler_options(self, request) -> dict[str, int]:
        """TF's defaults (host 2, device 1, python 0) unless the client set a version."""
        opts = request.opts
        if not opts.version:
            return {"host_tracer_level": 2, "device_tracer_level": 1, "python_tracer_level": 0}
        return {"host_tracer_level": opts.host_tracer_level,
                "device_tracer_level": opts.device_tracer_level,
                "python_tracer_level": opts.python_tracer_level}

    def _duration_s(self, request) -> float:
        duration_ms = request.duration_ms or request.opts.duration_ms \
            or self.config.default_duration_ms
        return min(duration_ms, self.config.max_duration_ms) / 1000

    def Profile(self, request, context: grpc.ServicerContext):
        if request.repository_root and not self._may_write(request.repository_root):
            context.abort(grpc.StatusCode.PERMISSION_DENIED,
                          f"{request.repository_root} is outside the allowed profile roots")
        if not self._busy.acquire(blocking=False):
            context.abort(grpc.StatusCode.UNAVAILABLE, "another profiling session is active")
        try:
            self._stop.clear()
            xspace = self._capture(request, context)  # a serialized tensorflow.profiler.XSpace
        finally:
            self._busy.release()
        response = self.messages["ProfileResponse"](empty_trace=_is_empty(xspace))
        if request.repository_root:
            host_name = request.host_name or socket.gethostname()
            _write_xspace(xspace, request.repository_root, request.session_id, host_name)
        if request.emit_xspace:
            response.xspace = xspace
        return response

    def _capture(self, request, context: grpc.ServicerContext) -> bytes:
        """Runs TF's profiler for the requested time; returns the XSpace it collected.

        The pywrap session's `stop()` returns trace-viewer events, not an XSpace; its
        `export_to_tb()` writes the XSpace under the session's logdir, so a scratch
        directory is used and the file read back.
        """
        from tensorflow.python.profiler.internal import _pywrap_profiler

        from tensorflow.python.profiler.trace import Trace

        with tempfile.TemporaryDirectory(prefix="tokenserve-profile-") as scratch:
            session = _pywrap_profiler.ProfilerSession()
            try:
                session.start(scratch, self._profiler_options(request))
            except Exception as error:  # TF's profiler is busy (started by tf.profiler) etc.
                context.abort(grpc.StatusCode.UNAVAILABLE, f"cannot start profiler: {error}")
            # The capture itself is host activity and is traced as such: a window with no
            # request in it still returns a trace (the capture's span, nothing else), as
            # tensorflow_model_server does, instead of TF's client failing with
            # "UNAVAILABLE: No trace event was collected".
            with Trace(CAPTURE_EVENT, duration_ms=int(self._duration_s(request) * 1000)):
                self._wait(self._duration_s(request), context)
            session.export_to_tb()
            written = glob.glob(os.path.join(scratch, "plugins", "profile", "*", "*.xplane.pb"))
            if not written:
                context.abort(grpc.StatusCode.INTERNAL, "the profiler wrote no trace")
            with open(written[0], "rb") as file:
                return file.read()

    def _may_write(self, repository_root: str) -> bool:
        if not self.config.allowed_roots:
            return True
        root = os.path.realpath(repository_root)
        return any(os.path.commonpath([root, os.path.realpath(allowed)])
                   == os.path.realpath(allowed) for allowed in self.config.allowed_roots)

    def _wait(self, seconds: float, context: grpc.ServicerContext) -> None:
        """Sleeps for the capture, waking early on Terminate or a cancelled call."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0 and context.is_active():
            if self._stop.wait(min(remaining, 0.1)):
                return

    def Terminate(self, request, context: grpc.ServicerContext):
        self._stop.set()
        return self.messages["TerminateResponse"]()


def _is_empty(xspace: bytes) -> bool:
    """True when no plane of the XSpace holds an event (what TF's server reports as empty)."""
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    planes = xplane_pb2.XSpace.FromString(xspace).planes
    return not any(line.events for plane in planes for line in plane.lines)


def _file_name(text: str) -> str:
    """`text` as one safe path component: host:port becomes host_port (colons are not allowed
    in file names everywhere), and separators or `..` cannot climb out of the run dir."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", text).lstrip(".") or "_"


def _write_xspace(xspace: bytes, repository_root: str, session_id: str, host_name: str) -> str:
    """Writes `<root>/<session>/<host>.xplane.pb` (tf.io.gfile, so gs:// logdirs work too)."""
    import tensorflow as tf

    run_dir = os.path.join(repository_root, _file_name(session_id)) if session_id \
        else repository_root
    tf.io.gfile.makedirs(run_dir)
    path = os.path.join(run_dir, _file_name(host_name) + ".xplane.pb")
    with tf.io.gfile.GFile(path, "wb") as file:
        file.write(xspace)
    return path


def add_profiler_service(grpc_server, config: ProfilerServiceConfig | None = None
                         ) -> ProfilerServicer:
    """Registers `tensorflow.ProfilerService` on a grpcio server (sync or `grpc.aio`).

    Call it before `server.start()`.

    Returns:
        The servicer (its `Terminate` can end a capture early).
    """
    servicer = ProfilerServicer(config)
    messages = servicer.messages
    methods = {"Profile": (servicer.Profile, "ProfileRequest", "ProfileResponse"),
               "Terminate": (servicer.Terminate, "TerminateRequest", "TerminateResponse")}
    is_async = isinstance(grpc_server, grpc.aio.Server)
    handlers = {}
    for name, (method, request_type, response_type) in methods.items():
        if is_async:
            method = _in_thread(method)
        handlers[name] = grpc.unary_unary_rpc_method_handler(
            method, request_deserializer=messages[request_type].FromString,
            response_serializer=messages[response_type].SerializeToString)
    grpc_server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(SERVICE_NAME, handlers),))
    return servicer


class _AbortRequested(Exception):
    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self.code, self.details = code, details


class _ThreadContext:
    """What the blocking servicer needs of a grpc.aio context, usable from a worker thread."""

    def __init__(self, context) -> None:
        self._context = context

    def is_active(self) -> bool:
        return not self._context.cancelled() and not self._context.done()

    def abort(self, code: grpc.StatusCode, details: str):
        raise _AbortRequested(code, details)


def _in_thread(method):
    """Runs a blocking servicer method off the event loop for a grpc.aio server."""

    async def handler(request, context):
        try:
            return await asyncio.to_thread(method, request, _ThreadContext(context))
        except _AbortRequested as abort:
            await context.abort(abort.code, abort.details)

    return handler
