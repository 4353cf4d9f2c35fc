"""Why an adapter is refused: each a 400 naming what is wrong, raised before anything of the
adapter reaches a slot (lora_adapter.py re-exports them; no TF)."""

from __future__ import annotations

from tokenserve.errors import InvalidRequestError


class LoraAdapterError(InvalidRequestError):
    """An adapter that cannot be served (HTTP 400); nothing of it is loaded."""


class LoraNotFoundError(LoraAdapterError):
    """The adapter's directory or one of its two files is missing or unreadable."""


class LoraRankError(LoraAdapterError):
    """The adapter's rank is above the server's --max_lora_rank."""


class LoraTargetError(LoraAdapterError):
    """The adapter changes a module the model lacks or tokenserve does not adapt."""


class LoraShapeError(LoraAdapterError):
    """A factor's shape does not fit its module (or its rank)."""


class LoraBaseMismatchError(LoraAdapterError):
    """The adapter was made for another base model (hidden size, layer count, family)."""


class LoraNameError(LoraAdapterError):
    """An adapter name that is empty, already taken, or the base model's."""
