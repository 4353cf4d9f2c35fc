"""Capturing a profile over gRPC with TF's own client, as against tensorflow_model_server."""

from __future__ import annotations

import asyncio
import glob
import os
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from tokenserve.observability.profiler import SERVICE_NAME, add_profiler_service

tf = pytest.importorskip("tensorflow")


@pytest.fixture
def busy_tensorflow():
    """A thread running a small TF computation, so the trace has events to find."""
    stop = threading.Event()
    matmul = tf.function(lambda x: tf.matmul(x, x))
    operand = tf.random.normal([32, 32])
    matmul(operand)

    def work():
        while not stop.is_set():
            matmul(operand)

    thread = threading.Thread(target=work, daemon=True)
    thread.start()
    yield
    stop.set()
    thread.join()


def xplane_files(logdir) -> list[str]:
    return glob.glob(os.path.join(logdir, "plugins", "profile", "*", "*.xplane.pb"))


def test_tf_profiler_client_captures_a_trace_over_grpc(tmp_path, busy_tensorflow):
    server = grpc.server(ThreadPoolExecutor(max_workers=2))
    add_profiler_service(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        tf.profiler.experimental.client.trace(f"grpc://127.0.0.1:{port}", str(tmp_path),
                                              duration_ms=200, num_tracing_attempts=1)
    finally:
        server.stop(0)
    files = xplane_files(tmp_path)
    assert len(files) == 1
    assert os.path.basename(files[0]) == f"127.0.0.1_{port}.xplane.pb"
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    with open(files[0], "rb") as file:
        xspace = xplane_pb2.XSpace.FromString(file.read())
    assert any(plane.name == "/host:CPU" for plane in xspace.planes)
    assert any(line.events for plane in xspace.planes for line in plane.lines)


def test_asyncio_server_and_raw_profile_request(tmp_path, busy_tensorflow):
    """grpc.aio servers get async handlers; a client asking for emit_xspace gets the bytes."""

    async def main():
        server = grpc.aio.server()
        servicer = add_profiler_service(server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        messages = servicer.messages
        request = messages["ProfileRequest"](duration_ms=100, repository_root=str(tmp_path),
                                             session_id="run1", host_name="replica-0",
                                             emit_xspace=True)
        try:
            # TF's own profiler client lifts the 4 MB limit too: a trace of a busy process
            # (e.g. after the rest of the suite ran in it) is tens of MB
            async with grpc.aio.insecure_channel(
                    f"127.0.0.1:{port}",
                    options=[("grpc.max_receive_message_length", -1)]) as channel:
                profile = channel.unary_unary(
                    f"/{SERVICE_NAME}/Profile", request_serializer=lambda m: m.SerializeToString(),
                    response_deserializer=messages["ProfileResponse"].FromString)
                return await profile(request, timeout=60)
        finally:
            await server.stop(0)

    response = asyncio.run(main())
    assert not response.empty_trace
    written = tmp_path / "run1" / "replica-0.xplane.pb"
    assert written.read_bytes() == response.xspace


class FakeContext:
    """The two ServicerContext calls the servicer makes, without a gRPC server."""

    def is_active(self) -> bool:
        return True

    def abort(self, code, details):
        raise RuntimeError(f"{code.name}: {details}")


def test_client_names_cannot_leave_the_run_directory(tmp_path):
    from tokenserve.observability.profiler import ProfilerServicer

    servicer = ProfilerServicer()
    request = servicer.messages["ProfileRequest"](
        duration_ms=50, repository_root=str(tmp_path / "root"), session_id="../../s",
        host_name="../../evil:1")
    servicer.Profile(request, FakeContext())
    (written,) = [path for path in tmp_path.rglob("*") if path.is_file()]
    assert written.relative_to(tmp_path / "root").parts == ("_.._s", "_.._evil_1.xplane.pb")


def test_allowed_roots_refuse_other_directories(tmp_path):
    from tokenserve.observability.profiler import ProfilerServiceConfig, ProfilerServicer

    servicer = ProfilerServicer(ProfilerServiceConfig(allowed_roots=(str(tmp_path / "tb"),)))
    request = servicer.messages["ProfileRequest"](duration_ms=50,
                                                  repository_root=str(tmp_path / "elsewhere"))
    with pytest.raises(RuntimeError, match="PERMISSION_DENIED"):
        servicer.Profile(request, FakeContext())
    assert not (tmp_path / "elsewhere").exists()
    inside = servicer.messages["ProfileRequest"](
        duration_ms=50, repository_root=str(tmp_path / "tb" / "plugins" / "profile"),
        session_id="s", host_name="h")
    servicer.Profile(inside, FakeContext())
    assert (tmp_path / "tb" / "plugins" / "profile" / "s" / "h.xplane.pb").is_file()
