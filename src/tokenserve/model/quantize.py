"""Post-training int8 weight quantization of a TransformerLM.

Every linear layer's kernel and the token embedding (which a tied LM head reuses) become
int8 with one float32 scale per output channel (symmetric, absmax / 127): about one byte
per weight instead of four. Norms, biases and position embeddings stay float: they are
under 1 % of the weights. Activations are not calibrated here: the engine's int8 kernel
quantizes them on the fly in blocks of 32 (as llama.cpp's q8_0 does), so no representative
dataset is needed. `tokenserve eval --reference` measures what it costs.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from tokenserve.config import TransformerConfig
from tokenserve.errors import ConfigError

WEIGHT_FORMATS = ("none", "int8")


def quantize_model(model, dtype: str = "float32"):
    """A new TransformerLM with `model`'s weights in int8 (`weight_format="int8"`)."""
    from tokenserve.kernels.int8_matmul import quantize_weight
    from tokenserve.model import build_model

    config = model.config
    if not isinstance(config, TransformerConfig):
        raise ConfigError(f"int8 quantization supports Transformer models, not the "
                          f"{config.family} family")
    if config.weight_format == "int8":
        raise ConfigError("the model's weights are already int8")
    if config.weight_format == "gguf":
        raise ConfigError("the model keeps its GGUF file's quantized blocks; import the file "
                          "with keep_blocks=False (the CLI: --quantize int8) to re-quantize")
    quantized = build_model(dataclasses.replace(config, weight_format="int8"), dtype=dtype)
    source = {w.path: w for w in model.weights}
    for weight in quantized.weights:
        path = weight.path
        if path.endswith("_q"):                     # kernel_q, token_embedding_q
            float_path = path[:-2]
            value = np.asarray(source[float_path].numpy(), np.float32)
            if float_path.endswith("token_embedding"):
                value = value.T                     # [vocab, D] rows are its outputs already
            q, scale = quantize_weight(value)
            weight.assign(q)
            _weight(quantized, path[:-2] + "_scale").assign(scale)
        elif path.endswith("_scale"):
            continue                                # assigned with its q
        else:
            weight.assign(np.asarray(source[path].numpy()).astype(weight.dtype))
    return quantized


def _weight(model, path: str):
    return next(w for w in model.weights if w.path == path)
