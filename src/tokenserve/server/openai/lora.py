"""LoRA adapters over the OpenAI API, as vLLM serves them.

- `LoraModels` wraps the server's ModelResolver: an adapter's name is a model id (a request
  picks it with `"model": "<adapter>"`), listed in /v1/models with `parent` = its base.
- `POST /v1/load_lora_adapter` {"lora_name", "lora_path"} reads and checks the adapter
  against its base model's engine and registers it (400 and nothing registered when it does
  not fit); `POST /v1/unload_lora_adapter` {"lora_name"} unregisters it. Both sit behind
  the API key like every route.
- A request holds its adapter (a LoraRequest) for its whole life: unloading lets requests in
  flight finish; only new requests get 404. Slots are the engine's business
  (engine/lora_slots.py).
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from fastapi import APIRouter, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel

from tokenserve.engine.lora_adapter import LoraNameError, LoraRequest
from tokenserve.engine.protocol import EngineClient
from tokenserve.errors import InvalidRequestError, ModelNotFoundError

from .http import read_json
from .models import ModelCard, ModelResolver


class LoadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_path: str


class UnloadLoraAdapterRequest(BaseModel):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's optional id: accepted, not needed


class LoraClient:
    """An engine seen through one adapter: generate runs with it, the rest is the base's."""

    def __init__(self, engine: EngineClient, lora: LoraRequest):
        self._engine, self.lora = engine, lora

    def __getattr__(self, name: str):
        return getattr(self._engine, name)

    def generate(self, prompt_ids, params, request_id=None, priority=0, timeout_s=None,
                 **options):
        return self._engine.generate(prompt_ids, params, request_id, priority, timeout_s,
                                     lora=self.lora, **options)

    def prompt_logprobs(self, prompt_ids, num_top):
        return self._engine.prompt_logprobs(prompt_ids, num_top, lora=self.lora)


class LoraModels:
    """A ModelResolver with LoRA adapters as model ids of their own.

    Args:
        models: the base models' resolver.
        adapters: name -> path, registered at start (checked as each base engine loads,
            `check_startup_adapters`).
        base_model: the model adapters belong to; None: the default model.
    """

    def __init__(self, models: ModelResolver, adapters: Mapping[str, str] | None = None,
                 base_model: str | None = None):
        self.models = models
        self._base = base_model
        self._lock = threading.Lock()
        # name -> (lora, base (None: the default model, not known before it loads), created)
        self._adapters: dict[str, tuple[LoraRequest, str | None, int]] = {
            name: (LoraRequest.new(name, path), base_model, int(time.time()))
            for name, path in (adapters or {}).items()}

    @property
    def base_model(self) -> str:
        return self._base or self.models.default_model()

    def adapters(self) -> dict[str, LoraRequest]:
        with self._lock:
            return {name: lora for name, (lora, _, _) in self._adapters.items()}

    # -- ModelResolver ----------------------------------------------------------------------
    @contextmanager
    def acquire(self, model_id: str) -> Iterator[EngineClient]:
        with self._lock:
            entry = self._adapters.get(model_id)
        if entry is None:
            with self.models.acquire(model_id) as engine:
                yield engine
            return
        lora, base, _ = entry
        with self.models.acquire(base or self.base_model) as engine:
            yield LoraClient(engine, lora)

    def resolve(self, model_id: str) -> EngineClient:
        with self.acquire(model_id) as engine:
            return engine

    def list_models(self) -> list[ModelCard]:
        cards = self.models.list_models()
        lengths = {card.id: card.max_model_len for card in cards}
        with self._lock:
            adapters = list(self._adapters.items())
        default = self.base_model
        return cards + [ModelCard(id=name, root=lora.path, created=created,
                                  parent=base or default,
                                  max_model_len=lengths.get(base or default))
                        for name, (lora, base, created) in adapters]

    def default_model(self) -> str:
        return self.models.default_model()

    def model_names(self) -> list[str]:
        return self.models.model_names()

    # -- live changes ---------------------------------------------------------------------
    def load(self, name: str, path: str) -> LoraRequest:
        """Checks the adapter on its base's engine, then registers it (blocking).

        Raises:
            LoraNameError: an empty name, one already taken, or a base model's name.
            LoraAdapterError subclasses: the adapter does not fit (nothing registered).
        """
        if not name or name != name.strip():
            raise LoraNameError(f"LoRA adapter name {name!r} is empty or padded", "lora_name")
        base = self.base_model
        self._check_free(name)
        lora = LoraRequest.new(name, path)
        with self.models.acquire(base) as engine:
            _slots_of(engine, base).check(path, lora)  # read here, off the engine's thread
        with self._lock:
            self._check_free(name, locked=True)
            self._adapters[name] = (lora, base, int(time.time()))
        return lora

    def _check_free(self, name: str, locked: bool = False) -> None:
        taken = name in self._adapters if locked else name in self.adapters()
        if taken:
            raise LoraNameError(f"LoRA adapter {name!r} is already loaded", "lora_name")
        try:
            self.models.resolve(name)
        except (ModelNotFoundError, InvalidRequestError):
            return
        except Exception:  # noqa: BLE001 - a model of that name exists but cannot serve now
            pass
        raise LoraNameError(f"{name!r} is a model's name", "lora_name")

    def unload(self, name: str) -> None:
        """Unregisters an adapter: new requests for it get 404; requests in flight finish.

        Raises:
            ModelNotFoundError: no adapter of that name.
        """
        with self._lock:
            if self._adapters.pop(name, None) is None:
                raise ModelNotFoundError(f"The LoRA adapter '{name}' does not exist.")

    def collect(self):
        """Prometheus collector: requests and generated tokens per adapter of the base
        model's engine (labels: the adapter names loaded, a set operators bound)."""
        from prometheus_client.core import CounterMetricFamily

        requests = CounterMetricFamily("tokenserve:lora_requests",
                                       "Requests per LoRA adapter", labels=["model", "adapter"])
        tokens = CounterMetricFamily("tokenserve:lora_generation_tokens",
                                     "Generated tokens per LoRA adapter",
                                     labels=["model", "adapter"])
        base, counts = "", {}
        try:
            base = self.base_model
            with self.models.acquire(base) as engine:
                counts = _slots_of(engine, base).count_snapshot()
        except Exception:  # noqa: BLE001 - no AVAILABLE base version: no series
            counts = {}
        for name, (num_requests, num_tokens) in sorted(counts.items()):
            requests.add_metric([base, name], num_requests)
            tokens.add_metric([base, name], num_tokens)
        yield requests
        yield tokens

    def check_startup_adapters(self, engine) -> None:
        """Checks the adapters registered at start on a base engine as it loads (raising
        what load would: a bad --lora_modules entry fails the start, with its reason)."""
        for lora in self.adapters().values():
            _slots_of(engine, self.base_model).check(lora.path, lora)


def _slots_of(engine, base: str):
    """The LoraSlots of a base engine (AsyncEngine.loras)."""
    slots = getattr(engine, "loras", None)
    if slots is None:
        raise InvalidRequestError(f"model {base!r} serves no LoRA adapters: start the server "
                                  f"with --max_loras N (or --lora_modules)")
    return slots


def lora_router(models: LoraModels, max_body_bytes: int) -> APIRouter:
    """POST /v1/load_lora_adapter and /v1/unload_lora_adapter (vLLM's bodies and replies)."""
    router = APIRouter()

    @router.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request, LoadLoraAdapterRequest, max_body_bytes)
        await asyncio.to_thread(models.load, body.lora_name, body.lora_path)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added "
                                 f"successfully.")

    @router.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> PlainTextResponse:
        body = await read_json(request, UnloadLoraAdapterRequest, max_body_bytes)
        models.unload(body.lora_name)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed "
                                 f"successfully.")

    return router
