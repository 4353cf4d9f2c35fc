"""ModelResolver over the TF Serving lifecycle's ModelManager: the OpenAI and gRPC generation
frontends serve whatever versions the manager has AVAILABLE, with TF Serving's version labels.

Each language-model version carries its engine as a manager extension (by default
`version.extensions["engine"]`, registered by whoever wires `tokenserve serve`). Generation
holds the version through `acquire` for the whole request, stream included, so a hot reload
drains it rather than cutting it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import (InvalidRequestError, ModelNotFoundError,
                               ServableUnavailableError)

from .models import ModelCard, ModelId


class ManagedModels:
    """`ModelResolver` for a `tokenserve.lifecycle.manager.ModelManager`.

    Args:
        manager: the server's ModelManager.
        extension: the name the engine factory was registered under.
        default_model: the model a request without `model` gets (and /ready checks);
            None: the first configured model that serves generation, else the first one.
        owned_by: the `owned_by` of /v1/models.

    Example:
        manager.register_extension("engine", make_engine)   # before apply_config
        app = build_openai_app(ManagedModels(manager), OpenAIServerConfig(api_keys=keys))
    """

    def __init__(self, manager, extension: str = "engine", default_model: str | None = None,
                 owned_by: str = "tokenserve"):
        self.manager = manager
        self.extension = extension
        self._default = default_model
        self.owned_by = owned_by

    @contextmanager
    def acquire(self, model_id: str) -> Iterator[EngineClient]:
        parsed = ModelId.parse(model_id)
        try:
            held = self.manager.acquire(parsed.name, parsed.version, parsed.label)
            version = held.__enter__()
        except InvalidRequestError as error:  # the manager's "unknown label"
            raise ModelNotFoundError(f"The model '{model_id}' does not exist: {error}") from None
        except ModelNotFoundError as error:
            if parsed.name in self.manager.model_names() and not (
                    self.manager.available_versions(parsed.name)):
                raise ServableUnavailableError(
                    f"The model '{model_id}' has no AVAILABLE version yet.") from None
            raise ModelNotFoundError(f"The model '{model_id}' does not exist: {error}") from None
        try:
            engine = version.extensions.get(self.extension)
            if engine is None:
                raise ModelNotFoundError(f"The model '{model_id}' is not a language model: it "
                                         f"serves TF Serving's predict API only.")
            yield engine
        finally:
            held.__exit__(None, None, None)

    def resolve(self, model_id: str) -> EngineClient:
        with self.acquire(model_id) as engine:
            return engine

    def list_models(self) -> list[ModelCard]:
        cards = []
        for name in self.manager.model_names():
            versions = [v for v in self.manager.available_versions(name)
                        if v.extensions.get(self.extension) is not None]
            if not versions:
                continue
            by_number = {v.version: v for v in versions}

            def card(model_id: str, version) -> ModelCard:
                engine = version.extensions[self.extension]
                return ModelCard(id=model_id, root=name, created=int(version.loaded_at or 0),
                                 owned_by=self.owned_by, max_model_len=engine.max_model_len)

            cards.append(card(name, versions[0]))  # highest AVAILABLE first
            cards += [card(f"{name}:{v.version}", v) for v in versions]
            cards += [card(f"{name}@{label}", by_number[number])
                      for label, number in sorted(self.manager.labels(name).items())
                      if number in by_number]
        return cards

    def default_model(self) -> str:
        if self._default:
            return self._default
        names = self.manager.model_names()
        serving = {card.root for card in self.list_models()}
        return next((n for n in names if n in serving), names[0] if names else "")

    def model_names(self) -> list[str]:
        return self.manager.model_names()
