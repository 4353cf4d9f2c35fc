"""TransformerConfig from a Hugging Face config.json, for the families of this package.

Every field a family needs is read; a setting tokenserve does not implement (an activation,
a RoPE scaling type, a vision tower) is refused by name.
"""

from __future__ import annotations

import logging
import math

from tokenserve.config import TransformerConfig
from tokenserve.errors import ConfigError
from tokenserve.model.families.rope_scaling import hf_longrope, hf_rope

log = logging.getLogger("tokenserve.model")

HF_ARCHITECTURES = {"Qwen3ForCausalLM": "qwen3", "MistralForCausalLM": "mistral",
                    "Gemma2ForCausalLM": "gemma2", "Gemma3ForCausalLM": "gemma3",
                    "Phi3ForCausalLM": "phi3"}
"""The config.json architectures read here, and their family."""

_ACTIVATIONS = {"silu": "swiglu", "gelu_pytorch_tanh": "geglu"}


class UnsupportedFamilySettingError(ConfigError):
    """A family's config asks for something tokenserve does not implement."""


def clamp_windows(windows: list[int], max_seq_len: int) -> tuple[int, ...]:
    """Per-layer windows with any not shorter than the context made global (0): there such
    a window masks nothing. Logged, since the config asked for it."""
    clamped = tuple(0 if w >= max_seq_len else w for w in windows)
    if clamped != tuple(windows):
        log.info("sliding window %d is not shorter than the context (%d positions): those "
                 "layers attend globally", max(windows), max_seq_len)
    return clamped if any(clamped) else ()


def layer_windows(hf: dict, family: str, num_layers: int) -> list[int]:
    """Each layer's window (0: global) from config.json: `layer_types` when it is there,
    else the family's pattern (Gemma 2 alternates from a local layer 0; Gemma 3 runs
    sliding_window_pattern - 1 local layers to one global; Mistral and Phi-3 window all)."""
    window = int(hf.get("sliding_window") or 0)
    types = hf.get("layer_types")
    if types:
        unknown = set(types) - {"sliding_attention", "full_attention"}
        if unknown:
            raise UnsupportedFamilySettingError(f"layer types {sorted(unknown)} are not "
                                                f"supported")
        return [window if t == "sliding_attention" else 0 for t in types]
    if family == "gemma2":
        return [window if i % 2 == 0 else 0 for i in range(num_layers)]
    if family == "gemma3":
        pattern = int(hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern")
                      or 6)
        return [window if (i + 1) % pattern else 0 for i in range(num_layers)]
    if family in ("qwen3",) and not hf.get("use_sliding_window"):
        return [0] * num_layers
    if family == "qwen3":  # Qwen's windows start at layer max_window_layers
        first = int(hf.get("max_window_layers", num_layers))
        return [window if i >= first else 0 for i in range(num_layers)]
    return [window] * num_layers


def _rope_parameters(hf: dict, family: str) -> tuple[dict, dict | None, float]:
    """(global layers' rope parameters, local layers' or None, partial rotary factor)."""
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params:  # transformers 5's per-layer-type form (Gemma 3)
        local = dict(params.get("sliding_attention") or {})
        params = dict(params["full_attention"])
    else:
        local = None
        if family == "gemma3" and hf.get("rope_local_base_freq"):
            local = {"rope_theta": hf["rope_local_base_freq"]}
    scaling = hf.get("rope_scaling")
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    params.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    partial = float(params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0)))
    return params, local, partial


def hf_config(hf: dict) -> TransformerConfig:
    """Our TransformerConfig for a config.json of one of HF_ARCHITECTURES."""
    arch = hf["architectures"][0]
    family = HF_ARCHITECTURES[arch]
    heads, hidden = hf["num_attention_heads"], hf["hidden_size"]
    head_dim = hf.get("head_dim") or hidden // heads
    activation = hf.get("hidden_activation") or hf.get("hidden_act", "silu")
    if activation not in _ACTIVATIONS:
        raise UnsupportedFamilySettingError(f"activation {activation!r} is not supported; "
                                            f"supported: {', '.join(_ACTIVATIONS)}")
    max_seq_len = hf["max_position_embeddings"]
    params, local, partial = _rope_parameters(hf, family)
    rotary_dim = int(head_dim * partial)
    long_factors, original = (), 0
    if (params.get("rope_type") or params.get("type")) == "longrope":
        theta = float(params["rope_theta"])
        factors, long_factors, original, attention_factor = hf_longrope(
            params, rotary_dim, max_seq_len, hf.get("original_max_position_embeddings"))
    else:
        theta, factors, attention_factor = hf_rope(params, float(params["rope_theta"]),
                                                   rotary_dim, max_seq_len)
    local_theta = 0.0
    if local is not None:
        if (local.get("rope_type") or "default") != "default":
            raise UnsupportedFamilySettingError(
                f"rope scaling {local['rope_type']!r} on local layers is not supported")
        local_theta = float(local.get("rope_theta", 10000.0))
    num_layers = hf["num_hidden_layers"]
    windows = clamp_windows(layer_windows(hf, family, num_layers), max_seq_len)
    bias = bool(hf.get("attention_bias", False))
    gemma = family in ("gemma2", "gemma3")
    scalar = hf.get("query_pre_attn_scalar")
    return TransformerConfig(
        vocab_size=hf["vocab_size"], max_seq_len=max_seq_len, hidden_size=hidden,
        num_layers=num_layers, num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        intermediate_size=hf["intermediate_size"], head_dim=head_dim, norm="rmsnorm",
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), position="rope", rope_theta=theta,
        rope_freq_factors=factors, rope_attention_factor=attention_factor,
        rope_long_freq_factors=long_factors, rope_original_context=original,
        rotary_dim=rotary_dim, local_rope_theta=local_theta,
        mlp=_ACTIVATIONS[activation],
        tie_embeddings=bool(hf.get("tie_word_embeddings", gemma)),
        qkv_bias=bias, out_bias=bias, mlp_bias=bool(hf.get("mlp_bias", False)),
        qk_norm=family in ("qwen3", "gemma3"), sliding_windows=windows,
        attn_scale=float(scalar) ** -0.5 if gemma and scalar else 0.0,
        attn_softcap=float(hf.get("attn_logit_softcapping") or 0.0) if gemma else 0.0,
        final_softcap=float(hf.get("final_logit_softcapping") or 0.0) if gemma else 0.0,
        embedding_multiplier=math.sqrt(hidden) if gemma else 1.0, post_norms=gemma)
