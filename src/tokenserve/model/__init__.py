"""Model families behind one decoder-state interface (see `base.DecoderLM`)."""

from __future__ import annotations

from tokenserve.config import LSTMConfig, ModelConfig, TransformerConfig
from tokenserve.model.base import DecoderLM


def build_model(config: ModelConfig, seed: int | None = None,
                dtype: str = "float32") -> DecoderLM:
    """Builds (and initialises the weights of) the model `config` describes.

    dtype: the Keras dtype policy of the model, e.g. "float32" or "bfloat16".
    """
    import keras

    from tokenserve.model.lstm import LSTMLM
    from tokenserve.model.transformer import TransformerLM

    if seed is not None:
        keras.utils.set_random_seed(seed)
    if dtype not in ("float32", "bfloat16", "float16"):
        from tokenserve.errors import ConfigError

        raise ConfigError(f"unsupported dtype {dtype!r}; use float32, bfloat16 or float16")
    if not isinstance(config, (TransformerConfig, LSTMConfig)):
        raise TypeError(f"not a model config: {config!r}")
    # Keras sublayers take the global policy, not their parent's: set it while building.
    previous = keras.mixed_precision.global_policy()
    if dtype != "float32":
        keras.mixed_precision.set_global_policy(dtype)
    try:
        model = (TransformerLM if isinstance(config, TransformerConfig) else LSTMLM)(config)
        model.build()
    finally:
        keras.mixed_precision.set_global_policy(previous)
    return model


__all__ = ["DecoderLM", "build_model"]
