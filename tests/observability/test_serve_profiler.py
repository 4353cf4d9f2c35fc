"""TensorBoard's "capture profile" against `tokenserve serve`'s gRPC port, as it works
against tensorflow_model_server: TF's own profiler client, a trace file on disk, for a
server under load and for one that sees no request during the capture."""

from __future__ import annotations

import threading

import httpx
import pytest

from support import servables as S


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("profiler")
    S.write_tf1_model(root / "half", 1)  # half_plus_two-style TF1 graph, Session-served
    process = S.ServerProcess(root, "--model_name=half", f"--model_base_path={root / 'half'}")
    try:
        process.wait_ready("half")
        process.root = root
        yield process
    finally:
        process.stop()


def capture(server, logdir, duration_ms: int) -> list[str]:
    """Event names on the host plane of one capture taken with TF's own client."""
    import tensorflow as tf
    from tensorflow.tsl.profiler.protobuf import xplane_pb2

    tf.profiler.experimental.client.trace(f"grpc://{server.target}", str(logdir), duration_ms,
                                          num_tracing_attempts=1)
    [trace] = logdir.glob("plugins/profile/*/*.xplane.pb")
    space = xplane_pb2.XSpace.FromString(trace.read_bytes())
    [host] = [plane for plane in space.planes if plane.name == "/host:CPU"]
    return [host.event_metadata[event.metadata_id].name
            for line in host.lines for event in line.events]


def test_capture_while_requests_arrive_traces_the_session_runs(server):
    stop = threading.Event()

    def load():
        while not stop.is_set():
            httpx.post(f"{server.rest}/v1/models/half:predict",
                       json={"instances": [1.0, 2.0, 3.0]}, timeout=10).raise_for_status()

    client = threading.Thread(target=load, daemon=True)
    client.start()
    try:
        events = capture(server, server.root / "busy", 1000)
    finally:
        stop.set()
        client.join(10)
    assert "ProfilerService::Profile" in events
    assert set(events) - {"ProfilerService::Profile"}, events  # the predicts' own events


def test_capture_with_no_request_in_the_window_still_returns_a_trace(server):
    """Requests once a second and a shorter capture: the window often holds none.
    tensorflow_model_server returns a trace; TF's client used to fail here with
    `UNAVAILABLE: No trace event was collected`."""
    events = capture(server, server.root / "idle", 300)
    assert events == ["ProfilerService::Profile"]
