"""The compiled custom ops for the kernel tests: the built op module or a skip that says why."""

from __future__ import annotations

import pytest


def compiled_op_module(library):
    """The op module a kernels OpLibrary builds (cached across runs), or a skip of the
    calling test or fixture naming why it is unavailable (the fallback tests still run)."""
    loaded = library.load()
    if isinstance(loaded, str):
        pytest.skip(f"compiled {library.what} unavailable ({loaded}); the fallback tests run")
    return loaded[0]


def use_compiled_op(monkeypatch, library) -> None:
    """Clears the variables that would force `library`'s ops onto their fallback."""
    from tokenserve.kernels.build import KERNELS_ENV

    monkeypatch.delenv(library.mode_env, raising=False)
    monkeypatch.delenv(KERNELS_ENV, raising=False)
