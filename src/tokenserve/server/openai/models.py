"""Which engine serves a request's `model`: the ModelResolver protocol and a static, in-memory
implementation for single-model servers and tests.

Model ids come in three forms, as TF Serving names versions:
  - `name`          the model's default version (the newest AVAILABLE one),
  - `name:version`  one version, e.g. `builtin:3`,
  - `name@label`    the version a label points at, e.g. `builtin@stable`.
The TF Serving lifecycle implements ModelResolver over its repository; frontends (OpenAI HTTP
and the gRPC generation service) only ever see this protocol.
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Protocol

from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import ModelNotFoundError


@dataclass(frozen=True)
class ModelCard:
    """One servable id as /v1/models lists it."""

    id: str
    """`name`, `name:version` or `name@label`."""
    root: str
    """The model name the id belongs to."""
    created: int
    """Unix time the version was loaded."""
    owned_by: str = "tokenserve"
    max_model_len: int | None = None
    parent: str | None = None
    """The base model of a LoRA adapter's id; None for a model."""


@dataclass(frozen=True)
class ModelId:
    """A parsed model id: exactly one of `version` and `label` may be set."""

    name: str
    version: int | None = None
    label: str | None = None

    @classmethod
    def parse(cls, model_id: str) -> "ModelId":
        """Splits `name`, `name:version` or `name@label`.

        Raises:
            ModelNotFoundError: on an empty name or a non-numeric version.
        """
        if "@" in model_id:
            name, _, label = model_id.partition("@")
            if name and label:
                return cls(name, label=label)
        elif ":" in model_id:
            name, _, version = model_id.rpartition(":")
            if name and version.isdigit():
                return cls(name, version=int(version))
        elif model_id:
            return cls(model_id)
        raise ModelNotFoundError(f"The model '{model_id}' does not exist.")


class ModelResolver(Protocol):
    """Maps a request's model id to the engine that serves it."""

    def resolve(self, model_id: str) -> EngineClient:
        """The engine for `model_id` (any of the three id forms).

        Raises:
            ModelNotFoundError: no such model, version or label.
            ServableUnavailableError: the model exists but no version is AVAILABLE.
        """

    def acquire(self, model_id: str) -> AbstractContextManager[EngineClient]:
        """`resolve`, holding the version until the block exits: frontends hold it for a
        whole generation (stream included), so a hot reload drains it instead of cutting it.

        Raises:
            As `resolve`, on entering.
        """

    def list_models(self) -> list[ModelCard]:
        """Every id a client may use, names first, then versions and labels."""

    def default_model(self) -> str:
        """The id used when a request names no model; readiness checks this one."""

    def model_names(self) -> list[str]:
        """The configured model names (AVAILABLE or not): the only model values metrics
        label requests with."""


class StaticModels:
    """A fixed set of engines, each one version of its name (single-model servers, tests).

    Example:
        models = StaticModels({"builtin": engine})            # builtin, builtin:1
        models = StaticModels({"m": e}, version=3, labels={"stable": 3})  # m, m:3, m@stable
    """

    def __init__(self, engines: Mapping[str, EngineClient], version: int = 1,
                 labels: Mapping[str, int] | None = None, owned_by: str = "tokenserve"):
        if not engines:
            raise ValueError("StaticModels needs at least one engine")
        self.engines = dict(engines)
        self.version = version
        self.labels = dict(labels or {})
        self.owned_by = owned_by
        self.created = int(time.time())

    def resolve(self, model_id: str) -> EngineClient:
        parsed = ModelId.parse(model_id)
        engine = self.engines.get(parsed.name)
        if engine is None:
            raise ModelNotFoundError(f"The model '{model_id}' does not exist.")
        if parsed.version is not None and parsed.version != self.version:
            raise ModelNotFoundError(f"The model '{model_id}' does not exist: "
                                     f"{parsed.name} has version {self.version} only.")
        if parsed.label is not None and self.labels.get(parsed.label) != self.version:
            raise ModelNotFoundError(f"The model '{model_id}' does not exist: "
                                     f"{parsed.name} has no label '{parsed.label}'.")
        return engine

    @contextmanager
    def acquire(self, model_id: str) -> Iterator[EngineClient]:
        yield self.resolve(model_id)

    def list_models(self) -> list[ModelCard]:
        cards = []
        for name, engine in self.engines.items():
            ids = [name, f"{name}:{self.version}"] + [f"{name}@{label}" for label in self.labels]
            cards += [ModelCard(id=i, root=name, created=self.created, owned_by=self.owned_by,
                                max_model_len=engine.max_model_len) for i in ids]
        return cards

    def default_model(self) -> str:
        return next(iter(self.engines))

    def model_names(self) -> list[str]:
        return list(self.engines)
