"""The OpenAI server tests' shared servers as module-scoped fixtures: one process of each
kind for the whole session (support.openai_harness). A module that needs another server
defines its own fixture of the same name."""

from __future__ import annotations

import pytest

from support.openai_harness import shared_builtin_server, shared_server


@pytest.fixture(scope="module")
def server(pytestconfig, tmp_path_factory):
    """The tiny test model's server (shared_server)."""
    return shared_server(pytestconfig, tmp_path_factory)


@pytest.fixture(scope="module")
def builtin_server(pytestconfig):
    """The built-in model's server (shared_builtin_server)."""
    return shared_builtin_server(pytestconfig)
