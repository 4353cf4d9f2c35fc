"""Model families behind one decoder-state interface (see `base.DecoderLM`)."""

from __future__ import annotations

from tokenserve.config import LSTMConfig, ModelConfig, TransformerConfig
from tokenserve.model.base import DecoderLM


def build_model(config: ModelConfig, seed: int | None = None) -> DecoderLM:
    """Builds (and initialises the weights of) the model `config` describes."""
    import keras

    from tokenserve.model.lstm import LSTMLM
    from tokenserve.model.transformer import TransformerLM

    if seed is not None:
        keras.utils.set_random_seed(seed)
    if isinstance(config, TransformerConfig):
        model = TransformerLM(config)
    elif isinstance(config, LSTMConfig):
        model = LSTMLM(config)
    else:
        raise TypeError(f"not a model config: {config!r}")
    model.build()
    return model


__all__ = ["DecoderLM", "build_model"]
