"""`tokenserve serve` with no model flags serves the built-in model as `builtin`."""

from __future__ import annotations

import httpx
import pytest

from support import servables as S


@pytest.mark.slow  # exports the built-in model into the user cache on first use
def test_serves_builtin_model_without_model_flags(tmp_path):
    process = S.ServerProcess(tmp_path)
    try:
        process.wait_ready("builtin", timeout_s=600)
        from tokenserve.export.cached_exports import builtin_export
        from tokenserve.tools.generate import ExportedModel

        model = ExportedModel(builtin_export())
        prompt = model.tokenizer.encode("def read_config(path):")
        expected = model.signatures["serving_default"](
            input_ids=__import__("tensorflow").constant([prompt]))["predicted_id"].numpy()
        reply = httpx.post(f"{process.rest}/v1/models/builtin:predict",
                           json={"instances": [prompt]}, timeout=120)
        assert reply.status_code == 200, reply.text
        assert reply.json() == {"predictions": expected.tolist()}
    finally:
        process.stop()
