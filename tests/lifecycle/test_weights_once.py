"""A language model's TF Serving Session (a second copy of the weights) is built on its first
TF Serving request, not at load; its signatures are known at once."""

from __future__ import annotations

from support.tiny_models import tiny
from tokenserve.lifecycle.servable_loader import load_servable
from tokenserve.lifecycle.model_config import ModelSpecConfig
from tokenserve.lifecycle.savedmodel import LazySavedModelServable, SavedModelServable


def test_session_waits_for_its_first_request(tokenizer, tmp_path):
    from tokenserve.export.exporter import export_model

    model, config = tiny("tiny-gpt2", tokenizer)
    version_dir = export_model(model, tokenizer, config, tmp_path / "m", jit_compile=False)
    spec = ModelSpecConfig("m", str(tmp_path / "m"))
    eager = load_servable(spec, version_dir)
    lazy = load_servable(spec, version_dir, lazy_session=True)
    assert isinstance(eager, SavedModelServable)
    assert isinstance(lazy, LazySavedModelServable)
    assert set(lazy.signature_defs) == set(eager.signature_defs) >= {"serving_default",
                                                                     "generate"}
    assert not lazy.loaded and lazy.weights_bytes == 0
    lazy._session()  # what the first run does  # noqa: SLF001
    assert lazy.loaded and lazy.weights_bytes > 0
    lazy.close()
    eager.close()
    assert not lazy.loaded
