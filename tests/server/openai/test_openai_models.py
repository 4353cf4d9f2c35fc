"""Model ids and resolvers: StaticModels, and ManagedModels over the real ModelManager (fake
engines as the `engine` extension, empty version directories, a loader that loads nothing)."""

from __future__ import annotations

import threading

import pytest
from fastapi.testclient import TestClient

from support.fake_engine import FakeEngine
from support.tiny_models import tiny
from support.waiting import wait_until
from tokenserve.errors import ModelNotFoundError, ServableUnavailableError
from tokenserve.lifecycle.manager import ModelManager
from tokenserve.lifecycle.model_config import ModelSpecConfig
from tokenserve.lifecycle.policy import VersionPolicy
from tokenserve.server.openai import StaticModels, build_openai_app
from tokenserve.server.openai.managed_models import ManagedModels
from tokenserve.server.openai.models import ModelId


@pytest.mark.parametrize("text,parsed", [
    ("m", ModelId("m")), ("m:3", ModelId("m", version=3)),
    ("m@stable", ModelId("m", label="stable")),
    ("org/m:12", ModelId("org/m", version=12)), ("a:b", None), ("", None), ("m@", None),
    (":3", None)])
def test_model_id_forms(text, parsed):
    if parsed is None:
        with pytest.raises(ModelNotFoundError):
            ModelId.parse(text)
    else:
        assert ModelId.parse(text) == parsed


@pytest.fixture(scope="module")
def config(tokenizer):
    return tiny("tiny-gpt2", tokenizer)[1]


@pytest.fixture()
def manager(tmp_path, tokenizer, config):
    for version in (1, 2):
        (tmp_path / "lm" / str(version)).mkdir(parents=True)
    (tmp_path / "classifier" / "1").mkdir(parents=True)
    (tmp_path / "empty").mkdir()
    manager = ModelManager(lambda spec, path: object())
    manager.register_extension("engine", lambda version: FakeEngine(tokenizer, config)
                               if version.model_name == "lm" else None)
    manager.apply_config([
        ModelSpecConfig("classifier", str(tmp_path / "classifier")),
        ModelSpecConfig("lm", str(tmp_path / "lm"), policy=VersionPolicy.all(),
                        labels={"stable": 1, "canary": 2}),
        ModelSpecConfig("empty", str(tmp_path / "empty"))], wait=True)
    yield manager
    manager.close(timeout_s=10)


def test_managed_models_list_names_versions_and_labels(manager):
    models = ManagedModels(manager)
    ids = [c.id for c in models.list_models()]
    assert ids == ["lm", "lm:2", "lm:1", "lm@canary", "lm@stable"]
    assert {c.root for c in models.list_models()} == {"lm"}
    assert models.default_model() == "lm"
    versions = {model_id: manager_version(manager, model_id) for model_id in ids}
    for model_id, version in versions.items():
        assert models.resolve(model_id) is version.extensions["engine"]
    assert models.resolve("lm") is versions["lm:2"].extensions["engine"]
    assert models.resolve("lm@stable") is versions["lm:1"].extensions["engine"]


def manager_version(manager, model_id):
    parsed = ModelId.parse(model_id)
    with manager.acquire(parsed.name, parsed.version, parsed.label) as version:
        return version


def test_managed_models_errors(manager):
    models = ManagedModels(manager)
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        models.resolve("nope")
    with pytest.raises(ModelNotFoundError, match="does not exist"):
        models.resolve("lm:7")
    with pytest.raises(ModelNotFoundError, match="Unrecognized servable version label"):
        models.resolve("lm@gone")
    with pytest.raises(ModelNotFoundError, match="not a language model"):
        models.resolve("classifier")
    with pytest.raises(ServableUnavailableError, match="no AVAILABLE version"):
        models.resolve("empty")


def test_a_generation_holds_its_version_until_the_stream_ends(manager, tokenizer, config):
    models = ManagedModels(manager)
    version = manager_version(manager, "lm:2")
    engine = version.extensions["engine"]
    engine.step_s = 0.02
    app = build_openai_app(models)
    seen = []
    with TestClient(app) as client:
        def watch():
            if wait_until(lambda: bool(engine.running)):
                seen.append(version.num_inflight)

        watcher = threading.Thread(target=watch)
        watcher.start()
        response = client.post("/v1/completions", json={"model": "lm:2", "prompt": "x",
                                                         "max_tokens": 5, "stream": True})
        watcher.join(timeout=10)
        assert response.status_code == 200 and response.text.endswith("data: [DONE]\n\n")
    assert seen == [1]
    assert version.num_inflight == 0


def test_static_models_default_and_versions(tokenizer, config):
    models = StaticModels({"a": FakeEngine(tokenizer, config),
                           "b": FakeEngine(tokenizer, config)}, version=4, labels={"x": 4})
    assert models.default_model() == "a"
    assert [c.id for c in models.list_models()] == ["a", "a:4", "a@x", "b", "b:4", "b@x"]
    with models.acquire("b@x") as engine:
        assert engine is models.engines["b"]
