"""TensorBoard's "capture profile" against `tokenserve serve`'s gRPC port, as it works
against tensorflow_model_server: TF's own profiler client, a trace file on disk."""

from __future__ import annotations

import threading

import httpx

import servables as S


def test_profiler_client_captures_a_trace_through_the_serving_port(tmp_path):
    import tensorflow as tf

    S.write_tf2_model(tmp_path / "half", 1)
    process = S.ServerProcess(tmp_path, "--model_name=half",
                              f"--model_base_path={tmp_path / 'half'}")
    stop = threading.Event()

    def load():  # an idle server has nothing to trace (TF's client then fails, as with TF Serving)
        while not stop.is_set():
            httpx.post(f"{process.rest}/v1/models/half:predict",
                       json={"instances": [1.0, 2.0, 3.0]}, timeout=10).raise_for_status()

    try:
        process.wait_ready("half")
        client = threading.Thread(target=load, daemon=True)
        client.start()
        logdir = tmp_path / "tb"
        tf.profiler.experimental.client.trace(f"grpc://{process.target}", str(logdir), 1000)
        traces = list(logdir.glob("plugins/profile/*/*.xplane.pb"))
        assert traces and traces[0].stat().st_size > 0, process.log()
    finally:
        stop.set()
        process.stop()
