"""Model weights as safetensors files, keyed by Keras variable path."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

from tokenserve.errors import ModelLoadError
from tokenserve.model.base import DecoderLM


def save_weights(model: DecoderLM, path: str | Path, dtype: str = "float32") -> None:
    """Writes every weight of `model` to `path`, cast to `dtype` (e.g. float16 to halve size)."""
    tensors = {v.path: np.asarray(v.numpy(), dtype=dtype) for v in model.weights}
    save_file(tensors, str(path))


def load_weights(model: DecoderLM, path: str | Path) -> None:
    """Loads weights saved by `save_weights`; names every missing, extra or misshapen tensor."""
    try:
        tensors = load_file(str(path))
    except Exception as error:  # safetensors raises several types for corrupt files
        raise ModelLoadError(f"cannot read weights {path}: {error}") from error
    expected = {v.path: v for v in model.weights}
    missing = sorted(set(expected) - set(tensors))
    extra = sorted(set(tensors) - set(expected))
    if missing or extra:
        raise ModelLoadError(f"weights {path} do not match the model: missing {missing}, "
                             f"unexpected {extra}")
    for name, variable in expected.items():
        value = tensors[name]
        if tuple(value.shape) != tuple(variable.shape):
            raise ModelLoadError(f"weight {name}: file has shape {tuple(value.shape)}, "
                                 f"model expects {tuple(variable.shape)}")
        variable.assign(value.astype(variable.dtype))
