"""tokenserve: autoregressive token generation served on TensorFlow.

The few names a user needs; TensorFlow loads only when one of them does.

Example:
    >>> from tokenserve import ExportedModel, SamplingParams
    >>> model = ExportedModel("models/builtin")          # base path or version dir
    >>> ids = model.tokenizer.encode("def read_config(path):")
    >>> text = model.tokenizer.decode(model.stream(ids, SamplingParams(max_tokens=32)))
"""

from __future__ import annotations

import importlib

from tokenserve.config import (GenerationConfig, LSTMConfig, TrainConfig, TransformerConfig,
                               gpt2_config, llama_config, preset)
from tokenserve.errors import TokenserveError
from tokenserve.host.cpu_quota import size_tensorflow_threads
from tokenserve.sampling import SamplingParams

__version__ = "0.1.0"

# before anything creates TensorFlow's context: pools no larger than a container's CPU quota
size_tensorflow_threads()

_LAZY = {
    "build_model": "tokenserve.model",
    "export_model": "tokenserve.export.exporter",
    "ExportedModel": "tokenserve.tools.generate",
    "LLM": "tokenserve.engine.llm",
    "AsyncEngine": "tokenserve.engine.async_engine",
    "EngineConfig": "tokenserve.engine.config",
    "Tokenizer": "tokenserve.model.tokenizer",
}

__all__ = ["GenerationConfig", "LSTMConfig", "SamplingParams", "TokenserveError", "TrainConfig",
           "TransformerConfig", "gpt2_config", "llama_config", "preset", *_LAZY]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'tokenserve' has no attribute {name!r}")
