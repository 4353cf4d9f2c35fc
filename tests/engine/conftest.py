"""Fixtures of the engine tests."""

from __future__ import annotations

import pytest

from support.openai_harness import tiny_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """The OpenAI harness's tiny exported Llama (one export per session)."""
    return tiny_model_dir(tmp_path_factory)
