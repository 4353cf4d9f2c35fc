"""Starting `tokenserve serve` as tensorflow_model_server starts
(docs/migrating-from-tf-serving.md#lifecycle): a bad --model_config_file fails with protobuf's
own error line, and the ports open only once the initial models have loaded or finally
failed after TF Serving's retry flags."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import httpx

from support import servables as S


def test_malformed_model_config_prints_tf_servings_parse_error(tmp_path):
    config = tmp_path / "models.config"
    config.write_text('model_config_list {\n  config { name: "m" base_path: \n')
    result = subprocess.run(
        [sys.executable, "-m", "tokenserve", "serve", f"--model_config_file={config}",
         f"--port={S.free_port()}", "--rest_api_port=0", "--openai_port=0"],
        capture_output=True, text=True, timeout=300,
        env=dict(os.environ, TF_CPP_MIN_LOG_LEVEL="3"))
    assert result.returncode != 0
    assert ("Error parsing text-format tensorflow.serving.ModelServerConfig: 3:1: "
            in result.stderr), result.stderr
    assert f"Invalid protobuf file: '{config}'" in result.stderr


def _accepts(port: int) -> bool:
    with socket.socket() as sock:
        sock.settimeout(0.2)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def test_ports_open_after_initial_loads_finally_failed(tmp_path):
    S.write_tf2_model(tmp_path / "good", 1)
    (tmp_path / "broken" / "1").mkdir(parents=True)
    (tmp_path / "broken" / "1" / "saved_model.pb").write_bytes(b"not a protobuf")
    (tmp_path / "models.config").write_text(
        "model_config_list {\n"
        f'  config {{ name: "good" base_path: "{tmp_path / "good"}" '
        'model_platform: "tensorflow" }\n'
        f'  config {{ name: "broken" base_path: "{tmp_path / "broken"}" '
        'model_platform: "tensorflow" }\n}\n')
    process = S.ServerProcess(tmp_path, f"--model_config_file={tmp_path / 'models.config'}",
                              "--max_num_load_retries=2", "--load_retry_interval_micros=1000000")
    try:
        deadline = time.monotonic() + 240
        while not _accepts(process.rest_port) and not _accepts(process.grpc_port):
            assert process.process.poll() is None, process.log()
            assert time.monotonic() < deadline, process.log()
            time.sleep(0.05)
        log = process.log()  # what had happened when a port first accepted a connection
        assert "loading broken version 1 failed (attempt 3)" in log, log
        assert "good version 1 is AVAILABLE" in log
        assert log.index("(attempt 3)") < log.index("Running gRPC ModelServer")
        process.wait_ready("good")
        [broken] = httpx.get(f"{process.rest}/v1/models/broken").json()["model_version_status"]
        assert broken["state"] == "END" and broken["status"]["error_code"] != "OK"
        assert httpx.post(f"{process.rest}/v1/models/good:predict",
                          json={"instances": [1.0]}).json() == {"predictions": [2.5]}
    finally:
        process.stop()
